"""Trainer-side weight sync to SGLang-compatible workers: from disk, over a process group, or as
serialized tensors (colocated), each wrapped in pause -> update -> continue.

Role: the one place a trainer pushes a weight version to inference workers (real SGLang or the
embedded engine: the same requests reach both). Three paths:
- `DiskSync`: the trainer wrote an HF checkpoint; every worker loads it
  (`/update_weights_from_disk`). Works everywhere, costs a disk round trip.
- `DistributedSync`: the trainer is rank 0 of torch.distributed groups the workers joined
  (`/init_weights_update_group`, each server's ranks `rank_offset + tp_rank`); tensors are
  broadcast in buckets of at most `bucket_bytes`, each bucket announced by one
  `/update_weights_from_distributed` (names, dtypes, shapes in broadcast order). NCCL on GPUs,
  gloo on CPU. NCCL takes one rank per GPU in a group, so workers sharing a GPU go to
  different groups (`plan_groups`); a failed push gives its groups up, forms new ones and
  sends again before it fails.
- `TensorSync` (same host): tensors in the request body (`/update_weights_from_tensor`), in
  buckets. `serializer = "safetensors"`: base64 safetensors of each bucket (the embedded engine;
  any device, CPU included; buckets of at most 160 MiB, so that a body fits the engine's
  256 MiB limit: a single tensor above ~190 MiB is refused there with 413, use another path).
  `serializer = "cuda_ipc"` (weight_sync.path "cuda_ipc"): SGLang's own format, load_format
  "flattened_bucket" (engine/cuda_ipc.py): each bucket (one dtype) is copied into one staging
  buffer on the trainer's GPU and only its CUDA IPC handle travels; the worker copies GPU to GPU.
  Extra device memory: one bucket (the largest tensor if bigger), allocated at the first push
  and kept for the sync's life: torch's IPC reference count pairs one export with one release,
  but every worker releases every bucket of the same buffer, so a dropped buffer would never
  count down to 0 and `ipc_collect` would never free it (one bucket lost per push, measured on
  an H200); a buffer that is never dropped costs one bucket, once.
  Real SGLang and the embedded engine read the same payload.
- `SplitSync` (weight_sync.path "auto"): by placement, per worker: CUDA IPC to the workers on the
  trainer's GPU, a process group (NCCL from a CUDA trainer) to the others (`plan_paths`).

Pause modes (`pause_mode`, /pause_generation's `mode`; default "in_place"): "in_place" holds
the requests running on a worker at a step boundary with their KV cache; the update applies while
they wait and they then finish with the new weights, so nothing in flight is discarded (a
response computed partly by each version; the embedded engine reports where the version changed
in `meta_info.weight_version_spans`, and the rollout records the older version, engine/session.py).
"retract" holds them too but drops their KV cache, prefilled again with the new weights on
continue. "abort" (SGLang's default) ends them at once with finish_reason abort and the rollout
generates those turns again.

Invariants:
- Generation is paused on a worker before the first byte moves to it and continued after the last
  bucket, also when the update fails; the last bucket carries `flush_cache = true` and the
  `weight_version`, so a worker's version changes only once all its tensors arrived.
- After a push, every worker reports the new version (`/get_weight_version`), else SyncError.
- `weight_sync.path` is read in one place, `make_weight_sync` (the path to each worker:
  `worker_paths`); `check_weight_sync_placement` checks a placement against the same plan before
  anything starts. What a trainer calls per version (one `push(version)` whatever the path, the
  disk fallback, the colocated wake order) is engine/weight_push.py, built from
  engine/weight_sync_config.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Iterable, Iterator, Literal

import torch

from engine import cuda_ipc, dist_group
from engine.client import SglangClient
from engine.errors import EngineUnavailable, SyncError
from engine.weight_sync_plan import (  # noqa: F401 - the plan: also read from here
    PATHS,
    check_sync_device,
    check_weight_sync_placement,
    plan_groups,
    plan_paths,
    worker_paths,
)
from memory.device_usage import give_back_cached
from transport.dtypes import dtype_name
from transport.sockets import free_port

NamedTensors = Iterable[tuple[str, torch.Tensor]]

log = logging.getLogger(__name__)


HEALTH_PROBE_S = 3.0  # a worker that does not answer /health this long is skipped by a push


def _bucketed(named: NamedTensors, bucket_bytes: int, by_dtype: bool = False
              ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """(bucket, last) pairs: consecutive groups of at most `bucket_bytes` (a bigger tensor is
    alone; `by_dtype`: one dtype each). A bucket is given out as soon as the next tensor does
    not fit, so at most one bucket and the tensor after it are held here; `last` is known then
    (a next tensor exists) or at the end."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (size + nbytes > bucket_bytes
                       or (by_dtype and tensor.dtype != bucket[-1][1].dtype)):
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket, True


