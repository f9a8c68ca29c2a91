"""Device memory a process holds as users see it: NVML's per-process figure (what `nvidia-smi`
lists), not `torch.cuda.memory_allocated`.

Role: the memory metrics of workers and trainer, so that a colocated run shows what a sleeping
side really gives back. `memory_allocated` counts live tensors only; the caching allocator's
reserve, the CUDA context and other libraries' buffers stay invisible to it, and they are what
keeps the other side from fitting. Needs `nvidia-ml-py` (the `gpu` extra) and an NVIDIA driver;
without them `process_device_bytes` answers None and callers publish nothing.
"""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_nvml = None  # the pynvml module once initialised; False when unavailable


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


def give_back_cached(device: str) -> None:
    """Return the caching allocator's unused blocks on a CUDA `device` to the driver, so that
    freed tensors stop counting against the process in NVML; nothing elsewhere. Called when a
    colocated side sleeps; `RLX_KEEP_CUDA_CACHE=1` in an actor's env keeps the blocks cached
    instead (the side's next phase then allocates faster, but the other side cannot use them)."""
    if str(device).startswith("cuda") and os.environ.get("RLX_KEEP_CUDA_CACHE") != "1":
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
