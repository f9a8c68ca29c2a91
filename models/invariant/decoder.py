"""The project's own forward of a Qwen2/Qwen3/Llama-style causal LM, on invariant operators.

`InvariantDecoder(model)` reads the transformers module's weights at every call (so in-place
weight updates, releases and reloads are seen) and computes what the module computes, with
every reduction done by models/invariant/ops.py. Sequences are laid out from position 0
(right-padded batches, a KV cache indexed by position), never left-padded, and no reduction ever
runs over another row or over padding, so for the same weights and tokens:
- the trainer's forward (`token_logprobs`, with gradients) on a right-padded micro-batch,
- the worker's prefill (`prefill`) of a right-padded wave, and
- the worker's cached decode (`decode`: one token per row over its KV cache)
give bitwise the same logits, hence (through `ops.log_softmax`) the same log-probs, whatever the
batch size, padding, cache capacity or position. Supported: Qwen2 (q/k/v bias), Qwen3 (q/k
RMSNorm), Llama (rope scaling baked into `inv_freq`); sliding-window attention is refused.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from models.invariant import ops

SUPPORTED = ("qwen2", "qwen3", "llama")
CACHE_STEP = 64  # KV-cache capacity grows in steps of this many positions


def check_supported(model) -> None:
    """ValueError naming what is not covered, unless `model` is a decoder this forward serves."""
    config = model.config
    kind = getattr(config, "model_type", "?")
    if kind not in SUPPORTED:
        raise ValueError(f"true_on_policy: the invariant forward covers {SUPPORTED} decoders, not "
                         f"model_type {kind!r}")
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError("true_on_policy: sliding-window attention is not covered")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"true_on_policy: activation {config.hidden_act!r} is not covered (silu)")
    rotary = model.model.rotary_emb
    if getattr(rotary, "rope_type", "default") == "dynamic":
        raise ValueError("true_on_policy: dynamic RoPE scaling is not covered")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim & (head_dim - 1):
        raise ValueError(f"true_on_policy: head_dim {head_dim} is not a power of two")


class KVCache:
    """Per layer, keys and values [B, capacity, Hkv, D] indexed by position; spare capacity is
    never read (attention stops at each query's position)."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              need: int) -> None:
        """k, v [B, L, Hkv, D] of `positions` [B, L]; `need` = the largest position + 1."""
        b = k.shape[0]
        buf = self.k[layer]
        if buf is None or buf.shape[1] < need:
            cap = -(-need // CACHE_STEP) * CACHE_STEP
            for store in (self.k, self.v):
                new = k.new_zeros((b, cap) + tuple(k.shape[2:]))
                if store[layer] is not None:
                    new[:, :store[layer].shape[1]] = store[layer]
                store[layer] = new
        rows = torch.arange(b, device=k.device)[:, None]
        self.k[layer][rows, positions] = k
        self.v[layer][rows, positions] = v

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows `index` (finished sequences dropped)."""
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t[index]


class InvariantDecoder:
    """The invariant forward of one transformers causal LM (see the module docstring)."""

    def __init__(self, model):
        check_supported(model)
        self.model = model
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.head_dim = (getattr(config, "head_dim", None)
                         or config.hidden_size // config.num_attention_heads)
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ pieces
    def _rope(self, positions: torch.Tensor, need: int, dtype: torch.dtype):
        """cos, sin [*positions.shape, 1, D] in `dtype` (a table per device and dtype, grown in
        steps; each entry depends on its position alone); `need` > every position."""
        rotary = self.model.model.rotary_emb
        key = (positions.device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < need:
            size = -(-need // CACHE_STEP) * CACHE_STEP
            kern = ops.kernels(positions.device)
            cos, sin = kern.cos_sin(torch.arange(size, device=positions.device), rotary.inv_freq,
                                    float(getattr(rotary, "attention_scaling", 1.0)))
            table = (cos.to(dtype), sin.to(dtype))
            self._tables[key] = table
        return table[0][positions].unsqueeze(-2), table[1][positions].unsqueeze(-2)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def hidden(self, ids: torch.Tensor, start: torch.Tensor, cache: KVCache | None = None,
               prefill: bool = True) -> torch.Tensor:
        """Final hidden states (before the last norm) [B, L, H] of tokens `ids` [B, L] at
        positions start[b] + i. With `cache`, each layer's keys/values are written to it;
        `prefill=False` attends over the cache (decode), else over the fresh keys."""
        inner = self.model.model
        b, length = ids.shape
        x = F.embedding(ids, inner.embed_tokens.weight)
        positions = start[:, None] + torch.arange(length, device=ids.device)[None, :]
        need = int(start.max()) + length if b else length  # the one host sync of a forward
        cos, sin = self._rope(positions, need, x.dtype)
        start32 = start.to(torch.int32)
        hq, hkv, d = self.num_heads, self.num_kv, self.head_dim
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = ops.rmsnorm(x, layer.input_layernorm.weight, self.eps)
            q = ops.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(b, length, hq, d)
            k = ops.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(b, length, hkv, d)
            v = ops.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(b, length, hkv, d)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before RoPE
                q = ops.rmsnorm(q, attn.q_norm.weight, self.eps)
                k = ops.rmsnorm(k, attn.k_norm.weight, self.eps)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            if cache is not None:
                cache.write(i, k, v, positions, need)
            if cache is not None and not prefill:
                keys, values = cache.k[i].transpose(1, 2), cache.v[i].transpose(1, 2)
            else:
                keys, values = k.transpose(1, 2), v.transpose(1, 2)
            o = ops.attention(q.transpose(1, 2), keys, values, start32, self.scale)
            x = x + ops.linear(o.reshape(b, length, hq * d), attn.o_proj.weight,
                               attn.o_proj.bias)
            h = ops.rmsnorm(x, layer.post_attention_layernorm.weight, self.eps)
            act = ops.silu_mul(ops.linear(h, mlp.gate_proj.weight),
                               ops.linear(h, mlp.up_proj.weight))
            x = x + ops.linear(act, mlp.down_proj.weight)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [..., V] of final hidden states [..., H] (last norm, LM head)."""
        h = ops.rmsnorm(hidden, self.model.model.norm.weight, self.eps)
        head = self.model.lm_head
        return ops.linear(h, head.weight, getattr(head, "bias", None), torch.float32)

    # ------------------------------------------------------------------ the three uses
    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       temperature: float, with_entropy: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The trainer's pass: [B, T-1] log p(ids[:, t+1] | ids[:, :t+1]) at `temperature` (and
        entropies), gradients flowing. Rows must be right-padded (mask a prefix of ones);
        entries whose target is padding are meaningless, as in algos.logprobs."""
        b, length = input_ids.shape
        if attention_mask is not None and attention_mask.shape[1] > 1:
            mask = attention_mask.long()
            if bool((mask[:, 1:] > mask[:, :-1]).any()):
                raise ValueError("the invariant forward takes right-padded rows (each sequence "
                                 "from position 0); got padding before a token")
        start = torch.zeros(b, dtype=torch.long, device=input_ids.device)
        hidden = self.hidden(input_ids, start)[:, :-1]
        logp = ops.log_softmax(self.logits(hidden), temperature)  # [B, T-1, V]
        token = logp.gather(-1, input_ids[:, 1:, None])[..., 0]
        entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
        return token, entropy

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, keep: int
                ) -> tuple[torch.Tensor, KVCache]:
        """The worker's first pass over a wave: `ids` [B, L] right-padded, `lengths` [B].
        Returns float32 logits [B, keep, V] of each row's last `keep` positions (entries before
        a row's first token are filler) and the KV cache of every row's tokens."""
        b = ids.shape[0]
        cache = KVCache(len(self.model.model.layers))
        start = torch.zeros(b, dtype=torch.long, device=ids.device)
        hidden = self.hidden(ids, start, cache, prefill=True)
        cols = (lengths[:, None] - keep + torch.arange(keep, device=ids.device)[None, :]).clamp(
            min=0)
        rows = hidden.gather(1, cols[:, :, None].expand(-1, -1, hidden.shape[-1]))
        return self.logits(rows), cache

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache
               ) -> torch.Tensor:
        """One step: token ids [B] at positions [B] over `cache` (positions 0 .. p-1 of each
        row) -> float32 logits [B, V]; the cache gains the new tokens."""
        hidden = self.hidden(ids[:, None], positions, cache, prefill=False)
        return self.logits(hidden[:, 0])


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FLAG = "_rlx_true_on_policy"


def decoder_for(model) -> InvariantDecoder:
    """The (cached) invariant forward of `model`."""
    dec = _DECODERS.get(model)
    if dec is None:
        dec = _DECODERS[model] = InvariantDecoder(model)
    return dec


def enable(model) -> None:
    """Mark `model` so that the trainer's log-prob passes (training.aux_models) use the
    invariant forward; raises ValueError when the architecture is not covered. Copies of the
    model (reference, old-actor snapshots) carry the mark."""
    decoder_for(model)
    setattr(model, _FLAG, True)


def is_enabled(model) -> bool:
    return bool(getattr(model, _FLAG, False))
