"""Packed micro-batches: several samples concatenated in one row, attention kept per sample.

Role: a padded micro-batch (training/batching.py `make_micro_batch`) pads every row to the
longest sample, so on long-tailed lengths most of its tokens are padding the model computes for
nothing. `pack` lays the samples end to end in rows of at most `max_tokens` tokens instead
(first-fit decreasing by length, `algos.dp_schedule.pack`; a sample is never split, and one
longer than `max_tokens` gets a row of its own), with `position_ids` restarting at 0 for every
sample and the layout of each sample (row, start, length, prompt_len) and `cu_seqlens` per row
(the flash-attention varlen form). `packed_forward` runs an HF causal LM on the rows with each
token attending only to the earlier tokens of its own sample, and `packed_logprobs` /
`unpack` give back the response-aligned [B, R] layout of `make_micro_batch` for the same
samples in the same order, so a caller can swap the packed form for the padded one.

How attention is kept per sample (`attention_mechanism`, first that applies):
- "varlen": the model runs FlashAttention (`attn_implementation` "flash_attention_2"/"_3", CUDA
  with flash-attn installed, `preferred_attn_implementation`): the rows' real tokens are flattened
  into one sequence [1, T] with no padding at all and the sample boundaries are passed as
  `cu_seq_lens_q/k` and `max_length_q/k`, which transformers hands to `flash_attn_varlen_func`
  (modeling_flash_attention_utils.py `_flash_attention_forward`). flash-attn is not installed
  on the CPU development machine, so this path is only exercised there through a stand-in
  attention function that reads the same keyword arguments (tests/test_packing.py).
- "block_mask": the model runs FlexAttention (`attn_implementation` "flex_attention", CUDA
  without flash-attn): the rows are passed with their restarting `position_ids` and a
  FlexAttention BlockMask of the samples made here from those positions
  (`algos.logprobs.document_block_mask`), which transformers uses as given. transformers would
  build the same document mask itself (the next item), but finds the samples with a check that
  reads the device (`find_packed_sequence_indices`), once in every forward.
- "position_ids": any other implementation transformers builds masks for (sdpa, eager): the
  rows are passed with `attention_mask=None` and the restarting
  `position_ids`, and transformers 5.x builds the block-diagonal causal mask itself:
  masking_utils.py `_preprocess_mask_arguments` calls `find_packed_sequence_indices` (a new
  sequence wherever a position is not the previous one + 1) when no 2D mask and no cache are
  given, and `create_causal_mask` ANDs the causal mask with `packed_sequence_mask_function`
  (a dense boolean mask for sdpa/eager, a FlexAttention BlockMask document mask for
  flex_attention, so no BlockMask of our own is needed). This is the CPU path (sdpa, the
  default) and the CUDA path without flash-attn. FlexAttention has no backward on CPU, so it is
  for CUDA only. The trailing padding of a row gets positions 0, 1, ... too: a segment of its
  own that no sample token attends to. sdpa/eager get a dense [rows, 1, L, L] boolean mask (an
  8192-token row: 64 MiB a row), so long rows on CUDA want flash-attn or flex_attention.
- "mask": an explicit additive 4D mask [rows, 1, L, L] (0 where a query may attend a key of its
  own sample at or before it, the dtype's minimum elsewhere), passed as `attention_mask`, which
  transformers uses as given; for a transformers without `find_packed_sequence_indices` or an
  implementation without a mask builder.
Invariant: for every sample, `packed_logprobs` equals `training.aux_models.micro_batch_logprobs`
on the padded micro-batch of the same samples to float precision (positions restart as
`algos.logprobs.position_ids_from_mask` counts them); columns past a sample's response are 0.
A model in true on-policy mode (models/invariant) has its own batch-invariant forward and is not
packed here.
The train step uses it with `micro_batches.pack` (training/step.py): each micro-batch carries
its `pack`ed rows (`MicroBatch.packed`), and training/heads.py `response_head` gathers the
response positions' hidden states from one `packed_forward` (`response_positions`) for the
loss head, so the step's log-probs, entropies and OPD terms never make the logits.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from algos.dp_schedule import pack as pack_indices
from algos.logprobs import (
    document_block_mask,
    gather_logprobs,
    logits_to_logprobs,
    segment_causal,
    segments,
)
from training.batching import MicroBatch
from transport.schema import Sample

MECHANISMS = ("varlen", "block_mask", "position_ids", "mask")


class Slot(NamedTuple):
    """Where one sample lies in a packed batch: tokens [start, start + length) of row `row`."""

    row: int
    start: int
    length: int
    prompt_len: int


@dataclass
class PackedBatch:
    """Samples packed in rows; `slots`, `resp_*` follow the order the samples were given in."""

    input_ids: torch.Tensor  # [rows, L] long, pad_id after a row's last sample
    position_ids: torch.Tensor  # [rows, L] long, 0 at every sample's first token (and the pad's)
    row_lens: list[int]  # real tokens per row (the rest of the row is padding)
    cu_seqlens: list[torch.Tensor]  # per row: int32 [samples in row + 1] sample boundaries
    slots: list[Slot]  # per sample, in the given order
    num_response_cols: int  # R, as make_micro_batch gives it for the same samples
    resp_rows: torch.Tensor  # [B, R] long: row of the position predicting response token j
    resp_cols: torch.Tensor  # [B, R] long: column of that position (clamped past the response)
    resp_valid: torch.Tensor  # [B, R] bool: j < the sample's response length

    @property
    def num_tokens(self) -> int:
        """Real tokens: what the varlen path computes."""
        return sum(self.row_lens)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens a mask-based forward computes: rows x width, trailing padding included."""
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same packing with its tensors on `device`."""
        return PackedBatch(self.input_ids.to(device), self.position_ids.to(device),
                           self.row_lens, [c.to(device) for c in self.cu_seqlens], self.slots,
                           self.num_response_cols, self.resp_rows.to(device),
                           self.resp_cols.to(device), self.resp_valid.to(device))


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------

def _sequences(source: list[Sample] | MicroBatch) -> tuple[list[list[int]], list[int], int]:
    """(token ids per sample, prompt lengths, R) of samples or of a padded micro-batch."""
    if isinstance(source, MicroBatch):
        lens = source.attention_mask.sum(dim=1).tolist()
        ids = [row[:n] for row, n in zip(source.input_ids.tolist(), lens)]
        return ids, source.prompt_lens.tolist(), source.num_response_cols
    seqs = [list(s.prompt_ids) + list(s.response_ids) for s in source]
    cols = max([1] + [len(s.response_ids) for s in source])  # as make_micro_batch sizes it
    return seqs, [len(s.prompt_ids) for s in source], cols


def _check(seqs: list[list[int]], prompt_lens: list[int], max_tokens: int) -> None:
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if not seqs:
        raise ValueError("nothing to pack: no samples")
    for i, p in enumerate(prompt_lens):
        if p < 1:  # response token 0 is predicted at position prompt_len - 1
            raise ValueError(f"sample {i} has no prompt token; packing needs at least one")


def _response_index(slots: list[Slot], cols: int) -> tuple[torch.Tensor, ...]:
    """(rows, cols, valid) [B, R]: response token j of a sample is predicted at position
    start + prompt_len - 1 + j of its row, clamped to the sample's last token."""
    j = torch.arange(cols)[None, :]
    start = torch.tensor([s.start + s.prompt_len - 1 for s in slots])[:, None]
    resp = torch.tensor([s.length - s.prompt_len for s in slots])[:, None]
    last = torch.tensor([s.start + s.length - 1 for s in slots])[:, None]
    rows = torch.tensor([s.row for s in slots])[:, None].expand(-1, cols)
    return rows.contiguous(), torch.minimum(start + j, last), j < resp


