"""End-to-end RL loop benchmark: staleness 0 (synchronous) vs 1 (rollout overlapped), one run.

Runs the main job's cluster (two embedded workers behind sglang-router, rollout, buffer, torch
trainer) twice on the same config, differing only in `max_staleness`, and reads every metrics
record from each run directory. Reports samples/s and tokens/s of training, where the trainer's
step time goes (waiting for a batch, training, weight sync), and the train-rollout log-prob
mismatch (`logprob_abs_diff` includes the policy lag of stale samples; the RESULT reports the
synchronous run's, where trainer and workers hold the same weights).
`python -m bench.loop [--steps 12] [--model examples/base-tiny] [--device cpu] [--threads 1]
[--worker-devices cuda:1,cuda:1] [--weight-sync disk|distributed|tensor|cuda_ipc|auto]
[--compare-sync] [--colocated-syncs disk,cuda_ipc] [--dp-size 1] [--true-on-policy]
[--set PATH=VALUE ...]` (--set goes to the launcher: any trainer option, e.g. the megatron backend).
Final line: RESULT sync_sps=... async_sps=... async_vs_sync=... overlap_ratio=...
logprob_abs_diff=... (medians over `--repeat N` pairs of runs); overlap_ratio = the overlapped
run's step time / max(rollout time, train + weight-sync time), each stage timed in the
synchronous run: 1.0 is a perfect overlap.
With --true-on-policy: staleness 0 with the default kernels, then with `true_on_policy = true`
on the workers and the trainer: RESULT loop_default_mean_abs=... loop_true_mean_abs=...
loop_true_equal_frac=... true_sps_vs_default=... (every sample is fresh at staleness 0, so the
engine-only metrics are the whole batch).
With --compare-sync: staleness 1 with weight_sync distributed, then disk (both workers may share
one GPU, e.g. --device cuda:0 --worker-devices cuda:1,cuda:1): RESULT nccl_sync_s=...
disk_sync_s=... (gloo_sync_s on CPU).
With --colocated-syncs disk,cuda_ipc: colocated mode (staleness 0, the trainer asleep while the
workers generate) once per path: RESULT colocated_<path>_sps=... colocated_<path>_sync_s=...
<path>_vs_<first>_sps=...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOSTS = """
[run]
name = "bench-loop"
progress_interval_s = 30.0

[[hosts]]
name = "local"

[actors.worker0]
cls = "actors.inference:InferenceWorker"
env = {{ OMP_NUM_THREADS = "{threads}" }}
config = {{ model = "{model}", device = "{w0}", dtype = "{dtype}", seed = 0{worker_extra} }}

[actors.worker1]
cls = "actors.inference:InferenceWorker"
env = {{ OMP_NUM_THREADS = "{threads}" }}
config = {{ model = "{model}", device = "{w1}", dtype = "{dtype}", seed = 1{worker_extra} }}

[actors.router]
cls = "actors.router:RouterActor"
after = ["worker0", "worker1"]

[actors.buffer]
cls = "actors.buffer:BufferActor"
config = {{ max_staleness = {staleness} }}

[actors.rollout]
cls = "actors.rollout:RolloutActor"
after = ["router", "buffer"]
[actors.rollout.config]
group_size = {group}
groups_per_batch = {groups}
eval_every = 0
envs = [
  {{ cls = "envs.builtin.arith:ArithEnv", options = {{ max_operand = 9 }} }},
  {{ cls = "envs.builtin.reverse:ReverseEnv", options = {{ partial = true }} }},
]

