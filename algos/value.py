"""The critic's clipped value loss (PPO with GAE).

Per policy token, with V the critic's current value, V_old its value before this optimizer
step (the one GAE used) and R the return target (`A + V_old` from GAE, before whitening):
`L_t = max((V_t - R_t)^2, (V_old_t + clamp(V_t - V_old_t, -c, c) - R_t)^2)` with c =
`value_clip` (c = 0: the plain `(V - R)^2`). Reduction as the policy loss: each sample's masked
token mean, summed, divided by the number of samples in the whole step (`num_samples_in_step`),
so accumulation over micro-batches and ranks gives the one-batch value.
`clipfrac` is the share of policy tokens where the clipped term is the larger.
Invariant: pure tensor function; gradients flow only through `values`.
"""

from __future__ import annotations

import torch

from algos.policy_loss import masked_sample_sum


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, num_samples_in_step: int,
               value_clip: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss scalar, clip fraction: a detached 0-d tensor, read without waiting for the device
    only at the step's end); values, old_values, returns, mask: [B, T]."""
    if value_clip < 0:
        raise ValueError(f"value_clip must be >= 0, got {value_clip}")
    mask = mask.float()
    old, target = old_values.detach(), returns.detach()
    plain = (values - target).pow(2)
    if value_clip == 0:
        return masked_sample_sum(plain, mask) / num_samples_in_step, values.new_zeros(())
    clipped = (old + (values - old).clamp(-value_clip, value_clip) - target).pow(2)
    per_token = torch.maximum(plain, clipped)
    with torch.no_grad():
        frac = ((clipped > plain).float() * mask).sum() / mask.sum().clamp(min=1)
    return masked_sample_sum(per_token, mask) / num_samples_in_step, frac
