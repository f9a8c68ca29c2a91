"""Advantage estimators beyond GRPO: REINFORCE++, REINFORCE++-baseline, PPO with GAE.

Shapes: token tensors are response-aligned [B, T] with a loss mask (1 = policy token); scalar
rewards are [B]; `kl` is a per-token KL estimate against the reference (algos.kl), used as reward
shaping with `kl_coef`. Conventions follow the project's reference notes:
- REINFORCE++: token rewards `-kl_coef * kl_t * m_t`, the scalar reward added on the last policy
  token, discounted returns `G_t = sum_k gamma^k rew_{t+k}`, then whitened over policy tokens;
- REINFORCE++-baseline: `A_t = (r - mean_group(r)) - kl_coef * kl_t`, then whitened;
- GAE: `delta_t = r_t + gamma V_{t+1} - V_t` (V past the end = 0), `A_t = sum_l (gamma lam)^l
  delta_{t+l}`, `returns = A + V`; token rewards as in REINFORCE++.
- whitening: `(a - mean) / sqrt(var + 1e-8)` over policy tokens, var with the N/(N-1) correction.
Invariant: pure tensor functions; nothing here knows about models or sockets.
"""

from __future__ import annotations

import torch


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """[B, T]: -kl_coef*kl on policy tokens, plus the scalar reward on the last policy token."""
    mask = mask.float()
    out = torch.zeros_like(mask) if kl is None else -kl_coef * kl.float() * mask
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] += rewards.float()[rows]
    return out


def discounted_returns(rew: torch.Tensor, gamma: float) -> torch.Tensor:
    out = torch.zeros_like(rew)
    running = torch.zeros(rew.shape[0], dtype=rew.dtype, device=rew.device)
    for t in range(rew.shape[1] - 1, -1, -1):
        running = rew[:, t] + gamma * running
        out[:, t] = running
    return out


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mask = mask.float()
    n = mask.sum()
    if n < 2:
        raise ValueError("whitening needs at least 2 policy tokens in the batch")
    mean = (values * mask).sum() / n
    var = ((values - mean).pow(2) * mask).sum() / (n - 1)
    return (values - mean) / torch.sqrt(var + eps) * mask


def reinforce_pp(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                 kl_coef: float = 0.0, gamma: float = 1.0) -> torch.Tensor:
    returns = discounted_returns(token_rewards(rewards, mask, kl, kl_coef), gamma)
    return whiten(returns, mask)


def reinforce_pp_baseline(rewards: torch.Tensor, group_size: int, mask: torch.Tensor,
                          kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    grouped = rewards.float().view(-1, group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    adv = centred[:, None].expand_as(mask.float()).clone()
    if kl is not None:
        adv = adv - kl_coef * kl.float()
    return whiten(adv, mask)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        kl: torch.Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T]; values are the critic's per-token estimates."""
    rew = token_rewards(rewards, mask, kl, kl_coef)
    values = values.float() * mask.float()
    adv = torch.zeros_like(rew)
    running = torch.zeros(rew.shape[0], dtype=rew.dtype, device=rew.device)
    for t in range(rew.shape[1] - 1, -1, -1):
        next_value = values[:, t + 1] if t + 1 < rew.shape[1] else torch.zeros_like(running)
        delta = rew[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        adv[:, t] = running
    return adv, adv + values