[actors.trainer]
cls = "actors.trainer:TrainerActor"
after = ["worker0", "worker1", "buffer"]
primary = true
env = {{ OMP_NUM_THREADS = "{threads}" }}
[actors.trainer.config]
model = "{model}"
workers = ["worker0", "worker1"]
num_steps = {steps}
device = "{device}"
dtype = "{dtype}"
mode = "{mode}"
optimizer = {{ lr = 1e-4 }}
micro_batches = {{ size = 64 }}
parallel = {{ dp = {dp} }}
weight_sync = {{ path = "{sync}" }}
true_on_policy = {top}
"""


def run_once(args: argparse.Namespace, staleness: int, root: Path,
             mode: str = "decoupled", sync: str | None = None, top: bool = False) -> dict:
    sync = sync or args.weight_sync
    w0, w1 = (args.worker_devices.split(",") if args.worker_devices
              else [args.device, args.device])
    tag = f"{mode}-staleness{staleness}-{sync}{'-true' if top else ''}"
    root.mkdir(parents=True, exist_ok=True)
    hosts = root / f"{tag}.toml"
    hosts.write_text(HOSTS.format(model=args.model, device=args.device, dtype=args.dtype,
                                  group=args.group_size, groups=args.groups, steps=args.steps,
                                  staleness=staleness, mode=mode, threads=args.threads,
                                  dp=args.dp_size, w0=w0, w1=w1, sync=sync,
                                  top=str(top).lower(),
                                  worker_extra=", true_on_policy = true" if top else ""))
    run_dir = root / f"run-{tag}"
    t0 = time.monotonic()
    gpu = GpuMemory() if args.device.startswith("cuda") else None
    sets = [w for item in args.set for w in ("--set", item)]
    result = subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir), *sets], capture_output=True, text=True)
    wall = time.monotonic() - t0
    if gpu is not None:
        gpu.stop()
        print(f"{mode}, staleness {staleness}: device memory per process (min..max MiB over "
              f"the run, nvidia-smi): {gpu.by_actor(run_dir)}")
    if result.returncode != 0:
        sys.exit(f"run with staleness {staleness} failed:\n{result.stdout[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if mode == "colocated":
        print(f"colocated memory by phase (MiB): {memory_by_phase(records)}")
    out = summarize([r for r in records if r["actor"] == "trainer" and "time/step_s" in
                     r["values"]], wall, args)
    batches = [r["values"]["rollout/batch_s"] for r in records
               if r["actor"] == "rollout" and "rollout/batch_s" in r["values"]][1:]
    out["rollout_s"] = sum(batches) / len(batches) if batches else float("nan")
    return out


def memory_by_phase(records: list[dict]) -> dict[str, float]:
    """Median device memory each side reported in each phase of a colocated run. Medians, not
    maxima: a worker's 1 s sample can land inside a release/resume transition, where the bytes
    already belong to the next phase while the flag still names the previous one."""
    import statistics

    seen: dict[str, list[float]] = {}
    for r in records:
        v = r["values"]
        for phase in ("train", "generate"):
            for kind, label in (("device", "tensors"), ("nvml", "nvml")):
                key = f"memory/{phase}/trainer_{kind}_bytes"
                if key in v:
                    name = (f"trainer while {'training' if phase == 'train' else 'generating'}"
                            f" ({label})")
                    seen.setdefault(name, []).append(v[key] / 2**20)
        if "memory/released" in v:
            for key, label in (("memory/device_bytes", "allocated"), ("memory/nvml_bytes", "nvml")):
                if key in v:
                    name = (f"{r['actor']} {'released' if v['memory/released'] else 'serving'} "
                            f"({label})")
                    seen.setdefault(name, []).append(v[key] / 2**20)
    return {k: round(statistics.median(v), 1) for k, v in sorted(seen.items())}


class GpuMemory:
    """Samples nvidia-smi's per-process device memory every 0.2 s while a run is going."""

    def __init__(self) -> None:
        import threading

        self.samples: dict[int, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True).stdout
            for line in out.splitlines():
                pid, mib = (int(x) for x in line.split(","))
                self.samples.setdefault(pid, []).append(mib)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def by_actor(self, run_dir: Path) -> dict[str, str]:
        pids = {a["pid"]: n for n, a in json.loads((run_dir / "exit.json").read_text())
                ["actors"].items()}
        return {pids.get(pid, str(pid)): f"{min(v)}..{max(v)}" for pid, v in self.samples.items()}


def summarize(steps: list[dict], wall_s: float, args: argparse.Namespace) -> dict:
    """Steady state: skip the first step (it includes start-up and the first batch)."""
    steady = steps[1:] or steps
    span = steady[-1]["time_s"] - steps[0]["time_s"] if len(steps) > 1 else wall_s
    samples = sum(r["values"]["train/samples"] for r in steady)
    tokens = sum(r["values"]["train/tokens"] for r in steady)

    def mean(key: str) -> float:
        return sum(r["values"][key] for r in steady) / len(steady)

    return {"samples_per_s": samples / span, "tokens_per_s": tokens / span,
            "step_s": mean("time/step_s"), "wait_batch_s": mean("time/wait_batch_s"),
            "train_s": mean("time/train_s"), "weight_sync_s": mean("time/weight_sync_s"),
            "logprob_abs_diff": mean("train/logprob_abs_diff"),
            "engine_logprob_abs_diff": mean("train/engine_logprob_abs_diff"),
            "engine_equal_frac": (mean("train/engine_logprob_bitwise_equal_frac")
                                  if "train/engine_logprob_bitwise_equal_frac"
                                  in steady[0]["values"] else float("nan")),
            "staleness_mean": mean("train/staleness_mean"), "wall_s": wall_s,
            "num_steps": len(steps)}


