"""Mismatch metrics and corrections against a reference written differently (float64 loops)."""

from __future__ import annotations

import math

import pytest
import torch

from algos.mismatch import MismatchConfig, correction_weights, mismatch_metrics


def reference(train, rollout, mask, low, high):
    """Per-token python loops in float64."""
    toks, seqs = [], []
    for tr, ro, m in zip(train.tolist(), rollout.tolist(), mask.tolist()):
        ds = [a - b for a, b, k in zip(tr, ro, m) if k]
        toks += ds
        if ds:
            seqs.append(math.exp(sum(ds)))
    w = [math.exp(x) for x in toks]
    return {"mismatch/abs_diff_mean": sum(abs(x) for x in toks) / len(toks),
            "mismatch/abs_diff_max": max(abs(x) for x in toks),
            "mismatch/kl_k1": sum(-x for x in toks) / len(toks),
            "mismatch/kl_k3": sum(math.exp(x) - 1 - x for x in toks) / len(toks),
            "mismatch/token_outside_frac": sum(not low <= x <= high for x in w) / len(w),
            "mismatch/seq_outside_frac": sum(not low <= x <= high for x in seqs) / len(seqs),
            "mismatch/token_ratio_mean": sum(w) / len(w), "mismatch/token_ratio_min": min(w),
            "mismatch/token_ratio_max": max(w), "mismatch/seq_ratio_mean": sum(seqs) / len(seqs),
            "mismatch/seq_ratio_min": min(seqs), "mismatch/seq_ratio_max": max(seqs)}


def random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(6, 9, generator=g) * 3
    train = rollout + torch.randn(6, 9, generator=g) * 0.4
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    mask[2] = 0  # a sample with no policy tokens
    return train, rollout, mask


@pytest.mark.parametrize("seed", range(5))
def test_metrics_match_the_float64_reference(seed):
    train, rollout, mask = random_case(seed)
    got = mismatch_metrics(train, rollout, mask, 0.7, 1.4)
    ref = reference(train.double(), rollout.double(), mask, 0.7, 1.4)
    assert set(got) == set(ref)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_tis_truncate_and_clip():
    train, rollout, mask = random_case(7)
    w = torch.exp(train.double() - rollout.double())
    weights, kept = correction_weights(train, rollout, mask, MismatchConfig(correction="tis",
                                                                           high=1.2))
    for b in range(6):
        for t in range(9):
            expect = min(w[b, t].item(), 1.2) if mask[b, t] else 0.0
            assert weights[b, t].item() == pytest.approx(expect, rel=1e-5)
    assert torch.equal(kept, mask)
    weights, _ = correction_weights(train, rollout, mask, MismatchConfig(
        correction="tis", tis_mode="clip", low=0.9, high=1.2))
    assert weights[mask > 0].min() >= 0.9 - 1e-6 and weights.max() <= 1.2 + 1e-6


def test_rejection_token_and_sequence_with_veto():
    rollout = torch.zeros(3, 3)
    train = torch.tensor([[0.0, 0.1, -0.1], [1.0, 0.0, 0.0], [0.0, -3.0, 3.2]])
    mask = torch.ones(3, 3)
    _, tok = correction_weights(train, rollout, mask, MismatchConfig(correction="rejection_token",
                                                                     low=0.5, high=2.0))
    assert tok.tolist() == [[1, 1, 1], [0, 1, 1], [1, 0, 0]]  # e^1 > 2, e^-3 < .5, e^3.2 > 2
    cfg = MismatchConfig(correction="rejection_seq", low=0.5, high=2.0, veto_threshold=0.1)
    _, seq = correction_weights(train, rollout, mask, cfg)
    # sums: 0 -> kept; 1 -> e^1 = 2.7 rejected; 0.2 -> e^.2 kept by ratio but vetoed (e^-3 < .1)
    assert seq.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    _, seq = correction_weights(train, rollout, mask, MismatchConfig(
        correction="rejection_seq", low=0.5, high=2.0))
    assert seq[2].tolist() == [1, 1, 1]  # without the veto the third sequence stays


def test_incompatible_options_name_both():
    with pytest.raises(ValueError, match="bypass = true and correction = 'tis' conflict"):
        MismatchConfig(bypass=True, correction="tis")
    with pytest.raises(ValueError, match="correction = 'is'"):
        MismatchConfig(correction="is")
    with pytest.raises(ValueError, match="low < 1 < high"):
        MismatchConfig(low=1.5)
