"""Advantages: every estimator by name, its primitives, whitening across micro-batches and ranks.

Role: one entry point the trainer uses for every estimator, so that single-process and
data-parallel training compute the same advantages. `advantage_estimator` is one of:
- `grpo`: `A_i = (r_i - mean_g) / (std_g + 1e-6)` over the samples of a prompt, broadcast to
  every token (no whitening, no token rewards);
- `dr_grpo`: `A_i = r_i - mean_g` (Dr.GRPO: no std normalisation), broadcast;
- `reinforce_plus_plus`: token rewards `-kl_coef * kl_t` plus `r_i` on the last policy token,
  discounted returns `G_t = sum_k gamma^k rew_{t+k}`, whitened over the whole batch;
- `reinforce_plus_plus_baseline`: `A_t = (r_i - mean_g) - kl_coef * kl_t`, whitened;
- `ppo`: GAE on the critic's values (`gae`), `returns = A + V` (the critic's
  targets, before whitening), advantages whitened.
`kl_t` is the reward-shaping KL (`kl_in_reward`); with the KL as a loss term it is absent here.

The estimators are one table, `ESTIMATORS`: an `Estimator` record per name with its scoring
(`sample_scores`), its token function (`token_advantages`) and what the step does around it
(`whitened`, `token_rewards`: accepts KL reward shaping, `needs_critic`); all but the token
function are algos/estimators.py's records (no torch: what a config is checked with).

Whitening spans every policy token of the optimizer step, across micro-batches and ranks:
`whiten_sums` gives (N, sum a, sum a^2) in float64 per micro-batch; the caller adds them up
(all-reduce over ranks) and `whiten_with` applies `(a - mean) / sqrt(var + 1e-8)` with
`var = (sum a^2 / N - mean^2) * N / (N - 1)`, the same value `whiten` gives on
the concatenated batch.
Token rewards (`token_rewards`): `-kl_coef * kl_t * m_t`, plus the scalar reward on the last
policy token. GAE runs over the policy tokens alone: with t' the next policy token after t,
`delta_t = r_t + gamma V_{t'} - V_t` (V = 0 after the last policy token),
`A_t = delta_t + gamma lam A_{t'}`, `returns = A + V`. Observation tokens (mask 0: tool output
inside a response) are skipped, not steps: they are the environment's transition, and the critic
is not trained on them, so their values carry no estimate (A and returns there are 0).
Invariant: pure tensor functions; the per-sample scores only depend on the whole batch's rewards
and group ids, so every rank derives the same ones.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from algos.estimators import (  # noqa: F401 - the table: also read from here
    SPECS,
    TOKEN_REWARDS,
    EstimatorSpec,
    check_estimator,
)

# (per-sample scores [B], policy-token mask [B, T] float, reward-shaping KL [B, T] or None,
#  kl_coef, critic values [B, T] or None, gamma, lam) -> (advantages [B, T], returns or None)
TokenFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", float,
                    "torch.Tensor | None", float, float],
                   "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclasses.dataclass(frozen=True)
class Estimator(EstimatorSpec):
    """One advantage estimator: its record (algos/estimators.py) and its token function."""

    # scores -> token advantages (and returns), before whitening
    token_fn: TokenFn = dataclasses.field(kw_only=True)


def _broadcast(scores, mask, kl, kl_coef, values, gamma, lam):
    return scores[:, None].expand_as(mask) * mask, None


def _reinforce(scores, mask, kl, kl_coef, values, gamma, lam):
    return discounted_returns(token_rewards(scores, mask, kl, kl_coef), gamma) * mask, None


def _baseline(scores, mask, kl, kl_coef, values, gamma, lam):
    adv = scores[:, None].expand_as(mask).clone()
    if kl is not None:
        adv = adv - kl_coef * kl.float()
    return adv * mask, None


def _gae(scores, mask, kl, kl_coef, values, gamma, lam):
    if values is None:
        raise ValueError("advantage_estimator = 'ppo' needs the critic's values")
    adv, returns = gae(scores, values, mask, kl, kl_coef, gamma, lam)
    return adv * mask, returns


TOKEN_FNS: dict[str, TokenFn] = {"grpo": _broadcast, "dr_grpo": _broadcast,
                                 "reinforce_plus_plus": _reinforce,
                                 "reinforce_plus_plus_baseline": _baseline, "ppo": _gae,
                                 "none": _broadcast}
ESTIMATORS: dict[str, Estimator] = {
    name: Estimator(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)},
                    token_fn=TOKEN_FNS[name]) for name, spec in SPECS.items()}


def estimator(name: str) -> Estimator:
    """The estimator named `name` (ValueError naming the choices otherwise)."""
    check_estimator(name)
    return ESTIMATORS[name]


def sample_scores(estimator_name: str, rewards: Sequence[float], group_ids: Sequence
                  ) -> torch.Tensor:
    """[N] per-sample scalar: group-normalised (grpo), group-centred (dr_grpo,
    reinforce_plus_plus_baseline) or the raw reward (reinforce_plus_plus, ppo). Groups are the
    samples sharing a group id (a group may have lost failed samples)."""
    kind = estimator(estimator_name).scores
    r = torch.tensor(list(rewards), dtype=torch.float32)
    if kind == "zero":
        return torch.zeros_like(r)
    if kind == "raw":
        return r
    by_group: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        by_group[g].append(i)
    out = torch.zeros_like(r)
    for idx in by_group.values():
        out[idx] = grpo_advantages(r[idx], len(idx),
                                   std_normalization=kind == "group_normalised")
    return out


def token_advantages(estimator_name: str, scores: torch.Tensor, mask: torch.Tensor,
                     kl: torch.Tensor | None = None, kl_coef: float = 0.0,
                     values: torch.Tensor | None = None, gamma: float = 1.0,
                     lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages [B, T] before whitening, returns [B, T] for ppo else None) of a micro-batch.

    scores: [B] from `sample_scores`; mask: [B, T] policy tokens; kl: [B, T] reward-shaping KL.
    """
    return estimator(estimator_name).token_fn(scores, mask.float(), kl, kl_coef, values, gamma,
                                              lam)


