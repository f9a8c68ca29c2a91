"""Collectives over megatron's tensor/pipeline groups: whole-model HF tensors and gradient norms.

Role: what the trainer needs from a sharded model as if it were one module: the HF state dict
(gathered over tensor ranks, merged over pipeline stages) and a clipped global gradient norm.
`iter_hf_tensors` is the weight push's and the HF export's gather: only data-parallel replica
0 moves data, piece by piece (the embedding, one transformer layer, the final norm and output
layer): a piece's tensor shards are gathered to its stage's first tensor rank one tensor at a
time, converted to HF names there, and sent from later stages to global rank 0; rank 0 gives
each piece out as it comes, so a push (or the HF export) streams the model. Memory bound: on a
device, one tensor's gathered shards beyond the model; in host memory, one piece on every rank
(plus what the consumer keeps: one bucket of a push, one shard file of an export).
A mixture-of-experts layer's experts are gathered over the expert tensor x expert-parallel
group of expert replica 0 (the expert-parallel ranks are data-parallel ranks, so ranks outside
replica 0 take part in those gathers).
`hf_tensors_on_rank0` collects the stream into one dict (tests, small models).
Gradients: `sum_tensor_partial_grads` (replicated parameters with a partial gradient per tensor
rank, q/k norms and, under sequence parallelism, norms and routers: summed over the tensor ranks
once per gradient; the norm does it first), `grad_norm` (experts
of other expert-parallel ranks counted over their group), `sum_data_parallel_grads` /
`ExpertDataParallel` (the step's data-parallel sum with each expert-parallel expert summed over
its expert data-parallel group only).
Invariant: at any TP/PP/EP layout the stream equals that of the same model at TP=PP=EP=1 (up to
float summation order); the gradient norm is the same on every rank of the model-parallel group.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterator

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


def _pieces(model: MegatronCausalLM) -> list[tuple[str, int]]:
    """This stage's pieces in model order: ("embedding", -1), ("layer", global index), ("final",
    -1)."""
    core = model.core
    out = [("embedding", -1)] if core.pre_process else []
    out += [("layer", i) for i in model.layers]
    return out + ([("final", -1)] if core.post_process else [])


def _piece_tensors(local: dict[str, torch.Tensor], kind: str, local_layer: int, tied: bool
                   ) -> dict[str, torch.Tensor]:
    """The stage's megatron tensors of one piece, a layer's renamed to layer 0 (the last
    stage's copy of tied embeddings left out: HF has no lm_head then)."""
    if kind == "embedding":
        return {k: v for k, v in local.items() if k == "embedding.word_embeddings.weight"}
    if kind == "final":
        keep = ("decoder.final_layernorm.weight",) + (() if tied else ("output_layer.weight",))
        return {k: v for k, v in local.items() if k in keep}
    prefix = f"decoder.layers.{local_layer}."
    return {"decoder.layers.0." + k[len(prefix):]: v for k, v in local.items()
            if k.startswith(prefix)}


def _gather_to_first_tensor_rank(piece: dict[str, torch.Tensor]
                                 ) -> list[dict[str, torch.Tensor]] | None:
    """Every tensor rank's copy of `piece` (CPU, rank order) on the stage's first tensor rank,
    one tensor at a time; None on the other tensor ranks. At tp = 1 the piece itself, on its
    device."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:  # where they are: a GPU push stages or broadcasts them without a host trip
        return [{k: v.detach() for k, v in piece.items()}]
    first = parallel_state.get_tensor_model_parallel_rank() == 0
    group = parallel_state.get_tensor_model_parallel_group()
    dst = parallel_state.get_tensor_model_parallel_src_rank()
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for key in sorted(piece):  # on the collective's device (the model may be on the CPU)
        tensor = piece[key].detach().to(_comm_device()).contiguous()
        parts = [torch.empty_like(tensor) for _ in range(tp)] if first else None
        dist.gather(tensor, parts, dst=dst, group=group)
        if first:
            for rank, part in enumerate(parts):
                shards[rank][key] = part.cpu()
    return shards if first else None


def _comm_device() -> torch.device:
    """Where point-to-point tensors live: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _send_piece(hf: dict[str, torch.Tensor] | None, dst: int) -> None:
    """One converted piece (None = the stage is done) to global rank `dst`: names, shapes and
    dtypes as an object, then each tensor."""
    meta = None if hf is None else [(k, tuple(v.shape), str(v.dtype)) for k, v in hf.items()]
    dist.send_object_list([meta], dst=dst, device=_comm_device())
    for tensor in (hf or {}).values():
        dist.send(tensor.to(_comm_device()).contiguous(), dst=dst)


def _recv_piece(src: int) -> dict[str, torch.Tensor] | None:
    box: list = [None]
    dist.recv_object_list(box, src=src, device=_comm_device())
    if box[0] is None:
        return None
    out = {}
    for key, shape, dtype in box[0]:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]),
                             device=_comm_device())
        dist.recv(tensor, src=src)
        out[key] = tensor.cpu()
    return out


