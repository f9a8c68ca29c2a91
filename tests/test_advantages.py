"""Estimators, KL and the dual clip against hand-computed values and a float64 loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from algos.advantages import gae, sample_scores, token_advantages, token_rewards, whiten
from algos.kl import approx_kl
from algos.policy_loss import ppo_clip_loss


def test_kl_estimators_hand_computed():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.4)])
    lr = [math.log(2), math.log(0.5)]
    assert approx_kl(logp, ref, "k1").tolist() == pytest.approx(lr, rel=1e-6)
    assert approx_kl(logp, ref, "k2").tolist() == pytest.approx([x * x / 2 for x in lr], rel=1e-6)
    assert approx_kl(logp, ref, "k3").tolist() == pytest.approx(
        [math.exp(-x) - 1 + x for x in lr], rel=1e-6)
    assert (approx_kl(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    with pytest.raises(ValueError, match="k1"):
        approx_kl(logp, ref, "k4")


def test_k3_estimate_is_clamped_to_ten():
    """The source clamps the k3 (low_var_kl) estimate, not the log-ratio, to [-10, 10]."""
    lr = [-15.0, -2.0, 0.5, 11.0, 15.0]
    logp = torch.tensor(lr, requires_grad=True)
    kl = approx_kl(logp, torch.zeros(5), "k3")
    raw = [math.exp(-x) - 1 + x for x in lr]  # 3.27e6, 4.389, 0.1065, 10.00002, 14.0000003
    assert kl.tolist() == pytest.approx([min(r, 10.0) for r in raw], rel=1e-6)
    kl.sum().backward()
    # d/d lr (exp(-lr) - 1 + lr) = 1 - exp(-lr) inside the clamp, 0 where it binds
    assert logp.grad.tolist() == pytest.approx([0.0, 1 - math.exp(2.0), 1 - math.exp(-0.5),
                                                0.0, 0.0], rel=1e-6)


def test_token_rewards_put_the_reward_on_the_last_policy_token():
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    kl = torch.full((2, 5), 0.5)
    rew = token_rewards(torch.tensor([1.0, 2.0]), mask, kl, kl_coef=0.1)
    assert rew.flatten().tolist() == pytest.approx([-0.05, -0.05, 0.0, 0.95, 0.0,
                                                    1.95, 0.0, 0.0, 0.0, 0.0])


def loop_gae(r, v, gamma, lam):
    """Independent float64 reference: explicit sums over future deltas."""
    T = len(r)
    delta = [r[t] + gamma * (v[t + 1] if t + 1 < T else 0.0) - v[t] for t in range(T)]
    adv = [sum((gamma * lam) ** k * delta[t + k] for k in range(T - t)) for t in range(T)]
    return adv, [a + x for a, x in zip(adv, v)]


def test_gae_matches_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(3, 6)
    mask[1, 4:] = 0
    values = torch.randn(3, 6, generator=g) * mask
    rewards = torch.tensor([1.0, -0.5, 0.25])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    rew = token_rewards(rewards, mask)
    for b in range(3):
        ref_adv, ref_ret = loop_gae(rew[b].double().tolist(), values[b].double().tolist(), 0.9,
                                    0.8)
        assert adv[b].tolist() == pytest.approx(ref_adv, abs=1e-5)
        assert ret[b].tolist() == pytest.approx(ref_ret, abs=1e-5)


def test_gae_skips_observation_tokens_with_a_perfect_critic():
    """V = 1 everywhere, reward 1 at the end, 40 tool-output tokens inside the response: every
    policy token has A = 0 and return 1 (the value is 0 only after the last policy token)."""
    mask = torch.ones(1, 50)
    mask[0, 5:45] = 0
    adv, ret = gae(torch.tensor([1.0]), torch.ones(1, 50), mask, gamma=1.0, lam=0.95)
    policy = mask[0] > 0
    assert adv[0, 4].item() == pytest.approx(0.0, abs=1e-6)
    assert ret[0, 4].item() == pytest.approx(1.0, abs=1e-6)
    assert adv[0][policy].abs().max().item() < 1e-6
    assert ret[0][policy].tolist() == pytest.approx([1.0] * 10, abs=1e-6)
    assert adv[0][~policy].abs().max().item() == 0.0


def test_gae_carries_value_and_advantage_across_observation_tokens():
    """Against float64 GAE on each row's policy tokens alone, the observation tokens removed
    (their values and KL are noise that must not enter)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0],
                         [1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0],
                         [0, 0, 1, 1, 0, 1, 1, 1, 1, 1, 0]], dtype=torch.float)
    values = torch.randn(3, 11, generator=g)
    kl = torch.rand(3, 11, generator=g)
    rewards = torch.tensor([1.0, -0.5, 0.25])
    gamma, lam, coef = 0.9, 0.8, 0.1
    adv, ret = gae(rewards, values, mask, kl, coef, gamma, lam)
    for b in range(3):
        idx = [t for t in range(11) if mask[b, t] > 0]
        r = [-coef * float(kl[b, t]) for t in idx]
        r[-1] += float(rewards[b])
        ref_adv, ref_ret = loop_gae(r, [float(values[b, t]) for t in idx], gamma, lam)
        assert [float(adv[b, t]) for t in idx] == pytest.approx(ref_adv, abs=1e-5)
        assert [float(ret[b, t]) for t in idx] == pytest.approx(ref_ret, abs=1e-5)
        off = [t for t in range(11) if mask[b, t] == 0]
        assert [float(adv[b, t]) for t in off] == [0.0] * len(off)
        assert [float(ret[b, t]) for t in off] == [0.0] * len(off)


