"""The distributed optimizer: AdamW state and fp32 main weights sharded over data-parallel ranks.

Role: `parallel.distributed_optimizer = true` (`use_distributed_optimizer` in the backend's
option table, ZeRO stage 1): each of the D data-parallel replicas of one tensor/pipeline shard
keeps 1/D of that shard's optimizer state, AdamW's two moments and the fp32 main weights,
instead of all of it. The rank's parameters are laid end to end in one flat index space (model
order, padded to a multiple of D); replica r owns the contiguous range [r * S, (r + 1) * S), S =
ceil(N / D), and its AdamW steps one fp32 tensor of that range.

Per step (`step(max_norm)`: `reduce_and_clip`, then `apply`; training/step.py): the gradients
are reduce-scattered over the data-parallel group in fp32 (each replica receives the sum for its
range only), the global norm is taken from the ranges (each element once: tensor-parallel
duplicates and the tied output copy left out, summed over the data- and model-parallel groups)
and the range clipped by it, each replica takes the AdamW step on its range, and the updated
ranges are all-gathered (in the parameters' dtype) into every replica's parameters: the bytes of
the replicated step's all-reduce.

Memory per parameter (bf16 parameters with fp32 main weights): 2 (weight) + 2 (gradient) +
12 / D (main weight, two moments) bytes, against 2 + 2 + 12 replicated; the step's transients
are one flat fp32 copy of the shard's gradients (what the reduce-scatter sends), one range of
them, and one flat copy of the parameters in their dtype (the all-gather).

Numerics: AdamW is elementwise, so every element gets the update the replicated optimizer gives
it from the same summed, clipped gradient; the sums are fp32 (the replicated step sums in the
gradients' dtype) and the norm is summed in another order, so the step equals the replicated
one up to that rounding (for two replicas of fp32 gradients the sums are the same numbers; the
norm differs in its last bits). Rounding the fp32 main weight to the parameter's dtype is the
same as training/master_weights.py's. Invariant: between steps every parameter equals its main
weight rounded (fp32 parameters: equal).

Checkpoints: `full_view()` (collective over the data-parallel group) gathers the ranges into
the per-parameter layout a distributed checkpoint writes (the backend's checkpoint: each
moment and main weight sharded like its parameter), so a checkpoint written with the distributed
optimizer resumes with or without it, at any layout; `load_view` takes the ranges back out of
a loaded view. The gather holds the tensor/pipeline shard's whole optimizer state for the
duration of a save (the replicated optimizer's size), not between saves.

Expert parallelism (`DistributedOptimizers`): an expert is replicated over its expert
data-parallel group, not the data-parallel group, so the experts get a distributed optimizer
of their own over that group, the dense parameters one over the data-parallel group; the two
share one global norm (each part's squares summed over its groups, then added) and one view.
"""

from __future__ import annotations

import math
import types
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from training.master_weights import TrainOptimizer

