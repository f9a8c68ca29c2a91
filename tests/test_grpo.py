"""GRPO advantages and PPO-clip loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from algos.advantages import grpo_advantages
from algos.policy_loss import ppo_clip_loss


def test_grpo_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = grpo_advantages(r, group_size=4)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1,0,0,1]
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6)] * 1
    assert a[0].item() == pytest.approx(expected[0], rel=1e-6)
    assert a[1].item() == pytest.approx(expected[1], rel=1e-6)
    assert torch.all(a[4:] == 0)  # identical rewards: no signal
    dr = grpo_advantages(r, group_size=4, std_normalization=False)
    assert dr[:4].tolist() == [0.5, -0.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(r, group_size=3)


def test_ppo_clip_loss_hand_computed():
    # one sample, three tokens; the third is masked out (an observation token)
    logp = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.1)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.9), math.log(0.9)]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.tensor([2.0])
    t = ppo_clip_loss(logp, old, adv, mask, num_samples_in_step=2, eps_clip=0.2)
    # token 0: ratio 2 -> clipped to 1.2: max(-4, -2.4) = -2.4 (clipped); token 1: ratio 1 -> -2
    expected = (-2.4 + -2.0) / 2 / 2
    assert t.loss.item() == pytest.approx(expected, rel=1e-6)
    assert t.clipfrac == pytest.approx(0.5)
    assert t.ppo_kl == pytest.approx(-(math.log(2) + 0) / 2, rel=1e-6)
    t.loss.backward()
    # clipped token has zero gradient; unclipped: d(-ratio*A)/dlogp = -ratio*A = -2, / 2 tokens / 2
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.5, 0.0])


def test_negative_advantage_clips_low_side():
    logp = torch.tensor([[math.log(0.1)]])
    old = torch.tensor([[math.log(0.5)]])  # ratio 0.2 < 0.8
    t = ppo_clip_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 1), 1, eps_clip=0.2)
    assert t.loss.item() == pytest.approx(0.8)  # max(0.2, 0.8)
    assert t.clipfrac == 1.0
