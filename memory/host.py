"""The pinned host tier: one shared-memory arena per host, allocated once, pinned once.

The arena is a file in /dev/shm mapped MAP_SHARED by every process that attaches to it by name
(the trainer, the prefetcher), so the prefetcher can read NVMe into it and the trainer copy from
it to the GPU without another copy. On CUDA machines each process registers its mapping with
`cudaHostRegister`, which makes H2D/D2H from it run at pinned speed and asynchronously; pinning
costs time per GiB, which is why the arena is allocated and registered once, never per copy.
Python's `multiprocessing.shared_memory` is not used: before 3.13 a child's resource tracker can
unlink the segment when the child exits.

Regions are handed out by the owner (first fit, page-aligned, never past the arena): the arena's
size is the host tier's budget. Invariant: regions never overlap; only the creating process
unlinks the file.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import torch

from memory.layout import PAGE_BYTES, _round_up
from transport.errors import RlxError

SHM_DIR = "/dev/shm"
PREFIX = "rlx-arena-"


@dataclass(frozen=True)
class Region:
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class HostBudgetError(RlxError, ValueError):
    """The host tier cannot hold what was asked: the message has the numbers."""


class PinnedArena:
    """A shared, (on CUDA) page-locked byte arena with a first-fit region allocator."""

    def __init__(self, name: str, nbytes: int, owner: bool, pin: bool | None = None):
        self.name, self.nbytes, self.owner = name, nbytes, owner
        self.path = os.path.join(SHM_DIR, name)
        self.buffer = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)
        self.regions: dict[str, Region] = {}
        self.pinned = False
        if pin is None:
            pin = torch.cuda.is_available()
        if pin:
            self._pin()

    @classmethod
    def create(cls, nbytes: int, name: str | None = None, pin: bool | None = None,
               private: bool = False) -> PinnedArena:
        """A new arena of `nbytes` (rounded up to a page). Fails at once, with the numbers, when
        /dev/shm cannot hold it (instead of a SIGBUS on first touch later). `private`: no other
        process attaches to it, so its file is unlinked at once (the mapping stays): nothing is
        left in /dev/shm whatever happens to this process, and the memory goes with the last
        view of `buffer`."""
        nbytes = _round_up(max(nbytes, PAGE_BYTES), PAGE_BYTES)
        name = name or f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        free = os.statvfs(SHM_DIR)
        if free.f_bavail * free.f_frsize < nbytes:
            raise HostBudgetError(
                f"{SHM_DIR} has {free.f_bavail * free.f_frsize / 2**30:.2f} GiB free, the host "
                f"tier budget asks {nbytes / 2**30:.2f} GiB: lower host_budget_bytes or enlarge "
                f"{SHM_DIR}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserve now: a full /dev/shm fails here
        except OSError as e:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, name))
            raise HostBudgetError(f"cannot reserve {nbytes} bytes in {SHM_DIR}: {e}") from e
        os.close(fd)
        arena = cls(name, nbytes, owner=True, pin=pin)
        if private:
            os.unlink(arena.path)
        return arena

    @classmethod
    def attach(cls, name: str, pin: bool | None = None) -> PinnedArena:
        """Map an arena another process created (the regions table stays with the owner)."""
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"{name!r} is not an arena name")
        return cls(name, os.stat(os.path.join(SHM_DIR, name)).st_size, owner=False, pin=pin)

    def _pin(self) -> None:
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(self.buffer.data_ptr(), self.nbytes, 0)
        if err != rt.cudaError.success:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed: {err}")
        self.pinned = True

    # ---- regions -------------------------------------------------------------------------
    def alloc(self, tag: str, nbytes: int) -> Region:
        if tag in self.regions:
            raise ValueError(f"{tag!r} already has a host region")
        nbytes = _round_up(nbytes, PAGE_BYTES)
        start = self._first_fit(nbytes)
        if start is None:
            raise HostBudgetError(
                f"host tier: {tag!r} needs {nbytes / 2**20:.1f} MiB, "
                f"{self.free_bytes() / 2**20:.1f} MiB free of {self.nbytes / 2**20:.1f} MiB "
                f"(held by {sorted(self.regions)})")
        self.regions[tag] = Region(start, nbytes)
        return self.regions[tag]

    def _first_fit(self, nbytes: int) -> int | None:
        """Offset of the first gap of `nbytes` (page-rounded), or None."""
        start = 0
        for r in sorted(self.regions.values(), key=lambda r: r.offset):
            if r.offset - start >= nbytes:
                return start
            start = r.end
        return start if start + nbytes <= self.nbytes else None

    def free(self, tag: str) -> None:
        self.regions.pop(tag, None)

    def free_bytes(self) -> int:
        return self.nbytes - sum(r.nbytes for r in self.regions.values())

    def fits(self, nbytes: int) -> bool:
        """Whether a region of `nbytes` can be allocated now (first fit, as `alloc` does)."""
        return self._first_fit(_round_up(nbytes, PAGE_BYTES)) is not None

    def view(self, region: Region, nbytes: int | None = None) -> torch.Tensor:
        return self.buffer[region.offset:region.offset + (nbytes or region.nbytes)]

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
        self.buffer = torch.empty(0, dtype=torch.uint8)  # the mapping goes with its last view
        if self.owner and os.path.exists(self.path):
            os.unlink(self.path)
