"""The prefetcher actor: NVMe and checkpoint reads into the host's shared pinned arena.

One per trainer host. The trainer's `WeightMemory` owns the arena's region table and sends
`ReadToHost` (NVMe -> arena region) and `LoadCheckpoint` (checkpoint -> arena region -> NVMe)
requests; this process maps the same arena by name and does the reads on its own threads, so
disk I/O never blocks the trainer's event loop or holds its GIL. It publishes what it has read
(`prefetch/bytes`, `prefetch/gbps`, `prefetch/in_flight`, `residency/<tag>`) on the metrics
stream and shows a progress bar (log lines when not on a terminal) while loading checkpoints.

`RemoteReader` is the trainer's side: it turns `WeightMemory`'s `remote_read(tag, region)` into a
call to this actor. If the prefetcher dies or misses its deadline, the trainer reads the set
itself (WeightMemory counts `sync_fallbacks`), so a killed prefetcher costs time, never
correctness. Invariant: a reply is sent only after every byte of the region is written and its
checksums (when asked) verified.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import sys
import time

import msgspec

from memory.host import PinnedArena, Region
from memory.layout import FlatLayout
from memory.nvme import ChecksumError, NvmeStore
from memory.sources import read_source
from runtime.actor import Actor
from transport.rpc import RemoteError
from transport.schema import LoadCheckpoint, LoadCheckpointReply, ReadToHost, ReadToHostReply

log = logging.getLogger(__name__)


class PrefetcherConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of the prefetcher actor (one per trainer host)."""

    chunk_bytes: int = 16 << 20  # NVMe read size per request (a multiple of 4096)
    num_readers: int = 4  # chunk reads in flight per set
    num_sets_in_flight: int = 2  # weight sets read concurrently
    pin: bool = True  # register the arena mapping with CUDA when a GPU is present


class PrefetcherActor(Actor):
    Config = PrefetcherConfig
    role = "prefetcher"

    async def on_start(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(self.config.num_sets_in_flight,
                                                          thread_name_prefix="prefetch")
        self.arenas: dict[str, PinnedArena] = {}
        self.in_flight = 0

    def rpc_handlers(self):
        return {ReadToHost: self.read_to_host, LoadCheckpoint: self.load_checkpoint}

    async def on_stop(self, reason: str) -> None:
        self.pool.shutdown(wait=True)
        for arena in self.arenas.values():
            arena.close()

    def _arena(self, name: str) -> PinnedArena:
        if name not in self.arenas:
            import torch

            self.arenas[name] = PinnedArena.attach(name, pin=self.config.pin and
                                                   torch.cuda.is_available())
        return self.arenas[name]

    async def read_to_host(self, msg: ReadToHost) -> ReadToHostReply:
        view = self._arena(msg.arena).view(Region(msg.offset, msg.nbytes))
        store = NvmeStore(msg.nvme_dir, self.config.chunk_bytes, self.config.num_readers)
        t0 = time.perf_counter()
        stats = await self._io(store.read_into, msg.tag, view, msg.verify)
        seconds = time.perf_counter() - t0
        self._publish_read(msg.tag, stats.nbytes, seconds)
        return ReadToHostReply(tag=msg.tag, nbytes=stats.nbytes, seconds=seconds,
                               direct=stats.direct)

    async def load_checkpoint(self, msg: LoadCheckpoint) -> LoadCheckpointReply:
        layout = FlatLayout.from_json(msg.layout_json)
        view = self._arena(msg.arena).view(Region(msg.offset, layout.total_bytes))
        bar = Progress(f"loading {msg.tag} from {msg.path}", layout.total_bytes)
        t0 = time.perf_counter()
        await self._io(read_source, msg.path, view, layout, bar.update)
        if msg.spill and msg.nvme_dir:
            await self._io(NvmeStore(msg.nvme_dir, self.config.chunk_bytes).write, msg.tag, view,
                           layout, msg.path)
        bar.close()
        seconds = time.perf_counter() - t0
        self._publish_read(msg.tag, layout.total_bytes, seconds)
        return LoadCheckpointReply(tag=msg.tag, nbytes=layout.total_bytes, seconds=seconds)

    async def _io(self, fn, *args):
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.in_flight -= 1

    def _publish_read(self, tag: str, nbytes: int, seconds: float) -> None:
        self.counters["bytes_read"] += nbytes
        self.counters["sets_read"] += 1
        if self.metrics:
            self.metrics.publish({"prefetch/bytes": float(self.counters["bytes_read"]),
                                  "prefetch/gbps": nbytes / max(seconds, 1e-9) / 1e9,
                                  "prefetch/in_flight": float(self.in_flight),
                                  f"residency/{tag}": 1.0})


class Progress:
    """A rich progress bar on a terminal; a log line every 10% otherwise."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.next_pct = label, total, 10
        self.bar = None
        if sys.stderr.isatty():
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(transient=True)
            self.task = self.bar.add_task(label, total=total)
            self.bar.start()

    def update(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done)
            return
        pct = 100 * done // max(total, 1)
        if pct >= self.next_pct:
            log.info("%s: %d%% (%.1f of %.1f MiB)", self.label, pct, done / 2**20, total / 2**20)
            self.next_pct = pct // 10 * 10 + 10

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class RemoteReader:
    """WeightMemory's `remote_read`: NVMe -> arena reads done by the prefetcher actor.

    Called from WeightMemory's reader threads; the call runs on the actor's event loop. A
    checksum failure comes back as ChecksumError (the set is then reloaded from its source);
    anything else (dead prefetcher, deadline) raises and WeightMemory falls back to reading
    synchronously."""

    def __init__(self, client, loop: asyncio.AbstractEventLoop, arena: PinnedArena,
                 nvme_dir: str, timeout_s: float = 120.0):
        self.client, self.loop, self.arena = client, loop, arena
        self.nvme_dir, self.timeout_s = nvme_dir, timeout_s

    def __call__(self, tag: str, region: Region) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self._read(tag, region), self.loop)

    async def _read(self, tag: str, region: Region) -> ReadToHostReply:
        msg = ReadToHost(tag=tag, arena=self.arena.name, offset=region.offset,
                         nbytes=region.nbytes, nvme_dir=self.nvme_dir)
        try:
            return await self.client.call(msg, self.timeout_s)
        except RemoteError as e:
            bad = re.search(r"offset (\d+) \((\d+) bytes\) fails its checksum", e.message)
            if bad:
                raise ChecksumError(tag, int(bad[1]), int(bad[2])) from e
            raise
