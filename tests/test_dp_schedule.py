"""DP micro-batch schedule: invariants over random cases, KK against brute force, hand examples."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from algos.dp_schedule import (
    build_schedule,
    distribute,
    equalise,
    karmarkar_karp,
    pack,
    quadratic_flops,
    transformer_flops,
)


def check_invariants(sched, lengths, groups, num_ranks, cap, steps):
    seen = [i for step in sched.steps for rank in step for mb in rank for i in mb]
    assert sorted(seen) == list(range(len(lengths)))  # every sample exactly once
    assert len(sched.steps) == steps
    step_of = {}
    for s, step in enumerate(sched.steps):
        assert len(step) == num_ranks
        assert len({len(rank) for rank in step}) == 1  # same micro-batch count on every rank
        for rank in step:
            for mb in rank:
                assert mb
                tokens = sum(lengths[i] for i in mb)
                if tokens > cap:
                    assert len(mb) == 1 and mb[0] in sched.oversized
                for i in mb:
                    step_of[i] = s
    assert sorted(sched.oversized) == [i for i, x in enumerate(lengths) if x > cap]
    for g in set(groups):
        assert len({step_of[i] for i, gi in enumerate(groups) if gi == g}) == 1
    assert 0 < sched.token_utilisation <= 1 or len(sched.oversized) == len(lengths)
    assert sched.max_over_mean_flops >= 1 - 1e-12


def random_case(rng):
    cap = rng.choice([8, 16, 100, 1000])
    n_groups = rng.randint(1, 40)
    sizes = [rng.randint(1, 6) for _ in range(n_groups)]
    groups = [g for g, k in enumerate(sizes) for _ in range(k)]
    rng.shuffle(groups)
    lengths = [max(1, int(rng.paretovariate(1.5) * cap / 6)) for _ in groups]
    return lengths, groups, cap


def test_invariants_on_random_cases():
    rng = random.Random(1234)
    ran = 0
    for case in range(400):
        lengths, groups, cap = random_case(rng)
        num_ranks = rng.choice([1, 2, 3, 4, 8])
        steps = rng.randint(1, min(3, len(set(groups))))
        mode = rng.choice(["first_fit", "first_fit_decreasing", "fixed"])
        mbs = rng.randint(1, 4) if mode == "fixed" else None
        try:
            sched = build_schedule(lengths, groups, num_ranks=num_ranks, max_tokens_per_mb=cap,
                                   steps=steps, mode=mode, micro_batch_size=mbs)
        except ValueError as e:
            assert "needs at least" in str(e), (case, e)
            continue
        check_invariants(sched, lengths, groups, num_ranks, cap, steps)
        ran += 1
    assert ran > 250  # most random cases are schedulable


def test_fixed_mode_respects_micro_batch_size_and_order():
    rng = random.Random(7)
    for _ in range(200):
        lengths = [rng.randint(1, 12) for _ in range(rng.randint(1, 30))]
        size = rng.randint(1, 5)
        mbs, over = pack(lengths, 10, "fixed", size)
        flat = [i for mb in mbs for i in mb]
        assert flat == [i for i, x in enumerate(lengths) if x <= 10] + over
        assert all(len(mb) <= size for mb in mbs)


def test_equalise_keeps_cap_and_hits_multiple():
    rng = random.Random(99)
    for _ in range(300):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 60))]
        ranks = rng.randint(1, 8)
        mbs, _ = pack(lengths, 64, rng.choice(["first_fit", "first_fit_decreasing"]))
        if len(lengths) < -(-len(mbs) // ranks) * ranks:
            with pytest.raises(ValueError, match="give the step >="):
                equalise(mbs, lengths, ranks)
            continue
        out = equalise(mbs, lengths, ranks)
        assert len(out) % ranks == 0 and len(out) >= ranks
        assert sorted(i for mb in out for i in mb) == list(range(len(lengths)))
        assert max(sum(lengths[i] for i in mb) for mb in out) <= 64


# --------------------------------------------------------------------------- Karmarkar-Karp


def brute_force_max(weights, k):
    n, size = len(weights), len(weights) // k
    best = float("inf")
    for labels in itertools.product(range(k), repeat=n):
        if labels[0] != 0 or any(labels.count(r) != size for r in range(k)):
            continue
        loads = [0.0] * k
        for w, r in zip(weights, labels):
            loads[r] += w
        best = min(best, max(loads))
    return best


def max_load(parts, weights):
    return max(sum(weights[i] for i in p) for p in parts)


def check_equal_parts(parts, n, k):
    assert len(parts) == k and len({len(p) for p in parts}) == 1
    assert sorted(i for p in parts for i in p) == list(range(n))


def test_kk_optimal_for_one_or_two_items_per_part():
    # n == k is trivial; n == 2k pairs the i-th smallest with the i-th largest, which is optimal.
    rng = random.Random(5)
    for _ in range(150):
        k = rng.randint(1, 4)
        n = k * rng.choice([1, 2])
        w = [rng.randint(1, 100) for _ in range(n)]
        parts = karmarkar_karp(w, k)
        check_equal_parts(parts, n, k)
        assert max_load(parts, w) == brute_force_max(w, k)


def test_kk_within_proven_bound_of_brute_force():
    # Merging two states never widens the spread past the wider input's, so
    # max_KK <= mean + (w_max - w_min) <= OPT + (w_max - w_min). KK is NOT always optimal.
    rng = random.Random(11)
    worst_ratio, suboptimal = 1.0, 0
    for _ in range(200):
        k = rng.choice([2, 2, 3])
        n = k * (4 if k == 2 else 2) if rng.random() < 0.5 else k * 3
        w = [rng.randint(1, 100) for _ in range(n)]
        parts = karmarkar_karp(w, k)
        check_equal_parts(parts, n, k)
        got, opt = max_load(parts, w), brute_force_max(w, k)
        assert opt <= got <= sum(w) / k + max(w) - min(w) + 1e-9
        assert max_load(distribute(w, k), w) <= got  # the polish never raises the max
        worst_ratio = max(worst_ratio, got / opt)
        suboptimal += got > opt
    assert suboptimal > 0  # honest: KK misses the optimum on some tiny cases...
    assert worst_ratio < 1.2  # ...but stays close (observed about 1.09 on this seed)


def test_kk_hand_computed_and_errors():
    parts = karmarkar_karp([1, 2, 3, 4], 2)
    assert sorted(sorted(p) for p in parts) == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="multiple of num_parts"):
        karmarkar_karp([1, 2, 3], 2)


# --------------------------------------------------------------------------- hand examples


def test_pack_hand_computed():
    assert pack([5, 3, 4, 2], 8, "first_fit") == ([[0, 1], [2, 3]], [])
    # first-fit in input order needs 4 bins; decreasing order needs 3
    assert pack([3, 3, 3, 7, 7, 7], 10, "first_fit") == ([[0, 1, 2], [3], [4], [5]], [])
    assert pack([3, 3, 3, 7, 7, 7], 10, "first_fit_decreasing") == ([[3, 0], [4, 1], [5, 2]], [])
    assert pack([20, 3], 10, "first_fit") == ([[1], [0]], [0])
    assert pack([1, 1, 1, 1, 1], 10, "fixed", 2) == ([[0, 1], [2, 3], [4]], [])
    assert pack([1, 2, 1], 2, "fixed", 5) == ([[0], [1], [2]], [])


def test_equalise_hand_computed():
    # largest multi-sample micro-batch [0,1,2] (9 tokens) splits into [0] (4) and [1,2] (5)
    assert equalise([[0, 1, 2], [3]], [4, 3, 2, 5], 3) == [[0], [3], [1, 2]]


def test_flops_models_hand_computed():
    # s=2, everything else 1: qkv 4+8, attn 4+4, out 4, mlp 12 -> 36 per layer; LM head 4
    assert transformer_flops(2, 1, 1, 1, 1, 1, 1, 1) == 40.0
    assert transformer_flops(np.array([2, 2]), 1, 1, 1, 1, 1, 1, 1).tolist() == [40.0, 40.0]
    assert quadratic_flops(3, linear_coef=2) == 15.0


def test_schedule_metrics_hand_computed():
    s = build_schedule([8, 8], num_ranks=2, max_tokens_per_mb=8, flops=lambda x: x)
    assert s.max_over_mean_flops == 1.0 and s.token_utilisation == 1.0
    s = build_schedule([8, 4], num_ranks=2, max_tokens_per_mb=8, flops=lambda x: x)
    assert s.max_over_mean_flops == pytest.approx(8 / 6) and s.token_utilisation == 0.75
    s = build_schedule([20, 4, 4], num_ranks=1, max_tokens_per_mb=8, flops=lambda x: x)
    assert s.oversized == [0] and s.steps == [[[[1, 2], [0]]]] and s.token_utilisation == 1.0


def test_groups_split_into_steps():
    s = build_schedule([1] * 8, [0, 0, 1, 1, 2, 2, 3, 3], num_ranks=1, max_tokens_per_mb=2, steps=2)
    assert [sorted(i for mb in step[0] for i in mb) for step in s.steps] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert s.micro_batches_per_rank == [2, 2]


def test_scalar_only_flops_model_is_accepted():
    s = build_schedule([3, 5, 7, 9], num_ranks=2, max_tokens_per_mb=8, flops=lambda x: float(int(x)))
    assert s.max_over_mean_flops == pytest.approx(1.0)


# --------------------------------------------------------------------------- errors


def test_too_few_samples_for_ranks():
    with pytest.raises(ValueError, match=r"step 0 has 3 samples but needs at least 4 .*fewer ranks"):
        build_schedule([1, 1, 1], num_ranks=4, max_tokens_per_mb=8)
    with pytest.raises(ValueError, match="step 1 has 2 samples but needs at least 3"):
        build_schedule([1] * 5, [0, 0, 0, 1, 1], num_ranks=3, max_tokens_per_mb=8, steps=2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown packing mode 'best_fit'; use one of first_fit"):
        build_schedule([1, 2], num_ranks=1, max_tokens_per_mb=8, mode="best_fit")
    with pytest.raises(ValueError, match="needs micro_batch_size >= 1"):
        build_schedule([1, 2], num_ranks=1, max_tokens_per_mb=8, mode="fixed")
    with pytest.raises(ValueError, match="steps=3 but only 2 groups.*use steps <= 2"):
        build_schedule([1] * 4, [0, 0, 1, 1], num_ranks=1, max_tokens_per_mb=8, steps=3)
    with pytest.raises(ValueError, match="positive integers"):
        build_schedule([1, 0], num_ranks=1, max_tokens_per_mb=8)
    with pytest.raises(ValueError, match="num_ranks must be an integer >= 1"):
        build_schedule([1, 2], num_ranks=0, max_tokens_per_mb=8)
    with pytest.raises(ValueError, match="group_ids has 1 entries for 2 lengths"):
        build_schedule([1, 2], [0], num_ranks=1, max_tokens_per_mb=8)
    with pytest.raises(ValueError, match="finite, non-negative"):
        build_schedule([1, 2], num_ranks=1, max_tokens_per_mb=8, flops=lambda x: -x)


def test_100k_samples_schedule_quickly():
    import time

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(1500), 1.0, 100_000).round(), 1, 32768).astype(int)
    t = time.perf_counter()
    s = build_schedule(lengths, num_ranks=512, max_tokens_per_mb=16384)
    assert time.perf_counter() - t < 2.0  # loose bound here; the bench measures the 0.5 s target
    assert s.max_over_mean_flops <= 1.001