def _is_expert_key(key: str) -> bool:
    return ".mlp.experts." in key


def _gather_experts(piece: dict[str, torch.Tensor]) -> list[list[dict[str, torch.Tensor]]] | None:
    """Every expert rank's copy of a layer's expert tensors `piece` on the first rank of the
    expert tensor x expert-parallel group, one tensor at a time, as [ep rank][expert tensor
    rank] (CPU; on its device when the group is this rank alone); None on the other ranks."""
    group = parallel_state.get_expert_tensor_and_model_parallel_group()
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return [[{k: v.detach() for k, v in piece.items()}]]
    ranks = dist.get_process_group_ranks(group)
    first = dist.get_rank() == ranks[0]
    where = [None] * size  # each member's (ep rank, expert tensor rank)
    dist.all_gather_object(where, (parallel_state.get_expert_model_parallel_rank(),
                                   parallel_state.get_expert_tensor_parallel_rank()), group=group)
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    out: list[list[dict[str, torch.Tensor]]] = [[{} for _ in range(etp)] for _ in range(ep)]
    for key in sorted(piece):
        tensor = piece[key].detach().to(_comm_device()).contiguous()
        parts = [torch.empty_like(tensor) for _ in range(size)] if first else None
        dist.gather(tensor, parts, dst=ranks[0], group=group)
        if first:
            for (ep_rank, etp_rank), part in zip(where, parts):
                out[ep_rank][etp_rank][key] = part.cpu()
    return out if first else None


