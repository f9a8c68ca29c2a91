"""Turning samples into padded micro-batch tensors, response-aligned.

Invariant: for a sample with P prompt tokens and R response tokens, `input_ids` holds the P + R
tokens (right-padded), and the response-aligned tensors (`mask`, `rollout_logp`, and log-probs
gathered with `algos.logprobs.response_slice`) have R valid columns: column j is the log-prob of
response token j, which `token_logprobs(...)[:, P - 1 + j]` computes from the full sequence.
With `micro_batches.pack` a micro-batch also carries its samples packed in rows (`packed`,
training/packing.py) and the model passes run on those; the response-aligned tensors are the
same either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from training.moe import sample_routes
from transport.schema import Sample


@dataclass
class MicroBatch:
    samples: list[Sample]
    input_ids: torch.Tensor  # [B, L] right-padded with pad_id
    attention_mask: torch.Tensor  # [B, L]
    prompt_lens: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, R] float, 1 on policy tokens
    rollout_logp: torch.Tensor  # [B, R]
    rewards: torch.Tensor  # [B]
    # the same samples packed in rows (training.packing.PackedBatch), on the same device, with
    # `micro_batches.pack`: the model passes then run on it instead of `input_ids`
    packed: Any = None
    # mixture-of-experts: the samples' routed experts per position [B, L, layers, k] (-1: none;
    # training/moe.py), and laid out like `packed`'s rows; None without any
    routes: torch.Tensor | None = None
    packed_routes: torch.Tensor | None = None
    # (smallest, largest) token id in `input_ids`, known on the host: the loss head and the
    # step check ids against a vocabulary with these, without reading the device
    token_bounds: tuple[int, int] | None = None

    @property
    def num_response_cols(self) -> int:
        return self.mask.shape[1]

    def to(self, device: torch.device | str) -> "MicroBatch":
        """The same micro-batch with its tensors on `device`."""
        return MicroBatch(self.samples, *(t.to(device) for t in (
            self.input_ids, self.attention_mask, self.prompt_lens, self.mask,
            self.rollout_logp, self.rewards)),
            packed=None if self.packed is None else self.packed.to(device),
            routes=None if self.routes is None else self.routes.to(device),
            packed_routes=None if self.packed_routes is None else self.packed_routes.to(device),
            token_bounds=self.token_bounds)


def _padded(prompts: list[list[int]], responses: list[list[int]], pad_id: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(input_ids [B, L] right-padded, attention_mask [B, L], prompt_lens [B], response
    columns R >= 1) of prompt + response token lists."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, :len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attn[b, :len(p) + len(r)] = 1
    resp = max(1, max(len(r) for r in responses))
    return ids, attn, torch.tensor([len(p) for p in prompts]), resp


def make_micro_batch(samples: list[Sample], pad_id: int = 0) -> MicroBatch:
    ids, attn, prompt_lens, resp = _padded([s.prompt_ids for s in samples],
                                           [s.response_ids for s in samples], pad_id)
    mask = torch.zeros((len(samples), resp))
    rlp = torch.zeros((len(samples), resp))
    for b, s in enumerate(samples):
        n = len(s.response_ids)
        mask[b, :n] = torch.tensor(s.loss_mask, dtype=torch.float)
        rlp[b, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float)
    return MicroBatch(samples, ids, attn, prompt_lens, mask, rlp,
                      torch.tensor([s.reward for s in samples], dtype=torch.float),
                      routes=sample_routes(samples, ids.shape[1]), token_bounds=bounds_of(ids))


def token_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0
                ) -> MicroBatch:
    """A micro-batch of token ids alone (no samples, every response token masked in): what a
    colocated teacher of another vocabulary scores, the samples in its own tokens."""
    ids, attn, prompt_lens, resp = _padded(prompts, responses, pad_id)
    mask = torch.zeros((len(prompts), resp))
    for b, r in enumerate(responses):
        mask[b, :len(r)] = 1.0
    return MicroBatch([], ids, attn, prompt_lens, mask, torch.zeros_like(mask),
                      torch.zeros(len(prompts)), token_bounds=bounds_of(ids))


def bounds_of(ids: torch.Tensor) -> tuple[int, int]:
    """(smallest, largest) of a host tensor of token ids."""
    lo, hi = torch.aminmax(ids)
    return int(lo), int(hi)


def check_token_ids(mbs: list[MicroBatch], vocab_size: int) -> None:
    """ValueError naming the samples whose token ids lie outside [0, vocab_size) (the model's
    embedding would fail on them: on a GPU with a device-side assert that ends the process)."""
    for mb in mbs:
        lo, hi = mb.token_bounds if mb.token_bounds is not None else bounds_of(mb.input_ids)
        if lo >= 0 and hi < vocab_size:
            continue
        bad = [f"({s.group_id[:64]!r}, {s.index})" for s in mb.samples
               if min(s.prompt_ids + s.response_ids, default=0) < 0
               or max(s.prompt_ids + s.response_ids, default=0) >= vocab_size]
        raise ValueError(f"token ids outside the model's vocabulary [0, {vocab_size}) in "
                         f"sample(s) {', '.join(bad) or '(padding)'}: the rollout's tokenizer "
                         f"must be the trained model's")
