"""A mixture-of-experts model's expert layout, read from its HF config (no torch: the rollout
and the launcher read it).

`moe_shape(config)` takes a transformers config object (or any object with its attributes,
e.g. a config.json read into a namespace) and gives the expert layout of Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3 and GLM-4.5 models (experts, top-k, which layers have them); None for a dense model.
`TINY_MOE` is the layout of the built-in tiny MoE models (models/tiny.py; a test keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoeShape:
    num_layers: int  # decoder layers (the routes' layer axis, MoE or not)
    moe_layers: tuple[int, ...]  # layers with routed experts
    num_experts: int
    top_k: int


def moe_shape(config: Any) -> MoeShape | None:
    """The expert layout of an HF config, None for a dense model."""
    cfg = getattr(config, "text_config", None) or config
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None) \
        or getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not experts or not top_k:
        return None
    layers = cfg.num_hidden_layers
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    first_dense = getattr(cfg, "first_k_dense_replace", 0) or 0
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    moe = tuple(i for i in range(layers)
                if i not in dense and i >= first_dense and (i + 1) % step == 0)
    return MoeShape(layers, moe, int(experts), int(top_k))


TINY_MOE = {"tiny-qwen3-moe": MoeShape(num_layers=2, moe_layers=(0, 1), num_experts=4, top_k=2)}
