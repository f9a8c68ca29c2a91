"""Estimators by name, batch-wide whitening, the value loss and decoupled PPO, against hand values
and a float64 reference written with plain Python floats."""

from __future__ import annotations

import math
import random

import pytest
import torch

from algos.advantages import (
    ESTIMATORS,
    check_estimator,
    sample_scores,
    token_advantages,
    whiten,
    whiten_sums,
    whiten_with,
)
from algos.mismatch import MismatchConfig, correction_weights
from algos.policy_loss import ppo_clip_loss
from algos.value import value_loss

R = [1.0, 0.0, 0.5, 2.0]
G = ["a", "a", "b", "b"]


def test_sample_scores_per_estimator_hand_computed():
    s = 0.5 / math.sqrt(0.5)  # (r - mean) / unbiased std of a two-sample group
    assert sample_scores("grpo", R, G).tolist() == pytest.approx([s, -s, -s, s], rel=1e-5)
    centred = [0.5, -0.5, -0.75, 0.75]
    assert sample_scores("dr_grpo", R, G).tolist() == pytest.approx(centred)
    assert sample_scores("reinforce_plus_plus_baseline", R, G).tolist() == pytest.approx(centred)
    assert sample_scores("reinforce_plus_plus", R, G).tolist() == R
    assert sample_scores("ppo", R, G).tolist() == R
    with pytest.raises(ValueError, match="advantage_estimator = 'gae'"):
        sample_scores("gae", R, G)


def test_estimator_table_says_what_each_needs():
    """The records the step and the config read: which are whitened, take KL reward shaping,
    need a critic; an unknown name names every choice."""
    assert {n for n, e in ESTIMATORS.items() if e.whitened} == {
        "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"}
    assert {n for n, e in ESTIMATORS.items() if e.token_rewards} == {
        "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"}
    assert [n for n, e in ESTIMATORS.items() if e.needs_critic] == ["ppo"]
    with pytest.raises(ValueError, match="advantage_estimator = 'gae'; use one of grpo, dr_grpo, "
                       "reinforce_plus_plus, reinforce_plus_plus_baseline, ppo, none"):
        check_estimator("gae")
    with pytest.raises(ValueError, match="use one of grpo"):
        sample_scores("gae", [1.0], [0])


def test_token_advantages_hand_computed():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.2, 0.4, 9.0]])
    # REINFORCE++: rew = [-0.5*0.2, -0.5*0.4 + 1, 0]; G_t with gamma 0.5
    adv, ret = token_advantages("reinforce_plus_plus", torch.tensor([1.0]), mask, kl, 0.5,
                                gamma=0.5)
    assert adv.tolist()[0] == pytest.approx([-0.1 + 0.5 * 0.8, 0.8, 0.0]) and ret is None
    adv, _ = token_advantages("reinforce_plus_plus_baseline", torch.tensor([0.5]), mask, kl, 0.5)
    assert adv.tolist()[0] == pytest.approx([0.4, 0.3, 0.0])
    adv, _ = token_advantages("grpo", torch.tensor([0.7]), mask)
    assert adv.tolist()[0] == pytest.approx([0.7, 0.7, 0.0])
    # GAE, gamma 0.9, lambda 0.8: delta_1 = 1 - 0.25, delta_0 = 0.9*0.25 - 0.5
    values = torch.tensor([[0.5, 0.25, 7.0]])
    adv, ret = token_advantages("ppo", torch.tensor([1.0]), mask, values=values, gamma=0.9,
                                lam=0.8)
    assert adv.tolist()[0] == pytest.approx([-0.275 + 0.72 * 0.75, 0.75, 0.0])
    assert ret.tolist()[0] == pytest.approx([0.265 + 0.5, 0.75 + 0.25, 0.0])


