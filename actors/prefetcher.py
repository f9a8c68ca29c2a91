"""The prefetcher actor: NVMe reads into the host's shared pinned arena.

One per trainer host. The trainer's `WeightMemory` owns the arena's region table and sends
`ReadToHost` requests (NVMe -> arena region); this process maps the same arena by name and does
the reads on its own threads, so disk I/O never blocks the trainer's event loop or holds its
GIL. It publishes what it has read (`prefetch/bytes`, `prefetch/gbps`, `prefetch/in_flight`,
`residency/<tag>`) on the metrics stream.

`RemoteReader` is the trainer's side: it turns `WeightMemory`'s `remote_read(tag, region)` into a
call to this actor. If the prefetcher dies or misses its deadline, the trainer reads the set
itself (WeightMemory counts `sync_fallbacks`), so a killed prefetcher costs time, never
correctness. Invariant: a reply is sent only after every byte of the region is written and its
checksums (when asked) verified.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

from actors.prefetcher_config import (  # noqa: F401 - PrefetcherConfig: also read from here
    PrefetcherActorPlan,
    PrefetcherConfig,
)
from memory.checksum import ChecksumError
from memory.host import PinnedArena, Region
from memory.nvme import NvmeStore
from transport.rpc import RemoteError
from transport.schema import ReadToHost, ReadToHostReply


class PrefetcherActor(PrefetcherActorPlan):
    """The prefetcher itself: its settings are `PrefetcherActorPlan`'s
    (actors/prefetcher_config.py)."""

    async def on_start(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(self.config.num_sets_in_flight,
                                                          thread_name_prefix="prefetch")
        self.arenas: dict[str, PinnedArena] = {}
        self.in_flight = 0

    def rpc_handlers(self):
        return {ReadToHost: self.read_to_host}

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
            bad = ChecksumError.parse(e.message)
            if bad is not None:
                raise bad from e
            raise
