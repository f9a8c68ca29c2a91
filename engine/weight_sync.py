"""Trainer-side weight sync to SGLang-compatible workers: from disk, over a process group, or as
serialized tensors (colocated), each wrapped in pause -> update -> continue.

Role: the one place a trainer pushes a weight version to inference workers (real SGLang or the
embedded engine: the same requests reach both). Three paths:
- `DiskSync`: the trainer wrote an HF checkpoint; every worker loads it
  (`/update_weights_from_disk`). Works everywhere, costs a disk round trip.
- `DistributedSync`: the trainer is rank 0 of a torch.distributed group that every worker
  joined (`/init_weights_update_group`, each server's ranks `rank_offset + tp_rank`); tensors
  are broadcast in buckets of at most `bucket_bytes`, each bucket announced by one
  `/update_weights_from_distributed` (names, dtypes, shapes in broadcast order). NCCL on GPUs,
  gloo on CPU.
- `TensorSync` (colocated): tensors go in the request body (`/update_weights_from_tensor`), in
  buckets. `serializer = "safetensors"` for the embedded engine (it never unpickles); for real
  SGLang `serializer = "sglang"` uses SGLang's own MultiprocessingSerializer (CUDA IPC handles,
  same GPU; needs sglang importable in the trainer process).

Invariants:
- Generation is paused on a worker before the first byte moves to it and continued after the last
  bucket, also when the update fails; the last bucket carries `flush_cache = true` and the
  `weight_version`, so a worker's version changes only once all its tensors arrived.
- After a push, every worker reports the new version (`/get_weight_version`), else SyncError.
- Colocated memory: `resume_weights_then(push)` wakes the weights, pushes, then wakes the KV
  cache and CUDA graphs (tags "weights", then "kv_cache" + "cuda_graph", SGLang's memory tags),
  so no KV memory is held while weights load.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Iterable, Iterator, Literal

import torch

from engine import dist_group
from engine.client import SglangClient, SglangConnectionError
from transport.dtypes import dtype_name
from transport.sockets import free_port

NamedTensors = Iterable[tuple[str, torch.Tensor]]

log = logging.getLogger(__name__)


class SyncError(RuntimeError):
    """A worker refused or missed a weight update; the message names the worker and why."""


def buckets(named: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `bucket_bytes` each (a bigger tensor is alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@contextlib.asynccontextmanager
async def paused(clients: list[SglangClient], mode: str = "abort") -> AsyncIterator[None]:
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


async def resume_weights_then(clients: list[SglangClient], push) -> None:
    """Colocated: resume the weights' memory, run `push()` (an awaitable factory), then resume
    the rest (KV cache, CUDA graphs)."""
    await asyncio.gather(*(c.resume_memory_occupation(["weights"]) for c in clients))
    await push()
    await asyncio.gather(*(c.resume_memory_occupation(["kv_cache", "cuda_graph"])
                           for c in clients))


async def _all_ok(calls: dict[str, Any]) -> None:
    """Await {worker url: request}; SyncError naming every worker that failed."""
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    failed = [(url, r) for url, r in zip(calls, results)
              if isinstance(r, BaseException) or (isinstance(r, dict) and not r.get("success"))]
    if failed:
        raise SyncError("weight update failed on " + "; ".join(f"{u}: {r}" for u, r in failed))


class DiskSync:
    """Every worker loads the checkpoint directory the trainer wrote, each on its own
    (pause -> load -> continue per worker).

    A worker that cannot be reached (down, or restarting) is skipped and named in `unreachable`:
    a restarting worker loads the newest version from disk itself before it serves
    (actors/inference.py), so the run goes on without it instead of failing. Any other failure
    (a worker that answers but refuses the update) raises SyncError.
    """

    def __init__(self, clients: list[SglangClient], pause_mode: str = "abort"):
        self.clients, self.pause_mode = clients, pause_mode
        self.unreachable: list[str] = []  # workers skipped by the latest push

    async def push(self, path: str, version: str) -> None:
        results = await asyncio.gather(*(self._push_one(c, path, version) for c in self.clients),
                                       return_exceptions=True)
        self.unreachable = [c.base_url for c, r in zip(self.clients, results)
                            if isinstance(r, SglangConnectionError)]
        failed = [(c.base_url, r) for c, r in zip(self.clients, results)
                  if isinstance(r, BaseException) and not isinstance(r, SglangConnectionError)]
        if failed:
            raise SyncError("weight update failed on " + "; ".join(f"{u}: {r}"
                                                                    for u, r in failed))
        if self.unreachable:
            log.warning("weight version %s not pushed to unreachable worker(s) %s; they load "
                        "the newest version from disk when they come back", version,
                        ", ".join(self.unreachable))

    async def _push_one(self, client: SglangClient, path: str, version: str) -> None:
        async with paused([client], self.pause_mode):
            await _all_ok({client.base_url: client.update_weights_from_disk(
                path, weight_version=version)})
        await check_versions([client], version)


class TensorSync:
    """Colocated: tensors in the request body, bucketed; see the module docstring."""

    def __init__(self, clients: list[SglangClient], serializer: Literal["safetensors", "sglang"]
                 = "safetensors", bucket_bytes: int = 512 << 20, tp_sizes: list[int] | None = None,
                 pause_mode: str = "abort", executor: ThreadPoolExecutor | None = None):
        self.clients, self.serializer, self.bucket_bytes = clients, serializer, bucket_bytes
        self.tp_sizes = tp_sizes or [1] * len(clients)  # serialized copies per worker (TP ranks)
        self.pause_mode = pause_mode
        self.executor = executor  # serializes off the event loop when given (None: inline)

    def serialize(self, bucket: list[tuple[str, torch.Tensor]]) -> str:
        if self.serializer == "sglang":  # SGLang's own format: pickled CUDA IPC handles
            from sglang.srt.utils import MultiprocessingSerializer

            return MultiprocessingSerializer.serialize(bucket, output_str=True)
        from safetensors.torch import save

        blob = save({name: t.detach().contiguous().cpu() for name, t in bucket})
        return base64.b64encode(blob).decode("ascii")

    async def push(self, named: NamedTensors, version: str) -> None:
        async with paused(self.clients, self.pause_mode):
            parts = list(buckets(named, self.bucket_bytes))
            for i, bucket in enumerate(parts):
                last = i == len(parts) - 1
                payload = (await asyncio.get_running_loop().run_in_executor(
                    self.executor, self.serialize, bucket) if self.executor
                    else self.serialize(bucket))
                await _all_ok({c.base_url: c.update_weights_from_tensor(
                    [payload] * tp, weight_version=version if last else None, flush_cache=last)
                    for c, tp in zip(self.clients, self.tp_sizes)})
        await check_versions(self.clients, version)


class DistributedSync:
    """The trainer as rank 0 of a weight-update group every worker joined; see the module
    docstring. `connect()` once, `push()` per version, `close()` at the end."""

    def __init__(self, clients: list[SglangClient], backend: Literal["nccl", "gloo"] = "nccl",
                 master_address: str = "127.0.0.1", master_port: int = 0,
                 group_name: str = dist_group.DEFAULT_GROUP_NAME, bucket_bytes: int = 512 << 20,
                 ranks_per_worker: list[int] | None = None, timeout_s: float = 600.0,
                 pause_mode: str = "abort"):
        self.clients, self.backend, self.group_name = clients, backend, group_name
        self.master_address, self.master_port = master_address, master_port
        self.bucket_bytes, self.timeout_s, self.pause_mode = bucket_bytes, timeout_s, pause_mode
        self.ranks = ranks_per_worker  # each server's TP size; None = ask /server_info
        self.device = "cuda" if backend == "nccl" else "cpu"  # where broadcast tensors live
        self.group = None
        # the blocking rendezvous and broadcasts run here while the loop drives the HTTP calls
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-sync")

    async def _in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def connect(self) -> None:
        if self.ranks is None:  # SGLang reports tp_size; the embedded engine has one rank
            infos = await asyncio.gather(*(c.server_info() for c in self.clients))
            self.ranks = [int(info.get("tp_size", 1)) for info in infos]
        port = self.master_port or free_port(self.master_address)
        world = 1 + sum(self.ranks)
        offsets = [1 + sum(self.ranks[:i]) for i in range(len(self.clients))]
        joins = {c.base_url: c.init_weights_update_group(self.master_address, port, off, world,
                                                         self.group_name, self.backend)
                 for c, off in zip(self.clients, offsets)}
        mine = self._in_pool(dist_group.new_group, self.backend, self.master_address, port, 0,
                             world, self.group_name, self.timeout_s)
        results = await asyncio.gather(_all_ok(joins), mine, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise SyncError(f"weight update group {self.group_name!r} not formed: {r}")
        self.group = results[1]

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for _, tensor in bucket:
                dist_group.broadcast(tensor.detach().to(self.device).contiguous(), self.group)

    async def push(self, named: NamedTensors, version: str) -> None:
        if self.group is None:
            raise SyncError("call connect() before push()")
        async with paused(self.clients, self.pause_mode):
            parts = list(buckets(named, self.bucket_bytes))
            for i, bucket in enumerate(parts):
                last = i == len(parts) - 1
                names = [n for n, _ in bucket]
                dtypes = [dtype_name(t.dtype) for _, t in bucket]
                shapes = [list(t.shape) for _, t in bucket]
                announce = _all_ok({c.base_url: c.update_weights_from_distributed(
                    names, dtypes, shapes, self.group_name,
                    weight_version=version if last else None, flush_cache=last)
                    for c in self.clients})
                await asyncio.gather(announce, self._in_pool(self._broadcast, bucket))
        await check_versions(self.clients, version)

    async def close(self) -> None:
        """Leave the group on both sides (workers first: they answer while still joined)."""
        if self.group is not None:
            await asyncio.gather(*(c.destroy_weights_update_group(self.group_name)
                                   for c in self.clients), return_exceptions=True)
            await self._in_pool(dist_group.destroy, self.group)
            self.group = None
        self._pool.shutdown(wait=True)


async def make_weight_sync(kind: str, clients: list[SglangClient], device: str,
                           bucket_bytes: int):
    """The weight-sync path named `kind` (disk | tensor | distributed), connected; a
    distributed group uses NCCL when the trainer's `device` is CUDA, else gloo."""
    if kind == "disk":
        return DiskSync(clients)
    if kind == "tensor":
        return TensorSync(clients, bucket_bytes=bucket_bytes)
    sync = DistributedSync(clients, "nccl" if device.startswith("cuda") else "gloo",
                           bucket_bytes=bucket_bytes)
    await sync.connect()
    return sync
