"""Context parallelism (megatron's `context_parallel_size`) without Transformer Engine.

Role: megatron-core's local `DotProductAttention` refuses context_parallel_size > 1; this module
gives the local layer spec a core attention that accepts it, and the helpers that cut a
micro-batch into the context-parallel ranks' pieces and put per-token outputs back together.

Layout (megatron's load-balanced split, the one its RoPE assumes): a sequence of length S (a
multiple of 2 * cp) is cut into 2 * cp equal chunks; CP rank r holds chunks r and 2 * cp - 1 - r,
in that order, so every rank gets the same share of the causal work. Megatron's
`RotaryEmbedding` computes the embedding of the whole S and keeps this rank's two chunks
(`get_pos_emb_on_this_cp_rank`), so the model sees each token at its global position.

`ContextParallelAttention` (through `cp_layer_spec`): this rank's queries [s, b, heads, d] attend
over the whole sequence. Keys and values are all-gathered over the CP group (before the GQA
expansion, so num_query_groups heads travel) and put in global order by an autograd function
whose backward reduce-scatters (sums) their gradients back to the ranks that own them; the
scores go through torch's scaled_dot_product_attention (or megatron's masked softmax, where
dropout, a softmax offset or layer scaling ask for it); the mask is built from global
positions: causal, plus the attention mask the model passes, in one of three shapes (True =
may not attend, megatron's convention):
  [b|1, 1, 1, S]  keys that may not be attended (padding), the compact form `split_batch` gives;
  [b|1, 1, s, S]  this rank's query rows against every key (global order);
  [b|1, 1, S, S]  the whole sequence's mask (global order; this rank's rows are taken).
At cp = 1 the forward is megatron's DotProductAttention itself (a compact mask is widened with
the causal part first), so the results are identical.

Inputs and outputs: `split_batch` / `split_for_cp` take a micro-batch's [B, T] tensors to this
rank's [B, S / cp] pieces (T padded up to S, a multiple of 2 * cp); `gather_from_cp` puts a
per-token tensor [B, S / cp, ...] (logits, or the cheaper per-token log-probs of
`local_token_logprobs`) back into global order [B, T, ...]; `cp_logits` is the three together
(a model's whole-sequence logits, what the trainer's forward returns).
Gradient convention: `gather_from_cp`'s backward hands each rank the gradient of its own
positions, so a loss computed on the gathered tensor, the same on every CP rank, leaves on each
rank the part of the parameter gradients that flows through its tokens; their SUM over the CP
group is the whole gradient. (Megatron's DDP reduces over the data-parallel-with-CP group, as
a mean unless calculate_per_token_loss: there such a loss is scaled by cp.)
Invariant: at any cp the gathered outputs and the CP-summed gradients equal those of cp = 1 up
to float summation order.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from algos.logprobs import (
    document_block_mask,
    document_mask_function,
    gather_logprobs,
    logits_to_logprobs,
)
from backends.megatron.mcore import parallel_state, tensor_parallel

with warnings.catch_warnings():  # megatron-core is imported by mcore above; no new warnings
    warnings.simplefilter("ignore")
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.utils import attention_mask_func, is_layer_window_attention

if TYPE_CHECKING:  # flex_attention imports torch._dynamo (~0.4 s): where it is used
    from torch.nn.attention.flex_attention import BlockMask


# ---------------------------------------------------------------------------------------------
# the load-balanced layout


def padded_length(length: int, cp: int) -> int:
    """`length` rounded up to a multiple of 2 * cp (two chunks per rank); at cp = 1 itself."""
    if cp < 1 or length < 0:
        raise ValueError(f"context parallelism needs cp >= 1 and a length >= 0, got cp = {cp}, "
                         f"length = {length}")
    if cp == 1:
        return length
    step = 2 * cp
    return -(-length // step) * step


def positions(length: int, cp: int, rank: int, device: torch.device | str | None = None
              ) -> torch.Tensor:
    """Global positions (long [length / cp]) held by CP rank `rank` of a sequence of `length`
    tokens: chunks rank and 2 * cp - 1 - rank of 2 * cp equal chunks (at cp = 1 all of them).
    ValueError when 2 * cp does not divide `length` (pad it with `padded_length` first) or the
    rank is out of range."""
    if not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {rank} is not in 0..{cp - 1}")
    if cp == 1:
        return torch.arange(length, device=device)
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens cannot be split over cp = {cp} ranks: "
                         f"the load-balanced split needs a multiple of 2 * cp = {2 * cp} "
                         f"(pad to {padded_length(length, cp)}; split_for_cp does)")
    chunk = length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def _cp_group_rank(group) -> tuple[Any, int, int]:
    """(group, size, rank) of `group`, or of megatron's CP group when None (size 1, rank 0 when
    neither torch.distributed nor megatron's parallel state is initialized)."""
    if group is None:
        if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
            return None, 1, 0
        group = parallel_state.get_context_parallel_group()
    return group, dist.get_world_size(group), dist.get_rank(group)


