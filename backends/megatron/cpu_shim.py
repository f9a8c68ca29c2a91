"""CPU stand-ins for the few `torch.cuda` calls megatron-core makes: for CPU tests and the CPU
runs of bench/megatron_gpu.py and bench/train_parallel.py only; the backend itself never imports
it.

Role: lets megatron-core build and run a GPTModel on a CPU-only torch (CI) without any change to
the backend code: `torch.cuda.current_device()` answers "cpu", `synchronize` / `manual_seed` /
`Tensor.cuda()` do nothing, megatron's CUDA RNG tracker is replaced by one over CPU generator
states, the pipeline schedules' one hard-coded `device="cuda"` allocation (a token
counter) lands on the CPU, RoPE's pinned index tensor at context_parallel_size > 1 is a plain
one, and the MoE all-to-all token dispatcher's streams and events are
no-ops (its split sizes become host values as on CUDA).
`install_on_import()` arms it for a whole process tree (tests/megatron_shim/sitecustomize.py):
it installs the patches the moment the backend imports megatron-core, so processes that never
use megatron pay nothing (torch too is imported inside the functions, not at import); in such a
process megatron's torch.compile'd fusion helpers are plain functions (`_eager_fusions`).
`armed()` says whether this process (and its children) run megatron on the CPU this way; the
trainer actor reads it through `sys.modules` (never importing this module) to accept backend =
"megatron" on a CPU device.
Invariant: `install()` is idempotent, and `uninstall()` restores every patched attribute
exactly; the RNG tracker forks the CPU generator, so dropout-free forwards are unaffected.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Any

_saved: dict[tuple[object, str], object] = {}
_ARMED_ON = "backends.megatron.mcore"  # the backend's one import of megatron-core
_armed = False


class CpuRngTracker:
    """Megatron's CUDA RNG tracker API (add/fork/get_states/set_states/reset) over CPU states."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, Any] = {}  # name -> CPU generator state
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, Any]:
        return dict(self.states_)

    def set_states(self, states: dict[str, Any]) -> None:
        self._is_initialized, self.states_ = True, dict(states)

    def add(self, name: str, seed: int) -> None:
        import torch

        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} or seed {seed} already added")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        import torch

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
        import torch

        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs):
        import torch

        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


class _TorchWithoutPinning:
    """The torch module as megatron's RoPE sees it: `pin_memory=True` (an accelerator's) is
    dropped (`get_pos_emb_on_this_cp_rank` slices a context-parallel rank's positions with a
    pinned index tensor)."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)

    @staticmethod
    def tensor(*args, pin_memory: bool = False, **kwargs):
        import torch

        return torch.tensor(*args, **kwargs)


class _Event:
    """torch.cuda.Event on the CPU: nothing to wait for."""

    def __init__(self, *args, **kwargs) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None


class _Stream:
    """torch.cuda.Stream on the CPU: one object stands for every stream, so megatron's MoE
    token dispatcher never thinks it is on a side stream."""

    _one: "_Stream | None" = None

    def __new__(cls, *args, **kwargs):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def wait_stream(self, other) -> None:
        return None

    def record_event(self, event=None) -> _Event:
        return event or _Event()

    def synchronize(self) -> None:
        return None


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """The MoE dispatcher's device-to-host step for split sizes, which it applies to CUDA
    tensors only: on the CPU they must become host values too (all_to_all_single takes
    lists)."""
    import torch

    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor.cpu() if torch.is_tensor(tensor) else tensor


def _patch(owner: object, name: str, value: object) -> None:
    _saved.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, value)


def install() -> None:
    """Patch torch.cuda's current device / synchronize and megatron's RNG tracker for CPU."""
    import torch
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    _patch(torch.cuda, "current_device", lambda: "cpu")
    _patch(torch.cuda, "synchronize", lambda device=None: None)
    _patch(torch.cuda, "manual_seed", lambda seed: None)
    # tied embeddings over pipeline stages: the last stage's copy is moved with `.cuda()`
    _patch(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER", CpuRngTracker())
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    _patch(schedules, "torch", _TorchOnCpu())
    # context parallelism: RoPE keeps a CP rank's positions through a pinned index tensor
    from megatron.core.models.common.embeddings import rope_utils

    _patch(rope_utils, "torch", _TorchWithoutPinning())
    # mixture of experts: the all-to-all token dispatcher's streams, events and host copies
    from megatron.core.transformer.moe import token_dispatcher

    _patch(torch.cuda, "Stream", _Stream)
    _patch(torch.cuda, "current_stream", lambda device=None: _Stream())
    _patch(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())
    _patch(torch.cuda, "Event", _Event)
    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", _to_host)


def uninstall() -> None:
    """Restore everything `install` patched."""
    for (owner, name), value in _saved.items():
        setattr(owner, name, value)
    _saved.clear()


def armed() -> bool:
    """This process and the ones it starts run megatron-core on the CPU: `install_on_import`
    was called (the patches are in place, or will be at megatron-core's import). A bare
    `install()` (one test process) does not arm it."""
    return _armed


def _eager_fusions(jit: Any) -> None:
    """megatron-core's `jit_fuser` (torch.compile on torch >= 2.2) made a no-op decorator, as
    its own `disable_jit_fuser` does: its fused helpers run eagerly on the CPU (the same
    functions; the backend's defaults call few of them), and a process no longer imports
    torch._dynamo for the dozens of functions megatron decorates at import (~1 s of CPU per
    process that imports megatron-core)."""
    jit.disable_jit_fuser()


# module -> what runs right after it executed, in an armed process
_AFTER_IMPORT = {_ARMED_ON: lambda _module: install(), "megatron.core.jit": _eager_fusions}


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when the backend's megatron module (or megatron-core's `jit`) is
    being imported, wraps its loader so `install()` (`_eager_fusions`) runs right after the
    module executed."""

    def find_spec(self, name, path=None, target=None):
        after = _AFTER_IMPORT.get(name)
        if after is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                execute = spec.loader.exec_module

                def exec_then_install(module, execute=execute, after=after):
                    execute(module)
                    after(module)

                spec.loader.exec_module = exec_then_install
                return spec
        return None


def install_on_import() -> None:
    """Install the patches when (and only if) this process imports megatron-core through the
    backend; at once if it already has."""
    global _armed
    if _armed:
        return
    _armed = True
    if _ARMED_ON in sys.modules:
        install()
    else:
        sys.meta_path.insert(0, _InstallAfterImport())