def buckets(named: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `bucket_bytes` each (a bigger tensor is alone)."""
    return (bucket for bucket, _ in _bucketed(named, bucket_bytes))


class WeightStream:
    """One weight version's tensors, produced while they are sent: `produce()` is a fresh
    iterator of (name, tensor) each time the version is read (a retry reads it again), advanced
    only in `executor`'s thread (a sharded trainer's gather runs collectives there, in the order
    its other ranks run them). `copies`: the tensors are new host copies (a gather), not views of
    the live parameters, so what a push holds of them is extra memory: `peak_held_bytes` is the
    most bytes of them alive at once during the latest read (one bucket and one gathered piece,
    where a whole-model list would hold the model). `shared`: several reads may run at once
    (views of a local model); a gather's reads go one after another. A plain list or iterable
    of tensors is a stream of views (`as_stream`)."""

    def __init__(self, produce: Any, executor: ThreadPoolExecutor | None = None,
                 copies: bool = False, shared: bool = False):
        self.produce, self.executor, self.copies, self.shared = produce, executor, copies, shared
        self.peak_held_bytes = 0
        self.bytes_read = 0  # the latest complete read's bytes (one version)
        self._held = 0
        self._read = 0  # reads so far: a tensor of an earlier read let go later is not counted

    def _count(self, named: Iterator[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        self._read += 1
        self._held = self.peak_held_bytes = 0
        total = 0
        for name, tensor in named:
            nbytes = tensor.numel() * tensor.element_size()
            total += nbytes
            if self.copies:  # alive until the push lets go of it
                self._held += nbytes
                self.peak_held_bytes = max(self.peak_held_bytes, self._held)
                weakref.finalize(tensor, self._release, self._read, nbytes)
            yield name, tensor
        self.bytes_read = total

    def _release(self, read: int, nbytes: int) -> None:
        if read == self._read:
            self._held -= nbytes

    @contextlib.asynccontextmanager
    async def buckets(self, bucket_bytes: int, by_dtype: bool = False
                      ) -> AsyncIterator[AsyncIterator[tuple[list[tuple[str, torch.Tensor]],
                                                                bool]]]:
        """`async with stream.buckets(n) as parts: async for bucket, last in parts`: one read,
        each bucket produced in the stream's thread when it is wanted; leaving the block early
        (a failed push) finishes the read there (a gather's other ranks complete it)."""
        source = iter(self.produce())
        parts = _bucketed(self._count(source), bucket_bytes, by_dtype)
        run = asyncio.get_running_loop().run_in_executor

        async def each() -> AsyncIterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
            while True:
                got = await run(self.executor, next, parts, None)
                if got is None:
                    return
                yield got
                del got  # before the next is made: the consumer's is the only reference

        try:
            yield each()
        finally:
            await run(self.executor, _finish, parts, source)


def _finish(parts: Iterator, source: Iterator) -> None:
    """A read's end: the bucketing closed, then the source (a gather's `close` runs what is
    left of its collectives)."""
    for it in (parts, source):
        close = getattr(it, "close", None)
        if close is not None:
            close()


def as_stream(named: Any) -> WeightStream:
    """`named` as a WeightStream: itself, or a list of (name, tensor) views read in place."""
    if isinstance(named, WeightStream):
        return named
    named = list(named)
    return WeightStream(lambda: named, shared=True)


def bucket_nbytes(bucket: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


DEFAULT_PAUSE_MODE = "in_place"  # nothing in flight is discarded by a push


@contextlib.asynccontextmanager
async def paused(clients: list[SglangClient], mode: str = DEFAULT_PAUSE_MODE
                 ) -> AsyncIterator[None]:
    """Generation paused on every worker inside the block; continued on exit, whatever happens."""
    await asyncio.gather(*(c.pause_generation(mode) for c in clients))
    try:
        yield
    finally:
        await asyncio.gather(*(c.continue_generation() for c in clients),
                             return_exceptions=True)


async def check_versions(clients: list[SglangClient], version: str) -> None:
    got = await asyncio.gather(*(c.get_weight_version() for c in clients))
    wrong = [(c.base_url, v) for c, v in zip(clients, got) if v != version]
    if wrong:
        raise SyncError(f"workers did not take weight version {version!r}: {wrong}")


class DiskSync:
    """Every worker loads the checkpoint directory the trainer wrote, each on its own
    (pause -> load -> continue per worker).

    A worker that cannot be reached (down, or restarting) is skipped and named in `unreachable`:
    a restarting worker loads the newest version from disk itself before it serves
    (actors/inference.py), so the run goes on without it instead of failing. So is one that does
    not answer /health within `probe_timeout_s` (hung: stopped, or stuck), and later pushes skip
    it at once until a probe left waiting on it hears back; every push loads the whole
    checkpoint, so the next one brings it up to date (its samples meanwhile carry its own, older
    version). Any other failure (a worker that answers but refuses the update) raises SyncError.
    """

    def __init__(self, clients: list[SglangClient], pause_mode: str = DEFAULT_PAUSE_MODE,
                 probe_timeout_s: float = HEALTH_PROBE_S):
        self.clients, self.pause_mode = clients, pause_mode
        self.probe_timeout_s = probe_timeout_s
        self.unreachable: list[str] = []  # workers skipped by the latest push
        self._silent: dict[str, asyncio.Task] = {}  # a /health probe still waiting, by worker

    async def push(self, path: str, version: str) -> None:
        results = await asyncio.gather(*(self._push_one(c, path, version) for c in self.clients),
                                       return_exceptions=True)
        self.unreachable = [c.base_url for c, r in zip(self.clients, results)
                            if isinstance(r, EngineUnavailable)]
        failed = [(c.base_url, r) for c, r in zip(self.clients, results)
                  if isinstance(r, BaseException) and not isinstance(r, EngineUnavailable)]
        if failed:
            raise SyncError("weight update failed on " + "; ".join(f"{u}: {r}"
                                                                    for u, r in failed))
        if self.unreachable:
            log.warning("weight version %s not pushed to unreachable worker(s) %s; they load "
                        "the newest version from disk when they come back", version,
                        ", ".join(self.unreachable))

    async def _push_one(self, client: SglangClient, path: str, version: str) -> None:
        await self._answering(client)
        async with paused([client], self.pause_mode):
            await _settle({client.base_url: _succeeded(client.update_weights_from_disk(
                path, weight_version=version))}, None, f"weight version {version} from disk")
        await check_versions([client], version)


    async def _answering(self, client: SglangClient) -> None:
        """EngineUnavailable (skipped as unreachable) unless `client` answers /health
        within probe_timeout_s, or, when it did not before, its waiting probe has heard back."""
        url = client.base_url
        probe = self._silent.pop(url, None)
        if probe is None:
            probe = asyncio.ensure_future(client.health())
            await asyncio.wait({probe}, timeout=self.probe_timeout_s)
        if probe.done():
            probe.result()  # False (an error status, no connection): the push itself says why
            return
        self._silent[url] = probe
        raise EngineUnavailable(f"{url} has not answered /health for at least "
                                f"{self.probe_timeout_s:g} s (hung)")


MAX_SAFETENSORS_BUCKET_BYTES = 160 << 20  # base64 of it (+ headers) stays under 256 MiB


class TensorSync:
    """Tensors in the request body, bucketed: base64 safetensors, or CUDA IPC handles of a
    staging buffer on the trainer's GPU `device` (`serializer = "cuda_ipc"`); see the module
    docstring."""

    def __init__(self, clients: list[SglangClient],
                 serializer: Literal["safetensors", "cuda_ipc"] = "safetensors",
                 bucket_bytes: int = 512 << 20, tp_sizes: list[int] | None = None,
                 pause_mode: str = DEFAULT_PAUSE_MODE,
                 executor: ThreadPoolExecutor | None = None, device: str | None = None):
        if serializer == "cuda_ipc" and not str(device).startswith("cuda"):
            raise SyncError(f"weight_sync.path = 'cuda_ipc' sends CUDA IPC handles of the "
                            f"trainer's GPU; this trainer runs on {device}: use 'tensor' "
                            f"(weights in the request body) or 'disk'")
        if serializer not in ("safetensors", "cuda_ipc"):
            raise ValueError(f"serializer must be 'safetensors' or 'cuda_ipc', got {serializer!r}")
        self.clients, self.serializer, self.bucket_bytes = clients, serializer, bucket_bytes
        self.tp_sizes = tp_sizes or [1] * len(clients)  # serialized copies per worker (TP ranks)
        self.pause_mode, self.device = pause_mode, device
        self.load_format = cuda_ipc.FLATTENED_BUCKET if serializer == "cuda_ipc" else None
        # serializing copies every tensor: never on the event loop (None: a pool of its own)
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix="weight-serialize")
        # cuda_ipc: one bucket's bytes, kept from the first push on (see the module docstring);
        # a bigger bucket later gets a bigger buffer and the old one stays referenced too
        self._staging: torch.Tensor | None = None
        self._outgrown: list[torch.Tensor] = []
        self.reduce = cuda_ipc.reduce_cuda  # a staged tensor -> its IPC arguments (torch's)

    def serialize(self, bucket: list[tuple[str, torch.Tensor]]) -> str:
        """One bucket's payload (cuda_ipc: staged in the push's buffer first)."""
        if self.serializer == "cuda_ipc":
            return self._stage(bucket)
        from safetensors.torch import save

        blob = save({name: t.detach().contiguous().cpu() for name, t in bucket})
        return base64.b64encode(blob).decode("ascii")

    async def push(self, named: NamedTensors | WeightStream, version: str) -> None:
        stream = as_stream(named)
        size = (self.bucket_bytes if self.serializer == "cuda_ipc"  # a bucket is one dtype
                # base64 of a bucket must fit a worker's body limit (a bigger tensor: 413)
                else min(self.bucket_bytes, MAX_SAFETENSORS_BUCKET_BYTES))
        run = asyncio.get_running_loop().run_in_executor
        async with paused(self.clients, self.pause_mode):
            try:
                async with stream.buckets(size, self.serializer == "cuda_ipc") as parts:
                    i = 0
                    async for bucket, last in parts:
                        i += 1
                        payload = await run(self.executor, self.serialize, bucket)
                        del bucket  # one bucket held at a time (the stream's next is made now)
                        extra = {"load_format": self.load_format} if self.load_format else {}
                        await _settle({c.base_url: _succeeded(c.update_weights_from_tensor(
                            [payload] * tp, weight_version=version if last else None,
                            flush_cache=last, **extra))
                            for c, tp in zip(self.clients, self.tp_sizes)}, None,
                            f"weight version {version}, bucket {i}" + (" (the last)" if last
                                                                        else ""))
                        del payload
            finally:
                if self.serializer == "cuda_ipc":
                    await run(self.executor, self._collect)
        await check_versions(self.clients, version)

    def _allocate(self, nbytes: int) -> None:
        nbytes = -(-nbytes // 256) * 256  # every dtype's view of it covers whole elements
        if self._staging is not None and self._staging.numel() >= nbytes:
            return
        if self._staging is not None:
            self._outgrown.append(self._staging)
        self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _stage(self, bucket: list[tuple[str, torch.Tensor]]) -> str:
        """Copy one bucket (one dtype) into the staging buffer (grown to it if smaller); its
        flattened_bucket payload. The worker answers only once it has copied out of it, so the
        next bucket may reuse it."""
        self._allocate(bucket_nbytes(bucket))
        metadata, numel = cuda_ipc.flatten_metadata(bucket)
        dtype = bucket[0][1].dtype
        flat = self._staging[:numel * bucket[0][1].element_size()].view(dtype)
        with torch.no_grad():
            for m, (_, t) in zip(metadata, bucket):
                flat[m.start_idx:m.end_idx].copy_(t.detach().reshape(-1), non_blocking=True)
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()
        return cuda_ipc.encode_bucket(flat, metadata, self.reduce)

    def _collect(self) -> None:
        """After a push: whatever torch's IPC bookkeeping can free goes back to the driver (the
        staging buffer itself stays, see the module docstring)."""
        if str(self.device).startswith("cuda"):
            torch.cuda.ipc_collect()
            give_back_cached(self.device)


class _Group:
    """One weight-update group: its name, its workers (indices) and rank 0's handle."""

    def __init__(self, name: str, members: list[int]):
        self.name, self.members, self.handle = name, members, None


class DistributedSync:
    """The trainer as rank 0 of weight-update groups the workers joined; see the module
    docstring. `connect()` once (or let `push()` do it), `push()` per version, `close()` at the
    end.

    Placement: `devices` (each worker's GPU ids; None = unknown, one group) and `own_devices`
    (the trainer's) go through `plan_groups`, so workers sharing a GPU are in different groups;
    every bucket is broadcast into every group.

    Failures never hang the caller: every step (rendezvous, each bucket) ends within
    `timeout_s` or as soon as one worker refuses; then the groups are given up on both sides
    (a collective stuck in a thread is left to its timeout, with a fresh thread for what
    follows), new groups are formed and the version is sent again, `retries` times, before
    SyncError names each failing worker and its cause. No collective and no copy runs on the
    event loop."""

    def __init__(self, clients: list[SglangClient], backend: Literal["nccl", "gloo"] = "nccl",
                 master_address: str = "127.0.0.1", master_port: int = 0,
                 group_name: str = dist_group.DEFAULT_GROUP_NAME, bucket_bytes: int = 512 << 20,
                 ranks_per_worker: list[int] | None = None, timeout_s: float = 120.0,
                 pause_mode: str = DEFAULT_PAUSE_MODE, devices: list[list[str]] | None = None,
                 own_devices: list[str] | None = None, names: list[str] | None = None,
                 retries: int = 1):
        self.clients, self.backend, self.group_name = clients, backend, group_name
        self.master_address, self.master_port = master_address, master_port
        self.bucket_bytes, self.timeout_s, self.pause_mode = bucket_bytes, timeout_s, pause_mode
        self.ranks = ranks_per_worker  # each server's TP size; None = ask /server_info
        self.devices = devices or [[] for _ in clients]
        self.own_devices = own_devices or []
        self.names = names or [c.base_url for c in clients]
        self.retries = retries
        self.device = "cuda" if backend == "nccl" else "cpu"  # where broadcast tensors live
        self.groups: list[_Group] = []
        self.generation = 0  # group names carry it: a re-formed group never meets an old one
        self.reconnects = 0  # groups formed again after a failure
        self._jobs: list[asyncio.Future] = []  # rendezvous and broadcasts in flight

    def _in_thread(self, fn, *args) -> asyncio.Future:
        """Blocking calls run in threads of their own while the loop drives the HTTP calls."""
        self._jobs = [j for j in self._jobs if not j.done()]
        self._jobs.append(dist_group.in_thread(fn, *args))
        return self._jobs[-1]

    @property
    def group(self):
        """Rank 0's handle of the first group (None before connect)."""
        return self.groups[0].handle if self.groups else None

    async def connect(self) -> None:
        """Form the groups; SyncError (and nothing left half-joined) if any worker fails."""
        if self.ranks is None:  # SGLang reports tp_size; the embedded engine has one rank
            infos = await _settle({self.names[i]: c.server_info()
                                   for i, c in enumerate(self.clients)}, self.timeout_s,
                                  "asking the workers' tp_size")
            self.ranks = [int(infos[n].get("tp_size", 1)) for n in self.names]
        plan = plan_groups(self.devices, self.own_devices, self.names)
        self.generation += 1
        groups = [_Group(f"{self.group_name}-{self.generation}-{k}", members)
                  for k, members in enumerate(plan)]
        calls: dict[str, Any] = {}
        for k, g in enumerate(groups):
            try:
                port = self.master_port + k if self.master_port \
                    else free_port(self.master_address)
            except OSError as e:
                raise SyncError(f"no port for the weight update group on master_address "
                                f"{self.master_address!r} (the trainer's address as the "
                                f"workers reach it): {e}") from None
            world = 1 + sum(self.ranks[i] for i in g.members)
            offset = 1
            for i in g.members:
                calls[self.names[i]] = _succeeded(self.clients[i].init_weights_update_group(
                    self.master_address, port, offset, world, g.name, self.backend))
                offset += self.ranks[i]
            calls[f"trainer (rank 0 of {g.name})"] = self._in_thread(
                dist_group.new_group, self.backend, self.master_address, port, 0, world,
                g.name, self.timeout_s)
        try:
            results = await _settle(calls, self.timeout_s, "forming the weight update groups")
        except SyncError:
            self.groups = groups  # so that what did form is given up on both sides
            await self._give_up()
            raise
        for g in groups:
            g.handle = results[f"trainer (rank 0 of {g.name})"]
        self.groups = groups
        if len(groups) > 1:
            log.info("weight sync: %d groups so that no GPU is in one twice: %s", len(groups),
                     "; ".join(", ".join(self.names[i] for i in g.members) for g in groups))

    async def push(self, named: NamedTensors | WeightStream, version: str) -> None:
        stream = as_stream(named)  # read again after a failure
        for attempt in range(self.retries + 1):
            try:
                if not self.groups:
                    if attempt or self.generation:
                        self.reconnects += 1
                    await self.connect()
                await self._push_once(stream, version)
                return
            except SyncError as e:
                await self._give_up()
                if attempt == self.retries:
                    raise
                log.warning("weight version %s: %s; forming the groups again (attempt %d of "
                            "%d)", version, e, attempt + 2, self.retries + 1)

    async def _push_once(self, stream: WeightStream, version: str) -> None:
        handles = [g.handle for g in self.groups]
        members = [(i, g.name) for g in self.groups for i in g.members]
        async with paused([self.clients[i] for i, _ in members], self.pause_mode), \
                stream.buckets(self.bucket_bytes) as parts:
            n = 0
            async for bucket, last in parts:
                n += 1
                names = [name for name, _ in bucket]
                dtypes = [dtype_name(t.dtype) for _, t in bucket]
                shapes = [list(t.shape) for _, t in bucket]
                calls: dict[str, Any] = {self.names[i]: _succeeded(
                    self.clients[i].update_weights_from_distributed(
                        names, dtypes, shapes, group,
                        weight_version=version if last else None, flush_cache=last))
                    for i, group in members}
                calls["trainer's broadcast"] = self._in_thread(self._broadcast, bucket, handles)
                del bucket
                await _settle(calls, self.timeout_s, f"weight version {version}, bucket {n}"
                              + (" (the last)" if last else ""))
                del calls
        await check_versions([self.clients[i] for i, _ in members], version)

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]], handles: list) -> None:
        with torch.no_grad():
            tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
            dist_group.broadcast_many(tensors, handles)

    async def _give_up(self) -> None:
        """Leave every group on both sides without waiting on a collective that may be stuck:
        the workers first (bounded), then ours: destroyed when idle, else aborted (the thread
        in the collective stays there until the group's timeout; nothing waits for it)."""
        groups, self.groups = self.groups, []
        if not groups:
            return
        leave = [self.clients[i].destroy_weights_update_group(g.name)
                 for g in groups for i in g.members]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*leave, return_exceptions=True),
                                   min(self.timeout_s, 10.0))
        busy = any(not j.done() for j in self._jobs)
        self._jobs = []
        for h in (g.handle for g in groups if g.handle is not None):
            release = dist_group.abort if busy else dist_group.destroy
            with contextlib.suppress(Exception, TimeoutError):
                await asyncio.wait_for(dist_group.in_thread(release, h), 10.0)

    async def close(self) -> None:
        """Leave the groups (workers first: they answer while still joined); bounded."""
        await self._give_up()


