"""KL estimators between a policy and a reference on tokens sampled from the policy.

With `log_ratio = logp - logp_ref` (per token):
- k1 = log_ratio (unbiased, high variance, can be negative);
- k2 = log_ratio**2 / 2;
- k3 = exp(-log_ratio) - 1 + log_ratio (unbiased for KL(policy || ref), never negative, low
  variance; "low_var_kl"), the estimate clamped to [-K3_CLAMP, K3_CLAMP] as the source clamps
  it: one token whose policy is far below the reference (exp(-log_ratio) grows without bound)
  would otherwise dominate the batch's KL, and its gradient stops there.
Invariant: pure elementwise tensor functions in float32; masking and reduction are the caller's.
"""

from __future__ import annotations

import torch

from algos.estimators import KL_ESTIMATORS as ESTIMATORS

K3_CLAMP = 10.0  # bound on each token's k3 estimate (nats)


def approx_kl(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    log_ratio = logp.float() - logp_ref.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio.pow(2) / 2
    if kind == "k3":
        return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; use one of {ESTIMATORS}")
