"""DP micro-batch schedule benchmark: FLOPs balance, token utilisation and scheduling time.

Two long-tailed length distributions (log-normal around 1.5k tokens capped at 32k; a 70/30 mix of
short math answers ~300 tokens and long code answers ~8k), 100k samples in groups of 8, 16k token
cap, 8/64/512 ranks, one step, default mode (first-fit-decreasing) and the default FLOPs model.
Time is the best of 3 runs of `build_schedule` on 100k samples.
`python -m bench.dp_schedule [--samples 100000] [--repeats 3]`.
Final line: RESULT max_over_mean=<worst> token_util=<mean> schedule_100k_s=<worst best-of-3 time>
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from algos.dp_schedule import build_schedule

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    dists = {"lognormal1.5k": lognormal_lengths(rng, args.samples),
             "math300+code8k": math_code_lengths(rng, args.samples)}
    build_schedule(dists["lognormal1.5k"][:1000], num_ranks=8, max_tokens_per_mb=CAP)  # warm up
    print(f"{'lengths':<16}{'ranks':>6}{'mb/rank':>9}{'oversized':>10}{'max/mean':>12}{'token_util':>12}{'time_s':>9}")
    rows = []
    for name, lengths in dists.items():
        for ranks in (8, 64, 512):
            s, dt = run_one(lengths, ranks, args.repeats)
            rows.append((s.max_over_mean_flops, s.token_utilisation, dt))
            print(f"{name:<16}{ranks:>6}{s.micro_batches_per_rank[0]:>9}{len(s.oversized):>10}"
                  f"{s.max_over_mean_flops:>12.7f}{s.token_utilisation:>12.4f}{dt:>9.3f}")
    worst = max(r[0] for r in rows)
    util = sum(r[1] for r in rows) / len(rows)
    slowest = max(r[2] for r in rows)
    print(f"RESULT max_over_mean={worst:.6f} token_util={util:.4f} schedule_100k_s={slowest:.3f}")


if __name__ == "__main__":
    main()
