"""The trainer's `weight_sync` table and the push it builds.

Role: `WeightSyncConfig` is how each new version reaches the inference workers (the fields,
their defaults and checks); `build(...)` turns it and what the trainer has (its worker clients
and their placement, its own device, its run directory, a writer of one version's HF
safetensors, a factory of weight streams) into the one object the trainer calls per version,
`push(version) -> PushReport` (engine/weight_push.py). The configured path is read there only,
through engine/weight_sync.py `make_weight_sync`; the checks that need the placement of the
other actors are engine/weight_sync_plan.py `check_sync_device` and `check_weight_sync_placement`.

The table is read by the launcher (the trainer's plan class) and the push built by the trainer
alone: the push's modules (torch at their tops) are imported by `build`, so that the launcher
stays free of torch (tests/test_import_cost.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Literal

import msgspec

if TYPE_CHECKING:
    from engine.client import SglangClient
    from engine.weight_push import DiskPush, FallbackPush, StreamPush


class WeightSyncConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How each new version reaches the inference workers (engine/weight_sync.py)."""

    # disk (safetensors + /update_weights_from_disk), distributed (torch.distributed groups
    # with the workers: NCCL on GPU, gloo on CPU; workers sharing a GPU go to different
    # groups), tensor (weights in the request body; colocated workers on the same host),
    # cuda_ipc (CUDA IPC handles of the trainer's GPU memory in SGLang's
    # update_weights_from_tensor format: workers on the trainer's own GPU), auto (cuda_ipc to
    # the workers on the trainer's GPU, distributed to the others)
    path: Literal["disk", "distributed", "tensor", "cuda_ipc", "auto"] = "disk"
    # bucket size of the in-memory paths (distributed, tensor, cuda_ipc), MiB (fractions allowed):
    # a push holds one bucket of the gathered weights at a time, and a sharded trainer's ranks
    # send each piece as it is wanted
    bucket_mib: float = 512
    keep_versions: int = 2  # disk path: pushed weight versions kept on disk
    # distributed: the trainer's address as the workers reach it (its TCP store and rank 0)
    master_address: str = "127.0.0.1"
    # distributed: group rendezvous and each bucket's transfer must finish within this, s
    timeout_s: float = 120.0
    retries: int = 1  # distributed: a failed push forms its groups again and resends this often
    # when a distributed/tensor push still fails: "disk" sends that version through disk (the
    # console says which worker failed and why; the next push tries `path` again), "none"
    # fails the trainer (its restart policy applies)
    fallback: Literal["disk", "none"] = "disk"
    # how every push pauses the workers' generation (/pause_generation's mode): "in_place"
    # holds running requests at a step boundary with their KV cache and lets them finish with
    # the new weights after the update; "retract" holds them but drops their KV cache (prefilled
    # again with the new weights); "abort" ends them at once (finish_reason abort, the rollout
    # regenerates the turn). With in_place / retract nothing in flight is discarded; a response
    # then spans two versions and its sample records the older (engine/session.py)
    pause_mode: Literal["in_place", "retract", "abort"] = "in_place"

    def __post_init__(self) -> None:
        if self.bucket_mib * 2**20 < 1024 or self.keep_versions < 1:
            raise ValueError(f"weight_sync needs bucket_mib >= 1/1024 (1 KiB) and keep_versions "
                             f">= 1, got "
                             f"bucket_mib = {self.bucket_mib}, keep_versions = "
                             f"{self.keep_versions}")
        if self.timeout_s <= 0 or self.retries < 0:
            raise ValueError(f"weight_sync needs timeout_s > 0 and retries >= 0, got "
                             f"timeout_s = {self.timeout_s}, retries = {self.retries}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mib * 2**20)

    async def build(self, clients: list[SglangClient], *, names: list[str],
                    worker_devices: list[list[str]] | None, own_devices: list[str],
                    device: str, run_dir: str | Path,
                    write: Callable[[Path, int], Awaitable[Any]],
                    stream: Callable[[], Any]) -> DiskPush | StreamPush | FallbackPush:
        """The trainer's push: `await it.push(version) -> PushReport`, `await it.close()` at
        the end. `clients` and `names`: the workers, in order; `worker_devices`: each one's
        GPU ids (runtime/devices.py; None = unknown); `own_devices` and `device`: the
        trainer's GPU ids and torch device; `run_dir`: where disk versions go (weights/v<N>);
        `write(directory, shard_bytes)`: writes one version's HF safetensors there (awaitable);
        `stream()`: one version as a WeightStream (read by the in-memory paths). A placement
        no group can serve, or cuda_ipc from a CPU trainer, raises SyncError here."""
        from engine.weight_push import DiskPush, FallbackPush, StreamPush
        from engine.weight_sync import DiskSync, make_weight_sync

        transport = await make_weight_sync(
            self.path, clients, device, self.bucket_bytes, names=names, devices=worker_devices,
            own_devices=own_devices, timeout_s=self.timeout_s, retries=self.retries,
            master_address=self.master_address, pause_mode=self.pause_mode)
        disk_sync = transport if isinstance(transport, DiskSync) else DiskSync(clients,
                                                                               self.pause_mode)
        disk = DiskPush(disk_sync, run_dir, write, self.keep_versions, self.bucket_bytes)
        if transport is disk_sync:
            return disk
        push = StreamPush(transport, stream, self.path)
        return FallbackPush(push, disk) if self.fallback == "disk" else push
