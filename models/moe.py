"""Mixture-of-experts models: their shape, and the routing hooks the engine and the trainer use.

Role: `moe_shape(config)` reads an HF config's expert layout (None for a dense model).
`Routing(model)` puts a forward hook on each router of a transformers MoE model (Qwen2-MoE,
Qwen3-MoE, DeepSeek-V3, GLM-4.5: their routers all return (logits, weights, expert ids)) and
can, per forward:
- record the expert ids each token was routed to (`recorded`, the inference engine's side);
- replay given expert ids (`set_batch(routes=...)`, the trainer's side): the ids are replaced,
  the weights recomputed from the router's own logits for those experts (the same formula the
  router uses for its own choice), so the router still gets gradients; a position whose route
  is -1 keeps its own choice;
- compare its own choice with given ids (the mismatch metric), and keep the router logits of a
  grad pass for the load-balancing loss (`aux_loss`) and the per-expert token counts.

Layouts: a router sees the tokens of its forward flattened row-major ([rows * width]). The
routes of a micro-batch are given per padded row ([B, W, layers, k]) and, when its samples are
also packed, per packed row ([rows, W', layers, k]); the hook takes the layout whose token count
matches, or the rows a `select` names (one forward per sequence length). A forward matching no
layout raises: replay is never silently misaligned.
Invariant: with routes equal to the router's own choice, outputs and gradients are unchanged.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from models.moe_shape import MoeShape, moe_shape  # noqa: F401 - re-exported

NO_ROUTE = -1  # a position without a recorded route: the router chooses itself
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _is_router(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith(("TopKRouter", "TopkRouter")) and hasattr(module, "top_k") \
        and hasattr(module, "weight")


def routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """{decoder layer index: its router} of a transformers MoE model."""
    out = {}
    for name, module in model.named_modules():
        if _is_router(module):
            m = _LAYER.search(name)
            if m is None:
                raise ValueError(f"router {name!r} is not inside a `layers.<i>` module")
            out[int(m.group(1))] = module
    return out


def replay_weights(router: torch.nn.Module, logits: torch.Tensor, ids: torch.Tensor
                   ) -> torch.Tensor:
    """The weights `router` gives experts `ids` [N, k] from its logits [N, E]: its own formula
    (softmax, or sigmoid with a scaling factor for the DeepSeek-V3 family)."""
    if hasattr(router, "e_score_correction_bias"):  # sigmoid scores; the bias only chooses
        weights = logits.float().sigmoid().gather(1, ids)
        if getattr(router, "norm_topk_prob", False):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


@dataclass
class _Layout:
    routes: torch.Tensor | None  # [rows, width, layers, k] (NO_ROUTE where none)
    valid: torch.Tensor  # [rows, width] bool: real tokens


class RowSelect:
    """`select`, shared by the routing objects: the forwards inside run rows `rows` of the
    first layout cut to `length` tokens (`_select` holds them meanwhile)."""

    _select: tuple[torch.Tensor, int] | None = None

    @contextlib.contextmanager
    def select(self, rows: torch.Tensor, length: int) -> Iterator[None]:
        """Forwards inside run rows `rows` of the first layout, cut to `length` tokens."""
        self._select = (rows, length)
        try:
            yield
        finally:
            self._select = None


class Routing(RowSelect):
    """Hooks on every router of `model` (see the module docstring). Not thread-safe: one
    forward at a time, as the engine and the trainer run them."""

    def __init__(self, model: torch.nn.Module, shape: MoeShape | None = None):
        self.shape = shape or moe_shape(model.config)
        if self.shape is None:
            raise ValueError("Routing needs a mixture-of-experts model (its config names no "
                             "routed experts)")
        self.routers = routers(model)
        if sorted(self.routers) != list(self.shape.moe_layers):
            raise ValueError(f"the model's routers sit at layers {sorted(self.routers)} but its "
                             f"config puts experts at {list(self.shape.moe_layers)}")
        self.record = False  # keep each forward's expert ids in `recorded`
        self.recorded: dict[int, torch.Tensor] = {}  # layer -> [N, k] ids of the last forward
        self.replay = False  # set_batch's routes replace the router's choice (else: compared)
        self.keep_logits = False  # keep router logits (with grad) for aux_loss
        self._layouts: list[_Layout] = []
        self._select: tuple[torch.Tensor, int] | None = None
        self._kept: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._zero_stats()
        self._handles = [r.register_forward_hook(self._hook(layer))
                         for layer, r in self.routers.items()]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ the trainer's side
    def set_batch(self, layouts: list[tuple[torch.Tensor | None, torch.Tensor]]) -> None:
        """The next forwards' token layouts: (routes [rows, W, layers, k] or None, valid
        [rows, W] bool) each, e.g. a micro-batch's padded rows and its packed rows. Clears the
        kept logits."""
        self._layouts = [_Layout(r, v.bool()) for r, v in layouts]
        self._kept = []

    def clear(self) -> None:
        self._layouts, self._kept, self._select = [], [], None

    def aux_loss(self) -> torch.Tensor | None:
        """Switch-style load-balancing loss of the forwards since set_batch (with keep_logits):
        num_experts * sum_e (fraction of routed slots to e) * (mean router probability of e)
        over real tokens, averaged over MoE layers; 1 when perfectly balanced. None: nothing
        kept."""
        if not self._kept:
            return None
        by_layer: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for layer, logits, ids, valid in self._kept:
            by_layer.setdefault(layer, []).append((logits, ids, valid))
        e, losses = self.shape.num_experts, []
        for parts in by_layer.values():
            logits = torch.cat([p[0][p[2]] for p in parts])
            ids = torch.cat([p[1][p[2]] for p in parts])
            if not len(logits):
                continue
            probs = F.softmax(logits, dtype=torch.float, dim=-1).mean(0)
            counts = torch.zeros(e, device=ids.device).index_add_(
                0, ids.reshape(-1), torch.ones(ids.numel(), device=ids.device))
            losses.append(e * (counts / ids.numel() * probs).sum())
        return torch.stack(losses).mean() if losses else None

    def take_stats(self) -> dict[str, float]:
        """Metrics since the last call: route mismatch against given routes (per token-layer
        and per token: any layer differs), expert load max/mean (worst layer), then reset."""
        out: dict[str, float] = {}
        if self._pairs:
            out["moe/route_mismatch"] = self._pairs_diff / self._pairs
            out["moe/route_mismatch_tokens"] = self._tokens_diff / max(1, self._tokens)
        loads = [c for c in self._counts.values() if c.sum() > 0]
        if loads:
            out["moe/expert_load_max_over_mean"] = max(float(c.max() / c.mean()) for c in loads)
            out["moe/expert_load_min_over_mean"] = min(float(c.min() / c.mean()) for c in loads)
        self._zero_stats()
        return out

    # ------------------------------------------------------------------ the hook
    def _zero_stats(self) -> None:
        self._pairs = self._pairs_diff = self._tokens = self._tokens_diff = 0
        self._token_diff: torch.Tensor | None = None
        self._counts: dict[int, torch.Tensor] = {}

    def _layout_for(self, n: int) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """(routes [n, layers, k] or None, valid [n]) for a forward of n tokens."""
        if not self._layouts:
            return None
        if self._select is not None:
            rows, length = self._select
            first = self._layouts[0]
            valid = first.valid[rows, :length].reshape(-1)
            routes = None if first.routes is None else first.routes[rows, :length]
            if valid.numel() == n:
                return (None if routes is None else routes.reshape(n, *routes.shape[2:]),
                        valid)
        for lay in self._layouts:
            if lay.valid.numel() == n:
                routes = None if lay.routes is None else lay.routes.reshape(
                    n, *lay.routes.shape[2:])
                return routes, lay.valid.reshape(-1)
            if int(lay.valid.sum()) == n:  # the real tokens only (a varlen forward)
                return (None if lay.routes is None else lay.routes[lay.valid]), \
                    torch.ones(n, dtype=torch.bool, device=lay.valid.device)
        sizes = [(tuple(lay.valid.shape), int(lay.valid.sum())) for lay in self._layouts]
        raise RuntimeError(f"routing: a router saw {n} tokens, matching none of the batch's "
                           f"layouts (shape, real tokens) {sizes}")

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits, weights, ids = output
            n = ids.shape[0]
            if self.record:
                self.recorded[layer] = ids.detach()
            layout = self._layout_for(n)
            if layout is None:
                return None
            routes, valid = layout
            valid = valid.to(ids.device)
            counts_ids = ids
            if routes is not None:
                given = routes[:, layer].to(device=ids.device, dtype=ids.dtype)
                has = (given[:, 0] != NO_ROUTE) & valid
                if not in_backward():
                    self._compare(ids, given, has, layer)
                if self.replay:
                    chosen = torch.where(has[:, None], given, ids)
                    new = replay_weights(module, logits, chosen).to(weights.dtype)
                    weights = torch.where(has[:, None], new, weights)
                    ids = counts_ids = chosen
                    output = (logits, weights, ids)
            if in_backward():  # a checkpointed layer's recompute: replayed, not counted again
                return output if self.replay and routes is not None else None
            self._count(layer, counts_ids, valid)
            if self.keep_logits and torch.is_grad_enabled():
                self._kept.append((layer, logits, ids.detach(), valid))
            return output if self.replay and routes is not None else None
        return hook

    def _compare(self, own: torch.Tensor, given: torch.Tensor, has: torch.Tensor,
                 layer: int) -> None:
        with torch.no_grad():
            differs = (own.sort(dim=-1).values != given.sort(dim=-1).values).any(-1) & has
            self._pairs += int(has.sum())
            self._pairs_diff += int(differs.sum())
            # a token differs when any MoE layer does: the layers of one forward are combined
            # at its last MoE layer
            if self._token_diff is None or self._token_diff.shape != differs.shape:
                self._token_diff, self._token_has = differs.clone(), has.clone()
            else:
                self._token_diff |= differs
                self._token_has |= has
            if layer == self.shape.moe_layers[-1]:
                self._tokens += int(self._token_has.sum())
                self._tokens_diff += int(self._token_diff.sum())
                self._token_diff = None

    def _count(self, layer: int, ids: torch.Tensor, valid: torch.Tensor) -> None:
        with torch.no_grad():
            sel = ids[valid].reshape(-1)
            counts = torch.bincount(sel, minlength=self.shape.num_experts).to("cpu",
                                                                                torch.float64)
            self._counts[layer] = self._counts.get(layer, 0) + counts


def in_backward() -> bool:
    """Whether this runs inside autograd's backward (a checkpointed layer's recompute)."""
    return torch._C._current_graph_task_id() != -1


def routes_array(recorded: dict[int, torch.Tensor], shape: MoeShape) -> torch.Tensor:
    """The recorded ids of one forward as [N, num_layers, k] (0 in layers without experts),
    SGLang's `routed_experts` layout."""
    some = next(iter(recorded.values()))
    out = torch.zeros((some.shape[0], shape.num_layers, shape.top_k), dtype=torch.int32,
                      device=some.device)
    for layer, ids in recorded.items():
        out[:, layer] = ids.to(torch.int32)
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoint names: transformers holds a layer's experts fused ([E, 2I, H] gate_up_proj, gate
# rows first, and [E, H, I] down_proj); checkpoint files, SGLang and the megatron converter name
# each expert's matrices. Pushes and exports use the checkpoint names.
# ---------------------------------------------------------------------------------------------