def run_colocated(args, root: Path) -> None:
    colo = run_once(args, 0, root, "colocated")
    print(f"colocated: samples/s {colo['samples_per_s']:.3g}, step {colo['step_s']:.3g} s "
          f"(train {colo['train_s']:.3g} s, weight sync {colo['weight_sync_s']:.3g} s)")


def compare_colocated_syncs(args: argparse.Namespace, root: Path) -> None:
    """Colocated mode (the trainer sleeps while the workers generate) with each weight-sync
    path in `--colocated-syncs`, in turn; the same run otherwise."""
    syncs = args.colocated_syncs.split(",")
    runs = {sync: run_once(args, 0, root, "colocated", sync=sync) for sync in syncs}
    print(f"{'colocated':20}" + "".join(f"{s:>14}" for s in syncs))
    for key in ("samples_per_s", "step_s", "wait_batch_s", "train_s", "weight_sync_s",
                "engine_logprob_abs_diff"):
        print(f"{key:20}" + "".join(f"{runs[s][key]:14.4g}" for s in syncs))
    first = runs[syncs[0]]
    print("RESULT " + " ".join(
        f"colocated_{s}_sps={runs[s]['samples_per_s']:.3f} "
        f"colocated_{s}_sync_s={runs[s]['weight_sync_s']:.4f} "
        f"{s}_vs_{syncs[0]}_sps={runs[s]['samples_per_s'] / first['samples_per_s']:.3f}"
        for s in syncs))


def compare_sync(args: argparse.Namespace, root: Path) -> None:
    """Distributed (NCCL on CUDA, gloo on CPU) against disk, the same run otherwise, in turn."""
    runs = {sync: run_once(args, 1, root, sync=sync) for sync in ("distributed", "disk")}
    print(f"{'':20}{'distributed':>14}{'disk':>14}")
    for key in ("weight_sync_s", "step_s", "samples_per_s", "engine_logprob_abs_diff"):
        print(f"{key:20}{runs['distributed'][key]:14.4g}{runs['disk'][key]:14.4g}")
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    dist, disk = runs["distributed"]["weight_sync_s"], runs["disk"]["weight_sync_s"]
    print(f"RESULT {backend}_sync_s={dist:.4f} disk_sync_s={disk:.4f} "
          f"disk_vs_{backend}={disk / dist:.2f} workers={args.worker_devices or args.device}")