def iter_hf_tensors(model: MegatronCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's HF tensors on global rank 0 (CPU; at tp = 1 on the model's device),
    one piece at a time as they are gathered (the embedding, each layer, the final norm and
    output layer; later stages' pieces as they arrive), nothing on the other ranks. Collective:
    every rank runs it to the end; ranks outside data-parallel replica 0 (and its context-parallel
    ranks but the first) return at once, except
    (a MoE model) those holding the other experts: a layer's experts are gathered from the
    expert-parallel ranks of expert replica 0. A consumer that lets go of each piece before
    asking for the next holds one piece of the model, never the whole of it."""
    # the CP ranks of a replica hold the same weights: its CP rank 0 speaks for it
    replica0 = (parallel_state.get_data_parallel_rank() == 0
                and parallel_state.get_context_parallel_rank() == 0)
    experts = model.layout.moe and parallel_state.get_expert_data_parallel_rank() == 0
    if not (replica0 or experts):
        return
    core = model.core
    local = {k: v for k, v in core.state_dict(keep_vars=True).items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    stage = parallel_state.get_pipeline_model_parallel_rank()
    head = replica0 and parallel_state.get_tensor_model_parallel_rank() == 0
    offset = model.layers.start
    for kind, index in _pieces(model):
        piece = _piece_tensors(local, kind, index - offset, model.layout.tied_embeddings)
        expert_piece = {k: piece.pop(k) for k in [k for k in piece if _is_expert_key(k)]}
        shards = _gather_to_first_tensor_rank(piece) if replica0 else None
        expert_shards = _gather_experts(expert_piece) if experts and expert_piece else None
        if shards is None:
            continue
        layers = range(index, index + 1) if kind == "layer" else range(0)
        hf = megatron_to_hf(shards, model.layout, layers, kind == "embedding", kind == "final",
                            expert_shards)
        del shards, expert_shards
        if stage == 0:
            for key in list(hf):  # given out one by one: the consumer's is the only reference
                yield key, hf.pop(key)
        else:
            _send_piece(hf, dst=0)
        del hf
    if stage > 0:
        if head:
            _send_piece(None, dst=0)
        return
    if head:  # global rank 0: the later stages' pieces, stage by stage
        stages = dist.get_process_group_ranks(
            parallel_state.get_pipeline_model_parallel_group())
        for src in stages[1:]:
            while (hf := _recv_piece(src)) is not None:
                for key in list(hf):
                    yield key, hf.pop(key)


def hf_tensors_on_rank0(model: MegatronCausalLM) -> dict[str, torch.Tensor]:
    """`iter_hf_tensors` as one dict (tests, small models): the whole model on rank 0."""
    return dict(iter_hf_tensors(model))


def is_expert_parallel(param: torch.Tensor) -> bool:
    """A parameter of an expert that only its expert-parallel rank holds (megatron marks them
    allreduce = False when ep > 1): its gradient sums over the expert data-parallel group."""
    return getattr(param, "allreduce", True) is False


def _tensor_partial(name: str, param: torch.Tensor, config) -> bool:
    """A replicated parameter whose gradient each tensor rank holds only its part of: what
    sequence parallelism marks (layer norms, routers: each rank saw part of the sequence), and
    the per-head q/k norms (each rank applies them to its heads only)."""
    return (bool(config.sequence_parallel) and getattr(param, "sequence_parallel", False)) or (
        bool(config.qk_layernorm) and ("q_layernorm" in name or "k_layernorm" in name))


def sum_tensor_partial_grads(model: MegatronCausalLM) -> None:
    """Sum the gradients of `_tensor_partial` parameters over the tensor ranks (megatron's
    finalize_model_grads does the same). Once per gradient: a gradient already summed and
    unchanged since is left alone."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    config = model.core.config
    params = [p for name, p in model.core.named_parameters()
              if p.grad is not None and _tensor_partial(name, p, config)]
    if not params:
        return
    done = getattr(model, "_tensor_partial_summed", {})
    if all(done.get(id(p)) == (id(p.grad), p.grad._version) for p in params):
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n
    object.__setattr__(model, "_tensor_partial_summed",
                       {id(p): (id(p.grad), p.grad._version) for p in params})


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """Global L2 norm of the gradients: each shard counted once (tensor-parallel duplicates and
    the last stage's copy of tied embeddings skipped), summed over the model-parallel group;
    expert-parallel experts over the expert tensor x expert x pipeline group. Partial gradients
    of replicated parameters are summed over the tensor ranks first
    (`sum_tensor_partial_grads`)."""
    if hasattr(model, "core"):
        sum_tensor_partial_grads(model)
    params = [p for p in model.parameters() if p.grad is not None]
    first = params[0].grad if params else torch.zeros(())
    total = torch.zeros((), dtype=torch.float32, device=first.device)
    experts = torch.zeros((), dtype=torch.float32, device=first.device)
    for p in params:
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            square = p.grad.detach().float().pow(2).sum()
            if is_expert_parallel(p):
                experts += square
            else:
                total += square
    if dist.is_initialized() and parallel_state.get_model_parallel_group() is not None:
        dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            dist.all_reduce(experts,
                            group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return (total + experts).sqrt()


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ semantics over the sharded model; 0 = no clipping."""
    norm = grad_norm(model)
    if max_norm and max_norm > 0 and math.isfinite(float(norm)):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.dtype))
    return float(norm)


def sum_context_parallel_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients over megatron's context-parallel group: each CP rank holds the part
    that flowed through its positions (context_parallel.gather_from_cp), their sum the whole
    (missing = zero). No-op at cp = 1."""
    if parallel_state.get_context_parallel_world_size() == 1 or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=parallel_state.get_context_parallel_group())
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
        offset += g.numel()


def sum_data_parallel_grads(params: list[torch.nn.Parameter], group: Any = None) -> None:
    """Sum gradients over the data-parallel ranks as the train step's DataParallel.sum_grads does
    (missing = zero), but each expert-parallel expert's over the expert data-parallel group
    only: the other data-parallel ranks of its expert-parallel group hold other experts."""
    dense = [p for p in params if not is_expert_parallel(p)]
    experts = [p for p in params if is_expert_parallel(p)]
    for chosen, grp in ((dense, group or parallel_state.get_data_parallel_group()),
                        (experts, parallel_state.get_expert_data_parallel_group())):
        if not chosen or dist.get_world_size(grp) == 1:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in chosen]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=grp)
        offset = 0
        for p, g in zip(chosen, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
            offset += g.numel()


class ExpertDataParallel:
    """The train step's data-parallel reductions (training/data_parallel.py DataParallel's
    interface: rank, world_size, sum_grads, sum_tensor, gather) over megatron's data-parallel
    group (context-parallel ranks excluded: the CP ranks of a replica get the same
    micro-batches and compute the same per-sequence statistics, so sums and gathers count a
    replica once), gradients summed by `sum_data_parallel_grads` (experts over their own group)
    over the data-parallel x context-parallel group (each CP rank holds its positions' part)."""

    def __init__(self) -> None:
        self.group = parallel_state.get_data_parallel_group()
        self.grad_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        sum_data_parallel_grads(params, self.grad_group)

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.to(_comm_device(), copy=True)
        dist.all_reduce(out, group=self.group)
        return out.cpu()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


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
