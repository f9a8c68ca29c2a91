"""DP micro-batch schedule benchmark: FLOPs balance, token utilisation and scheduling time.

Two long-tailed length distributions (log-normal around 1.5k tokens capped at 32k; a 70/30 mix of
short math answers ~300 tokens and long code answers ~8k), 100k samples in groups of 8, 16k token
cap, 8/64/512 ranks, one step, default mode (first-fit-decreasing) and the default FLOPs model.
Time is the best of 3 runs of `build_schedule` on 100k samples. The baseline, in the same run on
the same lengths: plain first-fit in arrival order, micro-batches dealt round-robin to the ranks.
`python -m bench.dp_schedule [--samples 100000] [--repeats 3]`.
Final line: RESULT kk_max_over_mean=<worst> rr_max_over_mean=<worst> token_util=<mean>
schedule_100k_s=<worst best-of-3 time>
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from algos.dp_schedule import build_schedule, pack, quadratic_flops

CAP = 16384


def lognormal_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(1500), 1.0, n).round(), 1, 32768).astype(np.int64)


def math_code_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    short = rng.lognormal(np.log(300), 0.5, n)
    long = rng.lognormal(np.log(8000), 0.5, n)
    return np.clip(np.where(rng.random(n) < 0.7, short, long).round(), 1, 32768).astype(np.int64)


def run_one(lengths: np.ndarray, ranks: int, repeats: int):
    groups = np.arange(len(lengths)) // 8
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sched = build_schedule(lengths, groups, num_ranks=ranks, max_tokens_per_mb=CAP)
        times.append(time.perf_counter() - t)
    return sched, min(times)


def round_robin(lengths: np.ndarray, ranks: int) -> tuple[float, float]:
    """Baseline: first-fit in arrival order, micro-batch i to rank i % ranks. Returns (max/mean
    rank FLOPs, token utilisation of the capped micro-batches)."""
    mbs, over = pack(lengths, CAP, mode="first_fit")
    flops = quadratic_flops(lengths.astype(np.float64))
    loads = np.zeros(ranks)
    for i, mb in enumerate(mbs):
        loads[i % ranks] += flops[mb].sum()
    capped = len(mbs) - len(over)
    util = (lengths.sum() - lengths[over].sum()) / (capped * CAP)
    return float(loads.max() / loads.mean()), float(util)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    dists = {"lognormal1.5k": lognormal_lengths(rng, args.samples),
             "math300+code8k": math_code_lengths(rng, args.samples)}
    build_schedule(dists["lognormal1.5k"][:1000], num_ranks=8, max_tokens_per_mb=CAP)  # warm up
    print(f"{'lengths':<16}{'ranks':>6}{'mb/rank':>9}{'oversized':>10}{'kk max/mean':>13}"
          f"{'rr max/mean':>13}{'kk util':>9}{'rr util':>9}{'time_s':>8}")
    rows = []
    for name, lengths in dists.items():
        for ranks in (8, 64, 512):
            s, dt = run_one(lengths, ranks, args.repeats)
            rr, rr_util = round_robin(lengths, ranks)
            rows.append((s.max_over_mean_flops, rr, s.token_utilisation, dt))
            print(f"{name:<16}{ranks:>6}{s.micro_batches_per_rank[0]:>9}{len(s.oversized):>10}"
                  f"{s.max_over_mean_flops:>13.7f}{rr:>13.4f}{s.token_utilisation:>9.4f}"
                  f"{rr_util:>9.4f}{dt:>8.3f}")
    worst = max(r[0] for r in rows)
    rr_worst = max(r[1] for r in rows)
    util = sum(r[2] for r in rows) / len(rows)
    slowest = max(r[3] for r in rows)
    print(f"RESULT kk_max_over_mean={worst:.6f} rr_max_over_mean={rr_worst:.4f} token_util={util:.4f} "
          f"schedule_100k_s={slowest:.3f}")


if __name__ == "__main__":
    main()
