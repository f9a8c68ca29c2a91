"""Named tiny causal LMs built in code, for tests and CPU demos.

Role: `build_tiny(name, seed)` gives a randomly initialised Qwen2/Qwen3/Qwen3-MoE-architecture model and the
character tokenizer, with no download. Invariant: the same (name, seed) always gives bit-identical
weights, and the configs in `TINY` are never mutated (callers get deep copies).
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from models.tokenizer import SPECIALS, build_char_tokenizer, char_vocab

_COMMON = dict(
    vocab_size=len(char_vocab()),
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    pad_token_id=SPECIALS.index("<pad>"),
    bos_token_id=SPECIALS.index("<bos>"),
    eos_token_id=SPECIALS.index("<eos>"),
)

TINY: dict[str, PretrainedConfig] = {
    "tiny-qwen2": Qwen2Config(**_COMMON),
    "tiny-qwen3": Qwen3Config(head_dim=16, **_COMMON),
    # a mixture of experts: 4 experts of width 64 per layer, 2 routed per token (Qwen3-MoE)
    "tiny-qwen3-moe": Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=64, norm_topk_prob=True,
                                     **_COMMON),
    # Qwen2-0.5B's layer shapes with the character vocabulary (358M parameters): for GPU
    # throughput benchmarks of the whole loop, random init
    "qwen2-0.5b-shape": Qwen2Config(**{**_COMMON, "hidden_size": 896, "num_hidden_layers": 24,
                                       "num_attention_heads": 14, "num_key_value_heads": 2,
                                       "intermediate_size": 4864,
                                       "max_position_embeddings": 512}),
}


def tiny_config(name: str) -> PretrainedConfig:
    """A private copy of the named config; KeyError names the known ones."""
    if name not in TINY:
        raise KeyError(f"unknown tiny model {name!r}; known: {sorted(TINY)}")
    return copy.deepcopy(TINY[name])


def build_tiny(name: str, seed: int = 0):
    """(model, tokenizer) for a tiny model, initialised deterministically from `seed`."""
    config = tiny_config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval(), build_char_tokenizer()
