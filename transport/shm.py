"""Same-host bulk tensors through shared memory: one copy on send, zero copies on receive.

A sender keeps a pool of segments in /dev/shm (files it creates, maps and unlinks at close). To
send a large tensor it takes a free segment, copies the tensor in, marks the segment busy and sends
only a reference (segment name, byte count) in the message header. The receiver maps the segment
once and hands out a tensor that views it; when the last view of that tensor is freed, a finalizer
marks the segment free again, and the sender may reuse it. No message is needed for the release.

Invariant: a segment is written by its sender only while its state byte says FREE, and the state
is set back to FREE only by the receiver after every view of the data is gone. When no free
segment fits and the pool budget is spent, `accepts()` says no and the tensor travels as an
ordinary zmq frame instead: nothing blocks and nothing is lost. Only names with this module's
prefix are ever opened, so a peer cannot make a receiver map arbitrary files.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from transport.codec import WireArray, checked_nbytes

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
PREFIX = "rlx-"
HEADER_BYTES = 64  # state byte at offset 0; data starts 64-byte aligned
FREE, BUSY = 0, 1


class ShmConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Shared-memory fast path for same-host (ipc://) sockets."""

    enabled: bool = True
    min_bytes: int = 1 << 20  # tensors at least this large go through shared memory
    max_pool_bytes: int = 4 << 30  # total size of segments one sender may create


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


@dataclass
class _Segment:
    name: str
    mm: mmap.mmap
    capacity: int  # data bytes

    def state(self) -> int:
        return self.mm[0]


class ShmChannel:
    """Both roles for one codec: the segments it sends from and the segments it has mapped."""

    _ids = itertools.count()

    def __init__(self, config: ShmConfig | None = None):
        self.config = config or ShmConfig()
        self.enabled = self.config.enabled and available()
        self._own: list[_Segment] = []
        self._own_bytes = 0
        self._mapped: dict[str, mmap.mmap] = {}
        self._tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"

    # ------------------------------------------------------------------------ sender side
    def accepts(self, nbytes: int) -> bool:
        """Whether a tensor of `nbytes` bytes goes through a segment (else as a frame)."""
        if not self.enabled or nbytes < self.config.min_bytes:
            return False
        return self._free_segment(nbytes) is not None or self._can_grow(nbytes)

    def put(self, flat: Any) -> list:
        """Copy `flat` (a tensor's bytes: a uint8 array, `codec.flat_bytes`) into a free segment;
        the reference [segment name, byte count] the header carries."""
        nbytes = len(flat)
        seg = self._free_segment(nbytes) or self._grow(nbytes)
        seg.mm[0] = BUSY
        dst = np.frombuffer(seg.mm, dtype=np.uint8, count=nbytes, offset=HEADER_BYTES)
        dst[:] = flat
        del dst
        return [seg.name, nbytes]

    def _free_segment(self, nbytes: int) -> _Segment | None:
        fits = [s for s in self._own if s.capacity >= nbytes and s.state() == FREE]
        return min(fits, key=lambda s: s.capacity) if fits else None

    def _can_grow(self, nbytes: int) -> bool:
        return self._own_bytes + _round_up(nbytes) <= self.config.max_pool_bytes

    def _grow(self, nbytes: int) -> _Segment:
        capacity = _round_up(nbytes)
        name = f"{self._tag}-{next(self._ids)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + capacity)
            mm = mmap.mmap(fd, HEADER_BYTES + capacity)
        finally:
            os.close(fd)
        seg = _Segment(name, mm, capacity)
        self._own.append(seg)
        self._own_bytes += capacity
        return seg

    # ------------------------------------------------------------------------ receiver side
    def get_raw(self, dtype: str, shape: list[int], ref: list) -> WireArray:
        """The referenced bytes as a view (no copy); the segment is marked free once every view
        of them is gone. ValueError for a foreign name or sizes that disagree."""
        name, nbytes = ref
        if not isinstance(nbytes, int) or checked_nbytes(dtype, shape) != nbytes:
            raise ValueError(f"{dtype}{shape} does not fill {nbytes!r} bytes")
        if not (isinstance(name, str) and name.startswith(PREFIX) and "/" not in name):
            raise ValueError(f"refusing shared-memory segment name {name!r}")
        mm = self._mapped.get(name) or self._map(name)
        if HEADER_BYTES + nbytes > len(mm):
            raise ValueError(f"segment {name} holds {len(mm)} bytes, reference needs {nbytes}")
        arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=HEADER_BYTES)
        weakref.finalize(arr, _release, mm)
        return WireArray(arr, dtype, shape)

    def get(self, dtype: str, shape: list[int], ref: list) -> torch.Tensor:
        """`get_raw` as a torch tensor."""
        return self.get_raw(dtype, shape, ref).torch()

    def _map(self, name: str) -> mmap.mmap:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._mapped[name] = mm
        return mm

    def close(self) -> None:
        """Unlink own segments (peers keep valid mappings); drop mappings of others."""
        for seg in self._own:
            try:
                os.unlink(os.path.join(SHM_DIR, seg.name))
            except FileNotFoundError:
                pass
        self._own.clear()
        self._own_bytes = 0
        self._mapped.clear()  # mmaps close when their last exported view is gone


def _release(mm: mmap.mmap) -> None:
    try:
        mm[0] = FREE
    except ValueError:  # mapping already closed
        pass


def _round_up(nbytes: int, quantum: int = 1 << 20) -> int:
    return (nbytes + quantum - 1) // quantum * quantum


def channel_for(endpoint: str, config: ShmConfig | None = None) -> ShmChannel | None:
    """A channel for sockets whose peers are on this host (ipc://, inproc://), else None."""
    config = config or ShmConfig()
    if config.enabled and endpoint.startswith(("ipc://", "inproc://")) and available():
        return ShmChannel(config)
    return None
