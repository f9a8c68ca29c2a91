"""Train-rollout mismatch: metrics and corrections, as pure tensor functions.

Notation per policy token t of sample i: `rollout_logp` from the inference engine (behaviour
policy), `train_logp` recomputed by the trainer (the policy the loss assumes), mask m (1 = policy
token), token log-ratio `d = train_logp - rollout_logp`, token importance weight `w = exp(d)`,
sequence log-ratio `D_i = sum_t d_t m_t`, sequence weight `W_i = exp(D_i)`.

Metrics (`mismatch_metrics`), each a float:
- `mismatch/abs_diff_mean`, `mismatch/abs_diff_max`: mean and max |d| over policy tokens;
- `mismatch/token_ratio_mean|min|max`: of w over policy tokens;
- `mismatch/seq_ratio_mean|min|max`: of W over sequences (with at least one policy token);
- `mismatch/kl_k1`: mean of -d (k1 estimate of KL(rollout || train) on rollout samples);
- `mismatch/kl_k3`: mean of exp(d) - 1 - d (non-negative estimate of the same KL);
- `mismatch/token_outside_frac`, `mismatch/seq_outside_frac`: share of tokens (sequences)
  whose weight lies outside [low, high].

Corrections (`correction_weights`), returning per-token loss weights and a per-token mask:
- `tis`: truncated importance sampling, weight `min(w, high)` (mode "truncate") or
  `clamp(w, low, high)` (mode "clip"), no gradient through it;
- `rejection_token`: mask tokens whose w is outside [low, high];
- `rejection_seq`: mask whole sequences whose W is outside [low, high], and veto (mask) any
  sequence containing a token with w < veto_threshold.
- `decoupled`: decoupled PPO with three policies: behaviour pi_b (the rollout's log-probs),
  proximal pi_prox (the old actor: the trainer's weights at the start of the step, recomputed on
  the training micro-batches) and target pi_theta (the weights being trained). Per token,
  `L_t = w_t * max(-r_t A_t, -clamp(r_t, 1 - eps, 1 + eps_high) A_t)` with the trust-region
  ratio `r_t = pi_theta / pi_prox` and the behaviour weight `w_t = pi_prox / pi_b` (detached).
  A token whose w exceeds `high` is masked out (not truncated: its sample came from a policy too
  far from the proximal one); w below 1 is kept as is. Here `train_logp` is log pi_prox.
  Which weights are the proximal policy (`proximal`): "current", the trainer's weights at the
  start of the step (the trust region is around the policy being updated; w corrects both the
  staleness and the engine mismatch), or "rollout_version", for each sample the trainer's copy
  of the weights that generated it, kept as old-actor weight sets by version (w then corrects
  the engine mismatch alone and r spans the staleness, so the clip bounds the update relative
  to the behaviour weights).
A token the correction masks (rejection, decoupled's cap) leaves the policy loss's numerator
only: each sample's denominator stays its policy-token count before rejection (the source's;
`algos.policy_loss` `sample_tokens`), and the entropy bonus and the KL loss keep every policy
token, so rejecting part of a sample lowers its weight rather than scaling up what is left.
Invariant: no function changes its inputs; weights are detached.
"""

from __future__ import annotations

import torch

from algos.mismatch_config import (  # noqa: F401 - the table: also read from here
    CORRECTIONS,
    PROXIMAL,
    MismatchConfig,
)


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {f"{prefix}_mean": 1.0, f"{prefix}_min": 1.0, f"{prefix}_max": 1.0}
    return {f"{prefix}_mean": float(x.mean()), f"{prefix}_min": float(x.min()),
            f"{prefix}_max": float(x.max())}


def mismatch_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                     low: float = 0.5, high: float = 2.0) -> dict[str, float]:
    m = mask.bool()
    d = (train_logp.float() - rollout_logp.float())
    tok = d[m]
    w = torch.exp(tok)
    has = m.any(dim=1)
    seq_w = torch.exp((d * mask.float()).sum(dim=1))[has]
    out = {"mismatch/abs_diff_mean": float(tok.abs().mean()) if tok.numel() else 0.0,
           "mismatch/abs_diff_max": float(tok.abs().max()) if tok.numel() else 0.0,
           "mismatch/kl_k1": float((-tok).mean()) if tok.numel() else 0.0,
           "mismatch/kl_k3": float((w - 1 - tok).mean()) if tok.numel() else 0.0,
           "mismatch/token_outside_frac": float(((w < low) | (w > high)).float().mean())
           if tok.numel() else 0.0,
           "mismatch/seq_outside_frac": float(((seq_w < low) | (seq_w > high)).float().mean())
           if seq_w.numel() else 0.0}
    out |= _stats("mismatch/token_ratio", w) | _stats("mismatch/seq_ratio", seq_w)
    return out


def correction_weights(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                       cfg: MismatchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss weights, per-token mask), both [B, T], detached."""
    with torch.no_grad():
        d = train_logp.float() - rollout_logp.float()
        w = torch.exp(d)
        mask = mask.float()
        ones = torch.ones_like(w)
        if cfg.correction == "tis":
            weights = w.clamp(max=cfg.high) if cfg.tis_mode == "truncate" \
                else w.clamp(cfg.low, cfg.high)
            return weights * mask, mask
        if cfg.correction == "rejection_token":
            keep = ((w >= cfg.low) & (w <= cfg.high)).float()
            return ones * mask * keep, mask * keep
        if cfg.correction == "rejection_seq":
            seq_w = torch.exp((d * mask).sum(dim=1))
            keep = (seq_w >= cfg.low) & (seq_w <= cfg.high)
            veto = ((w < cfg.veto_threshold) & (mask > 0)).any(dim=1)
            keep = (keep & ~veto).float()[:, None]
            return ones * mask * keep, mask * keep
        if cfg.correction == "decoupled":
            keep = (w <= cfg.high).float() * mask
            return w * keep, keep
        return ones * mask, mask
