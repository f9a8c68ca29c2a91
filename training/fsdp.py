"""The torch backend's sharded data parallelism: FSDP2 (`parallel.shard = "fsdp2"`).

Role: with `backend = "torch"` and `parallel = { dp = N, shard = "fsdp2" }` every rank holds
1/N of the policy's parameters, gradients and optimizer state (torch.distributed.fsdp's
`fully_shard`: each decoder layer, then the root), so a model larger than one GPU's memory
trains with the torch backend. Each forward gathers one layer at a time and frees it after; backward
reduce-scatters the gradients. Every rank first loads the whole model (a resume loads the
checkpoint the same way on every rank), the ranks compare weight digests, then `shard_state`
shards it: per layer, so a device holds at most one whole layer beyond the shards.

Numerics, kept equal to the replicated (one-process) step:
- gradients are summed over ranks, not averaged (every rank's loss is already divided by the
  number of samples in the whole step): gradient divide factor 1;
- fp32 master weights for a 16-bit `dtype`: the sharded parameters are kept in fp32 (they are
  the masters) and FSDP's mixed-precision policy runs the forward and backward in `dtype` (the
  gathered layer cast to it: the parameter the one-process trainer would hold), gradients
  reduced in fp32; without masters the parameters stay in `dtype`;
- the forward is one padded pass per micro-batch (never per length: every rank must run the
  same number of forwards, each a collective), every rank the same number of micro-batches
  (training.data_parallel's schedule).

Checkpoints and pushes gather: `iter_full_state` (every rank runs it, rank 0 gets the whole
model in `dtype` on the CPU one tensor at a time, as a push sends it and the HF export writes
it: never the whole model in host memory at once); the optimizer's
state is gathered into the one-process format (AdamW's, or the master-weight optimizer's), so a
checkpoint resumes at any dp, sharded or not.
Not covered (refused at load, training/config.py): another backend (it shards itself),
colocated mode (sleep moves FSDP's own storage), colocated teachers (their micro-batches are
regrouped per teacher: unequal forward counts), old-actor copies (`proximal =
"rollout_version"`), a reference that follows the actor, true on-policy.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist

from memory.safetensors_io import DEFAULT_SHARD_BYTES, write_safetensors_shards
from training.master_weights import MasterWeightOptimizer, TrainOptimizer


def _fsdp():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    return DeviceMesh, MixedPrecisionPolicy, fully_shard


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a shard (a collective for a DTensor), else `t`."""
    return t.full_tensor() if is_dtensor(t) else t


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks FSDP shards one by one (HF causal LMs: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def shard_state(state: Any, dtype: torch.dtype, lr: float, weight_decay: float) -> None:
    """Shard the policy of `state` over the world (every rank calls it, after the weight
    check) and give it an optimizer over its shards, carrying over the optimizer state the
    one-process optimizer held (a resume)."""
    DeviceMesh, MixedPrecisionPolicy, fully_shard = _fsdp()
    model, old = state.model, state.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    masters = isinstance(old, MasterWeightOptimizer)
    saved = _full_optimizer_state(old, params)
    device = next(model.parameters()).device
    # the world group itself (init_device_mesh would make another, which outlives the run)
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    policy = MixedPrecisionPolicy()
    if masters:  # the sharded parameters become the fp32 masters; compute in `dtype`
        with torch.no_grad():
            for p, m in zip(old.params, old.master):
                p.data = m.detach().to(p.device, torch.float32)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in [*decoder_layers(model), model]:  # each FSDP module has its own setting
        module.set_gradient_divide_factor(1.0)  # the sum over ranks (losses are pre-divided)
        if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.9
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    sharded = [p for p in model.parameters() if p.requires_grad]
    optimizer = ShardedOptimizer(sharded, lr, weight_decay, masters, dtype)
    optimizer.load_full(saved)
    state.optimizer = optimizer
    state.backend.sharded_dtype = dtype  # the torch backend streams and saves from the shards
    # the sharded model's HF interface (training/state.py, weight pushes, the reference copy)
    model.hf_state_dict = partial(full_state_dict, model, dtype)
    model.iter_hf_tensors = partial(iter_full_state, model, dtype)
    model.save_pretrained = partial(save_pretrained, model, dtype)


def _full_optimizer_state(optimizer: TrainOptimizer, params: list[torch.nn.Parameter]
                          ) -> list[dict[str, Any]]:
    """Per parameter (model order) the one-process optimizer's AdamW state ({} before the first
    step)."""
    keys = optimizer.master if isinstance(optimizer, MasterWeightOptimizer) else params
    return [dict(optimizer.optimizer.state.get(k, {})) for k in keys]


class ShardedOptimizer(TrainOptimizer):
    """AdamW over the FSDP shards (training.master_weights.TrainOptimizer); `state_dict` (a
    collective) gathers the one-process format: AdamW's, or {"optimizer", "master"} with
    masters."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, weight_decay: float,
                 masters: bool, dtype: torch.dtype):
        self.params, self.masters, self.dtype = params, masters, dtype
        self.has_masters = masters
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)

    def reduce_and_clip(self, max_norm: float, dp: Any = None) -> float:
        """The backward already summed the shards' gradients over the ranks (`dp` skips
        DTensors): the global clip."""
        if dp is not None:
            dp.sum_grads(self.params)
        return clip_grad_norm(self.params, max_norm)

    def apply(self) -> None:
        self.optimizer.step()

    def load_full(self, saved: list[dict[str, Any]]) -> None:
        """Every rank's shard of the whole-parameter AdamW state `saved` (model order)."""
        from torch.distributed.tensor import distribute_tensor

        for p, st in zip(self.params, saved):
            if not st:
                continue
            self.optimizer.state[p] = {
                k: (distribute_tensor(v.to(p.device, torch.float32 if self.masters else
                                           v.dtype), p.device_mesh, p.placements,
                                      src_data_rank=None)
                    if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                for k, v in st.items()}

    def state_dict(self) -> dict[str, Any]:
        """The one-process optimizer's state dict (collective; whole tensors on every rank)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        groups[0]["params"] = list(range(len(self.params)))
        state = {i: {k: (full(v).cpu() if isinstance(v, torch.Tensor) else v)
                     for k, v in self.optimizer.state[p].items()}
                 for i, p in enumerate(self.params) if p in self.optimizer.state}
        out = {"state": state, "param_groups": groups}
        if not self.masters:
            return out
        return {"optimizer": out, "master": [full(p.detach()).cpu() for p in self.params]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        raise RuntimeError("a sharded trainer resumes before sharding (training/setup.py loads "
                           "the one-process checkpoint, then training.fsdp.shard_state)")


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip to the global L2 norm of the sharded gradients (each rank's shards squared and
    summed, all-reduced); torch.nn.utils.clip_grad_norm_ semantics, returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        local = g.to_local() if is_dtensor(g) else g
        total += local.detach().float().pow(2).sum()
    dist.all_reduce(total)
    norm = total.sqrt()
    if max_norm and max_norm > 0 and math.isfinite(float(norm)):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            (g.to_local() if is_dtensor(g) else g).detach().mul_(coef.to(g.dtype))
    return float(norm)


def iter_full_state(model: torch.nn.Module, dtype: torch.dtype
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's HF-named tensors in `dtype` on the CPU of rank 0, one tensor gathered
    at a time and given out at once (nothing on the others); every rank runs it to its end.
    Tied weights once."""
    seen: set[int] = set()
    rank0 = dist.get_rank() == 0
    skip = _non_persistent(model)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or name in skip:
            continue
        seen.add(id(t))
        whole = full(t.detach())
        if rank0:
            yield name, whole.to("cpu", dtype if whole.is_floating_point() else whole.dtype)
        del whole


def full_state_dict(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`iter_full_state` as one dict ({} on ranks other than 0)."""
    return dict(iter_full_state(model, dtype))


def _non_persistent(model: torch.nn.Module) -> set[str]:
    names = set()
    for prefix, module in model.named_modules():
        for b in getattr(module, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{b}" if prefix else b)
    return names


def save_pretrained(model: torch.nn.Module, dtype: torch.dtype, directory: str,
                    shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """The HF directory of the whole model, written by rank 0 as the tensors are gathered (one
    shard file in memory at a time); collective: every rank calls it."""
    tensors = iter_full_state(model, dtype)
    try:
        if dist.get_rank() == 0:
            write_safetensors_shards(tensors, directory, shard_bytes)
            model.config.save_pretrained(directory)
    finally:  # the rest of the gathers after a failed write: the other ranks are in them
        for _ in tensors:
            pass
