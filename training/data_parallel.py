"""Data-parallel training: which micro-batches a rank runs, and the sums across ranks.

Role: `plan_micro_batches` turns one optimizer step's samples into this rank's micro-batches with
`algos.dp_schedule` (one step, `world_size` ranks): with `max_tokens_per_mb > 0` first-fit-
decreasing packing under the token cap, else fixed chunks of `micro_batch_size` samples; micro-
batches spread over ranks balancing estimated FLOPs, every rank the same count. A sample longer
than the cap gets a micro-batch of its own and is reported (`oversized`), never dropped.

`DataParallel` wraps a torch.distributed process group (gloo on CPU, NCCL on GPUs) with the
reductions the step needs: gradients (summed: every rank's loss is already divided by the number
of samples in the whole step, so the sum is the one-process gradient), float64 statistics
(whitening sums, metric totals), and a gather of the mismatch-metric tensors. `SingleProcess`
is the same interface for one process, doing nothing.
Invariant: every rank calls the reductions in the same order with the same shapes; each rank
holds the whole step's sample list, so per-sample quantities (rewards, group baselines) are
computed identically everywhere without communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from algos.dp_schedule import build_schedule
from transport.schema import Sample

NO_CAP = 1 << 62  # "no token cap": larger than any sample


@dataclass
class MicroBatchPlan:
    micro_batches: list[list[int]]  # this rank's micro-batches, as indices into the step's samples
    oversized: list[int]  # indices (over all ranks) of samples longer than the token cap


def plan_micro_batches(samples: Sequence[Sample], micro_batch_size: int, max_tokens_per_mb: int,
                       rank: int = 0, world_size: int = 1) -> MicroBatchPlan:
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    capped = max_tokens_per_mb > 0
    schedule = build_schedule(lengths, [s.group_id for s in samples], num_ranks=world_size,
                              max_tokens_per_mb=max_tokens_per_mb if capped else NO_CAP,
                              mode="first_fit_decreasing" if capped else "fixed",
                              micro_batch_size=None if capped else micro_batch_size)
    mine = [sorted(mb) for mb in schedule.steps[0][rank]]
    return MicroBatchPlan(sorted(mine), sorted(schedule.oversized))


class SingleProcess:
    """The one-process case: rank 0 of 1, reductions are identities."""

    rank, world_size = 0, 1

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        return None

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (metrics only: pickled through the group)."""
        return [obj]


class DataParallel(SingleProcess):
    """Reductions over an initialised torch.distributed group (default: the world)."""

    def __init__(self, group: Any = None):
        if not dist.is_initialized():
            raise ValueError("DataParallel needs torch.distributed.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        nccl = dist.get_backend(group) == "nccl"  # NCCL reduces device tensors only
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl \
            else torch.device("cpu")

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over ranks in one flat all-reduce (missing = zero).
        Shards of an FSDP model (DTensors) are skipped: their backward already summed them."""
        from torch.distributed.tensor import DTensor

        params = [p for p in params if not isinstance(p, DTensor)]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, on the CPU."""
        out = tensor.to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out.cpu()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