_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def _expert_parts(name: str, fused: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, view) of each expert matrix of a fused experts tensor."""
    prefix, kind = _FUSED.match(name).groups()
    if kind == "down_proj":
        for e in range(fused.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", fused[e]
        return
    half = fused.shape[1] // 2
    for e in range(fused.shape[0]):
        yield f"{prefix}.{e}.gate_proj.weight", fused[e, :half]
        yield f"{prefix}.{e}.up_proj.weight", fused[e, half:]


def checkpoint_tensors(named: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with every fused experts tensor split into its experts' matrices
    under their checkpoint names (views, no copy); other tensors as given."""
    for name, tensor in named:
        if _FUSED.match(name) and tensor.dim() == 3:
            yield from _expert_parts(name, tensor)
        else:
            yield name, tensor


def fused_expert_names(targets: dict[str, torch.Tensor]) -> set[str]:
    """The names of `targets` that are fused experts tensors (what `expert_views` splits)."""
    return {n for n, t in targets.items() if _FUSED.match(n) and t.dim() == 3}


def expert_views(targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views into the fused experts tensors of `targets` (name -> parameter) under their
    checkpoint names: copying into a view writes the fused parameter."""
    out: dict[str, torch.Tensor] = {}
    for name in fused_expert_names(targets):
        out.update(_expert_parts(name, targets[name]))
    return out


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors with each layer's per-expert matrices stacked into the fused
    tensors transformers holds (`checkpoint_tensors`' inverse); ValueError if a layer's experts
    are incomplete."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in weights.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = tensor
            continue
        prefix, e, kind = m.groups()
        groups.setdefault(prefix, {}).setdefault(kind, {})[int(e)] = tensor
    for prefix, kinds in groups.items():
        count = 1 + max(max(parts) for parts in kinds.values())
        for kind in ("gate_proj", "up_proj", "down_proj"):
            have = kinds.get(kind, {})
            if sorted(have) != list(range(count)):
                missing = sorted(set(range(count)) - set(have))
                raise ValueError(f"{prefix}: {kind} of experts {missing[:8]} missing (a layer's "
                                 f"experts load together)")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]]) for e in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([kinds["down_proj"][e] for e in range(count)])
    return out
