"""The PPO-clip policy loss and the sample-mean reduction every loss term shares.

Conventions (the same as slime's defaults, see the project's design notes):
- `ratio = exp(logp - old_logp)`, `L = max(-ratio*A, -clamp(ratio, 1-eps, 1+eps_high)*A)`, clip
  fraction = share of tokens where the clipped term is the larger;
- reduction is the *sample mean*: each sample's masked token mean, summed, divided by the number
  of samples in the whole optimizer step (`num_samples_in_step`), so gradient accumulation over
  micro-batches gives the same update as one big batch;
- a mismatch correction that rejects tokens (algos/mismatch.py) removes them from the numerator
  only: the token mean's denominator stays the sample's policy tokens before rejection
  (`sample_tokens`, the source's), so a sample keeps its weight whatever share of it was
  rejected instead of its remaining tokens being scaled up.
Invariant: every function takes and returns tensors; nothing here touches models or sockets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossTerms:
    """The loss and its statistics. The statistics are detached 0-d tensors on the loss's
    device: reading them (`float`) waits for the device, so a trainer sums them there and reads
    the step's totals once."""
    loss: torch.Tensor  # scalar to backpropagate (already divided by num_samples_in_step)
    pg_loss: torch.Tensor
    clipfrac: torch.Tensor
    ppo_kl: torch.Tensor  # mean of old_logp - logp over policy tokens
    num_tokens: torch.Tensor  # the mask's count


def masked_sample_sum(values: torch.Tensor, mask: torch.Tensor,
                      sample_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over samples of (masked token sum / that sample's token count); values, mask: [B, T];
    `sample_tokens` [B] the counts (default: the mask's, the masked token mean)."""
    counts = mask.sum(dim=1) if sample_tokens is None else sample_tokens.to(mask.dtype)
    return ((values * mask).sum(dim=1) / counts.clamp(min=1)).sum()


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, num_samples_in_step: int, eps_clip: float = 0.2,
                  eps_clip_high: float | None = None, dual_clip_c: float | None = None,
                  token_weights: torch.Tensor | None = None,
                  sample_tokens: torch.Tensor | None = None) -> LossTerms:
    """logp, old_logp, mask: [B, T] (response positions; mask: the tokens kept); advantages:
    [B] or [B, T]. `dual_clip_c` (> 1) bounds the loss of negative-advantage tokens at -c*A
    (dual clip); `token_weights` [B, T] scales each token's loss (importance-sampling
    corrections); `sample_tokens` [B]: each sample's denominator, its policy tokens before any
    rejection (default: the mask's count)."""
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)
    mask = mask.float()
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1 - eps_clip, 1 + eps_high) * adv
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        per_token = torch.where(adv < 0, torch.minimum(-dual_clip_c * adv, per_token), per_token)
    if token_weights is not None:
        per_token = per_token * token_weights
    loss = masked_sample_sum(per_token, mask, sample_tokens) / num_samples_in_step
    with torch.no_grad():
        count = mask.sum()
        n = count.clamp(min=1)
        clipfrac = ((clipped > unclipped).float() * mask).sum() / n
        ppo_kl = (-log_ratio * mask).sum() / n
        pg = loss.detach() * (num_samples_in_step / max(1, logp.shape[0]))
    return LossTerms(loss, pg, clipfrac, ppo_kl, count)
