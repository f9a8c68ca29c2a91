"""fp32 master weights for a model trained in bfloat16 / float16 (mixed precision).

Role: the model's parameters stay in their low-precision dtype, so the trainer's forward (the
log-prob recompute and the training forward) is the function the inference workers run in that
dtype; the optimizer updates fp32 copies of them (the master weights, with fp32 optimizer state)
and after every step the model's parameters are set to the masters, rounded. Without masters an
update smaller than half a unit in the last place of the weight is rounded away: in bfloat16
(8 significant bits) a weight of 0.02 cannot move by less than about 6e-5, so AdamW at lr 1e-5
leaves most weights exactly where they were.

Flow of a step: backward fills the low-precision gradients -> `prepare_grads()` moves them to
fp32 gradients on the masters (what data-parallel ranks sum and what clipping measures, so both
happen in fp32) -> the update -> parameters = masters (`step(max_norm, dp)` does all three). Checkpoints hold the masters, so a resumed
run continues in full precision. Invariant: between steps every parameter equals its master
rounded to the parameter's dtype.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator

import torch

# the global gradient norm of a model whose parameters are shards (tensor/pipeline shards, FSDP):
# clips the parameters' gradients to `max_norm` in place and returns the norm
ClipFn = Callable[[float], float]


class TrainOptimizer:
    """The optimizer protocol of the trainer, shared by its variants (plain AdamW, fp32 master
    weights, FSDP2 shards, the distributed optimizer). What the trainer calls:
    - `step(max_norm, dp)`: sum the gradients over the data-parallel ranks (`dp`:
      training.data_parallel), clip them to the global norm `max_norm`, take the step; returns
      the norm. `step()` without arguments is torch's: the update alone, the gradients reduced
      and clipped by the caller (returns nan: no norm taken);
    - `zero_grad`, `state_dict` / `load_state_dict` (checkpoints), `state`, `param_groups`;
    - `tensors()`: every tensor it holds (what sleep parks), `to(device)`;
    - `has_masters`: its state holds fp32 master weights (a checkpoint records them);
    - `holds_ranges`: its state covers ranges of the flattened parameters, not whole parameters
      (the distributed optimizer). A checkpoint that stores state per parameter (a backend's,
      which cannot import this layer) reads it through `full_view()`, loads into `empty_view()`
      and hands that back with `load_view(view)`; a view has `optimizer` (with `state` keyed by
      each parameter's master, or by the parameter without masters), `params`, `master` (the
      parameters themselves without masters) and `has_masters`. Otherwise `optimizer.state` is
      keyed by `master` (`has_masters`) or by `params`.
    A variant sets `params` (the model's trained parameters) and `optimizer` (the torch optimizer
    it steps) and overrides `reduce_and_clip` and `apply`; `clip` is the backend's global norm
    of a sharded model (training/state.py sets it when the variant was made without)."""

    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    has_masters = False
    holds_ranges = False
    clip: ClipFn | None = None  # the global norm of a sharded model (None: torch's clip here)

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, max_norm: float | None = None, dp: Any = None) -> float:
        norm = math.nan
        if max_norm is not None or dp is not None:
            norm = self.reduce_and_clip(math.inf if max_norm is None else max_norm, dp)
        self.apply()
        return norm

    def reduce_and_clip(self, max_norm: float, dp: Any = None) -> float:
        """The gradients summed over `dp` (None: one rank) and clipped; returns the norm."""
        raise NotImplementedError

    def apply(self) -> None:
        """The update from the (reduced, clipped) gradients."""
        raise NotImplementedError

    def steps_taken(self) -> int:
        """Optimizer steps taken (AdamW's per-parameter count, restored with its state)."""
        steps = [float(st["step"]) for st in self.optimizer.state.values() if "step" in st]
        return int(max(steps, default=0.0))

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor it holds: the stepped parameters and their gradients, the state."""
        yield from torch_optimizer_tensors(self.optimizer)

    def to(self, device: str | torch.device) -> None:
        """Its state tensors to `device` (colocated mode moves them off the GPU)."""
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    st[k] = v.to(device)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(saved)


def torch_optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """A torch optimizer's parameters with their gradients and its state tensors."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p
            if p.grad is not None:
                yield p.grad
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def clip_local(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """torch's clip over parameters that are whole on this rank."""
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


class PlainOptimizer(TrainOptimizer):
    """A torch optimizer stepping the model's parameters themselves; `clip` takes the norm of a
    sharded model (None: the parameters are whole here)."""

    def __init__(self, optimizer: torch.optim.Optimizer, clip: ClipFn | None = None):
        self.optimizer, self.clip = optimizer, clip
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]

    def reduce_and_clip(self, max_norm: float, dp: Any = None) -> float:
        if dp is not None:
            dp.sum_grads(self.params)
        return self.clip(max_norm) if self.clip is not None else clip_local(self.params, max_norm)

    def apply(self) -> None:
        self.optimizer.step()


def as_train_optimizer(optimizer: Any, clip: ClipFn | None = None) -> Any:
    """`optimizer` as a TrainOptimizer (a torch optimizer is wrapped in PlainOptimizer)."""
    if optimizer is None or isinstance(optimizer, TrainOptimizer):
        return optimizer
    return PlainOptimizer(optimizer, clip)


class MasterWeightOptimizer(TrainOptimizer):
    """An optimizer over fp32 masters of low-precision parameters. Gradients are summed and
    clipped in fp32 on the masters (`clip` given, a sharded model: on the parameters, before
    they move to the masters)."""

    has_masters = True

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 clip: ClipFn | None = None):
        self.params = [p for p in params if p.requires_grad]
        self.master = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
                       for p in self.params]
        self.optimizer = make_optimizer(self.master)
        self.clip = clip

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params + self.master:
            p.grad = None

    def prepare_grads(self) -> list[torch.nn.Parameter]:
        """The parameters' gradients as fp32 gradients of the masters (which are returned)."""
        for p, m in zip(self.params, self.master):
            if p.grad is not None:
                m.grad = p.grad.to(device=m.device, dtype=torch.float32)
                p.grad = None
        return self.master

    def reduce_and_clip(self, max_norm: float, dp: Any = None) -> float:
        if self.clip is not None:  # a sharded model clips its own parameters' gradients
            if dp is not None:
                dp.sum_grads(self.params)
            return self.clip(max_norm)
        masters = self.prepare_grads()
        if dp is not None:
            dp.sum_grads(masters)
        return clip_local(masters, max_norm)

    def apply(self) -> None:
        self.prepare_grads()  # a no-op when reduce_and_clip (or the caller) already did
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)  # cast to the parameters' dtype

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from torch_optimizer_tensors(self.optimizer)  # the masters are its parameters

    def to(self, device: str | torch.device) -> None:
        """Masters and optimizer state to `device` (colocated mode moves them off the GPU)."""
        for m in self.master:
            m.data = m.data.to(device)
            if m.grad is not None:
                m.grad = m.grad.to(device)
        super().to(device)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(),
                "master": [m.detach().cpu() for m in self.master]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if "master" not in saved:
            raise ValueError("this checkpoint's optimizer state has no fp32 master weights (it "
                             "was written with master_weights = false); resume it with "
                             "master_weights = false")
        if [tuple(t.shape) for t in saved["master"]] != [tuple(m.shape) for m in self.master]:
            raise ValueError("the checkpoint's master weights do not match the model's "
                             "parameters")
        with torch.no_grad():
            for m, t in zip(self.master, saved["master"]):
                m.copy_(t)
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        self.optimizer.load_state_dict(saved["optimizer"])


def make_optimizer(params: Iterable[torch.nn.Parameter], dtype: torch.dtype, master: bool | None,
                   lr: float, weight_decay: float = 0.0, clip: ClipFn | None = None
                   ) -> TrainOptimizer:
    """AdamW over `params`, through fp32 masters when `master` (None: when `dtype` is a 16-bit
    float); `clip`: the global norm of a sharded model (None: whole parameters)."""
    params = list(params)
    if master is None:
        master = dtype in (torch.bfloat16, torch.float16)

    def adamw(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        # on CUDA one fused kernel for every tensor (else torch's default: foreach on CUDA,
        # the per-tensor loop on the CPU, whose values the CPU tests pin)
        fused = bool(ps) and all(p.is_cuda for p in ps)
        return torch.optim.AdamW(ps, lr=lr, weight_decay=weight_decay, fused=fused or None)

    return MasterWeightOptimizer(params, adamw, clip) if master else PlainOptimizer(adamw(params),
                                                                                  clip)
