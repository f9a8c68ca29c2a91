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

import asyncio
import contextlib
import datetime
import threading

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


def in_thread(fn, *args) -> asyncio.Future:
    """`fn(*args)` in a thread of its own; the returned future resolves on the running loop.
    Rendezvous and collectives block, and one waiting for a peer that is gone blocks until the
    group's timeout (or until the peer's side of the group is torn down): in its own thread it
    holds up neither the event loop nor later calls. Not a daemon thread: the process's exit
    joins it, since a thread that used a process group and ends while the interpreter shuts
    down can abort the process ("terminate called without an active exception", seen with
    gloo in a few exits out of ten)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if not future.cancelled():
            future.set_exception(error) if error is not None else future.set_result(result)

    def target() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting side
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name=f"dist-{fn.__name__}").start()
    return future


def destroy(group) -> None:
    dist.destroy_process_group(group)


def abort(group) -> None:
    """Give a group up while a collective may still be waiting in it (a peer is gone): NCCL's
    communicator is aborted, which ends a kernel that waits for the peer; a gloo collective
    still waits for its timeout in the thread that called it, so callers never wait on that
    thread. The group cannot be used again either way."""
    try:
        c10d._abort_process_group(group)
    except Exception:  # noqa: BLE001 - an older torch, or a group already torn down
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - nothing more can be done for it
            pass


def broadcast(tensor: torch.Tensor, group) -> None:
    """Rank 0 sends `tensor`; every other rank receives into it (in place)."""
    dist.broadcast(tensor, src=0, group=group)


def broadcast_many(tensors: list[torch.Tensor], groups: list) -> None:
    """Rank 0 sends every tensor to every group (each group its own communicator, so no GPU is
    twice in one), all collectives in flight together; returns when all have completed. On
    CUDA they run on a side stream that first waits for the current one: the transfer sees
    the latest writes, and a collective stuck on a lost peer never blocks the stream other
    threads compute on."""
    with _side_stream(tensors):
        works = [dist.broadcast(t, src=0, group=g, async_op=True) for g in groups for t in tensors]
        for work in works:
            work.wait()


def receive_many(tensors: list[torch.Tensor], group) -> None:
    """A receiving rank's side of `broadcast_many`: fills `tensors` in place, in order. On CUDA
    on a side stream (allocated by the caller on the current one), synchronized before return,
    so the engine's own stream never waits on the sender."""
    with _side_stream(tensors):
        for t in tensors:
            dist.broadcast(t, src=0, group=group)


@contextlib.contextmanager
def _side_stream(tensors: list[torch.Tensor]):
    """CUDA tensors: the block runs on a new stream that first waits for the current one, and
    is synchronized on exit (the caller's thread waits, no other stream does). Else nothing."""
    if not tensors or not tensors[0].is_cuda:
        yield
        return
    stream = torch.cuda.Stream(tensors[0].device)
    stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()

