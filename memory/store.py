"""The weight store: tagged weight sets as copies in pinned host memory, each in a flat layout
(memory/layout.py), backed up from and restored into the tensors that compute with them.

One mechanism for every model the trainer keeps besides its live policy: the reference, the old
actors and the critic (weights and optimizer state; training/aux_models.py) switch sets in place
into their modules, and the colocated teachers' tiered memory (memory/manager.py `WeightMemory`)
keeps its host tier here (its device slots and NVMe tier on top).

Operations (slime's TensorBackuper where the names match):
- `backup(tag, source)`: a module's weights (or a {name: tensor} mapping, e.g. optimizer state,
  or the views of a device slot) -> the tag's host copy (D2H on CUDA). It copies nothing, and
  returns False, when the source's tensors are the very tensors the host copy was last made from
  or restored into and none has been written since. The fingerprint is, per tensor, the tensor
  object (a weak reference), its storage pointer and its autograd version counter: every
  in-place write through the tensor (optimizer steps, `copy_`, `load_state_dict`) bumps the
  counter, and re-pointing `.data` changes the pointer. A write through `.data` or through
  another alias of the storage is not seen: `force=True` copies anyway.
- `restore(tag, target)`: the host copy -> the target's own tensors, in place (H2D from pinned
  memory on CUDA; a released tensor gets its storage back first). On the CPU, `bind_cpu=True`
  (frozen modules) makes the tensors view the host copy itself: no copy and no second copy in
  memory. A no-op when the target already holds the tag, unchanged on both sides.
- `release(tag, target)`: the target's tensors become empty, so their device memory goes back;
  only allowed while the tag holds the target's current values (nothing is lost).
- `copy(src, dst)` (host -> host), `rename`, `drop`, `host_tensors`, `nbytes`.
- `reserve(tag, layout)` / `view(tag)` / `written(tag)`: a set whose host copy the caller fills
  itself (read from a checkpoint or NVMe: the tiered memory's moves).

Checks: with `verify`, every host copy has a CRC-32 per chunk (memory/checksum.py), computed
when the copy is written (backup, copy, `written`) and verified at the first restore after each
write (`ChecksumError` naming the tag and the byte offset); a target whose names, shapes or
dtypes differ from the tag's layout is refused before anything moves.

Where the sets live: regions of pinned arenas (memory/host.py), first fit. Without `arena`,
private arenas (unlinked from /dev/shm at once, pinned once on CUDA) are made as needed, each of
exactly the size missing; a dropped or renamed set's region is reused by the next set of its
size. With `arena` (a shared arena that is the host tier's budget), every set lives in it and
one that does not fit raises `HostBudgetError` with the numbers. The store closes its arenas.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch

from memory.checksum import ChecksumError, chunk_crcs
from memory.host import PinnedArena, Region
from memory.layout import FlatLayout, bind, pack

CRC_CHUNK_BYTES = 16 << 20

Target = Union[torch.nn.Module, Mapping[str, torch.Tensor]]


def weight_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name, the registered objects themselves, each object
    once (tied weights under their first name); non-tensor entries (extra state) are skipped."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _fingerprint(tensors: Mapping[str, torch.Tensor]) -> list[tuple]:
    return [(weakref.ref(t), t.data_ptr(), t._version) for t in tensors.values()]


def _same(recorded: list[tuple] | None, tensors: Mapping[str, torch.Tensor]) -> bool:
    if recorded is None or len(recorded) != len(tensors):
        return False
    return all(ref() is t and ptr == t.data_ptr() and version == t._version
               for (ref, ptr, version), t in zip(recorded, tensors.values()))


@dataclass
class _Set:
    layout: FlatLayout
    arena: PinnedArena
    region: Region
    crcs: list[int] | None = None  # per chunk; None: reserved, not written yet
    verified: bool = False  # the CRCs were checked by a restore since the copy was written
    synced: list[tuple] | None = None  # fingerprint of the tensors equal to the host copy
    pending: Any = None  # CUDA event: an H2D still reading the host copy


class WeightStore:
    """Tagged host copies of weight sets; see the module docstring."""

    def __init__(self, pin: bool | None = None, verify: bool = True,
                 crc_chunk_bytes: int = CRC_CHUNK_BYTES, arena: PinnedArena | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.verify, self.crc_chunk_bytes = verify, crc_chunk_bytes
        self.fixed = arena is not None  # one arena, the host tier's budget: never grown
        self.arenas: list[PinnedArena] = [arena] if arena is not None else []
        self.sets: dict[str, _Set] = {}
        self.counters = {"backups": 0, "backup_noops": 0, "restores": 0, "restore_noops": 0,
                         "binds": 0, "copies": 0, "d2h_bytes": 0, "h2d_bytes": 0}
        self._finalizer = weakref.finalize(self, _close_arenas, self.arenas)

    # ---- the operations ------------------------------------------------------------------
    def backup(self, tag: str, source: Target, force: bool = False) -> bool:
        """`source`'s tensors -> the tag's host copy; False when nothing had to be copied."""
        tensors = _tensors_of(source)
        layout = FlatLayout.from_state_dict(tensors)
        ws = self.sets.get(tag)
        if ws is not None and ws.layout.fingerprint() != layout.fingerprint():
            if any(t.numel() == 0 and n in ws.layout._by_name and ws.layout[n].nbytes
                   for n, t in tensors.items()):
                raise ValueError(f"backup of {tag!r} from released tensors (restore first)")
            self.drop(tag)  # the source's shapes changed (optimizer state after its first step)
            ws = None
        if ws is None:
            ws = self._register(tag, layout)
        elif not force and _same(ws.synced, tensors):
            self.counters["backup_noops"] += 1
            return False
        self._wait(ws)
        host = self._host(ws)
        if not all(t.data_ptr() == v.data_ptr() for t, v in zip(
                tensors.values(), bind(host, ws.layout).values())):  # not bound to this copy
            pack(tensors, host, ws.layout)
            for dev in {t.device for t in tensors.values() if t.is_cuda}:
                torch.cuda.current_stream(dev).synchronize()  # the CRC reads the host copy
            self.counters["d2h_bytes"] += ws.layout.total_bytes
        self._written(ws)
        ws.synced = _fingerprint(tensors)
        self.counters["backups"] += 1
        return True

    def restore(self, tag: str, target: Target, bind_cpu: bool = False) -> bool:
        """The tag's host copy -> `target`'s tensors in place; False when they already held it.
        `bind_cpu`: CPU tensors view the host copy instead (frozen weights only)."""
        ws = self._need(tag)
        tensors = self._targets(tag, ws, target)
        if _same(ws.synced, tensors):
            self.counters["restore_noops"] += 1
            return False
        self._check(tag, ws)
        views = bind(self._host(ws), ws.layout)
        cuda = None
        with torch.no_grad():
            for name, t in tensors.items():
                if bind_cpu and t.device.type == "cpu":
                    t.data = views[name]
                    continue
                if t.numel() == 0 and views[name].numel() > 0:  # released: storage back first
                    t.data = torch.empty(views[name].shape, dtype=t.dtype, device=t.device)
                t.copy_(views[name], non_blocking=self.pin and t.is_cuda)
                cuda = t.device if t.is_cuda else cuda
        if cuda is not None:
            ws.pending = torch.cuda.Event()
            ws.pending.record(torch.cuda.current_stream(cuda))
        self.counters["binds" if bind_cpu and cuda is None else "restores"] += 1
        self.counters["h2d_bytes"] += ws.layout.total_bytes if cuda is not None else 0
        ws.synced = _fingerprint(tensors)
        return True

    def release(self, tag: str, target: Target) -> None:
        """Give `target`'s tensor storage back (tensors become empty, on their device); the tag
        must hold its current values (restore or backup it first)."""
        ws = self._need(tag)
        tensors = self._targets(tag, ws, target)
        if not _same(ws.synced, tensors):
            raise ValueError(f"releasing a target that weight set {tag!r} does not hold: back it "
                             f"up first, or its values would be lost")
        for t in tensors.values():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        ws.synced = None

    def copy(self, src: str, dst: str) -> None:
        """Host -> host, no device traffic; `dst` is created in `src`'s layout if absent."""
        s = self._need(src)
        d = self.sets.get(dst)
        if d is not None and d.layout.fingerprint() != s.layout.fingerprint():
            raise ValueError(f"cannot copy {src!r} into {dst!r}: different layouts")
        if d is None:
            d = self._register(dst, s.layout)
        self._wait(d)
        self._host(d).copy_(self._host(s))
        d.crcs, d.verified, d.synced = s.crcs, False, None
        self.counters["copies"] += 1

    def rename(self, old: str, new: str) -> None:
        """The set `old` is now called `new` (its host region kept, e.g. to recycle it)."""
        if new in self.sets:
            raise ValueError(f"weight set {new!r} exists")
        ws = self.sets.pop(old)
        ws.arena.regions[new] = ws.arena.regions.pop(old)
        self.sets[new] = ws

    def drop(self, tag: str) -> None:
        ws = self.sets.pop(tag, None)
        if ws is not None:
            self._wait(ws)
            ws.arena.free(tag)

    # ---- sets the caller fills -------------------------------------------------------------
    def reserve(self, tag: str, layout: FlatLayout) -> Region:
        """A host region for `tag` in `layout`, counted as holding it; the caller fills
        `view(tag)` and then calls `written(tag)` before anything restores it."""
        return self._register(tag, layout).region

    def view(self, tag: str) -> torch.Tensor:
        """The tag's host copy as one flat uint8 buffer (its layout's `total_bytes`)."""
        return self._host(self._need(tag))

    def written(self, tag: str) -> None:
        """The tag's host copy was filled through `view`: its checksums (when verified)."""
        ws = self._need(tag)
        self._written(ws)
        ws.synced = None

    # ---- queries ---------------------------------------------------------------------------
    def has(self, tag: str) -> bool:
        return tag in self.sets

    def layout(self, tag: str) -> FlatLayout:
        return self._need(tag).layout

    def region(self, tag: str) -> Region:
        return self._need(tag).region

    def host_tensors(self, tag: str) -> dict[str, torch.Tensor]:
        """The tag's tensors, viewing its host copy (read them; write through `backup`)."""
        ws = self._need(tag)
        self._wait(ws)
        return bind(self._host(ws), ws.layout)

    @property
    def nbytes(self) -> int:
        """Host bytes the sets hold (their regions, whole pages)."""
        return sum(ws.region.nbytes for ws in self.sets.values())

    def close(self) -> None:
        self.sets.clear()
        self._finalizer()

    # ---- internals -----------------------------------------------------------------------
    def _register(self, tag: str, layout: FlatLayout) -> _Set:
        if tag in self.sets:
            raise ValueError(f"weight set {tag!r} exists")
        arena = next((a for a in self.arenas if a.fits(layout.total_bytes)), None)
        if arena is None and self.fixed:
            arena = self.arenas[0]  # full: its alloc raises HostBudgetError with the numbers
        elif arena is None:
            arena = PinnedArena.create(layout.total_bytes, pin=self.pin, private=True)
            self.arenas.append(arena)
        ws = _Set(layout, arena, arena.alloc(tag, layout.total_bytes))
        self.sets[tag] = ws
        return ws

    def _host(self, ws: _Set) -> torch.Tensor:
        return ws.arena.view(ws.region, ws.layout.total_bytes)

    def _need(self, tag: str) -> _Set:
        if tag not in self.sets:
            raise KeyError(f"unknown weight set {tag!r}; held: {sorted(self.sets)}")
        return self.sets[tag]

    def _targets(self, tag: str, ws: _Set, target: Target) -> dict[str, torch.Tensor]:
        """The target's tensors in the layout's order; refused when they do not match it."""
        if isinstance(target, torch.nn.Module):
            every = {n: t for n, t in target.state_dict(keep_vars=True).items()
                     if isinstance(t, torch.Tensor)}
        else:
            every = dict(target)
        names = ws.layout.names
        missing = [n for n in names if n not in every]
        own = {id(every[n]) for n in names if n in every}
        extra = [n for n, t in every.items() if n not in ws.layout._by_name and id(t) not in own]
        if missing or extra:
            raise ValueError(f"weight set {tag!r} does not match: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
        out = {}
        for spec in ws.layout.specs:
            t = every[spec.name]
            if t.dtype != spec.torch_dtype or (t.numel() and tuple(t.shape) != spec.shape):
                raise ValueError(f"weight set {tag!r}: {spec.name} is {t.dtype} "
                                 f"{tuple(t.shape)}, the set holds {spec.dtype} {spec.shape}")
            out[spec.name] = t
        return out

    def _written(self, ws: _Set) -> None:
        ws.crcs = chunk_crcs(self._host(ws).numpy(), self.crc_chunk_bytes) if self.verify else []
        ws.verified = False  # checked at the next restore

    def _check(self, tag: str, ws: _Set) -> None:
        if not self.verify or ws.verified:
            return
        if ws.crcs is None:
            raise ValueError(f"weight set {tag!r} was reserved but never written")
        got = chunk_crcs(self._host(ws).numpy(), self.crc_chunk_bytes)
        for i, (want, have) in enumerate(zip(ws.crcs, got)):
            if want != have:
                offset = i * self.crc_chunk_bytes
                raise ChecksumError(tag, offset, min(self.crc_chunk_bytes,
                                                     ws.layout.total_bytes - offset),
                                    where="host copy",
                                    reason="fails its CRC-32 (modified since it was written)")
        ws.verified = True

    def _wait(self, ws: _Set) -> None:
        """Before the host copy is written: no H2D may still be reading it."""
        if ws.pending is not None:
            ws.pending.synchronize()
            ws.pending = None


def _tensors_of(source: Target) -> dict[str, torch.Tensor]:
    if isinstance(source, torch.nn.Module):
        return weight_tensors(source)
    return dict(source)  # the objects themselves: the fingerprint knows them again


def _close_arenas(arenas: list[PinnedArena]) -> None:
    for a in arenas:
        a.close()
    arenas.clear()
