"""GPUDirect Storage reads (NVMe -> GPU without a host copy) through cuFile.

Uses `cuda.bindings.cufile` (cuda-python) when it is importable and the cuFile driver opens;
without the nvidia-fs kernel module cuFile runs in compatibility mode (it reads through a
host bounce buffer itself), which still saves our pinned-arena staging. `choose_reader` makes
the choice of `teacher_memory.gds` (memory/config.py): "auto" opens cuFile only when the target
device is CUDA, and where it is absent (every CPU machine, most containers) or refuses, the
weight memory uses the O_DIRECT -> pinned -> H2D path; "off" never tries it. The reason comes
back with the choice (WeightMemory logs it and keeps it as `nvme_reader_why`).

Reads are split into chunks issued from several threads (cuFile's read releases the GIL).
Checksums are not verified on this path (the bytes never reach host memory); a set whose
checksums must be checked is read through the host path. Invariant: the device buffer range is
registered with cuFile for exactly the duration of one read call.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable

import torch


class GdsReader:
    def __init__(self, cufile, num_threads: int = 4):
        self.cufile, self.num_threads = cufile, num_threads

    @classmethod
    def open(cls, num_threads: int = 4) -> GdsReader:
        """A reader on an opened cuFile driver; raises (ImportError, a driver error) where
        cuFile cannot be used."""
        from cuda.bindings import cufile

        cufile.driver_open()
        return cls(cufile, num_threads)

    def read(self, path: str, dst: torch.Tensor, nbytes: int, chunk_bytes: int) -> int:
        """Read the first `nbytes` of `path` into the CUDA uint8 tensor `dst`."""
        cf = self.cufile
        torch.cuda.set_device(dst.device)  # cuFile needs the device's context current here
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        ptr = dst.data_ptr()
        cf.buf_register(ptr, nbytes, 0)
        try:
            descr = cf.Descr()
            descr.type = cf.FileHandleType.OPAQUE_FD
            descr.handle.fd = fd
            descr.fs_ops = 0
            handle = cf.handle_register(descr.ptr)
            try:
                def one(off: int) -> int:
                    torch.cuda.set_device(dst.device)
                    n = min(chunk_bytes, nbytes - off)
                    got = cf.read(handle, ptr, n, off, off)
                    if got != n:
                        raise OSError(f"cuFile read of {n} bytes at {off} returned {got}")
                    return got

                with concurrent.futures.ThreadPoolExecutor(self.num_threads) as pool:
                    return sum(pool.map(one, range(0, nbytes, chunk_bytes)))
            finally:
                cf.handle_deregister(handle)
        finally:
            cf.buf_deregister(ptr)
            os.close(fd)

    def close(self) -> None:
        self.cufile.driver_close()


def choose_reader(mode: str, device: torch.device, num_threads: int = 4,
                  open_reader: Callable[[int], GdsReader] = GdsReader.open
                  ) -> tuple[GdsReader | None, str]:
    """(a cuFile reader, or None for the host path; why) for NVMe reads into slots on `device`
    under `mode` ("auto" or "off", see the module docstring)."""
    if mode not in ("auto", "off"):
        raise ValueError(f"gds = {mode!r}; use 'auto' or 'off'")
    if mode == "off":
        return None, "gds = off"
    if device.type != "cuda":
        return None, f"gds = auto, the device is {device.type}, not CUDA"
    try:
        return open_reader(num_threads), "gds = auto, cuFile opened"
    except Exception as e:  # noqa: BLE001 - no cuFile here: the host path is used
        return None, f"gds = auto, cuFile unavailable: {type(e).__name__}: {e}"
