"""Which weight-sync path serves which worker, and the checks of a placement: the plan a push
follows (engine/weight_sync.py), known before anything starts (no torch).

Role: `worker_paths` is the one reading of weight_sync.path (per worker: the path itself, or
for "auto" `plan_paths`' choice by placement); `plan_groups` splits the workers of a distributed
path into weight-update groups NCCL accepts. The launcher checks a plan with the same functions
(`check_sync_device`: the trainer's table; `check_weight_sync_placement`: the actors'
placement, launch/plan.py), so a placement no push can serve is refused before it starts.
engine/weight_sync.py builds its transports from them (and re-exports them).
"""

from __future__ import annotations

from engine.errors import SyncError


def plan_groups(workers: list[list[str]], trainer: list[str], names: list[str],
                nccl: bool = False) -> list[list[int]]:
    """Workers (by index) per weight-update group, so that no GPU is in a group twice: NCCL
    refuses two ranks on one device in a communicator. `workers[i]` is worker i's GPU ids
    (runtime/devices.py; [] on CPU), `trainer` the sender's. The k-th worker on a GPU goes to
    group k: as many groups as the most workers sharing one GPU. SyncError, naming the worker
    and what can serve it, for a layout no group serves: a worker on the trainer's own GPU
    (rank 0 is there), or (`nccl`) a worker on the CPU."""
    cpu = [n for n, gpus in zip(names, workers) if not gpus]
    if nccl and cpu:
        raise SyncError(f"weight_sync.path = 'distributed' from a CUDA trainer uses NCCL, but "
                        f"worker(s) {', '.join(cpu)} run on the CPU: put them on GPUs, or use "
                        f"weight_sync.path = 'disk'")
    mine = set(trainer)
    groups: list[tuple[list[int], set[str]]] = []
    for i, gpus in enumerate(workers):
        shared = sorted(set(gpus) & mine)
        if shared:
            raise SyncError(
                f"worker {names[i]} runs on {shared[0]}, the GPU the trainer sends from: a "
                f"NCCL group holds one rank per GPU. Move the worker (or the trainer) to "
                f"another GPU, or set weight_sync.path = 'cuda_ipc' (CUDA IPC on the shared "
                f"GPU), 'auto' (CUDA IPC there, NCCL to the others) or 'disk'")
        for members, used in groups:
            if used.isdisjoint(gpus):
                members.append(i)
                used.update(gpus)
                break
        else:
            groups.append(([i], set(gpus)))
    return [members for members, _ in groups]


def plan_paths(devices: list[list[str]] | None, own_devices: list[str], device: str,
               num_workers: int) -> list[str]:
    """The path to each worker for weight_sync.path "auto": "cuda_ipc" to a worker on the
    CUDA trainer's own GPU (NCCL cannot have both in one group), else "distributed" (NCCL
    between GPUs, gloo from a CPU trainer). Unknown placement (`devices` None): distributed."""
    if devices is None or not device.startswith("cuda"):
        return ["distributed"] * num_workers
    mine = set(own_devices)
    return ["cuda_ipc" if mine & set(gpus) else "distributed" for gpus in devices]


PATHS = ("disk", "tensor", "cuda_ipc", "distributed", "auto")  # weight_sync.path's values


def worker_paths(path: str, devices: list[list[str]] | None, own_devices: list[str],
                 device: str, num_workers: int) -> list[str]:
    """The path each worker gets under weight_sync.path `path`: `path` itself, or for "auto"
    `plan_paths`'s choice by placement. ValueError for a name that is no path."""
    if path not in PATHS:
        raise ValueError(f"unknown weight_sync.path {path!r}: disk, tensor, cuda_ipc, "
                         f"distributed or auto")
    if path == "auto":
        return plan_paths(devices, own_devices, device, num_workers)
    return [path] * num_workers


def check_sync_device(path: str, device: str) -> None:
    """ValueError when weight_sync.path `path` cannot send from a trainer on `device`: CUDA IPC
    handles exist only for CUDA memory."""
    if path == "cuda_ipc" and not device.startswith("cuda"):
        raise ValueError(f"weight_sync.path = 'cuda_ipc' sends CUDA IPC handles of the "
                         f"trainer's GPU memory, but device = {device!r}: use "
                         f"'tensor' (weights in the request body) or 'disk' on the CPU")


def check_weight_sync_placement(path: str, workers: list[str], gpus: list[list[str]],
                                own_gpus: list[str], device: str) -> None:
    """ValueError, naming the worker and what can serve it, when the placement cannot be served
    by weight_sync.path `path` (checked before anything starts, with the plan a push uses):
    cuda_ipc reaches only workers on the trainer's GPU; a distributed part needs groups
    `plan_groups` can form (no worker on the trainer's GPU, no CPU worker under NCCL). `workers`
    are actor names, `gpus` their GPU ids (runtime/devices.py; [] on the CPU), `own_gpus` the
    trainer's, `device` its torch device. disk and tensor serve any placement."""
    if path not in ("distributed", "cuda_ipc", "auto"):
        return
    paths = worker_paths(path, gpus, own_gpus, device, len(workers))
    for w, p, theirs in zip(workers, paths, gpus):
        if p == "cuda_ipc" and not set(theirs) & set(own_gpus):
            raise ValueError(
                f"weight_sync.path = 'cuda_ipc' hands [actors.{w}] CUDA IPC handles of the "
                f"trainer's GPU ({', '.join(own_gpus)}), but it runs on "
                f"{', '.join(theirs) or 'the CPU'}: put it on the trainer's GPU, or set "
                f"weight_sync.path = 'auto' (CUDA IPC on the shared GPU, NCCL to the "
                f"others), 'distributed' or 'disk'")
    nccl = [i for i, p in enumerate(paths) if p == "distributed"]
    try:
        plan_groups([gpus[i] for i in nccl], own_gpus,
                    [f"[actors.{workers[i]}]" for i in nccl], nccl=device.startswith("cuda"))
    except SyncError as e:
        raise ValueError(str(e)) from None


ADAPTER_PREFIX = "policy"


def adapter_name(version: int) -> str:
    """The name weight version `version` of a LoRA student is loaded under on every worker
    (what the rollout's requests name in `lora_path`)."""
    return f"{ADAPTER_PREFIX}-v{version}"