# torch 2.13 renamed reduce_scatter_tensor (the old name warns); the same call either way
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class DistributedOptimizer(TrainOptimizer):
    """AdamW over this replica's range of the flattened parameters (see the module docstring),
    a training.master_weights.TrainOptimizer."""

    holds_ranges = True  # a checkpoint reads and loads it through the per-parameter views

    def __init__(self, params: Iterable[torch.nn.Parameter], group: Any, lr: float,
                 weight_decay: float = 0.0, counted: Callable[[torch.Tensor], bool] | None = None,
                 norm_group: Any = None):
        """`group`: the data-parallel group; `counted(p)`: whether p's elements count in the
        global gradient norm (not a tensor-parallel duplicate, not the tied output copy);
        `norm_group`: where the norm is summed beyond it (the model-parallel group)."""
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the distributed optimizer needs parameters to train")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.size = -(-self.numel // self.world)  # elements per replica (the last one padded)
        self.start = self.rank * self.size
        dtypes = {p.dtype for p in self.params}
        self.gather_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        nccl = dist.get_backend(group) == "nccl"
        self.comm_device = (torch.device("cuda", torch.cuda.current_device()) if nccl
                            else self.params[0].device)
        counted = counted or (lambda p: True)
        self.norm_group = norm_group
        # called before the reduction: the backend's gradient completion (megatron: q/k norm
        # gradients summed over the tensor ranks); None = none
        self.prepare: Callable[[], None] | None = None
        # runs of my range whose elements count in the norm: (first, end) within the range
        self._counted = [(dst, dst + n) for i, _, dst, n in self._pieces()
                         if counted(self.params[i])]
        main = torch.zeros(self.size, dtype=torch.float32, device=self.params[0].device)
        self._copy_range([p.detach() for p in self.params], main)
        self.master = [torch.nn.Parameter(main)]
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay)

    @property
    def has_masters(self) -> bool:
        return self.masters

    @property
    def masters(self) -> bool:
        """Whether the fp32 main weights differ from the parameters (16-bit parameters)."""
        return self.gather_dtype != torch.float32

    def _pieces(self) -> Iterable[tuple[int, int, int, int]]:
        """(parameter index, first element in it, first element in my range, count) of every
        parameter that overlaps my range."""
        offset, end = 0, self.start + self.size
        for i, p in enumerate(self.params):
            lo, hi = max(offset, self.start), min(offset + p.numel(), end)
            if lo < hi:
                yield i, lo - offset, lo - self.start, hi - lo
            offset += p.numel()

    def _copy_range(self, tensors: list[torch.Tensor | None], out: torch.Tensor) -> None:
        """My range of the flattened `tensors` (None = zeros) into the fp32 `out`."""
        with torch.no_grad():
            for i, src, dst, n in self._pieces():
                t = tensors[i]
                if t is None:
                    out[dst:dst + n].zero_()
                else:
                    out[dst:dst + n].copy_(t.reshape(-1)[src:src + n])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params + self.master:
            p.grad = None

    def reduce_and_clip(self, max_norm: float, dp: Any = None) -> float:
        """(`dp` unused: the reduction is over the optimizer's own group.) This replica's range
        of the gradients summed over the data-parallel group (reduce-scatter, in fp32), clipped
        to `max_norm` by the global norm taken from the ranges (each element once, over the
        data- and model-parallel groups); returns the norm and leaves the range for `step`. The
        parameters' gradients are dropped. `prepare` (set by training/setup.py from the
        backend) completes the gradients first."""
        if self.prepare is not None:
            self.prepare()
        norm = self.reduce_squares().sqrt()
        self.clip_range(norm, max_norm)
        return float(norm)

    def reduce_squares(self) -> torch.Tensor:
        """Reduce-scatter the gradients into this replica's range (kept for `clip`) and return
        the sum of squares of the counted elements over the data- and model-parallel groups
        (the norm's square); no `prepare`, no clipping."""
        flat = torch.zeros(self.size * self.world, dtype=torch.float32, device=self.comm_device)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                    p.grad = None
                offset += p.numel()
        mine = torch.empty(self.size, dtype=torch.float32, device=self.comm_device)
        if self.world == 1:
            mine.copy_(flat)
        else:
            REDUCE_SCATTER(mine, flat, op=dist.ReduceOp.SUM, group=self.group)
        del flat
        square = torch.zeros((), dtype=torch.float32, device=self.comm_device)
        for first, end in self._counted:
            square += mine[first:end].square().sum()
        if self.world > 1:
            dist.all_reduce(square, group=self.group)
        if self.norm_group is not None and dist.get_world_size(self.norm_group) > 1:
            dist.all_reduce(square, group=self.norm_group)
        self._mine = mine
        return square

    def clip_range(self, norm: torch.Tensor, max_norm: float) -> None:
        """Scale the range `reduce_squares` left by min(1, max_norm / norm) (no clipping for
        max_norm 0 / inf or a norm that is not finite) and hand it to AdamW."""
        mine, self._mine = self._mine, None
        if max_norm and max_norm > 0 and math.isfinite(max_norm) and math.isfinite(float(norm)):
            mine.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        self.master[0].grad = mine.to(self.master[0].device)

    def apply(self) -> None:
        """AdamW on my range (its gradient from `reduce_and_clip`, else my range of the
        parameters' gradients, already summed), the updated ranges gathered into every
        replica's parameters."""
        main = self.master[0]
        if main.grad is None:
            grad = torch.empty_like(main)
            self._copy_range([p.grad for p in self.params], grad)
            main.grad = grad
        for p in self.params:
            p.grad = None
        self.optimizer.step()
        main.grad = None
        self._gather_into_params()

    def _all_gather(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Every replica's range of the per-range `tensor`, in `dtype`: the flat index space."""
        mine = tensor.detach().to(self.comm_device, dtype)
        flat = torch.empty(self.size * self.world, dtype=dtype, device=self.comm_device)
        if self.world == 1:
            flat.copy_(mine)
        else:
            dist.all_gather(list(flat.chunk(self.world)), mine, group=self.group)
        return flat

    def _gather_into_params(self) -> None:
        flat = self._all_gather(self.master[0], self.gather_dtype)
        with torch.no_grad():
            offset = 0
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def _gathered(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every replica's range of a per-range fp32 tensor, as one fp32 tensor per parameter."""
        flat = self._all_gather(tensor, torch.float32)
        out, offset = [], 0
        for p in self.params:
            out.append(flat[offset:offset + p.numel()].view(p.shape).to(p.device).clone())
            offset += p.numel()
        return out

    def full_view(self) -> types.SimpleNamespace:
        """The per-parameter optimizer a distributed checkpoint reads (`optimizer.state` keyed
        by each parameter's fp32 main weight in `master`, or by the parameter itself when they
        are fp32; `params`). Collective over the data-parallel group (every replica gets the
        same view)."""
        owners = self._gathered(self.master[0]) if self.masters else self.params
        state = self.optimizer.state.get(self.master[0], {})
        per_key = {k: self._gathered(v) for k, v in state.items()
                   if isinstance(v, torch.Tensor) and v.dim()}
        scalars = {k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.dim())}
        inner = types.SimpleNamespace(state={
            owner: {**{k: per_key[k][i] for k in per_key}, **scalars}
            for i, owner in enumerate(owners)} if state else {})
        return types.SimpleNamespace(optimizer=inner, params=self.params, master=owners,
                                     has_masters=self.masters)

    def empty_view(self) -> types.SimpleNamespace:
        """A view to load a checkpoint into (fresh per-parameter main weights); `load_view`
        after."""
        owners = ([torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                   for p in self.params] if self.masters else self.params)
        inner = types.SimpleNamespace(state={o: {} for o in owners})
        return types.SimpleNamespace(optimizer=inner, params=self.params, master=owners,
                                     has_masters=self.masters)

    def load_view(self, view: types.SimpleNamespace) -> None:
        """My ranges of a loaded view (its main weights and AdamW state)."""
        main = self.master[0]
        self._copy_range([m.detach() for m in view.master], main.data)
        states = [view.optimizer.state.get(o, {}) for o in view.master]
        keys = [k for k, v in states[0].items() if isinstance(v, torch.Tensor) and v.dim()]
        if not keys:
            self.optimizer.state.pop(main, None)
            return
        new = {}
        for key in keys:
            buf = torch.zeros_like(main)
            self._copy_range([s[key] for s in states], buf)
            new[key] = buf
        for key, value in states[0].items():
            if key not in new:
                new[key] = value
        self.optimizer.state[main] = new


class DistributedOptimizers(TrainOptimizer):
    """Several distributed optimizers stepped as one, each over its own group (expert
    parallelism: the dense parameters over the data-parallel group, the experts over the expert
    data-parallel group, where each expert is replicated): the gradients completed once
    (`prepare`), reduced by each, clipped by one global norm over all of them, each stepping its
    ranges. Checkpoints see one per-parameter view, the parts' views laid end to end."""

    holds_ranges = True

    def __init__(self, parts: list[DistributedOptimizer]):
        if not parts:
            raise ValueError("DistributedOptimizers needs at least one part")
        self.parts = parts
        self.params = [p for part in parts for p in part.params]
        self.prepare: Callable[[], None] | None = None

    @property
    def masters(self) -> bool:
        return self.parts[0].masters

    @property
    def has_masters(self) -> bool:
        return self.masters

    @property
    def state(self) -> Any:
        return {k: v for part in self.parts for k, v in part.optimizer.state.items()}

    @property
    def param_groups(self) -> Any:
        return [g for part in self.parts for g in part.optimizer.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def reduce_and_clip(self, max_norm: float, dp: Any = None) -> float:
        if self.prepare is not None:
            self.prepare()
        squares = [part.reduce_squares() for part in self.parts]
        norm = sum(squares[1:], squares[0]).sqrt()
        for part in self.parts:
            part.clip_range(norm, max_norm)
        return float(norm)

    def apply(self) -> None:
        for part in self.parts:
            part.apply()

    def steps_taken(self) -> int:
        return max(part.steps_taken() for part in self.parts)

    def tensors(self) -> Iterator[torch.Tensor]:
        for part in self.parts:
            yield from part.tensors()

    def to(self, device: str | torch.device) -> None:
        for part in self.parts:
            part.to(device)

    def state_dict(self) -> dict[str, Any]:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for part, st in zip(self.parts, saved["parts"], strict=True):
            part.load_state_dict(st)

    @staticmethod
    def _joined(views: list[types.SimpleNamespace]) -> types.SimpleNamespace:
        inner = types.SimpleNamespace(state={k: v for view in views
                                             for k, v in view.optimizer.state.items()})
        return types.SimpleNamespace(optimizer=inner,
                                     params=[p for view in views for p in view.params],
                                     master=[m for view in views for m in view.master],
                                     has_masters=views[0].has_masters)

    def full_view(self) -> types.SimpleNamespace:
        """The parts' per-parameter views end to end (collective over each part's group)."""
        return self._joined([part.full_view() for part in self.parts])

    def empty_view(self) -> types.SimpleNamespace:
        return self._joined([part.empty_view() for part in self.parts])

    def load_view(self, view: types.SimpleNamespace) -> None:
        """Each part's share of a view made by `empty_view` (the same order)."""
        start = 0
        for part in self.parts:
            end = start + len(part.params)
            master = view.master[start:end]
            part.load_view(types.SimpleNamespace(
                optimizer=types.SimpleNamespace(state={m: view.optimizer.state.get(m, {})
                                                       for m in master}),
                params=view.params[start:end], master=master, has_masters=view.has_masters))
            start = end