def split_for_cp(x: torch.Tensor, dim: int = 1, pad_value: float | int | bool = 0,
                 group=None) -> torch.Tensor:
    """This CP rank's piece of `x` along `dim` (the sequence): padded with `pad_value` up to a
    multiple of 2 * cp, then chunks rank and 2 * cp - 1 - rank. At cp = 1: `x` itself."""
    _, cp, rank = _cp_group_rank(group)
    if cp == 1:
        return x
    dim = dim % x.dim()
    length = x.shape[dim]
    total = padded_length(length, cp)
    if total > length:
        pad_shape = list(x.shape)
        pad_shape[dim] = total - length
        x = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=dim)
    return x.index_select(dim, positions(total, cp, rank, x.device))


def key_padding_mask(attention_mask: torch.Tensor, cp: int) -> torch.Tensor:
    """[B, T] 1 = token -> [B, 1, 1, S] bool, True for keys that may not be attended (padding,
    and the positions T..S-1 added to reach S = padded_length(T, cp)): the compact mask of
    `ContextParallelAttention` (causality is added there by global position). Every CP rank
    passes the same, whole-sequence mask."""
    length = attention_mask.shape[1]
    total = padded_length(length, cp)
    blocked = ~attention_mask.bool()
    if total > length:
        blocked = torch.cat([blocked, blocked.new_ones(blocked.shape[0], total - length)], 1)
    return blocked[:, None, None, :]


class CPBatch(NamedTuple):
    """A micro-batch as this CP rank feeds the model (`split_batch`)."""

    input_ids: torch.Tensor  # [B, S / cp] this rank's tokens (pad_id past T)
    position_ids: torch.Tensor  # [B, S / cp] their global positions (RoPE slices by itself)
    attention_mask: torch.Tensor  # [B, 1, 1, S] bool, True = key not attended (whole sequence)
    labels: torch.Tensor | None  # [B, S / cp] this rank's labels (pad_id past T), or None
    length: int  # T, the micro-batch's length before padding (gather_from_cp's `length`)


def split_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, pad_id: int = 0, group=None) -> CPBatch:
    """A [B, T] micro-batch (input_ids, attention_mask 1 = token, optional per-position labels,
    e.g. `next_token_labels`) as this CP rank's pieces: T padded to S, a multiple of 2 * cp,
    with `pad_id` tokens that the mask blocks. At cp = 1 the tensors keep their length (the
    mask is still the compact [B, 1, 1, T] one)."""
    _, cp, rank = _cp_group_rank(group)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape or (labels is not None
                                                   and labels.shape != input_ids.shape):
        raise ValueError(f"split_batch needs [B, T] tensors of one shape: input_ids "
                         f"{tuple(input_ids.shape)}, attention_mask "
                         f"{tuple(attention_mask.shape)}, labels "
                         f"{None if labels is None else tuple(labels.shape)}")
    length = input_ids.shape[1]
    pos = positions(padded_length(length, cp), cp, rank, input_ids.device)
    return CPBatch(
        input_ids=split_for_cp(input_ids, 1, pad_id, group),
        position_ids=pos.expand(input_ids.shape[0], -1),
        attention_mask=key_padding_mask(attention_mask, cp),
        labels=None if labels is None else split_for_cp(labels, 1, pad_id, group),
        length=length)


def next_token_labels(input_ids: torch.Tensor, pad_id: int = 0) -> torch.Tensor:
    """[B, T] -> [B, T]: position t's label is token t + 1 (the last position gets `pad_id`).
    Shifted on the whole sequence, before `split_batch`: the next token of a rank's last
    position may live on another rank."""
    return torch.cat([input_ids[:, 1:], input_ids.new_full((input_ids.shape[0], 1), pad_id)], 1)


