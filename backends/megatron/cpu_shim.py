"""CPU stand-ins for the few `torch.cuda` calls megatron-core makes: for CPU tests and the CPU
run of bench/megatron_gpu.py only; the backend itself never imports it.

Role: lets megatron-core build and run a GPTModel on a CPU-only torch (CI) without any change to
the backend code: `torch.cuda.current_device()` answers "cpu", `synchronize` / `manual_seed` do
nothing, megatron's CUDA RNG tracker is replaced by one over CPU generator states, and the
pipeline schedules' one hard-coded `device="cuda"` allocation (a token counter) lands on the CPU.
Invariant: `install()` is idempotent, and `uninstall()` restores every patched attribute
exactly; the RNG tracker forks the CPU generator, so dropout-free forwards are unaffected.
"""

from __future__ import annotations

import contextlib

import torch

_saved: dict[tuple[object, str], object] = {}


class CpuRngTracker:
    """Megatron's CUDA RNG tracker API (add/fork/get_states/set_states/reset) over CPU states."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized, self.states_ = True, dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} or seed {seed} already added")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} is not added")
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()


class _TorchOnCpu:
    """The torch module as megatron's schedules see it: allocations asked on "cuda" go to CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs):
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


def _patch(owner: object, name: str, value: object) -> None:
    _saved.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, value)


def install() -> None:
    """Patch torch.cuda's current device / synchronize and megatron's RNG tracker for CPU."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    _patch(torch.cuda, "current_device", lambda: "cpu")
    _patch(torch.cuda, "synchronize", lambda device=None: None)
    _patch(torch.cuda, "manual_seed", lambda seed: None)
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER", CpuRngTracker())
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    _patch(schedules, "torch", _TorchOnCpu())


def uninstall() -> None:
    """Restore everything `install` patched."""
    for (owner, name), value in _saved.items():
        setattr(owner, name, value)
    _saved.clear()