async def _succeeded(request: Awaitable[Any]) -> Any:
    """A worker's answer, raised as SyncError when it says `success: false`."""
    r = await request
    if isinstance(r, dict) and not r.get("success", True):
        raise SyncError(r.get("message", r))
    return r


SETTLE_GRACE_S = 2.0  # after a first failure, how long the other answers of a step may take


async def _settle(calls: dict[str, Awaitable[Any]], timeout_s: float | None, what: str) -> dict:
    """Await every call (named by who answers it); the first failure, or `timeout_s` (None:
    none) with calls unanswered, raises SyncError naming each failed or silent one. Nothing is
    awaited past that: a thread stuck in a collective is left to its own timeout."""
    futures = {name: asyncio.ensure_future(c) for name, c in calls.items()}
    done, pending = await asyncio.wait(futures.values(), timeout=timeout_s,
                                       return_when=asyncio.FIRST_EXCEPTION)
    if pending and any(f.exception() is not None for f in done):
        # a worker's refusal and the collective it breaks fail together, in either order: give
        # the other answers a moment, so that the message names the worker and its cause
        await asyncio.wait(pending, timeout=min(SETTLE_GRACE_S, timeout_s or SETTLE_GRACE_S))
        done = {f for f in futures.values() if f.done()}
        pending = {f for f in futures.values() if not f.done()}
    failed = [(name, f.exception()) for name, f in futures.items()
              if f in done and f.exception() is not None]
    if failed or pending:
        for f in pending:
            f.cancel()
        why = [f"{name}: {_short(e)}" for name, e in failed]
        if not failed:
            why = [f"{name}: no answer within {timeout_s:g} s" for name, f in futures.items()
                   if f in pending]
        raise SyncError(f"{what} failed on " + "; ".join(why))
    return {name: f.result() for name, f in futures.items()}


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 500 else text[:500] + "..."