def local_token_logprobs(logits: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probs [B, s] (float32) of this rank's `labels` [B, s] under its logits
    [B, s, V] (algos.logprobs' formula): what to gather instead of the logits (V times less)."""
    return gather_logprobs(logits_to_logprobs(logits, temperature), labels)


# ---------------------------------------------------------------------------------------------
# collectives in global order


def _gather_global(x: torch.Tensor, dim: int, group, cp: int) -> torch.Tensor:
    """Every CP rank's piece of x along `dim`, in global order (chunk c of 2 * cp)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x, group=group)
    half = x.shape[dim] // 2
    chunks = [parts[c].narrow(dim, 0, half) if c < cp
              else parts[2 * cp - 1 - c].narrow(dim, half, half) for c in range(2 * cp)]
    return torch.cat(chunks, dim)


def _own_pieces(x: torch.Tensor, dim: int, cp: int) -> list[torch.Tensor]:
    """A global-order tensor cut into the CP ranks' pieces (rank order)."""
    chunks = x.chunk(2 * cp, dim)
    return [torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim) for r in range(cp)]


def _reduce_scatter_global(grad: torch.Tensor, dim: int, group, cp: int, rank: int
                           ) -> torch.Tensor:
    """The sum over CP ranks of `grad` (global order), this rank's piece of it."""
    pieces = _own_pieces(grad, dim, cp)
    out = torch.empty_like(pieces[rank])
    dist.reduce_scatter(out, [p.contiguous() for p in pieces], group=group)
    return out


class _GatherKeyValue(torch.autograd.Function):
    """All-gather of every CP rank's keys or values (sequence dim 0) in global order; backward:
    the gradients summed over CP ranks, each rank getting those of its own positions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, cp: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.cp, ctx.rank = group, cp, rank
        return _gather_global(x, 0, group, cp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_global(grad, 0, ctx.group, ctx.cp, ctx.rank), None, None, None


class _GatherOutputs(torch.autograd.Function):
    """All-gather of per-token outputs in global order; backward: this rank's positions of the
    gradient (a loss computed identically on every CP rank; module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, cp: int, rank: int) -> torch.Tensor:
        ctx.dim, ctx.cp, ctx.rank = dim, cp, rank
        return _gather_global(x, dim, group, cp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_own_pieces(grad, ctx.dim, ctx.cp)[ctx.rank].contiguous(), None, None, None,
                None)


def gather_from_cp(x: torch.Tensor, dim: int = 1, length: int | None = None,
                   group=None) -> torch.Tensor:
    """This CP rank's per-token tensor (its S / cp positions along `dim`: logits [B, s, V],
    log-probs [B, s], ...) -> the whole sequence's, in global order, cut to `length` (T;
    None = S). Backward: the gradient of this rank's positions only, so a loss computed on the
    result (the same on every CP rank) gives parameter gradients whose sum over the CP group is
    the cp = 1 gradient. At cp = 1: `x` (cut to `length`)."""
    group, cp, rank = _cp_group_rank(group)
    dim = dim % x.dim()
    if cp > 1:
        if x.shape[dim] % 2:
            raise ValueError(f"gather_from_cp: {x.shape[dim]} positions along dim {dim} cannot "
                             f"be this rank's two chunks (split_for_cp gives an even count)")
        x = _GatherOutputs.apply(x, dim, group, cp, rank)
    return x if length is None else x.narrow(dim, 0, length)


def cp_logits(module: torch.nn.Module, input_ids: torch.Tensor,
              attention_mask: torch.Tensor | None = None, pad_id: int = 0) -> torch.Tensor:
    """Logits [B, T, V] of a GPTModel (or its Float16Module; a whole model, no pipeline stage)
    for a [B, T] micro-batch (attention_mask 1 = token), each CP rank running its share:
    `split_batch`, the forward (vocabulary gathered over the tensor ranks), `gather_from_cp`.
    Collective over megatron's CP group; the gradient convention of `gather_from_cp`. At
    cp = 1 the one forward with the whole [B, 1, T, T] mask (causal and padding), which any
    local-spec model takes, ContextParallelAttention or not."""
    _, cp, _ = _cp_group_rank(None)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if cp == 1:
        length = input_ids.shape[1]
        pos = torch.arange(length, device=input_ids.device)
        mask = _blocked_rows(key_padding_mask(attention_mask, 1), length, pos, True)
        return module(input_ids, pos.expand_as(input_ids), mask, runtime_gather_output=True)
    batch = split_batch(input_ids, attention_mask, pad_id=pad_id)
    local = module(batch.input_ids, batch.position_ids, batch.attention_mask,
                   runtime_gather_output=True)
    return gather_from_cp(local, 1, batch.length)


# ---------------------------------------------------------------------------------------------
# the core attention


class ContextParallelAttention(DotProductAttention):
    """megatron-core's DotProductAttention (same constructor and forward) that also runs with
    context_parallel_size > 1: this rank's queries against the whole sequence's keys and values
    (module docstring). `cp_comm_type` is accepted and ignored (the exchange is an all-gather).
    At cp > 1 the scores go through torch's scaled_dot_product_attention when that computes the
    same function (`use_sdpa`, no dropout, softmax offset or layer scaling), else through
    megatron's masked softmax on the explicit [b, heads, s, S] scores."""

    use_sdpa = True  # at cp > 1, torch's fused attention where it applies (_fused_ok)
    # at cp = 1 too, on CUDA (None) or always (True): torch's memory-efficient kernel takes the
    # mask and keeps no [b, heads, s, s] scores, where megatron's local attention (without
    # Transformer Engine) makes them and their softmax in the step's memory
    sdpa_at_cp1: bool | None = None
    flex_packed = True  # CUDA, half precision: the model hands block masks (flex_applies)

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None):
        cp = config.context_parallel_size
        _check_heads(config, pg_collection)
        # megatron's constructor refuses cp > 1: it builds everything from a copy that says 1
        # (a shallow copy: no __post_init__ re-run), and the module keeps the real config
        single = copy.copy(config)
        single.context_parallel_size = 1
        super().__init__(single, layer_number, attn_mask_type, attention_type,
                         attention_dropout, softmax_scale, cp_comm_type, pg_collection)
        self.config = config
        group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if group is None:
            group = parallel_state.get_context_parallel_group(check_initialized=False)
        size = 1 if group is None else dist.get_world_size(group)
        if size != cp:
            raise ValueError(f"context_parallel_size = {cp} in the TransformerConfig but the "
                             f"context-parallel group has {size} ranks: build the config and "
                             f"megatron's parallel state with the same context_parallel_size")
        self.cp_size, self.cp_group = cp, group
        self.cp_rank = dist.get_rank(group) if cp > 1 else 0
        if cp > 1 and is_layer_window_attention(config.window_size,
                                                config.window_attn_skip_freq, layer_number):
            raise ValueError("sliding-window attention is not supported with context "
                             "parallelism (ContextParallelAttention)")
        coeff = self.layer_number if config.apply_query_key_layer_scaling else None
        # this rank's queries against all keys: an explicit mask, never the square causal one
        self.cp_softmax = FusedScaleMaskSoftmax(
            input_in_fp16=config.fp16, input_in_bf16=config.bf16,
            attn_mask_type=AttnMaskType.padding,
            scaled_masked_softmax_fusion=config.masked_softmax_fusion,
            mask_func=attention_mask_func, softmax_in_fp32=config.attention_softmax_in_fp32,
            scale=coeff, window_size=None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """query [s, b, heads, d], key / value [s, b, groups, d] (this rank's positions) ->
        context [s, b, heads * d]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("ContextParallelAttention takes no packed sequences nor attention "
                             "bias (like megatron's DotProductAttention)")
        causal = self.attn_mask_type == AttnMaskType.causal
        # not a tensor: FlexAttention's BlockMask, made once per forward (flex_block_mask)
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            if not (self.cp_size == 1 and causal and self._fused_ok()):
                raise ValueError("a FlexAttention block mask is for causal attention at "
                                 "context_parallel_size = 1 without dropout, softmax offset or "
                                 "query-key layer scaling; pass the dense mask")
            return _flex(query, key, value, attention_mask, self.softmax_scale,
                         self.hidden_size_per_partition)
        if self.cp_size == 1 and self._fused_ok() and (
                query.is_cuda if self.sdpa_at_cp1 is None else self.sdpa_at_cp1):
            return self._whole_sdpa(query, key, value, attention_mask, causal)
        if self.cp_size == 1:
            if attention_mask is not None and attention_mask.shape[2] == 1 and causal \
                    and query.shape[0] > 1:  # the compact form: the causal part added here
                attention_mask = _blocked_rows(attention_mask, key.shape[0],
                                               torch.arange(query.shape[0],
                                                            device=query.device), True)
            return super().forward(query, key, value, attention_mask)
        return self._forward_cp(query, key, value, attention_mask, causal)

    def _forward_cp(self, query, key, value, attention_mask, causal: bool):
        cp, rank = self.cp_size, self.cp_rank
        sq, b, heads, d = query.shape
        if sq % 2 or key.shape[0] != sq or value.shape[0] != sq:
            raise ValueError(f"context parallelism: this rank's query / key / value lengths "
                             f"({sq}, {key.shape[0]}, {value.shape[0]}) must be equal and even "
                             f"(two chunks of a sequence split with split_for_cp)")
        total = sq * cp
        q_pos = positions(total, cp, rank, query.device)
        blocked = _blocked_rows(attention_mask, total, q_pos, causal)  # [b|1, 1, sq, S]
        key = _GatherKeyValue.apply(key, self.cp_group, cp, rank)  # [S, b, groups, d]
        value = _GatherKeyValue.apply(value, self.cp_group, cp, rank)
        repeat = heads // self.num_query_groups_per_partition
        if repeat > 1:  # expanded after the exchange (so groups travel, not heads)
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        if self._fused_ok():
            return self._sdpa(query, key, value, blocked, q_pos)

        q = query.reshape(sq, b * heads, d).transpose(0, 1)  # [b * heads, sq, d]
        k = key.reshape(total, b * heads, d).transpose(0, 1)  # [b * heads, S, d]
        scores = torch.baddbmm(q.new_empty(b * heads, sq, total), q, k.transpose(1, 2),
                               beta=0.0, alpha=self.softmax_scale)
        probs = self.cp_softmax(scores.view(b, heads, sq, total),
                                blocked.expand(b, 1, sq, total), self.softmax_offset)
        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        else:
            probs = self.attention_dropout(probs)
        v = value.reshape(total, b * heads, -1).transpose(0, 1)  # [b * heads, S, d]
        context = torch.bmm(probs.view(b * heads, sq, total), v)
        context = context.view(b, heads, sq, -1).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, self.hidden_size_per_partition)

    def _whole_sdpa(self, query, key, value, attention_mask, causal: bool):
        """cp = 1 through torch's scaled_dot_product_attention: every query against the whole
        sequence, the mask (any of the module docstring's shapes) or'ed with the causal one.
        (On CUDA in half precision the model hands the layers FlexAttention's block mask
        instead, model.py `layer_mask`: `forward` sends it to `_flex`.)"""
        sq = query.shape[0]
        q_pos = torch.arange(sq, device=query.device)
        blocked = _blocked_rows(attention_mask, sq, q_pos, causal)
        repeat = query.shape[2] // self.num_query_groups_per_partition
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        return self._sdpa(query, key, value, blocked, q_pos)

    def _fused_ok(self) -> bool:
        """Whether torch's scaled_dot_product_attention computes what megatron's softmax path
        would: no dropout to draw, no softmax offset, no query-key layer scaling."""
        return (self.use_sdpa and self.softmax_offset is None
                and not self.config.apply_query_key_layer_scaling
                and (self.attention_dropout.p == 0.0 or not self.training))

    def _sdpa(self, query, key, value, blocked, q_pos):
        """The attention through torch's fused kernels (on CUDA the memory-efficient one takes
        a mask: no score matrix kept; keys and values come expanded to the query heads, which
        that kernel needs). A query that may attend to no key at all (a padding row) is let
        see itself, where megatron's softmax path averages over every key: such rows are
        padding, their outputs unused."""
        sq, b, heads, _ = query.shape
        allowed = ~blocked  # [b|1, 1, sq, S], True = may attend (torch's convention)
        itself = torch.arange(allowed.shape[-1], device=q_pos.device)[None, :] == q_pos[:, None]
        allowed = allowed | (~allowed.any(-1, keepdim=True) & itself)
        out = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            attn_mask=allowed, scale=self.softmax_scale)  # [b, heads, sq, d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


_FLEX: dict[str, Any] = {}  # the compiled kernel


def flex_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention with a full [b, 1, s, s] mask runs through FlexAttention: on CUDA, in
    half precision, heads of at least 64 dimensions (ContextParallelAttention.flex_packed)."""
    return (ContextParallelAttention.flex_packed and device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16) and head_dim >= 64)