def compare_true_on_policy(args: argparse.Namespace, root: Path) -> None:
    """Staleness 0 with the default kernels, then with true_on_policy on both sides."""
    runs = {name: run_once(args, 0, root, top=name == "true") for name in ("default", "true")}
    print(f"{'':24}{'default':>14}{'true':>14}")
    for key in ("samples_per_s", "step_s", "train_s", "wait_batch_s",
                "engine_logprob_abs_diff", "engine_equal_frac"):
        print(f"{key:24}{runs['default'][key]:14.4g}{runs['true'][key]:14.4g}")
    sps = runs["true"]["samples_per_s"] / runs["default"]["samples_per_s"]
    train = runs["default"]["train_s"] / runs["true"]["train_s"]
    print(f"RESULT loop_default_mean_abs={runs['default']['engine_logprob_abs_diff']:.3e} "
          f"loop_true_mean_abs={runs['true']['engine_logprob_abs_diff']:.3e} "
          f"loop_default_equal_frac={runs['default']['engine_equal_frac']:.4f} "
          f"loop_true_equal_frac={runs['true']['engine_equal_frac']:.4f} "
          f"true_sps_vs_default={sps:.3f} true_train_speed_vs_default={train:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--model", default="examples/base-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per worker/trainer process (OMP_NUM_THREADS)")
    parser.add_argument("--dp-size", type=int, default=1,
                        help="trainer data-parallel ranks (on CUDA: one device each from cuda:0)")
    parser.add_argument("--colocated", action="store_true",
                        help="also run colocated mode (staleness 0) and report it")
    parser.add_argument("--only-colocated", action="store_true",
                        help="run only colocated mode and report its memory per phase")
    parser.add_argument("--worker-devices", default="",
                        help="the two workers' devices, e.g. cuda:1,cuda:1 (default: --device)")
    parser.add_argument("--weight-sync", default="disk",
                        choices=["disk", "distributed", "tensor", "cuda_ipc", "auto"],
                        help="how versions reach the workers (trainer's weight_sync.path)")
    parser.add_argument("--colocated-syncs", default="",
                        help="only: colocated mode once per weight-sync path, e.g. "
                             "disk,cuda_ipc; reports each one's step and weight sync time")
    parser.add_argument("--compare-sync", action="store_true",
                        help="only: staleness 1 with weight_sync distributed, then disk; "
                             "reports each one's weight sync time per step")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the staleness 0 / 1 pair this many times; the RESULT holds "
                             "the medians")
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                        help="passed to the launcher (repeatable), e.g. "
                             "actors.trainer.config.backend=megatron")
    parser.add_argument("--true-on-policy", action="store_true",
                        help="only: staleness 0 with the default kernels, then with "
                             "true_on_policy = true on the workers and the trainer")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    if args.true_on_policy:
        return compare_true_on_policy(args, root)
    if args.colocated_syncs:
        return compare_colocated_syncs(args, root)
    if args.only_colocated:
        return run_colocated(args, root)
    if args.compare_sync:
        return compare_sync(args, root)
    pairs = [{k: run_once(args, k, root / f"rep{i}") for k in (0, 1)}
             for i in range(args.repeat)]
    if args.colocated:
        run_colocated(args, root)
    keys = ["samples_per_s", "tokens_per_s", "step_s", "wait_batch_s", "train_s",
            "weight_sync_s", "rollout_s", "logprob_abs_diff", "engine_logprob_abs_diff",
            "staleness_mean", "wall_s"]
    for i, runs in enumerate(pairs):
        print(f"{'repeat ' + str(i + 1):20}{'staleness 0':>14}{'staleness 1':>14}")
        for key in keys:
            print(f"{key:20}{runs[0][key]:14.4g}{runs[1][key]:14.4g}")
    print_overlap(pairs)


def overlap(runs: dict[int, dict]) -> tuple[float, float]:
    """(async_vs_sync, overlap_ratio) of one pair of runs. overlap_ratio = the overlapped run's
    step time / max(rollout time, train + weight-sync time), both stages timed in the
    synchronous run, where they do not overlap: 1.0 is a perfect overlap (the step is the longer
    stage), the sum of the stages over the longer one is no overlap at all."""
    sync = runs[0]
    stage = max(sync["rollout_s"], sync["train_s"] + sync["weight_sync_s"])
    return runs[1]["samples_per_s"] / sync["samples_per_s"], runs[1]["step_s"] / stage


def print_overlap(pairs: list[dict[int, dict]]) -> None:
    """The RESULT line: medians over the repeats, with their spread when there are several."""
    import statistics

    def med(values: list[float]) -> str:
        spread = f" ({min(values):.2f}..{max(values):.2f})" if len(values) > 1 else ""
        return f"{statistics.median(values):.2f}{spread}"
    ratios = [overlap(runs) for runs in pairs]
    sync = [runs[0]["samples_per_s"] for runs in pairs]
    asy = [runs[1]["samples_per_s"] for runs in pairs]
    stages = [(runs[0]["rollout_s"], runs[0]["train_s"] + runs[0]["weight_sync_s"])
              for runs in pairs]
    print("stages of the synchronous run (rollout s, train + push s): "
          + ", ".join(f"{a:.3f}, {b:.3f}" for a, b in stages))
    print(f"medians over {len(pairs)} repeat(s) (min..max): sync_sps {med(sync)}, async_sps "
          f"{med(asy)}, async_vs_sync {med([r[0] for r in ratios])}, overlap_ratio "
          f"{med([r[1] for r in ratios])}")
    diff = statistics.median(runs[0]["engine_logprob_abs_diff"] for runs in pairs)
    print(f"RESULT sync_sps={statistics.median(sync):.2f} async_sps={statistics.median(asy):.2f} "
          f"async_vs_sync={statistics.median(r[0] for r in ratios):.2f} "
          f"overlap_ratio={statistics.median(r[1] for r in ratios):.2f} "
          f"logprob_abs_diff={diff:.2e}")


if __name__ == "__main__":
    main()