def pack(source: list[Sample] | MicroBatch, max_tokens: int, pad_id: int = 0) -> PackedBatch:
    """Pack samples (or a padded micro-batch's rows) into rows of <= max_tokens tokens.

    First-fit decreasing by length (deterministic: ties keep the given order); a sample longer
    than max_tokens gets a row of its own. Rows are right-padded with pad_id to the longest row.
    Tensors are on the CPU (`PackedBatch.to`). ValueError on max_tokens < 1, no samples, or a
    sample without a prompt token.
    """
    seqs, prompt_lens, cols = _sequences(source)
    _check(seqs, prompt_lens, max_tokens)
    rows, _ = pack_indices([len(s) for s in seqs], max_tokens, "first_fit_decreasing")
    row_lens = [sum(len(seqs[i]) for i in row) for row in rows]
    width = max(row_lens)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    slots: list[Slot | None] = [None] * len(seqs)
    cu = []
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(seqs[i])
            ids[r, start:start + n] = torch.tensor(seqs[i], dtype=torch.long)
            pos[r, start:start + n] = torch.arange(n)
            slots[i] = Slot(r, start, n, prompt_lens[i])
            start += n
        pos[r, start:] = torch.arange(width - start)  # the padding: a segment of its own
        cu.append(torch.tensor([0] + [slots[i].start + slots[i].length for i in row],
                               dtype=torch.int32))
    resp_rows, resp_cols, valid = _response_index(slots, cols)
    return PackedBatch(ids, pos, row_lens, cu, slots, cols, resp_rows, resp_cols, valid)