def test_whitening_over_micro_batches_equals_whole_batch():
    a1, m1 = torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    a2, m2 = torch.tensor([[5.0, 9.0]]), torch.tensor([[1.0, 0.0]])
    sums = whiten_sums(a1, m1) + whiten_sums(a2, m2)
    std = math.sqrt(((1.75 ** 2 + 0.75 ** 2 + 0.25 ** 2 + 2.25 ** 2) / 3) + 1e-8)
    got = whiten_with(a1, m1, sums)
    assert got.flatten().tolist() == pytest.approx([-1.75 / std, -0.75 / std, 0.25 / std, 0.0],
                                                   rel=1e-6)
    assert whiten_with(a2, m2, sums)[0].tolist() == pytest.approx([2.25 / std, 0.0], rel=1e-6)
    whole = whiten(torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 9.0]]),
                   torch.cat([m1, m2]))
    assert torch.allclose(torch.cat([got, whiten_with(a2, m2, sums)]), whole, atol=1e-6)


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old, returns = torch.tensor([[0.5, 0.1]]), torch.tensor([[2.0, -0.5]])
    loss, frac = value_loss(values, old, returns, torch.ones(1, 2), 2, value_clip=0.2)
    # token 0: V moved 0.5 > 0.2, clipped value 0.7: max(1.0, 1.69); token 1: inside the clip
    assert loss.item() == pytest.approx((1.69 + 0.25) / 2 / 2, rel=1e-6)
    assert frac == 0.5
    loss.backward()
    assert values.grad.tolist()[0] == pytest.approx([0.0, 2 * 0.5 / 2 / 2])
    plain, _ = value_loss(values, old, returns, torch.ones(1, 2), 2, value_clip=0.0)
    assert plain.item() == pytest.approx((1.0 + 0.25) / 2 / 2)


def decoupled_reference(logp, prox, behav, adv, mask, n_step, eps, eps_high, cap):
    """Plain-float decoupled PPO: (loss, d loss / d logp); a masked token leaves the sum, not
    the sample's token count (the source's denominator)."""
    loss, grads = 0.0, []
    for i in range(len(logp)):
        per_tok, row_grad = [], []
        for t in range(len(logp[i])):
            w = math.exp(prox[i][t] - behav[i][t])
            if not mask[i][t] or w > cap:
                per_tok.append(None)
                continue
            r = math.exp(logp[i][t] - prox[i][t])
            clipped_r = min(max(r, 1 - eps), 1 + eps_high)
            unclipped, clipped = -r * adv[i], -clipped_r * adv[i]
            per_tok.append((w * max(unclipped, clipped), w * unclipped if unclipped >= clipped
                            else 0.0))
        n = max(sum(mask[i]), 1)
        loss += sum(v for v, _ in filter(None, per_tok)) / n / n_step
        row_grad = [0.0 if p is None else p[1] / n / n_step for p in per_tok]
        grads.append(row_grad)
    return loss, grads


def test_decoupled_ppo_matches_float64_reference():
    rng = random.Random(7)
    B, T = 5, 6
    logp = [[math.log(rng.uniform(0.05, 0.95)) for _ in range(T)] for _ in range(B)]
    prox = [[x + rng.uniform(-0.4, 0.4) for x in row] for row in logp]
    behav = [[x + rng.uniform(-1.0, 1.0) for x in row] for row in prox]
    mask = [[int(rng.random() > 0.2) for _ in range(T)] for _ in range(B)]
    adv = [rng.uniform(-1, 1) for _ in range(B)]
    cfg = MismatchConfig(correction="decoupled", high=1.5)
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    lp = t(logp).requires_grad_(True)
    weights, keep = correction_weights(t(prox), t(behav), t(mask), cfg)
    assert 0 < float(keep.sum()) < float(t(mask).sum())  # the cap masks some tokens
    terms = ppo_clip_loss(lp, t(prox), t(adv), keep, 8, 0.2, 0.28, None, weights,
                          sample_tokens=t(mask).sum(dim=1))
    terms.loss.backward()
    ref_loss, ref_grad = decoupled_reference(logp, prox, behav, adv, mask, 8, 0.2, 0.28, 1.5)
    assert terms.loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert torch.allclose(lp.grad.double(), torch.tensor(ref_grad, dtype=torch.float64),
                          atol=1e-6)
    # the plain PPO loss (no behaviour weight, nothing masked) differs
    plain = ppo_clip_loss(t(logp), t(prox), t(adv), t(mask), 8, 0.2, 0.28)
    assert plain.loss.item() != pytest.approx(ref_loss, rel=1e-3)
