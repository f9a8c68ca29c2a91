"""Per-token log-probabilities: the one definition shared by inference and training.

Role: the inference engine (engine/scheduler.py) and the trainer both call these functions, so
the log-probs a rollout reports and the ones the trainer recomputes agree to float precision.
Invariant: the log-prob of token y under logits z at temperature T is log_softmax(z / T)[y]
(computed in float32), with temperature 0 (greedy) treated as 1; positions are counted from the
first non-padding token (position_ids = cumsum(attention_mask) - 1, clamped at 0), so left-,
right- and un-padded batches give the same values for the same tokens. In true on-policy mode
(`true_on_policy`) both sides compute the same formula with models/invariant's batch-invariant
forward and log-softmax instead, which makes the agreement bitwise.
"""

from __future__ import annotations

import torch


def effective_temperature(temperature: float) -> float:
    """The temperature log-probs are computed at: 0 (greedy decoding) counts as 1."""
    return 1.0 if temperature is None or temperature <= 0 else float(temperature)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only: cumsum(mask) - 1, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def segments(position_ids: torch.Tensor) -> torch.Tensor:
    """[rows, L] int32: each position's segment in packed rows, a new one wherever the
    positions restart at 0 (every sample, and a row's trailing padding)."""
    return (position_ids == 0).cumsum(-1, dtype=torch.int32)


def segment_causal(segment: torch.Tensor) -> torch.Tensor:
    """[rows, 1, L, L] bool, True where query t may attend key s: the same segment, s <= t."""
    width = segment.shape[-1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segment.device).tril()
    return ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]


def document_mask_function(docs: torch.Tensor):
    """FlexAttention's mask function (b, h, q, k) -> may attend of documents [b, s] (`segments`):
    a query attends its own document's keys at or before it."""
    def allowed(b, _h, q, k):
        return (docs[b, q] == docs[b, k]) & (k <= q)
    return allowed


def document_block_mask(docs: torch.Tensor):
    """FlexAttention's BlockMask of documents [b, s] (`document_mask_function`), made on their
    device from the documents alone: no dense mask, nothing read back to the host (compiled
    on CUDA, as transformers and megatron make theirs; eager elsewhere)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, width = docs.shape
    return create_block_mask(document_mask_function(docs), rows, None, width, width,
                             device=docs.device, _compile=docs.device.type == "cuda")


def logits_to_logprobs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) over the last dim, in float32."""
    return torch.log_softmax(logits.float() / effective_temperature(temperature), dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the last dim, in float32."""
    logp = logits_to_logprobs(logits, temperature)
    return -(logp.exp() * logp).sum(-1)


def gather_logprobs(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logprobs[..., targets] elementwise: [..., V] x [...] -> [...]."""
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def response_slice(per_position: torch.Tensor, prompt_lens: torch.Tensor,
                   num_cols: int) -> torch.Tensor:
    """Values per next-token position [B, L-1, ...] -> [B, num_cols, ...] per response token:
    column j of row b is position prompt_lens[b] - 1 + j (clamped to the last position). The
    one response-position gather, for log-probs, entropies, values and logits alike."""
    cols = prompt_lens[:, None] - 1 + torch.arange(num_cols, device=prompt_lens.device)[None, :]
    cols = cols.clamp(max=per_position.shape[1] - 1)
    if per_position.dim() == 3:
        cols = cols[:, :, None].expand(-1, -1, per_position.shape[-1])
    return per_position.gather(1, cols)


def response_tokens(mb) -> torch.Tensor:
    """[B, R] the response tokens of a micro-batch (`input_ids`, `prompt_lens`,
    `num_response_cols`; padding columns: the last token, clamped as `response_slice`)."""
    return response_slice(mb.input_ids[:, 1:], mb.prompt_lens, mb.num_response_cols)


def response_logprobs(next_logits: torch.Tensor, input_ids: torch.Tensor,
                      prompt_lens: torch.Tensor, num_cols: int, temperature: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From next-token logits [B, L-1, V] of `input_ids` [B, L]: response-aligned (log-probs
    [B, R], entropies [B, R], logits [B, R, V]), R = num_cols, by the formulas above."""
    logprobs = logits_to_logprobs(next_logits, temperature)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    token = gather_logprobs(logprobs, input_ids[:, 1:])
    return (response_slice(token, prompt_lens, num_cols),
            response_slice(entropy, prompt_lens, num_cols),
            response_slice(next_logits, prompt_lens, num_cols))


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float = 1.0) -> torch.Tensor:
    """[B, T] ids -> [B, T-1] float32: entry [b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1]).

    Entries whose target is padding are meaningless (mask them with attention_mask[:, 1:]).
    Gradients flow when called outside no_grad (the trainer's use).
    """
    return token_logprobs_and_entropy(model, input_ids, attention_mask, temperature,
                                      with_entropy=False)[0]


def token_logprobs_and_entropy(model, input_ids: torch.Tensor,
                               attention_mask: torch.Tensor | None = None,
                               temperature: float = 1.0, with_entropy: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` and, from the same forward, the entropy [B, T-1] of each next-token
    distribution at the same temperature (None when with_entropy is False)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    logprobs = logits_to_logprobs(out.logits[:, :-1], temperature)
    entropy = -(logprobs.exp() * logprobs).sum(-1) if with_entropy else None
    return gather_logprobs(logprobs, input_ids[:, 1:]), entropy
