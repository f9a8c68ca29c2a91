"""WeightMemory: tagged weight sets across three tiers (GPU slots, pinned host arena, NVMe), the
colocated teachers' memory.

The host tier is a `memory.store.WeightStore` over one shared arena whose size is the budget
(the store the reference, old actors and critic use, without CRCs here: a teacher's host copy
comes from checksummed NVMe chunks or from its checkpoint); on top of it:
- `spill(tag)`: host -> NVMe (checksummed); `prefetch(tag, "host" | "gpu")`: returns a Future at
  once; NVMe -> host runs on reader threads or in the prefetcher process (`remote_read`), and
  NVMe -> GPU is pipelined per chunk (the H2D of chunk i runs while chunk i+1 is read), or read
  by cuFile straight into the slot (`gds = "auto"` on a CUDA device where cuFile opens:
  memory/gds.py; `nvme_reader` says which, `counters["gds_loads"]` counts them);
- `acquire(tag)` / `release(tag)`: use a set for compute (the compute stream waits on the set's
  copy event only, never on the whole device); `run(order, fn)` runs a declared switch order with
  the planner's Belady eviction and prefetch one or more switches ahead.

A set registered with a `source` (its checkpoint) is loaded from it with `load_source`: into a
host region, or streamed chunk by chunk straight into an NVMe file (`to_tier="nvme"`: no copy in
host memory; see memory/sources.py for the bound). The source stays registered: a chunk that
fails its checksum on a later NVMe read is reloaded from there and the file rewritten (warning,
`checksum_reloads`). A set whose host region is dropped goes to NVMe once if it is not there yet
(its source too: later reads are the NVMe tier's O_DIRECT, checksummed ones); without an NVMe
directory a set with a source is read from the source again.

On CUDA, H2D copies run on a dedicated stream ordered by events: a slot is overwritten only
after the compute that last read it (its release event), and compute on a set starts only after
its copy event. On a CPU-only machine the "GPU" tier is the CPU device and copies run on a thread,
so every path runs in CI. Every copy and compute phase goes on the timeline.

Invariant: a tier never holds more than its budget (slots: count; host: arena bytes), and a set
always has a canonical copy somewhere (host region, NVMe file, or source checkpoint) before its
GPU slot is reused.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memory.checksum import ChecksumError
from memory.gds import choose_reader
from memory.host import PinnedArena, Region
from memory.layout import FlatLayout, bind, pack
from memory.nvme import NvmeStore
from memory.planner import Plan, check_sizes, plan_switches
from memory.sources import read_source, source_pieces
from memory.store import WeightStore
from memory.timeline import Timeline

log = logging.getLogger(__name__)
Future = concurrent.futures.Future


@dataclass
class WeightSet:
    tag: str
    layout: FlatLayout
    source: str = ""  # checkpoint to reload from ("" = none)
    slot: int | None = None  # GPU slot index while resident there
    region: Region | None = None  # host region while resident there
    ready: Any = None  # CUDA event after which the slot holds the set (None on CPU)
    copy_future: Future | None = None  # completes when the copy into the slot is issued (CUDA)
                                       # or done (CPU)
    host_ready: Future | None = None  # completes when the host region holds the set


class WeightMemory:
    def __init__(self, device: str = "cpu", gpu_slots: int = 2, slot_bytes: int = 1 << 26,
                 host_budget_bytes: int = 1 << 27, nvme_dir: str | None = None,
                 chunk_bytes: int = 16 << 20, num_readers: int = 4, lookahead: int = 1,
                 timeline: Timeline | None = None,
                 remote_read: Callable[[str, Region], Future] | None = None, gds: str = "off"):
        """`gds`: "auto" reads NVMe -> GPU slot through cuFile when the device is CUDA and
        cuFile opens, "off" never tries it (memory/gds.py `choose_reader`)."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slot_bytes, self.lookahead = slot_bytes, lookahead
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(gpu_slots)]
        self.slot_tag: list[str | None] = [None] * gpu_slots
        self.slot_free: list[Any] = [None] * gpu_slots  # event: last compute on the slot done
        self.host = WeightStore(verify=False, arena=PinnedArena.create(host_budget_bytes))
        self.store = NvmeStore(nvme_dir, chunk_bytes, num_readers) if nvme_dir else None
        self.timeline = timeline or Timeline()
        self.remote_read = remote_read
        self.sets: dict[str, WeightSet] = {}
        self.counters = {"sync_fallbacks": 0, "gpu_loads": 0, "host_loads": 0,
                         "checksum_reloads": 0, "gds_loads": 0}
        # two pools, so that a copy waiting for its disk read never holds the thread the read needs;
        # disk reads one set at a time, in the order issued (the plan's order of need: a set
        # needed soon never shares the disk with one needed later; each read has `num_readers`
        # chunks in flight)
        self._disk = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightmem-disk")
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightmem-h2d")
        self._lock = threading.RLock()
        if self.cuda:
            self.h2d = torch.cuda.Stream(self.device)
        self.gds, self.nvme_reader_why = choose_reader(gds, self.device, num_readers)
        self.gds_error = ""  # why cuFile was given up after it was chosen, if it was
        if self.store is not None:
            log.info("weight memory: NVMe -> %s reads %s (%s)", self.device,
                     "through cuFile" if self.gds else "through pinned host memory",
                     self.nvme_reader_why)

    @property
    def arena(self) -> PinnedArena:
        """The host tier's shared arena (its size is the budget; the prefetcher maps it)."""
        return self.host.arenas[0]

    @property
    def nvme_reader(self) -> str:
        """How a set only on NVMe reaches a device slot: "gds" (cuFile, no host staging) or
        "host" (O_DIRECT -> pinned host -> H2D)."""
        return "gds" if self.gds is not None else "host"

    # ---- registration --------------------------------------------------------------------
    def register(self, tag: str, layout: FlatLayout, source: str = "") -> WeightSet:
        if tag in self.sets:
            raise ValueError(f"weight set {tag!r} is already registered")
        check_sizes({tag: layout.total_bytes}, self.slot_bytes, self.arena.nbytes)
        self.sets[tag] = WeightSet(tag, layout, source)
        return self.sets[tag]

    def load_tensors(self, tag: str, tensors: Mapping[str, torch.Tensor], source: str = "",
                     ) -> WeightSet:
        """Register a set from a state dict and place it on the host tier."""
        ws = self.register(tag, FlatLayout.from_state_dict(tensors), source)
        pack(tensors, self.reserve_host(tag), ws.layout)
        self.host.written(tag)
        return ws

    def load_source(self, tag: str, layout: FlatLayout, source: str, to_tier: str = "host",
                    progress: Callable[[int, int], None] | None = None) -> WeightSet:
        """Register a set whose canonical copy is the checkpoint `source` and read it: into a
        host region (`to_tier="host"`), or straight into the NVMe tier (`"nvme"`: streamed,
        about three chunks of host memory, never a copy of the set). On any failure the set is
        not registered. Registering (and the budget checks) happen before anything is read."""
        if to_tier not in ("host", "nvme"):
            raise ValueError(f"to_tier = {to_tier!r}; use 'host' or 'nvme'")
        if to_tier == "nvme" and self.store is None:
            raise ValueError("loading to the NVMe tier needs an NVMe directory (nvme_dir)")
        ws = self.register(tag, layout, source)
        t0 = self.timeline.now()
        try:
            if to_tier == "host":
                read_source(source, self.reserve_host(tag), layout, progress)
                self.host.written(tag)
            else:
                self.store.write_stream(tag, layout, source_pieces(
                    source, layout, self.store.chunk_bytes), source, progress)
        except BaseException:
            self.host.drop(tag)
            del self.sets[tag]
            raise
        self.timeline.add("disk", tag, "disk", t0, nbytes=layout.total_bytes, src="source",
                          dst=to_tier)
        return ws

    def reserve_host(self, tag: str) -> torch.Tensor:
        """A host region for a registered set, counted as holding it: the caller fills the
        returned buffer (in the set's layout) before anything reads it."""
        ws = self.sets[tag]
        ws.region = self.host.reserve(tag, ws.layout)
        ws.host_ready = _done()
        return self.host.view(tag)

    # ---- moves between tiers ----------------------------------------------------------------
    def spill(self, tag: str, free_host: bool = False) -> None:
        ws = self._need(tag, on_host=True)
        if self.store is None:
            raise ValueError("spill needs an NVMe directory (nvme_dir)")
        t0 = self.timeline.now()
        self.store.write(tag, self.host.view(tag), ws.layout, ws.source)
        self.timeline.add("disk", tag, "disk", t0, nbytes=ws.layout.total_bytes, src="host",
                          dst="nvme")
        if free_host:
            self._drop_host(ws)

    def prefetch(self, tag: str, to_tier: str = "gpu") -> Future:
        """Start moving a set up to `to_tier` ("host" or "gpu"); returns at once."""
        ws = self.sets[tag]
        if to_tier == "host":
            return self._to_host(ws)
        if to_tier == "gpu":
            return self._to_gpu(ws)
        raise ValueError(f"to_tier = {to_tier!r}; use 'host' or 'gpu'")

    # ---- compute -------------------------------------------------------------------------
    def acquire(self, tag: str) -> dict[str, torch.Tensor]:
        """The set's tensors on the device; the compute stream waits for its copy, nothing else."""
        ws = self.sets[tag]
        t0 = self.timeline.now()
        self._to_gpu(ws).result()
        self._wait_ready(ws)
        self.timeline.add("wait", tag, "compute", t0)
        return self.gpu_tensors(tag)

    def release(self, tag: str) -> None:
        """Compute on the set is issued: its slot may be overwritten once that compute is done."""
        ws = self.sets[tag]
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.slot_free[ws.slot] = ev

    def plan(self, order: Sequence[str]) -> Plan:
        gpu = [t for t in self.slot_tag if t is not None]
        host = [t for t, ws in self.sets.items() if ws.region is not None]
        return plan_switches(order, {t: self.sets[t].layout.total_bytes for t in self.sets},
                             len(self.slots), self.arena.nbytes, gpu, host, self.lookahead)

    def run(self, order: Sequence[str], fn: Callable[[str, dict[str, torch.Tensor]], Any],
            next_order: Sequence[str] = ()) -> list[Any]:
        """Run `fn(tag, tensors)` for each switch of `order`, prefetching per the plan.
        `next_order` (a hint, e.g. the teachers of the buffer's next batch) extends the plan, so
        the last switches already prefetch the next step's first sets."""
        plan = self.plan(list(order) + list(next_order[:self.lookahead]))
        out = []
        for step in plan.steps[:len(order)]:
            for a in step.demand:
                self._apply(a)
            tensors = self.acquire(step.tag)
            for a in step.prefetch:  # issued now: they overlap this compute
                self._apply(a)
            out.append(fn(step.tag, tensors))
            self.release(step.tag)
        return out

    def hint(self, upcoming: Sequence[str]) -> list[Future]:
        """Start loading the first sets of an upcoming step to the GPU where slots are free (a
        hint from the buffer about the next batch's teachers); never evicts."""
        futures = []
        for tag in upcoming[:self.lookahead]:
            ws = self.sets[tag]
            resident = ws.slot is not None and self.slot_tag[ws.slot] == tag
            if resident or None in self.slot_tag:
                futures.append(self._to_gpu(ws))
        return futures

    def evict(self, tag: str, tier: str) -> None:
        """Drop a set from "gpu" or "host" (spilled to NVMe first if nothing else holds it)."""
        ws = self.sets[tag]
        if tier == "gpu":
            self._evict_gpu(ws)
        elif tier == "host":
            self._drop_host(ws)
        else:
            raise ValueError(f"tier = {tier!r}; use 'gpu' or 'host'")

    def gpu_tensors(self, tag: str) -> dict[str, torch.Tensor]:
        ws = self._need(tag, on_gpu=True)
        return bind(self.slots[ws.slot], ws.layout)

    def host_tensors(self, tag: str) -> dict[str, torch.Tensor]:
        self._need(tag, on_host=True)
        return self.host.host_tensors(tag)

    def residency(self) -> dict[str, list[str]]:
        return {"gpu": [t for t in self.slot_tag if t is not None],
                "host": sorted(t for t, ws in self.sets.items() if ws.region is not None),
                "nvme": sorted(t for t in self.sets if self.store and self.store.has(t))}

    def close(self) -> None:
        self._disk.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        if self.gds is not None:
            self.gds.close()
        self.slots = []
        self.host.close()

    # ---- moves ---------------------------------------------------------------------------
    def _apply(self, a) -> None:
        ws = self.sets[a.tag]
        if a.op == "evict":
            self.evict(a.tag, a.tier)
        elif a.tier == "host":
            self._to_host(ws)
        else:
            fut = self._to_gpu(ws)
            if not a.prefetch:
                fut.result()

    def _to_host(self, ws: WeightSet) -> Future:
        with self._lock:
            if ws.host_ready is not None:
                return ws.host_ready
            ws.region = self.host.reserve(ws.tag, ws.layout)
            ws.host_ready = self._disk.submit(self._read_host, ws)
            return ws.host_ready

    def _read_host(self, ws: WeightSet, on_chunk: Callable[[int, int], None] | None = None
                   ) -> None:
        t0 = self.timeline.now()
        if self.store is not None and self.store.has(ws.tag):
            self._read_nvme(ws, on_chunk)
        else:
            read_source(ws.source, self.host.view(ws.tag), ws.layout)
        self.host.written(ws.tag)
        self.timeline.add("disk", ws.tag, "disk", t0, nbytes=ws.layout.total_bytes,
                          src="nvme", dst="host")
        self.counters["host_loads"] += 1

    def _read_nvme(self, ws: WeightSet, on_chunk: Callable[[int, int], None] | None) -> None:
        try:
            if self.remote_read is not None:
                try:
                    return self.remote_read(ws.tag, ws.region).result()
                except Exception as e:  # noqa: BLE001 - any prefetcher failure: read here
                    if isinstance(e, ChecksumError):
                        raise
                    self.counters["sync_fallbacks"] += 1
                    log.warning("prefetcher failed reading %s (%s); reading synchronously",
                                ws.tag, e)
            self.store.read_into(ws.tag, self.host.view(ws.tag), on_chunk=on_chunk)
        except ChecksumError as e:
            if not ws.source:
                raise
            self._repair(ws, e)

    def _repair(self, ws: WeightSet, error: ChecksumError) -> None:
        """The set's host region from its source, and its NVMe file rewritten from that."""
        log.warning("%s; reloading %r from its source %s and rewriting its NVMe file", error,
                    ws.tag, ws.source)
        self.counters["checksum_reloads"] += 1
        try:
            read_source(ws.source, self.host.view(ws.tag), ws.layout)
        except (ValueError, OSError) as e:
            raise ValueError(f"weight set {ws.tag!r}: an NVMe chunk failed its checksum and its "
                             f"source {ws.source} cannot be read: {e}") from error
        self.store.write(ws.tag, self.host.view(ws.tag), ws.layout, ws.source)

    def _to_gpu(self, ws: WeightSet) -> Future:
        with self._lock:
            if ws.slot is not None and self.slot_tag[ws.slot] == ws.tag:
                return ws.copy_future or _done()
            slot = self._free_slot()
            self._occupy(ws, slot)
            on_nvme_only = ws.host_ready is None and self.store is not None and self.store.has(
                ws.tag)
            if self.gds is not None and on_nvme_only:
                ws.copy_future = self._disk.submit(self._gds_to_gpu, ws, slot)
                return ws.copy_future
            if self.cuda and on_nvme_only and self.remote_read is None:
                ws.region = self.host.reserve(ws.tag, ws.layout)
                ws.host_ready = ws.copy_future = self._disk.submit(self._pipelined, ws, slot)
                return ws.copy_future
            host = self._to_host(ws)
            ws.copy_future = self._copier.submit(self._h2d_after, ws, slot, host)
            return ws.copy_future

    def _h2d_after(self, ws: WeightSet, slot: int, host: Future) -> None:
        host.result()
        self._copy(self.host.view(ws.tag), self.slots[slot], ws, "h2d", slot)
        self.counters["gpu_loads"] += 1

    def _gds_to_gpu(self, ws: WeightSet, slot: int) -> None:
        """NVMe -> GPU slot through cuFile (no host staging; see memory/gds.py)."""
        if self.slot_free[slot] is not None:
            self.slot_free[slot].synchronize()  # cuFile writes outside any stream
        t0 = self.timeline.now()
        try:
            self.gds.read(str(self.store.data_path(ws.tag)), self.slots[slot],
                          ws.layout.total_bytes, self.store.chunk_bytes)
        except Exception as e:  # noqa: BLE001 - cuFile refused: the host path for good
            log.warning("cuFile read of %s failed (%s); using O_DIRECT -> pinned -> H2D from now "
                        "on", ws.tag, e)
            self.gds_error, self.gds = str(e), None
            self.nvme_reader_why = f"cuFile failed: {e}"
            ws.region = self.host.reserve(ws.tag, ws.layout)
            ws.host_ready = _done_after(self._pipelined, ws, slot)
            return
        self.timeline.add("disk", ws.tag, "gds", t0, nbytes=ws.layout.total_bytes, src="nvme",
                          dst="gpu")
        ws.ready = None
        self.counters["gpu_loads"] += 1
        self.counters["gds_loads"] += 1

    def _pipelined(self, ws: WeightSet, slot: int) -> None:
        """NVMe -> host -> GPU by chunks: each chunk's H2D is issued as soon as it is read,
        so the read of the next chunks overlaps it."""
        host, dev = self.host.view(ws.tag), self.slots[slot]
        if self.slot_free[slot] is not None:
            self.h2d.wait_event(self.slot_free[slot])

        def h2d_chunk(off: int, n: int) -> None:
            with torch.cuda.stream(self.h2d):
                dev[off:off + n].copy_(host[off:off + n], non_blocking=True)

        span = self.timeline.cuda_span(self.h2d)
        reloads = self.counters["checksum_reloads"]
        self._read_host(ws, on_chunk=h2d_chunk)
        if self.counters["checksum_reloads"] != reloads:  # chunks came from a bad read: redo
            h2d_chunk(0, ws.layout.total_bytes)
        span.end("h2d", ws.tag, "h2d", ws.layout.total_bytes, src="nvme")
        ev = torch.cuda.Event()
        ev.record(self.h2d)
        ws.ready = ev
        self.counters["gpu_loads"] += 1

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, ws: WeightSet, kind: str,
              slot: int | None = None) -> None:
        """Host region -> slot (`kind` "h2d"): on CUDA on the H2D stream after the slot's last
        compute, its event the set's `ready`."""
        n = ws.layout.total_bytes
        if not self.cuda:
            t0 = self.timeline.now()
            dst[:n].copy_(src[:n])
            self.timeline.add(kind, ws.tag, kind, t0, nbytes=n)
            ws.ready = None
            return
        stream = self.h2d
        if slot is not None and self.slot_free[slot] is not None:
            stream.wait_event(self.slot_free[slot])
        span = self.timeline.cuda_span(stream)
        with torch.cuda.stream(stream):
            dst[:n].copy_(src[:n], non_blocking=True)
        span.end(kind, ws.tag, kind, n)
        ev = torch.cuda.Event()
        ev.record(stream)
        ws.ready = ev

    def _wait_ready(self, ws: WeightSet) -> None:
        if self.cuda and ws.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ws.ready)

    def _free_slot(self) -> int:
        for i, t in enumerate(self.slot_tag):
            if t is None:
                return i
        raise ValueError(f"no free GPU slot (held by {self.slot_tag}); evict a set first")

    def _occupy(self, ws: WeightSet, slot: int) -> None:
        self.slot_tag[slot], ws.slot = ws.tag, slot

    def _evict_gpu(self, ws: WeightSet) -> None:
        if ws.copy_future is not None:
            ws.copy_future.result()
        if ws.slot is not None:
            self.slot_tag[ws.slot], ws.slot, ws.ready = None, None, None
            ws.copy_future = None

    def _drop_host(self, ws: WeightSet) -> None:
        if ws.region is None:
            return
        if ws.host_ready is not None:
            ws.host_ready.result()
        if ws.copy_future is not None:
            ws.copy_future.result()
        if ws.ready is not None and self.cuda:
            ws.ready.synchronize()  # an H2D may still be reading the region
        on_nvme = self.store is not None and self.store.has(ws.tag)
        if not on_nvme and (self.store is not None or not ws.source):
            self.spill(ws.tag)  # once: later reads are NVMe's; a source stays for repairs
        self.host.drop(ws.tag)
        ws.region, ws.host_ready = None, None

    def _need(self, tag: str, on_gpu: bool = False, on_host: bool = False) -> WeightSet:
        if tag not in self.sets:
            raise KeyError(f"unknown weight set {tag!r}; registered: {sorted(self.sets)}")
        ws = self.sets[tag]
        if on_gpu and (ws.slot is None or self.slot_tag[ws.slot] != tag):
            raise ValueError(f"{tag!r} is not on the device (prefetch or acquire it first)")
        if on_host:
            if ws.host_ready is None:
                raise ValueError(f"{tag!r} is not on the host tier (load or prefetch it first)")
            ws.host_ready.result()
        return ws


def _done_after(fn, *args) -> Future:
    """Run `fn` now, in this thread; a Future holding its outcome."""
    f: Future = Future()
    try:
        f.set_result(fn(*args))
    except Exception as e:  # noqa: BLE001 - handed to whoever waits on the future
        f.set_exception(e)
    return f


def _done() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f
