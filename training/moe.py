"""Mixture-of-experts in the train step: routes per micro-batch, routing replay, the
load-balancing loss and the routing metrics.

Role: a sample's `routed_experts` (the inference engine's expert ids per position,
transport/schema.py) become a micro-batch's `routes` [B, W, layers, k] (NO_ROUTE where a
position has none) and, for packed rows, `packed_routes` laid out like the packed tokens. Before
each micro-batch's model passes the runner gives its layouts to the policy's routing object
(`routed(model, mb)`; models/moe.py `Routing` for transformers models, the megatron backend's
own); `moe.routing_replay = "rollout"` makes them replace the router's choice, "off" only
compares (the mismatch metric). `with_aux_loss` adds the router's load-balancing loss to a
micro-batch's loss, weighted by its share of the step's tokens.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch

from models.moe import NO_ROUTE
from training.config import TrainConfig
from transport.schema import Sample

ROUTING_ATTR = "moe_routing"  # where a policy model keeps its routing object (None: dense)


def routing_of(model: Any) -> Any:
    """The routing object of a policy model (set by training/setup.py), None for a dense one."""
    return getattr(model, ROUTING_ATTR, None)


def attach(model: Any, routing: Any) -> None:
    object.__setattr__(model, ROUTING_ATTR, routing)  # not an nn.Module attribute


def sample_routes(samples: list[Sample], width: int) -> torch.Tensor | None:
    """[B, width, layers, k] expert ids of the samples' routed_experts (NO_ROUTE past each
    sample's rows and for samples without any), None when no sample has them. ValueError when
    samples disagree on [layers, k]."""
    arrays = [s.routed_experts for s in samples]
    present = [a for a in arrays if a is not None]
    if not present:
        return None
    shape = present[0].shape[1:]
    if any(a.shape[1:] != shape for a in present):
        raise ValueError(f"routed_experts of one batch disagree on [layers, top_k]: "
                         f"{sorted({tuple(a.shape[1:]) for a in present})}")
    dtype = torch.int16 if all(a.dtype == np.uint8 for a in present) else torch.int32
    out = torch.full((len(samples), width, *shape), NO_ROUTE, dtype=dtype)
    for b, a in enumerate(arrays):
        if a is not None and len(a):
            n = min(len(a), width)
            out[b, :n] = torch.from_numpy(a[:n].astype(np.int32))
    return out


def pack_routes(routes: torch.Tensor, packed: Any) -> torch.Tensor:
    """A micro-batch's routes [B, W, layers, k] laid out like its packed rows
    (training/packing.py PackedBatch): [rows, W', layers, k], NO_ROUTE on the padding."""
    rows, width = packed.input_ids.shape
    out = torch.full((rows, width, *routes.shape[2:]), NO_ROUTE, dtype=routes.dtype,
                     device=routes.device)
    for b, slot in enumerate(packed.slots):
        n = min(slot.length, routes.shape[1])
        out[slot.row, slot.start:slot.start + n] = routes[b, :n]
    return out


def layouts(mb: Any) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """The token layout a micro-batch's policy forwards run, (routes or None, real tokens):
    its packed rows when it has them (every policy pass then runs those), else its padded
    rows."""
    if mb.packed is None:
        return [(mb.routes, mb.attention_mask.bool())]
    cols = torch.arange(mb.packed.input_ids.shape[1], device=mb.packed.input_ids.device)
    lens = torch.tensor(mb.packed.row_lens, device=cols.device)
    return [(mb.packed_routes, cols[None, :] < lens[:, None])]


@contextlib.contextmanager
def routed(model: Any, mb: Any) -> Iterator[Any]:
    """The policy's routing set to micro-batch `mb` for the passes inside (backwards included:
    a checkpointed layer's recompute replays the same routes); the routing object or None."""
    routing = routing_of(model)
    if routing is None:
        yield None
        return
    routing.set_batch(layouts(mb))
    try:
        yield routing
    finally:
        routing.clear()


@contextlib.contextmanager
def rows_only(model: Any, rows: torch.Tensor, length: int) -> Iterator[None]:
    """Forwards inside run rows `rows` of the current micro-batch cut to `length` tokens (the
    unpadded forward per length)."""
    routing = routing_of(model)
    if routing is None:
        yield
        return
    with routing.select(rows, length):
        yield


def configure(model: Any, cfg: TrainConfig, mbs: list[Any], world_size: int) -> Any:
    """Set up the policy's routing for a step over `mbs`: replay or compare, and the
    load-balancing loss's weight per token; the routing object or None."""
    routing = routing_of(model)
    if routing is None:
        return None
    routing.take_stats()  # what passes outside steps counted
    routing.replay = cfg.moe.routing_replay == "rollout"
    routing.keep_logits = cfg.moe.aux_loss_coef > 0
    tokens = sum(float(mb.attention_mask.sum()) for mb in mbs)
    # each micro-batch's share of the step's tokens, over the data-parallel ranks (summed)
    routing.aux_per_token = cfg.moe.aux_loss_coef / max(tokens, 1.0) / world_size
    return routing


def with_aux_loss(loss: torch.Tensor, routing: Any, mb: Any) -> torch.Tensor:
    """`loss` plus the router's load-balancing loss of micro-batch `mb`'s forward, weighted by
    its tokens (moe.aux_loss_coef; megatron adds its own inside the model: None here)."""
    if routing is None or not routing.keep_logits:
        return loss
    aux = routing.aux_loss()
    if aux is None:
        return loss
    routing.aux_sum = getattr(routing, "aux_sum", 0.0) + float(aux.detach())
    routing.aux_count = getattr(routing, "aux_count", 0) + 1
    return loss + aux * (routing.aux_per_token * float(mb.attention_mask.sum()))


def step_stats(model: Any) -> dict[str, float]:
    """The step's routing metrics (and mean load-balancing loss), then reset."""
    routing = routing_of(model)
    if routing is None:
        return {}
    stats = routing.take_stats()
    if getattr(routing, "aux_count", 0):
        stats["moe/aux_loss"] = routing.aux_sum / routing.aux_count
    routing.aux_sum, routing.aux_count = 0.0, 0
    return stats