def flex_block_mask(blocked: torch.Tensor | None, documents: bool = True,
                    docs: torch.Tensor | None = None) -> BlockMask:
    """FlexAttention's BlockMask of `blocked` [b|1, 1, s, s] (True = may not attend) or'ed with
    the causal mask: the blocks no query of a block may attend are skipped. Packed rows (each
    sample attending its own earlier tokens, training/packing.py's block-causal mask) get a
    mask function of each position's document index ([b, s], a lookup per query and key); any
    other mask, a lookup in the dense one ([b, s, s]); `documents = False` skips looking for
    documents (a padded rows' mask, which has none). `docs` [b, s]: the documents themselves
    (packed rows given by their positions, algos/logprobs.py `segments`), no dense mask made
    or read."""
    from torch.nn.attention.flex_attention import create_block_mask

    if docs is not None:
        return document_block_mask(docs)
    allowed, rows, sq = mask_function(blocked, documents), blocked.shape[0], blocked.shape[-1]
    return create_block_mask(allowed, rows, None, sq, sq, device=blocked.device, _compile=True)


def mask_function(blocked: torch.Tensor, documents: bool = True) -> Callable:
    """FlexAttention's mask function (b, h, q, k) -> may attend, of `blocked` [b|1, 1, s, s]
    (True = may not attend) or'ed with the causal mask (`flex_block_mask`)."""
    dense = blocked[:, 0]
    docs = _documents(dense) if documents else None
    if docs is not None:
        return document_mask_function(docs)
    rows = dense.shape[0]

    def allowed(b, _h, q, k):
        return ~dense[b if rows > 1 else 0, q, k] & (k <= q)
    return allowed