def test_reinforce_pp_returns_then_whitening():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    raw_adv, _ = token_advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0]), mask, gamma=0.5)
    adv = whiten(raw_adv, mask)
    raw = [0.25, 0.5, 1.0, 0.0, 0.0]  # G_t = 0.5^(2-t) * 1 for sample 0; zeros for sample 1
    mean = sum(raw) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 4 + 1e-8)
    expected = [(x - mean) / std for x in raw]
    got = adv[0].tolist() + adv[1, :2].tolist()
    assert got == pytest.approx(expected, rel=1e-5)
    assert adv[1, 2] == 0  # padding stays zero


def test_reinforce_pp_baseline_removes_the_group_mean():
    mask = torch.ones(4, 2)
    est = "reinforce_plus_plus_baseline"
    scores = sample_scores(est, [1.0, 0.0, 3.0, 3.0], [0, 0, 1, 1])
    adv = whiten(token_advantages(est, scores, mask)[0], mask)
    centred = [0.5, 0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    std = math.sqrt(sum(x * x for x in centred) / 7 + 1e-8)
    assert adv.flatten().tolist() == pytest.approx([x / std for x in centred], rel=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        whiten(torch.ones(1, 1), torch.ones(1, 1))


def test_dual_clip_bounds_negative_advantage_loss():
    # ratio 5 with A = -1: plain PPO loss max(5, 1.2) = 5; dual clip c = 3 caps it at 3
    logp = torch.tensor([[math.log(0.5)]])
    old = torch.tensor([[math.log(0.1)]])
    plain = ppo_clip_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1), 1)
    dual = ppo_clip_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1), 1, dual_clip_c=3.0)
    assert plain.loss.item() == pytest.approx(5.0, rel=1e-6)
    assert dual.loss.item() == pytest.approx(3.0, rel=1e-6)
    pos = ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), 1, dual_clip_c=3.0)
    assert pos.loss.item() == pytest.approx(-1.2, rel=1e-6)  # positive A: unaffected
    asym = ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), 1, eps_clip=0.2,
                         eps_clip_high=0.28)
    assert asym.loss.item() == pytest.approx(-1.28, rel=1e-6)
    with pytest.raises(ValueError, match="> 1"):
        ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), 1, dual_clip_c=0.5)
