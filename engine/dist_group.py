"""The torch.distributed group that carries weights from a trainer to inference servers.

Role: one function that both sides call to join the group that `/init_weights_update_group`
names: the trainer as rank 0, each server's ranks as `rank_offset + tp_rank`. Invariant: the
group is made the way SGLang makes its own (its `init_custom_process_group`, read in the public
sources): a rendezvous on `tcp://master_address:master_port` (rank 0 hosts the TCP store), a
PrefixStore named after the group, torch's group constructor with that group name, and group
rank == rank. Both sides therefore meet on the same store keys, so a trainer using this module
reaches a real SGLang server as well as the embedded one. The group is never the process's
default group, so a trainer that already has one (FSDP, Megatron) keeps it untouched.

Uses torch's private `_new_process_group_helper`, as SGLang does: the public `new_group` needs a
default group, which an inference server or a single-GPU trainer does not have.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name


def new_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
              group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = 600.0):
    """Join (rank 0: create) the weight-update group; blocks until every rank has joined."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' (GPU) or 'gloo' (CPU), got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name,
        timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy(group) -> None:
    dist.destroy_process_group(group)


def broadcast(tensor: torch.Tensor, group) -> None:
    """Rank 0 sends `tensor`; every other rank receives into it (in place)."""
    dist.broadcast(tensor, src=0, group=group)