def _documents(dense: torch.Tensor) -> torch.Tensor | None:
    """[b, s] each position's document (a new one wherever a query may not attend the position
    before it) when `dense` [b, s, s] (True = may not attend), on and below the diagonal, is
    exactly "the same document" (a block-diagonal causal mask); else None."""
    rows, sq = dense.shape[0], dense.shape[-1]
    starts = torch.ones(rows, sq, dtype=torch.int32, device=dense.device)
    starts[:, 1:] = dense[:, 1:, :-1].diagonal(dim1=1, dim2=2)
    docs = starts.cumsum(-1, dtype=torch.int32)
    causal = torch.ones(sq, sq, dtype=torch.bool, device=dense.device).tril()
    same = (docs[:, :, None] == docs[:, None, :]) & causal
    return docs if torch.equal(same, ~dense & causal) else None


def _flex(query, key, value, block: BlockMask, scale: float | None, width: int
          ) -> torch.Tensor:
    """FlexAttention over query [s, b, heads, d] / key, value [s, b, groups, d] with the block
    mask -> [s, b, width]; a query with no key to attend outputs zeros (padding rows, unused).
    Inside a compiled layer (compile_layers) it is traced into the layer's graph; eager, it runs
    torch.compile's kernel (dynamic shapes: row widths and counts differ per micro-batch)."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        kernel = flex_attention
    else:
        if "kernel" not in _FLEX:
            _FLEX["kernel"] = torch.compile(flex_attention, dynamic=True)
        kernel = _FLEX["kernel"]
    sq, b, heads, _ = query.shape
    key, value, gqa = flex_key_value(key, value, heads)
    out = kernel(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                 block_mask=block, scale=scale, enable_gqa=gqa)
    return out.permute(2, 0, 1, 3).reshape(sq, b, width)


def flex_key_value(key: torch.Tensor, value: torch.Tensor, heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Keys and values [s, b, groups, d] as FlexAttention takes them for `heads` query heads,
    and whether it runs grouped-query attention (`enable_gqa`): at a head count that is not a
    power of two they are expanded to the heads (each group's keys repeated for its heads, as
    transformers' FlexAttention path does), where FlexAttention's grouped backward took twice
    the time (Qwen2.5-1.5B's 12 heads over 2 groups, docs/training.md)."""
    groups = key.shape[2]
    if groups == heads:
        return key, value, False
    if heads & (heads - 1) == 0:
        return key, value, True
    return (key.repeat_interleave(heads // groups, dim=2),
            value.repeat_interleave(heads // groups, dim=2), False)


def _check_heads(config, pg_collection) -> None:
    """ValueError unless the attention heads and key/value groups split evenly over the tensor
    ranks and the heads over the groups (megatron itself only asserts)."""
    tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    tp = (tp_group.size() if tp_group is not None
          else parallel_state.get_tensor_model_parallel_world_size())
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    if heads % tp:
        raise ValueError(f"{heads} attention heads cannot be split over {tp} tensor-parallel "
                         f"ranks")
    if groups % tp:
        raise ValueError(f"{groups} key/value groups cannot be split over {tp} tensor-parallel "
                         f"ranks")
    if heads % groups:
        raise ValueError(f"{heads} attention heads are not a multiple of the {groups} "
                         f"key/value groups (grouped-query attention)")


def _blocked_rows(mask: torch.Tensor | None, total: int, q_pos: torch.Tensor, causal: bool
                  ) -> torch.Tensor:
    """[b|1, 1, len(q_pos), total] bool, True = may not attend, for the queries at global
    positions `q_pos` against keys 0..total-1: causal (when asked) or'ed with `mask` in any of
    the module docstring's three shapes."""
    k_pos = torch.arange(total, device=q_pos.device)
    rows = len(q_pos)
    out = (k_pos[None, :] > q_pos[:, None]) if causal else torch.zeros(
        rows, total, dtype=torch.bool, device=q_pos.device)
    out = out[None, None]
    if mask is None:
        return out
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[3] != total:
        raise ValueError(f"attention mask of shape {tuple(mask.shape)}: expected [b|1, 1, q, "
                         f"{total}] (q = 1, this rank's {rows} queries or all {total}; the last "
                         f"dim covers the whole sequence, cp x the local length)")
    mask = mask.bool()
    if mask.shape[2] == total and total != rows:
        mask = mask.index_select(2, q_pos)
    elif mask.shape[2] not in (1, rows):
        raise ValueError(f"attention mask of shape {tuple(mask.shape)}: its query dim must be "
                         f"1, {rows} (this rank's queries) or {total} (the whole sequence)")
    return out | mask


def cp_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """A copy of a layer (or block) spec with every megatron DotProductAttention core attention
    replaced by ContextParallelAttention (megatron's local spec, `get_gpt_layer_local_spec`).
    ValueError when the spec has none (a Transformer Engine spec: TE has its own CP)."""
    spec, found = swap_modules(spec, {DotProductAttention: ContextParallelAttention})
    if not found:
        raise ValueError("cp_layer_spec: the spec has no megatron DotProductAttention core "
                         "attention to replace (build it with get_gpt_layer_local_spec)")
    return spec


def swap_modules(spec: ModuleSpec, classes: dict[type, type]) -> tuple[ModuleSpec, int]:
    """A copy of a layer (or block) spec with every module class that is a key of `classes`
    (a submodule field's class, or a ModuleSpec's `module`) replaced by its value; and the
    count of replacements."""
    spec = copy.deepcopy(spec)
    return spec, _swap(spec, classes)


def _swap(node: Any, classes: dict[type, type]) -> int:
    """Replace in place; the count of replacements."""
    if isinstance(node, (list, tuple)):
        return sum(_swap(n, classes) for n in node)
    if isinstance(node, ModuleSpec):
        count = 0
        if node.module in classes:
            node.module = classes[node.module]
            count = 1
        return count + _swap(node.submodules, classes)
    count = 0
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            if isinstance(value, type) and value in classes:
                setattr(node, field.name, classes[value])
                count += 1
            else:
                count += _swap(value, classes)
    return count


__all__ = ["CPBatch", "ContextParallelAttention", "cp_layer_spec", "cp_logits", "flex_applies",
           "flex_block_mask", "flex_key_value", "gather_from_cp", "key_padding_mask",
           "local_token_logprobs", "mask_function", "next_token_labels", "padded_length",
           "positions", "split_batch", "split_for_cp", "swap_modules"]
