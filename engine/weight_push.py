"""One weight version to every inference worker, whatever the path: the call a trainer makes.

Role: `await sync.push(version) -> PushReport` for every weight_sync.path; the object is made by
engine/weight_sync_config.py `WeightSyncConfig.build` (the one place the configured path is
read, through engine/weight_sync.py `make_weight_sync`). Three implementations:
- `DiskPush`: the version written once under `<run_dir>/weights/v<N>` (the trainer's `write`:
  one version's HF safetensors into a directory), every worker loads it (`DiskSync`), only the
  newest `keep_versions` directories are kept.
- `StreamPush`: an in-memory transport (`TensorSync`, `DistributedSync`, `SplitSync`) sending a
  fresh `WeightStream` (the trainer's `stream()`) per version.
- `FallbackPush`: any push, then disk for a version it fails with SyncError
  (weight_sync.fallback = "disk"); the next version tries the configured path again.

Colocated memory (the trainer and the workers on one GPU take turns): `wake_to_generate` and
`release_to_train` are the only order of the two sides' memory moves around a push.

Invariants:
- A PushReport is returned only once every reachable worker serves the version; `path` is the
  path that carried it ("disk" after a fallback, which also sets `fell_back` and `error`).
- A version's disk directory is complete before any worker is asked to load it (`write` returns
  after the files are in place), and old ones are pruned only after a successful push.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

from engine import cuda_ipc
from engine.client import SglangClient
from engine.errors import EngineHTTPError, EngineUnavailable
from engine.weight_sync import DiskSync, SyncError, TensorSync, WeightStream, _settle, as_stream
from engine.weight_sync_plan import ADAPTER_PREFIX, adapter_name  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PushReport:
    """What one push did."""

    version: int
    path: str  # the path that carried the version: the configured one, "disk" after a fallback
    bytes: int  # one version's bytes: the disk path's safetensors files, else the stream's
    seconds: float  # the whole push (the disk write, a failed attempt before a fallback)
    peak_held_bytes: int = 0  # a gathered stream: the most of its copies alive at once
    fell_back: bool = False  # the configured path failed; disk carried the version
    error: str = ""  # why the configured path failed (when fell_back)
    configured: str = ""  # weight_sync.path ("" = `path`)

    @property
    def notice(self) -> str:
        """The console line for a fallback ("" when none happened)."""
        if not self.fell_back:
            return ""
        return (f"weight version {self.version} over {self.configured} failed ({self.error}); "
                f"sent through {self.path} instead (the next version tries {self.configured} "
                f"again)")

    def metrics(self) -> dict[str, float]:
        """The push's time per GB of one version (the disk path counts the write and every
        worker's load, the others every bucket to every worker), per path too."""
        per_gb = self.seconds / (max(self.bytes, 1) / 1e9)
        out = {"weight_sync/push_s": self.seconds, "weight_sync/push_s_per_gb": per_gb,
               f"weight_sync/{self.path}/push_s_per_gb": per_gb,
               "weight_sync/weight_bytes": float(self.bytes)}
        if self.peak_held_bytes:  # a gathered (sharded) push: the most of it held at once
            out["weight_sync/push_held_bytes"] = float(self.peak_held_bytes)
        return out