class SplitSync:
    """Several paths pushing the same version at once, each to its own workers."""

    def __init__(self, parts: list[Any]):
        self.parts = parts

    async def push(self, named: NamedTensors | WeightStream, version: str) -> None:
        """All paths at once over views of a local model; one after another over a gather
        (each reads the version again: one bucket held at a time, never the whole model)."""
        stream = as_stream(named)
        if stream.shared:
            await asyncio.gather(*(part.push(stream, version) for part in self.parts))
            return
        for part in self.parts:
            await part.push(stream, version)

    async def close(self) -> None:
        for part in self.parts:
            if hasattr(part, "close"):
                await part.close()


async def make_weight_sync(kind: str, clients: list[SglangClient], device: str,
                           bucket_bytes: int, *, names: list[str] | None = None,
                           devices: list[list[str]] | None = None,
                           own_devices: list[str] | None = None, timeout_s: float = 120.0,
                           retries: int = 1, master_address: str = "127.0.0.1",
                           pause_mode: str = DEFAULT_PAUSE_MODE):
    """The transport of weight_sync.path `kind` (disk | tensor | cuda_ipc | distributed | auto),
    pausing the workers in `pause_mode` around every push; a distributed group uses NCCL when
    the trainer's `device` is CUDA, else gloo. Its groups form at the first push; a placement
    no group can serve (`plan_groups`), or cuda_ipc from a CPU trainer, raises SyncError here.
    "auto": `plan_paths` per worker, one `SplitSync` over the paths it chose. The only place
    where a path's name becomes a transport."""
    names = names or [c.base_url for c in clients]
    own_devices = own_devices or []
    paths = worker_paths(kind, devices, own_devices, device, len(clients))
    if kind != "auto":
        return _one_path(kind, clients, device, bucket_bytes, names, devices, own_devices,
                         timeout_s, retries, master_address, pause_mode)
    parts = []
    for path in dict.fromkeys(paths):
        mine = [i for i, p in enumerate(paths) if p == path]
        parts.append(_one_path(path, [clients[i] for i in mine], device, bucket_bytes,
                               [names[i] for i in mine],
                               None if devices is None else [devices[i] for i in mine],
                               own_devices, timeout_s, retries, master_address, pause_mode))
    return parts[0] if len(parts) == 1 else SplitSync(parts)


def _one_path(path: str, clients: list[SglangClient], device: str, bucket_bytes: int,
              names: list[str], devices: list[list[str]] | None, own_devices: list[str],
              timeout_s: float, retries: int, master_address: str, pause_mode: str):
    if path == "disk":
        return DiskSync(clients, pause_mode)
    if path in ("tensor", "cuda_ipc"):
        return TensorSync(clients, "cuda_ipc" if path == "cuda_ipc" else "safetensors",
                          bucket_bytes=bucket_bytes, pause_mode=pause_mode, device=device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if devices is not None:
        plan_groups(devices, own_devices, names, nccl=backend == "nccl")
    return DistributedSync(clients, backend, master_address, bucket_bytes=bucket_bytes,
                           devices=devices, own_devices=own_devices, names=names,
                           timeout_s=timeout_s, retries=retries, pause_mode=pause_mode)