# ---------------------------------------------------------------------------------------------
# Unpacking
# ---------------------------------------------------------------------------------------------

def unpack(per_position: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Per-position outputs of the packed rows [rows, L or L-1, ...] (entry t: the output at
    position t, i.e. the prediction of token t+1: log-probs, entropies, hidden states, logits)
    -> response-aligned [B, R, ...], as `algos.logprobs.response_slice` gives them from the
    padded micro-batch: row b column j is response token j of sample b; 0 past its response."""
    cols = packed.resp_cols.clamp(max=per_position.shape[1] - 1)  # [rows, L-1] inputs too
    out = per_position[packed.resp_rows, cols]
    valid = packed.resp_valid.reshape(packed.resp_valid.shape + (1,) * (out.dim() - 2))
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


def response_targets(packed: PackedBatch) -> torch.Tensor:
    """The response token ids [B, R] (the token each unpacked position predicts)."""
    cols = (packed.resp_cols + 1).clamp(max=packed.input_ids.shape[1] - 1)
    return packed.input_ids[packed.resp_rows, cols]


def flat_cu_seqlens(packed: PackedBatch) -> torch.Tensor:
    """Sample boundaries int32 [B + 1] over the rows' real tokens laid end to end, row by row
    (the varlen form of the whole batch, padding left out)."""
    offsets = [0]
    for n in packed.row_lens[:-1]:
        offsets.append(offsets[-1] + n)
    parts = [c[:-1] + off for c, off in zip(packed.cu_seqlens, offsets)]
    total = torch.tensor([packed.num_tokens], dtype=torch.int32, device=parts[0].device)
    return torch.cat(parts + [total]).to(torch.int32)


def _flat_index(packed: PackedBatch) -> torch.Tensor:
    """Index [B, R] into the flattened real tokens of the position each resp_* entry names."""
    lens = torch.tensor(packed.row_lens, device=packed.resp_rows.device)
    offsets = lens.cumsum(0) - lens  # first flat index of each row
    return offsets[packed.resp_rows] + packed.resp_cols


def real_tokens(packed: PackedBatch) -> torch.Tensor:
    """[rows, L] bool: True on sample tokens, False on the rows' trailing padding."""
    cols = torch.arange(packed.input_ids.shape[1], device=packed.input_ids.device)
    lens = torch.tensor(packed.row_lens, device=packed.input_ids.device)
    return cols[None, :] < lens[:, None]


def unflatten(flat: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Outputs over the flattened real tokens [1, T, ...] (the varlen forward's) -> per position
    of the rows [rows, L, ...], 0 on the padding; `unpack` then applies as to any row output."""
    keep = real_tokens(packed)
    out = flat.new_zeros(keep.shape + flat.shape[2:])
    out[keep] = flat[0]
    return out


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

def flash_attn_available() -> bool:
    """Whether flash-attn is installed (never on a CPU-only machine)."""
    return importlib.util.find_spec("flash_attn") is not None


def preferred_attn_implementation(device: torch.device | str) -> str:
    """The `attn_implementation` to build a model with for packed rows on `device`:
    FlashAttention 2 (varlen, no padding) on CUDA with flash-attn installed, else FlexAttention
    on CUDA (transformers builds its document BlockMask), else sdpa (CPU: FlexAttention has no
    backward there). Measured on one H200 at Qwen2.5-1.5B, bf16, 32k long-tailed tokens in
    8k-token micro-batches: packed with FlexAttention 2.39 s a step against 3.25 s padded
    (1.36x) at 56.6 against 100.9 GiB; packed with sdpa (a dense mask per row) 3.13 s, as fast
    as padded, at 57.3 GiB."""
    if torch.device(device).type != "cuda":
        return "sdpa"
    return "flash_attention_2" if flash_attn_available() else "flex_attention"


# FlexAttention's compiled kernel is used where it was measured to run: half-precision models
# with heads of at least this many dimensions (an fp32 model with 16-dimension heads failed to
# compile on an H200); other models keep sdpa with the dense packed mask, which runs anywhere
FLEX_MIN_HEAD_DIM = 64


def use_packed_attention(model: Any, device: torch.device | str) -> str:
    """Switch a transformers `model` that will run packed rows on `device` to
    `preferred_attn_implementation` (in place; the weights are untouched) where it applies
    (FLEX_MIN_HEAD_DIM for FlexAttention) and the model runs sdpa or eager; returns the
    attention it runs."""
    impl = str(getattr(model.config, "_attn_implementation", None) or "")
    want = preferred_attn_implementation(device)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or (
        cfg.hidden_size // cfg.num_attention_heads if getattr(cfg, "num_attention_heads", 0)
        else 0)
    half = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
    if want == "flex_attention" and not (half and head_dim >= FLEX_MIN_HEAD_DIM):
        return impl
    if want != "sdpa" and impl in ("sdpa", "eager", "") and hasattr(
            model, "set_attn_implementation"):
        model.set_attn_implementation(want)
        return want
    return impl


def attention_mechanism(model: Any) -> str:
    """How `packed_forward` keeps attention per sample for `model` (module docstring); a model
    that names its own (`packed_attention`, the megatron backend's "mask") gets that."""
    own = getattr(model, "packed_attention", None)
    if own is not None:
        return own
    impl = str(getattr(model.config, "_attn_implementation", None) or "")
    if "flash" in impl:
        return "varlen"
    if impl == "flex_attention":
        return "block_mask"
    # imported here: transformers.masking_utils imports torch._dynamo (~1.5 s of CPU), which
    # a process that never asks (the launcher, a rank that only loads) should not pay
    from transformers import masking_utils

    builds_masks = impl in masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    if builds_masks and hasattr(masking_utils, "find_packed_sequence_indices"):
        return "position_ids"
    return "mask"


def block_causal_mask(packed: PackedBatch, dtype: torch.dtype) -> torch.Tensor:
    """Additive [rows, 1, L, L]: 0 where query t may attend key s (same segment, s <= t),
    the dtype's minimum elsewhere. Segments: the samples and each row's trailing padding."""
    allowed = segment_causal(segments(packed.position_ids))
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def _model_dtype(model: Any) -> torch.dtype:
    return next(model.parameters()).dtype


def packed_forward(model: Any, packed: PackedBatch, mechanism: str | None = None,
                   **kwargs: Any) -> Any:
    """The model's output on the packed rows, attention kept per sample (module docstring);
    `mechanism` overrides `attention_mechanism(model)`, `kwargs` go to the model (e.g.
    output_hidden_states). Outputs are per position [rows, L, ...] except with "varlen", where
    they are over the flattened real tokens [1, T, ...] (`unflatten` puts them in rows)."""
    mechanism = mechanism or attention_mechanism(model)
    if mechanism == "varlen":
        keep = real_tokens(packed)
        cu = flat_cu_seqlens(packed)
        longest = max(s.length for s in packed.slots)
        return model(input_ids=packed.input_ids[keep][None],
                     position_ids=packed.position_ids[keep][None], use_cache=False,
                     cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                     max_length_k=longest, **kwargs)
    if mechanism == "block_mask":
        return model(input_ids=packed.input_ids,
                     attention_mask=document_block_mask(segments(packed.position_ids)),
                     position_ids=packed.position_ids, use_cache=False, **kwargs)
    if mechanism == "position_ids":
        return model(input_ids=packed.input_ids, attention_mask=None,
                     position_ids=packed.position_ids, use_cache=False, **kwargs)
    if mechanism == "mask":
        return model(input_ids=packed.input_ids,
                     attention_mask=block_causal_mask(packed, _model_dtype(model)),
                     position_ids=packed.position_ids, use_cache=False, **kwargs)
    raise ValueError(f"unknown attention mechanism {mechanism!r}; known: {MECHANISMS}")


def response_positions(per_position: torch.Tensor, packed: PackedBatch,
                       flat: bool = False) -> torch.Tensor:
    """Per-position outputs of one packed forward (rows [rows, L, ...], or with `flat` the
    varlen forward's [1, T, ...]) at the positions predicting the response tokens: [B, R, ...],
    row b column j predicting response token j of sample b (past its response: the sample's
    last position, as `algos.logprobs.response_slice` clamps; mask them)."""
    if flat:  # varlen: [1, T, H] over the real tokens
        return per_position[0, _flat_index(packed)]
    return per_position[packed.resp_rows, packed.resp_cols]


def packed_response_logits(model: Any, packed: PackedBatch, mechanism: str | None = None
                           ) -> torch.Tensor:
    """Response-aligned logits [B, R, V] from one packed forward. As in
    training/heads.py `response_logits`, a pre-hook on `get_output_embeddings()`
    hands the output head the response positions' hidden states only, so no [rows, L, V]
    tensor is made; a model without that module has its full logits gathered instead."""
    mechanism = mechanism or attention_mechanism(model)
    flat = mechanism == "varlen"
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Module):
        logits = packed_forward(model, packed, mechanism).logits
        return response_positions(logits, packed, flat)

    def select(_module, args):
        return (response_positions(args[0], packed, flat),) + tuple(args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        return packed_forward(model, packed, mechanism).logits
    finally:
        handle.remove()


def packed_logprobs(model: Any, packed: PackedBatch, temperature: float,
                    with_entropy: bool = True, mechanism: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response-aligned [B, R] (log-probs, entropies) of the packed samples, in the order they
    were given: the packed counterpart of training/aux_models.py `micro_batch_logprobs`, by the
    formulas of algos/logprobs.py (float32, temperature T); 0 past a sample's response."""
    logits = packed_response_logits(model, packed, mechanism)
    logprobs = logits_to_logprobs(logits, temperature)
    token = gather_logprobs(logprobs, response_targets(packed))
    zero = torch.zeros((), dtype=token.dtype, device=token.device)
    token = torch.where(packed.resp_valid, token, zero)
    if not with_entropy:
        return token, None
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return token, torch.where(packed.resp_valid, entropy, zero)
