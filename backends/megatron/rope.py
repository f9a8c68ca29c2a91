"""RoPE's cos and sin made once per forward, not in every attention layer.

Role: megatron-core 0.16.1 without Transformer Engine makes the rotary angle table [s, 1, 1, d]
once per forward (RotaryEmbedding) and hands it to every attention layer, whose
`apply_rotary_pos_emb` (rope_utils `_apply_rotary_pos_emb_bshd`) evaluates cos and sin of it
there: in each layer, and inside a compiled layer for every element of the query and the key (a
pointwise kernel of its own that evaluates the trig functions; measured in docs/training.md).
`table_rope` turns a GPTModel's rotary module into `CosSinRotary`, whose forward returns the
cos and sin of that same table once, stacked [s, 1, 1, 2, d] (float32); `install` routes such a
table, where megatron's attention applies RoPE, to `apply_table`, which rotates as megatron's
function does (mscale, the cast to the query's dtype, rotate-half, interleaved or not, the
dimensions past the rotary ones untouched) from the precomputed values, and hands every other
argument to megatron's own function unchanged. The rotation is computed in float32 and rounded
once to the query's dtype (megatron rounds each product to it): inside a compiled layer the
no-grad and the training graphs fuse RoPE differently (into FlexAttention's kernel in one of
them, seen in an H200 profile), and products rounded to bf16 in one graph and not in the other
would make the recompute's log-probs differ from the policy pass's at the same weights.

Invariant: the same function as megatron's path (the same float32 angles, cos and sin of
them; in float32 the same values): tests/test_megatron_model.py compares logits and
gradients. Packed sequences in megatron's THD format (`cu_seqlens`) never reach it: the
backend does not build them, and a table given with them is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.megatron.mcore import megatron_attention as _attention
from backends.megatron.mcore import rotary_pos_embedding as _rotary

_ORIGINAL: dict[str, Any] = {}


class CosSinRotary(_rotary.RotaryEmbedding):
    """A RotaryEmbedding whose forward gives cos and sin of its angle table, stacked on a new
    second-to-last axis ([s, 1, 1, 2, d], float32), for `apply_table`."""

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: Any = None) -> torch.Tensor:
        angles = super().forward(max_seq_len, offset, packed_seq, cp_group)
        return torch.stack((angles.cos(), angles.sin()), dim=-2)


def is_table(freqs: Any) -> bool:
    return isinstance(freqs, torch.Tensor) and freqs.dim() == 5 and freqs.shape[-2] == 2


def apply_table(t: torch.Tensor, freqs: torch.Tensor, config: Any, cu_seqlens: Any = None,
                mscale: float = 1.0, cp_group: Any = None) -> torch.Tensor:
    """megatron's `apply_rotary_pos_emb` signature: RoPE on `t` [s, b, heads, d] from a
    `CosSinRotary` table; any other `freqs`, megatron's own function."""
    if not is_table(freqs):
        return _ORIGINAL["apply_rotary_pos_emb"](t, freqs, config, cu_seqlens, mscale, cp_group)
    if cu_seqlens is not None or config.multi_latent_attention:
        raise ValueError("the precomputed RoPE table takes no THD packed sequences and no "
                         "multi-latent attention")
    cos, sin = freqs.unbind(-2)
    rot = cos.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    # in float32, rounded once to t's dtype: a compiled layer's no-grad and training graphs
    # may fuse this differently (into the attention kernel or not), which would otherwise
    # round the products to bf16 in one and not in the other
    xf = x.float()
    out = xf * (cos * mscale) + _rotate_half(xf, config.rotary_interleaved) * (sin * mscale)
    return torch.cat((out.to(t.dtype), rest), dim=-1)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[-x2, x1] of the halves (interleaved: of the odd and even components, pairwise)."""
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1)
    return pairs.flatten(-2)


def install() -> None:
    """Route megatron's attention's RoPE through `apply_table` (once per process; every other
    table still goes to megatron's function)."""
    if "apply_rotary_pos_emb" not in _ORIGINAL:
        _ORIGINAL["apply_rotary_pos_emb"] = _attention.apply_rotary_pos_emb
        _attention.apply_rotary_pos_emb = apply_table


def table_rope(gpt: Any) -> bool:
    """Make `gpt`'s rotary module a `CosSinRotary` where it is megatron's plain RotaryEmbedding
    and RoPE is applied unfused (no Transformer Engine kernel); returns whether it did."""
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if type(rotary) is not _rotary.RotaryEmbedding or gpt.config.apply_rope_fusion \
            or gpt.config.multi_latent_attention or gpt.config.flash_decode:
        return False
    install()
    rotary.__class__ = CosSinRotary  # same attributes, only its forward differs
    return True


__all__ = ["CosSinRotary", "apply_table", "install", "is_table", "table_rope"]
