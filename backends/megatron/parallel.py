"""Collectives over megatron's tensor/pipeline groups: whole-model HF tensors and gradient norms.

Role: what the trainer needs from a sharded model as if it were one module: the HF state dict
(gathered over tensor ranks, merged over pipeline stages) and a clipped global gradient norm.
Invariant: at any TP/PP layout both results equal those of the same model at TP=PP=1 (up to
float summation order), and every rank of the model-parallel group gets the same values.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # annotations only: model.py imports this module
    from backends.megatron.model import MegatronCausalLM

from backends.megatron.convert import megatron_to_hf
from backends.megatron.mcore import (
    parallel_state,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)


def _tensor_shards(local: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every tensor rank's copy of `local` (CPU), in rank order."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return [{k: v.detach().cpu() for k, v in local.items()}]
    group = parallel_state.get_tensor_model_parallel_group()
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for key, tensor in local.items():
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=group)
        for rank, part in enumerate(parts):
            shards[rank][key] = part.cpu()
    return shards


def gather_hf_state_dict(model: MegatronCausalLM) -> dict[str, torch.Tensor]:
    """The whole model's HF-named tensors on CPU, the same on every rank."""
    core = model.core
    local = {k: v for k, v in core.state_dict().items() if isinstance(v, torch.Tensor)}
    hf = megatron_to_hf(_tensor_shards(local), model.layout, model.layers, core.pre_process,
                        core.post_process)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        stages: list = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, hf,
                               group=parallel_state.get_pipeline_model_parallel_group())
        hf = {k: v for stage in stages for k, v in stage.items()}
    return hf


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """Global L2 norm of the gradients: each shard counted once (tensor-parallel duplicates and
    the last stage's copy of tied embeddings skipped), summed over the model-parallel group."""
    params = [p for p in model.parameters() if p.grad is not None]
    first = params[0].grad if params else torch.zeros(())
    total = torch.zeros((), dtype=torch.float32, device=first.device)
    for p in params:
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            total += p.grad.detach().float().pow(2).sum()
    if dist.is_initialized() and parallel_state.get_model_parallel_group() is not None:
        dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return total.sqrt()


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ semantics over the sharded model; 0 = no clipping."""
    norm = grad_norm(model)
    if max_norm and max_norm > 0 and math.isfinite(float(norm)):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.dtype))
    return float(norm)


def allreduce_tied_embedding_grads(model: MegatronCausalLM) -> None:
    """With pipeline stages and tied embeddings, the first stage's embedding and the last stage's
    output copy get the sum of both gradients, so their updates stay identical."""
    core = model.core
    if not (model.layout.tied_embeddings and parallel_state.get_pipeline_model_parallel_world_size()
            > 1 and parallel_state.is_rank_in_embedding_group()):
        return
    weight = core.shared_embedding_or_output_weight()
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    dist.all_reduce(grad, group=parallel_state.get_embedding_group())
    weight.grad = grad
