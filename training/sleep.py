"""Sleep and wake for the trainer's device memory: parameters, gradients and optimizer state go
to pinned host memory while the colocated workers generate, and come back in place.

Role: `TrainerSleep(model, optimizer).sleep()` parks every device storage the trainer's step
needs (the model's parameters, buffers and gradients; the optimizer's parameters, gradients and
state, fp32 master weights included) in pinned host buffers (memory/device_usage.py
`HostOffload`), returns the caching allocator's blocks and the cuBLAS workspaces to the driver,
and reports what NVML shows for the process before and after; `wake()` brings them back.
`sleep(keep_weights=True)` first parks all but the parameters, so that a weight push can still
read them (then `sleep()` parks the parameters too).

Invariants:
- In place: after `wake()` every tensor the optimizer and the model hold is the same Python
  object, on the same storage object, with the same bytes, as before `sleep()` (storages are
  resized, never replaced), so an optimizer step after a wake is exactly the step without the
  sleep, and anything holding a tensor or a view of it needs no rebinding.
- Only storages on the trainer's device move (the optimizer's CPU step counters stay); the
  host buffers (one for the parameters, one for the rest) are pinned once and reused.
- While asleep the storages hold 0 bytes: a forward or an optimizer step fails loudly instead of
  reading stale memory.

Faults: `sleep()` twice or `wake()` without `sleep()` raise RuntimeError (an ordering mistake of
the caller). On CPU the same moves run (into an unpinned host buffer) and reports carry no NVML
figure (None).

Why not torch_memory_saver: docs/memory.md (Sleep and wake).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from memory.device_usage import HostOffload, give_back_cached, process_device_bytes
from training.master_weights import as_train_optimizer


@dataclasses.dataclass
class SleepReport:
    """One sleep or wake: bytes moved between device and host, its time, and NVML's figure of
    this process before and after (None without NVML)."""

    moved_bytes: int
    seconds: float
    nvml_before: int | None
    nvml_after: int | None

    def metrics(self, prefix: str) -> dict[str, float]:
        out = {f"{prefix}/moved_bytes": float(self.moved_bytes), f"{prefix}/s": self.seconds}
        if self.nvml_after is not None:
            out[f"{prefix}/nvml_bytes"] = float(self.nvml_after)
        return out


def iter_optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor an optimizer holds (training.master_weights.TrainOptimizer `tensors()`: the
    tensors it steps, fp32 masters included, their gradients and its state; a torch optimizer
    is taken as a plain one)."""
    yield from as_train_optimizer(optimizer).tensors()


def module_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """A module's parameters (with their gradients) and buffers."""
    yield from _with_grads(module.parameters())
    yield from module.buffers()


def _with_grads(params: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    for p in params:
        yield p
        if p.grad is not None:
            yield p.grad


class TrainerSleep:
    """The trainer's device memory, asleep or awake (see the module docstring). `modules` and
    `optimizers` are everything whose tensors move (a critic and its optimizer can be added);
    `device` is where they train (default: the first parameter's device).

    Two parts, so that a push can read the weights after everything else left the device:
    `sleep(keep_weights=True)` parks all but the modules' parameters; a later `sleep()` parks
    those too; `wake()` brings back whatever is parked."""

    def __init__(self, modules: torch.nn.Module | list[torch.nn.Module],
                 optimizers: Any | list[Any] = (), device: str | torch.device | None = None):
        self.modules = modules if isinstance(modules, list) else [modules]
        self.optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        first = next(self.modules[0].parameters())
        self.device = torch.device(device) if device is not None else first.device
        pin = self.device.type == "cuda"
        self.states = HostOffload(backup=True, pin=pin)  # gradients, buffers, optimizer state
        self.weights = HostOffload(backup=True, pin=pin)  # the modules' parameters

    @property
    def asleep(self) -> bool:
        """Whether anything is parked (all of it, or all but the weights)."""
        return self.states.parked or self.weights.parked

    def tensors(self) -> list[torch.Tensor]:
        """The tensors on the trainer's device that sleep moves."""
        everything = [t for m in self.modules for t in module_tensors(m)]
        everything += [t for o in self.optimizers for t in iter_optimizer_tensors(o)]
        return [t for t in everything if _on(t, self.device)]

    def weight_tensors(self) -> list[torch.Tensor]:
        return [p for m in self.modules for p in m.parameters() if _on(p, self.device)]

    def sleep(self, keep_weights: bool = False) -> SleepReport:
        """Park every device tensor in pinned host memory (`keep_weights`: all but the modules'
        parameters, e.g. to push them first); give the freed memory back."""
        if self.weights.parked or (self.states.parked and keep_weights):
            raise RuntimeError("the trainer is asleep already")
        before, t0 = self._nvml(), time.perf_counter()
        moved = 0
        if not self.states.parked:
            weights = {p.untyped_storage()._cdata for p in self.weight_tensors()}
            moved += self.states.offload(t for t in self.tensors()
                                         if t.untyped_storage()._cdata not in weights)
        if not keep_weights:
            moved += self.weights.offload(self.weight_tensors())
        give_back_cached(self.device)
        return SleepReport(moved, time.perf_counter() - t0, before, self._nvml())

    def wake(self) -> SleepReport:
        """Every parked tensor back on the device, in place."""
        if not self.asleep:
            raise RuntimeError("the trainer is awake: wake() follows sleep()")
        before, t0 = self._nvml(), time.perf_counter()
        moved = self.weights.restore() + self.states.restore()
        return SleepReport(moved, time.perf_counter() - t0, before, self._nvml())

    def _nvml(self) -> int | None:
        """NVML's figure of this process (a trainer on CUDA with NVML; else None)."""
        return process_device_bytes() if self.device.type == "cuda" else None


def _on(t: torch.Tensor, device: torch.device) -> bool:
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index == device.index
