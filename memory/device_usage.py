"""Device memory a process holds as users see it, and giving it back: NVML's per-process figure
(what `nvidia-smi` lists, not `torch.cuda.memory_allocated`), and tensors' storages parked in
host memory while their process sleeps.

Role: the memory metrics of workers and trainer, and the mechanism both use to sleep, so that a
colocated run shows what a sleeping side really gives back. `memory_allocated` counts live
tensors only; the caching allocator's reserve, cuBLAS workspaces, the CUDA context and other
libraries' buffers stay invisible to it, and they are what keeps the other side from fitting.

Invariants:
- `HostOffload.offload(tensors)` leaves every tensor object, its storage object and every view
  of it in place; only the storage's bytes leave the device (the storage is resized to 0 and
  later back). Whoever holds a tensor (an optimizer's state, a module, a view) holds the same
  object after `restore()`, with the same values (with `backup=True`).
- `give_back_cached` returns the allocator's free blocks and the cuBLAS workspaces to the
  driver; what NVML still shows afterwards is the CUDA context (loaded kernels included) and
  the live tensors that were not offloaded.

Faults: without `nvidia-ml-py` (the `gpu` extra) or an NVIDIA driver `process_device_bytes`
answers None and callers publish nothing. On a machine without CUDA everything runs on CPU
tensors (host buffers are not pinned; `give_back_cached` does nothing), so CI tests the same code.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

import torch

_lock = threading.Lock()
_nvml = None  # the pynvml module once initialised; False when unavailable
ALIGN_BYTES = 256  # offsets of parked storages in the host buffer


def _init():
    global _nvml
    with _lock:
        if _nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml = pynvml
            except Exception:  # noqa: BLE001 - no package, no driver: no NVML figures
                _nvml = False
    return _nvml or None


def process_device_bytes(pid: int | None = None) -> int | None:
    """Bytes of device memory process `pid` (default: this one) holds on all GPUs, by NVML;
    None where NVML is not available."""
    nvml = _init()
    if nvml is None:
        return None
    pid = os.getpid() if pid is None else pid
    total = 0
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                total += int(proc.usedGpuMemory)
    return total


def give_back_cached(device: str | torch.device) -> None:
    """Return the caching allocator's unused blocks and the cuBLAS workspaces on a CUDA `device`
    to the driver, so that freed tensors stop counting against the process in NVML; nothing
    elsewhere. Called when a side sleeps; `RLX_KEEP_CUDA_CACHE=1` in an actor's env keeps the
    blocks cached instead (the side's next phase then allocates faster, but the other side
    cannot use them)."""
    if str(device).startswith("cuda") and os.environ.get("RLX_KEEP_CUDA_CACHE") != "1":
        torch.cuda.synchronize(device)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:  # workspaces are live allocations: empty_cache alone keeps them
            clear()
        torch.cuda.empty_cache()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (tied weights and views count once);
    a released storage counts 0."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _sync(devices: set[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class HostOffload:
    """Storages of a set of tensors parked in one host buffer and brought back in place.

    `offload(tensors)` copies every distinct storage behind `tensors` into the host buffer
    (pinned when `pin`; allocated at the first offload, kept and grown when a later offload
    needs more, since pinning is slow) and resizes it to 0 bytes: the device memory goes back
    to the allocator (`give_back_cached` returns it to the driver). `restore()` resizes each
    storage back and copies its bytes in. With `backup=False` nothing is copied and nothing
    pinned: storages come back zero-filled (weights that are pushed again after every wake).
    A storage that cannot be resized (memory-mapped from a checkpoint) is first re-homed into a
    fresh one, the tensors given pointing at it (views of it not among them keep the old one).
    """

    def __init__(self, backup: bool = True, pin: bool | None = None):
        self.backup = backup
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.host: torch.Tensor | None = None  # the host buffer (uint8), reused across offloads
        self._parked: list[tuple[torch.UntypedStorage, int, int]] = []  # storage, bytes, offset

    @property
    def parked(self) -> bool:
        return bool(self._parked)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Park the storages of `tensors` (see the class docstring); the bytes moved off the
        device. Refused while something is parked (restore first)."""
        if self._parked:
            raise RuntimeError("storages are parked already; restore() before offloading again")
        storages = self._distinct(tensors)
        plan, size = [], 0
        for st in storages:
            plan.append((st, st.nbytes(), size))
            size += -(-st.nbytes() // ALIGN_BYTES) * ALIGN_BYTES
        if self.backup:
            self._copy_out(plan, size)
        for st, _, _ in plan:
            st.resize_(0)
        self._parked = plan
        return sum(n for _, n, _ in plan)

    def restore(self) -> int:
        """Every parked storage back to its size and bytes (zeros without a backup); the bytes
        restored."""
        plan, self._parked = self._parked, []
        devices = set()
        with torch.no_grad():
            for st, nbytes, offset in plan:
                st.resize_(nbytes)
                dst = _as_bytes(st)
                if self.backup:
                    dst.copy_(self.host[offset:offset + nbytes], non_blocking=self.pin)
                else:
                    dst.zero_()
                devices.add(st.device)
        _sync(devices)
        return sum(n for _, n, _ in plan)

    def _distinct(self, tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
        groups: dict[int, list[torch.Tensor]] = {}
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes() > 0:
                groups.setdefault(st._cdata, []).append(t)
        out = []
        for group in groups.values():
            st = group[0].untyped_storage()
            out.append(st if st.resizable() else _rehome(group))
        return out

    def _copy_out(self, plan: list[tuple[torch.UntypedStorage, int, int]], size: int) -> None:
        if self.host is None or self.host.numel() < size:
            self.host = None  # the old buffer goes before the bigger one is pinned
            self.host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        devices = set()
        with torch.no_grad():
            for st, nbytes, offset in plan:
                self.host[offset:offset + nbytes].copy_(_as_bytes(st), non_blocking=self.pin)
                devices.add(st.device)
        _sync(devices)


def _rehome(group: list[torch.Tensor]) -> torch.UntypedStorage:
    """Give the tensors of one non-resizable storage a fresh (resizable) copy of it."""
    old = group[0].untyped_storage()
    new = torch.empty(old.nbytes(), dtype=torch.uint8, device=old.device)
    with torch.no_grad():
        new.copy_(_as_bytes(old))
    storage = new.untyped_storage()
    for t in group:
        t.data = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            storage, t.storage_offset(), t.shape, t.stride())
    return storage