def whiten_sums(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 [3]: (number of policy tokens, sum a, sum a^2) over the mask."""
    m = mask.double()
    a = adv.double() * m
    return torch.stack([m.sum(), a.sum(), (a * a).sum()])


def whiten_with(adv: torch.Tensor, mask: torch.Tensor, sums: torch.Tensor,
                eps: float = 1e-8) -> torch.Tensor:
    """Whiten `adv` with the batch-wide sums (see the module docstring); 0 off the mask."""
    n, s1, s2 = (float(x) for x in sums)
    if n < 2:
        raise ValueError("whitening needs at least 2 policy tokens in the optimizer step")
    mean = s1 / n
    var = max(s2 / n - mean * mean, 0.0) * n / (n - 1)
    return ((adv.double() - mean) / (var + eps) ** 0.5 * mask.double()).to(adv.dtype)


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten over the policy tokens of one tensor (the whole step in one piece)."""
    return whiten_with(values, mask, whiten_sums(values, mask), eps)


def grpo_advantages(rewards: torch.Tensor, group_size: int, std_normalization: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """rewards: [num_samples] ordered by group (group_size consecutive samples per prompt)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if std_normalization and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.view(-1)


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


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        kl: torch.Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T], 0 off the mask; values are the critic's per-token
    estimates. The recursion skips observation tokens (module docstring): the next value and
    the running advantage are carried across them."""
    rew = token_rewards(rewards, mask, kl, kl_coef)
    policy = mask > 0
    values = torch.where(policy, values.float(), torch.zeros_like(rew))
    adv = torch.zeros_like(rew)
    running = torch.zeros(rew.shape[0], dtype=rew.dtype, device=rew.device)
    next_value = torch.zeros_like(running)  # V of the next policy token (0 after the last)
    for t in range(rew.shape[1] - 1, -1, -1):
        step = rew[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        running = torch.where(policy[:, t], step, running)
        next_value = torch.where(policy[:, t], values[:, t], next_value)
        adv[:, t] = torch.where(policy[:, t], step, torch.zeros_like(step))
    return adv, adv + values
