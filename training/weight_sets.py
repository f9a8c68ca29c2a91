"""Tagged weight sets of the models the trainer holds besides its live policy: the reference, the
old actors of decoupled PPO and the critic (weights and optimizer state), as host copies in the
weight memory's pinned arena (memory/host.py), each in a flat layout (memory/layout.py), switched
in place into the modules that compute with them.

`WeightSets` has the operations of memory.manager.WeightMemory (slime's TensorBackuper) on
modules instead of device slots:
- `backup(tag, source)`: a module's weights (or a {name: tensor} mapping, e.g. optimizer state)
  -> the tag's host copy (D2H on CUDA). It copies nothing, and returns False, when the source's
  tensors are the very tensors the host copy was last made from or restored into and none has
  been written since. The fingerprint is, per tensor, the tensor object (a weak reference), its
  storage pointer and its autograd version counter: every in-place write through the tensor
  (optimizer steps, `copy_`, `load_state_dict`) bumps the counter, and re-pointing `.data`
  changes the pointer. A write through `.data` or through another alias of the storage is not
  seen: `force=True` copies anyway.
- `restore(tag, target)`: the host copy -> the target's own tensors, in place (H2D from pinned
  memory on CUDA; a released tensor gets its storage back first). On the CPU, `bind=True` (frozen
  modules) makes the tensors view the host copy itself: no copy and no second copy in memory.
  A no-op when the target already holds the tag, unchanged on both sides ("one resident model"
  switched between tags: a restore after another tag went in copies again).
- `release(tag, target)`: the target's tensors become empty, so its device memory goes back; only
  allowed while the tag holds the target's current values (nothing is lost).
- `copy(src, dst)` (host -> host), `rename`, `drop`, `host_tensors`, `nbytes`.

Checks: every host copy has a CRC-32 per chunk, computed when the copy is written (backup, copy,
load) and verified at the first restore after each write (ChecksumError naming the tag and the
byte offset); a target whose names, shapes or dtypes differ from the tag's layout is refused
before anything moves.

Where the sets live: host regions of private pinned arenas (`PinnedArena.create(private=True)`:
unlinked from /dev/shm at once, pinned once on CUDA), first fit, a new arena of exactly the size
needed when none fits; a dropped or renamed set's region is reused by the next set of its size.
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
import weakref
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from memory.host import PinnedArena, Region
from memory.layout import FlatLayout, bind, pack

CRC_CHUNK_BYTES = 16 << 20
CRC_THREADS = 8  # at most, for a set of several chunks

Target = Union[torch.nn.Module, Mapping[str, torch.Tensor]]


class ChecksumError(RuntimeError):
    def __init__(self, tag: str, offset: int, nbytes: int):
        super().__init__(f"weight set {tag!r}: host copy at byte offset {offset} ({nbytes} bytes) "
                         f"fails its CRC-32 (modified since it was written)")
        self.tag, self.offset = tag, offset


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


def hollow_copy(module: torch.nn.Module, device: str | torch.device | None = None
                ) -> torch.nn.Module:
    """A deep copy of `module` whose parameters and persistent buffers are empty (on `device`,
    default: where each one is): the shape of a resident module, without a second copy of the
    weights. `WeightSets.restore` gives it values."""
    memo: dict[int, Any] = {}
    for t in module.state_dict(keep_vars=True).values():
        if isinstance(t, torch.Tensor) and id(t) not in memo:
            empty = torch.empty(0, dtype=t.dtype, device=device or t.device)
            memo[id(t)] = (torch.nn.Parameter(empty, requires_grad=False)
                           if isinstance(t, torch.nn.Parameter) else empty)
    return copy.deepcopy(module, memo)


def optimizer_tensors(optimizer: Any) -> dict[str, torch.Tensor]:
    """An optimizer's tensors that live with the parameters, by stable names: fp32 masters
    (training/master_weights.py) and per-parameter state (Adam moments); CPU scalars such as
    Adam's step count stay where they are."""
    out: dict[str, torch.Tensor] = {}
    inner = optimizer
    if hasattr(optimizer, "master"):
        out.update({f"master.{i}": m for i, m in enumerate(optimizer.master)})
        inner = optimizer.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for key, v in sorted(inner.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"state.{i}.{key}"] = v
    return out


def optimizer_steps(optimizer: Any) -> int:
    """Optimizer steps taken (Adam's per-parameter step count, restored with its state on
    resume): the same on every data-parallel rank."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a MasterWeightOptimizer wraps one
    steps = [float(st["step"]) for st in inner.state.values() if "step" in st]
    return int(max(steps, default=0.0))


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
    crcs: list[int] = field(default_factory=list)
    verified: bool = False  # the CRCs were checked by a restore since the copy was written
    synced: list[tuple] | None = None  # fingerprint of the tensors equal to the host copy
    pending: Any = None  # CUDA event: an H2D still reading the host copy


class WeightSets:
    """Tagged host copies of module weights; see the module docstring."""

    def __init__(self, pin: bool | None = None, verify: bool = True,
                 crc_chunk_bytes: int = CRC_CHUNK_BYTES):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.verify, self.crc_chunk_bytes = verify, crc_chunk_bytes
        self.arenas: list[PinnedArena] = []
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
        d.crcs, d.verified, d.synced = list(s.crcs), False, None
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

    def has(self, tag: str) -> bool:
        return tag in self.sets

    def layout(self, tag: str) -> FlatLayout:
        return self._need(tag).layout

    def host_tensors(self, tag: str) -> dict[str, torch.Tensor]:
        """The tag's tensors, viewing its host copy (read them; write through `backup`)."""
        ws = self._need(tag)
        self._wait(ws)
        return bind(self._host(ws), ws.layout)

    def holds(self, tag: str, target: Target) -> bool:
        """Whether `target`'s tensors currently equal the tag's host copy (by fingerprint)."""
        ws = self.sets.get(tag)
        return ws is not None and _same(ws.synced, self._targets(tag, ws, target))

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
        if arena is None:
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

    def _crcs(self, ws: _Set) -> list[int]:
        """CRC-32 per chunk; big sets on several threads (zlib releases the GIL)."""
        flat = self._host(ws).numpy()
        step = self.crc_chunk_bytes
        chunks = [flat[o:o + step] for o in range(0, flat.size, step)]
        threads = min(CRC_THREADS, os.cpu_count() or 1, len(chunks))
        if threads < 2:
            return [zlib.crc32(c) for c in chunks]
        with concurrent.futures.ThreadPoolExecutor(threads, "weight-sets-crc") as pool:
            return list(pool.map(zlib.crc32, chunks))

    def _written(self, ws: _Set) -> None:
        ws.crcs = self._crcs(ws) if self.verify else []
        ws.verified = False  # checked at the next restore

    def _check(self, tag: str, ws: _Set) -> None:
        if not self.verify or ws.verified:
            return
        for i, (want, got) in enumerate(zip(ws.crcs, self._crcs(ws))):
            if want != got:
                offset = i * self.crc_chunk_bytes
                raise ChecksumError(tag, offset, min(self.crc_chunk_bytes,
                                                     ws.layout.total_bytes - offset))
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
