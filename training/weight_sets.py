"""The training side of the weight store (memory/store.py `WeightStore`, which does every backup,
restore, copy and CRC check): what a trainer's module and optimizer look like to it.

- `hollow_copy(module)`: a module of the same structure whose weights are empty: a resident
  module that weight sets are restored into (training/aux_models.py), with no second copy of the
  weights of its own.
- `optimizer_tensors(optimizer)`: the optimizer's tensors that live with the parameters, by
  stable names (fp32 masters, Adam moments): the critic's optimizer state as a weight set.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from training.master_weights import MasterWeightOptimizer, TrainOptimizer


def hollow_copy(module: torch.nn.Module, device: str | torch.device | None = None
                ) -> torch.nn.Module:
    """A deep copy of `module` whose parameters and persistent buffers are empty (on `device`,
    default: where each one is): the shape of a resident module, without a second copy of the
    weights. `WeightStore.restore` gives it values."""
    memo: dict[int, Any] = {}
    for t in module.state_dict(keep_vars=True).values():
        if isinstance(t, torch.Tensor) and id(t) not in memo:
            empty = torch.empty(0, dtype=t.dtype, device=device or t.device)
            memo[id(t)] = (torch.nn.Parameter(empty, requires_grad=False)
                           if isinstance(t, torch.nn.Parameter) else empty)
    return copy.deepcopy(module, memo)


def optimizer_tensors(optimizer: TrainOptimizer) -> dict[str, torch.Tensor]:
    """An optimizer's tensors that live with the parameters, by stable names: fp32 masters
    (training/master_weights.py) and per-parameter state (Adam moments); CPU scalars such as
    Adam's step count stay where they are."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(optimizer, MasterWeightOptimizer):
        out.update({f"master.{i}": m for i, m in enumerate(optimizer.master)})
    inner = optimizer.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for key, v in sorted(inner.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"state.{i}.{key}"] = v
    return out