def prune_versions(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` version directories `v<N>` under `root`."""
    versions = [p for p in root.glob("v*") if p.name[1:].isdigit()]
    for old in sorted(versions, key=lambda p: int(p.name[1:]))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


class DiskPush:
    """Write the version once under `<run_dir>/weights/v<N>` with `write(directory,
    shard_bytes)` (awaitable; files of at most `shard_bytes`), every worker loads it, then keep
    only the newest `keep_versions` version directories."""

    path = "disk"

    def __init__(self, disk: DiskSync, run_dir: str | Path,
                 write: Callable[[Path, int], Awaitable[Any]], keep_versions: int,
                 shard_bytes: int):
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.disk, self.write = disk, write
        self.root = Path(run_dir) / "weights"
        self.keep_versions, self.shard_bytes = keep_versions, shard_bytes

    async def push(self, version: int) -> PushReport:
        t0 = time.monotonic()
        path = self.root / f"v{version}"
        await self.write(path, self.shard_bytes)
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        await self.disk.push(str(path), str(version))
        self._prune()
        return PushReport(version, self.path, nbytes, time.monotonic() - t0)

    def _prune(self) -> None:
        prune_versions(self.root, self.keep_versions)

    async def close(self) -> None:
        """Nothing to leave (disk holds no connection)."""




class AdapterPush:
    """A LoRA student's version: its adapter only, loaded on every worker under
    `adapter_name(version)` through SGLang's LoRA endpoints; the base weights never move.
    Per worker (`paths`, one each): "disk", a PEFT directory `<run_dir>/weights/v<N>` (`write(
    directory)` writes it once and returns its tensor bytes) read by `/load_lora_adapter`;
    "tensor", the adapter in the body of `/load_lora_adapter_from_tensors` as base64
    safetensors (the embedded engine's reading; `tensors()` gives the adapter); "cuda_ipc", the
    same endpoint with SGLang's CUDA IPC payload (load_format "flattened_bucket") of the adapter
    staged once in a buffer on the trainer's GPU (`device`), for workers on this host's GPUs:
    no copy through the host. The newest `keep` versions stay loaded (requests of a version
    still in flight run with it), older ones are unloaded, and older disk versions removed. No
    pause: loading an adapter changes no running request."""

    def __init__(self, clients: list[SglangClient], names: list[str], paths: list[str],
                 run_dir: str | Path, config: dict[str, Any],
                 write: Callable[[Path], Awaitable[int]],
                 tensors: Callable[[], Awaitable[dict[str, Any]]], keep: int,
                 timeout_s: float | None = None, device: str = "cpu"):
        if isinstance(paths, str):
            paths = [paths] * len(clients)
        bad = sorted(set(paths) - {"disk", "tensor", "cuda_ipc"})
        if bad:
            raise ValueError(f"a LoRA student pushes adapters through weight_sync.path 'disk', "
                             f"'tensor', 'cuda_ipc' or 'auto', not {bad[0]!r}")
        self.clients, self.names, self.paths = clients, names, paths
        self.path = paths[0] if len(set(paths)) == 1 else "auto"
        self.root, self.config = Path(run_dir) / "weights", config
        self.write, self.tensors, self.keep = write, tensors, max(1, keep)
        self.timeout_s, self.device = timeout_s, device
        self._stager: Any = None  # cuda_ipc: engine/weight_sync.py TensorSync's staging buffer

    async def push(self, version: int) -> PushReport:
        t0 = time.monotonic()
        name = adapter_name(version)
        loads: dict[str, Callable[[SglangClient], Awaitable[Any]]] = {}
        nbytes = 0
        if "disk" in self.paths:
            directory = self.root / f"v{version}"
            nbytes = await self.write(directory)
            loads["disk"] = lambda c: c.load_lora_adapter(name, str(directory))
        if {"tensor", "cuda_ipc"} & set(self.paths):
            tensors = await self.tensors()
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            run = asyncio.get_running_loop().run_in_executor
            if "tensor" in self.paths:
                blob = await run(None, _b64_safetensors, tensors)
                loads["tensor"] = lambda c: c.load_lora_adapter_from_tensors(name, self.config,
                                                                             blob)
            if "cuda_ipc" in self.paths:
                handles = await run(None, self._stage, tensors)
                loads["cuda_ipc"] = lambda c: c.load_lora_adapter_from_tensors(
                    name, self.config, handles, load_format=cuda_ipc.FLATTENED_BUCKET)
            del tensors
        try:
            await _settle({n: self._load(c, name, loads[p]) for n, c, p in
                           zip(self.names, self.clients, self.paths)},
                          self.timeout_s, f"LoRA adapter {name}")
        finally:
            if self._stager is not None:
                await asyncio.get_running_loop().run_in_executor(None, self._stager._collect)
        old = version - self.keep
        if old >= 0:
            await asyncio.gather(*(self._unload(c, adapter_name(old)) for c in self.clients))
        if "disk" in self.paths:
            self._prune()
        return PushReport(version, self.path, nbytes, time.monotonic() - t0)

    def _stage(self, tensors: dict[str, Any]) -> str:
        """The adapter (one dtype) copied into the staging buffer; its IPC payload."""
        if self._stager is None:
            self._stager = TensorSync([], serializer="cuda_ipc", device=self.device)
        return self._stager.serialize(list(tensors.items()))

    @staticmethod
    async def _load(client: SglangClient, name: str, load) -> None:
        """Load; a name a worker already holds (a resumed trainer pushing its version again)
        is unloaded and loaded anew. A refusal raises SyncError with the worker's reason."""
        try:
            await _lora_ok(load(client))
        except (SyncError, EngineHTTPError) as e:
            if "already loaded" not in str(e):
                raise SyncError(str(e)) from None
            await client.unload_lora_adapter(name)
            await _lora_ok(load(client))

    @staticmethod
    async def _unload(client: SglangClient, name: str) -> None:
        try:
            await client.unload_lora_adapter(name)
        except (EngineHTTPError, EngineUnavailable) as e:  # not loaded there: nothing to do
            log.debug("unloading %s from %s: %s", name, client.base_url, e)

    def _prune(self) -> None:
        prune_versions(self.root, self.keep)

    async def close(self) -> None:
        """Nothing to leave."""


def adapter_paths(path: str, devices: list[list[str]] | None, own_devices: list[str],
                  device: str, num_workers: int) -> list[str]:
    """Each worker's adapter path under weight_sync.path `path`: "auto" is CUDA IPC to the
    workers on this CUDA trainer's host GPUs it shares (its own GPU), the body elsewhere."""
    if path != "auto":
        return [path] * num_workers
    if devices is None or not device.startswith("cuda"):
        return ["tensor"] * num_workers
    mine = set(own_devices)
    return ["cuda_ipc" if mine & set(gpus) else "tensor" for gpus in devices]


async def _lora_ok(request: Awaitable[Any]) -> None:
    r = await request
    if isinstance(r, dict) and not r.get("success", True):
        raise SyncError(r.get("error_message") or str(r))


def _b64_safetensors(tensors: dict[str, Any]) -> str:
    from safetensors.torch import save

    blob = save({n: t.detach().contiguous().cpu() for n, t in tensors.items()})
    return base64.b64encode(blob).decode("ascii")


class StreamPush:
    """An in-memory transport (anything with `push(stream, version)`: TensorSync,
    DistributedSync, SplitSync) sending the version `stream()` makes, a fresh WeightStream (or
    list of (name, tensor)) each push; `path` names it in reports."""

    def __init__(self, transport: Any, stream: Callable[[], Any], path: str):
        self.transport, self.stream, self.path = transport, stream, path
        self._bytes = 0  # one version's bytes, as the latest complete read counted them

    async def push(self, version: int) -> PushReport:
        t0 = time.monotonic()
        stream: WeightStream = as_stream(self.stream())
        await self.transport.push(stream, str(version))
        self._bytes = stream.bytes_read or self._bytes
        return PushReport(version, self.path, self._bytes, time.monotonic() - t0,
                          stream.peak_held_bytes)

    async def close(self) -> None:
        """The transport's groups left (DistributedSync), if it has any."""
        close = getattr(self.transport, "close", None)
        if close is not None:
            await close()


class FallbackPush:
    """`primary`'s push, or, when it fails with SyncError, `fallback`'s (disk) for that version:
    the report says so (`fell_back`, `error`, `notice`); the next version tries `primary`
    again. Any other error, or the fallback's own failure, is raised."""

    def __init__(self, primary: Any, fallback: DiskPush):
        self.primary, self.fallback = primary, fallback
        self.path = primary.path

    async def push(self, version: int) -> PushReport:
        t0 = time.monotonic()
        try:
            return await self.primary.push(version)
        except SyncError as e:
            error = str(e)
        log.warning("weight version %s over %s failed (%s); sending it through %s", version,
                    self.path, error, self.fallback.path)
        report = await self.fallback.push(version)
        return dataclasses.replace(report, seconds=time.monotonic() - t0, fell_back=True,
                                   error=error, configured=self.path)

    async def close(self) -> None:
        await self.primary.close()
        await self.fallback.close()


async def wake_to_generate(clients: list[SglangClient], push: Callable[[], Awaitable[T]],
                           park_state: Callable[[], Awaitable[Any]],
                           park_weights: Callable[[], Awaitable[Any]]) -> T:
    """Colocated, from training to generation: the trainer parks all but its weights
    (`park_state`: gradients, optimizer state), the workers take their weights' memory back,
    `push()` fills them (CUDA IPC reads the trainer's parameters where they are), the trainer
    parks its weights (`park_weights`), then the workers take their KV cache and CUDA graphs
    back (SGLang's memory tags): at no time do both sides' weights and the KV cache hold the
    device at once. `push()`'s result is returned; the caller announces the version after this
    (a worker still holding a released tag refuses requests)."""
    await park_state()
    await asyncio.gather(*(c.resume_memory_occupation(["weights"]) for c in clients))
    result = await push()
    await park_weights()
    await asyncio.gather(*(c.resume_memory_occupation(["kv_cache", "cuda_graph"])
                           for c in clients))
    return result


async def release_to_train(clients: list[SglangClient], wake: Callable[[], Awaitable[T]]) -> T:
    """Colocated, from generation to training: every worker releases its memory (weights, KV
    cache, CUDA graphs), then the trainer wakes (`wake()`, whose result is returned)."""
    await asyncio.gather(*(c.release_memory_occupation() for c in clients))
    return await wake()
