"""Host memory of a weight push from a sharded trainer: whole-model gather vs streamed buckets.

Role: this process plays the trainer actor (global rank 0) of a megatron trainer at TP=2 (or
PP=2, `--layout`), its other rank a process it starts (bench.train_parallel.Trainer:
actors.trainer_rank.start_standalone, driven through training.ranks.RankGroup). For one weight
version it measures rank 0's peak resident memory above what it held before, for:
- `gather`: the whole model gathered to rank 0 first (`RankGroup.named_weights`: a list of every
  HF tensor, what a push held before pushes streamed), then taken bucket by bucket;
- `stream`: the push's read as it runs now: `engine.weight_sync.WeightStream` over
  `RankGroup.stream_weights`, one bucket at a time in a compute thread, as the actor does, each
  bucket let go before the next (what the distributed path holds: it broadcasts the tensors);
- `tensor`: the same with each bucket serialized as `TensorSync` does for the tensor path
  (safetensors bytes, then base64: several copies of one bucket; no worker to send to);
- `disk`: the disk path's HF export (`RankGroup.save_weights`), shards of one bucket.
Peak RSS from the kernel (`VmHWM` of /proc/self/status, reset through /proc/self/clear_refs
before each, after `malloc_trim`), so it counts what the process really touched; each case runs
`--repeat` times, alternating, and the median with its range is printed. On CPU the ranks run
megatron-core over gloo with the test-only torch.cuda stand-ins (as bench.train_parallel).
`python -m bench.push_memory [--model qwen2-0.5b-shape] [--dtype bfloat16] [--bucket-mib 64]
[--layout tp2] [--repeat 3]`
Final line: RESULT gather_extra_mib=... stream_extra_mib=... tensor_path_extra_mib=...
disk_extra_mib=...
stream_vs_gather=... model_mib=... bucket_mib=...
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from bench.train_parallel import LAYOUTS, Trainer, at_layout, base_config, use_cpu_shim
from engine.weight_sync import MAX_SAFETENSORS_BUCKET_BYTES, TensorSync, WeightStream, buckets


def peak_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(fn) -> float:
    """MiB of resident memory `fn()` added at its peak over the RSS before it (freed heap memory
    handed back to the kernel first, so an earlier case's free pages are not reused unseen)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    peak_reset()
    before = rss_kib("VmRSS")
    fn()
    gc.collect()
    return (rss_kib("VmHWM") - before) / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2-0.5b-shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bucket-mib", type=float, default=64)
    ap.add_argument("--layout", default="tp2", choices=["tp2", "pp2"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    use_cpu_shim()
    bucket = min(int(args.bucket_mib * 2**20), MAX_SAFETENSORS_BUCKET_BYTES)
    cfg = at_layout(base_config(args.model, "cpu", args.dtype, timeout_s=600),
                    **LAYOUTS[args.layout])
    cfg = msgspec.structs.replace(cfg, workers=[])
    pool = ThreadPoolExecutor(1, thread_name_prefix="trainer")
    sync = TensorSync([], "safetensors", bucket_bytes=bucket, executor=pool)
    with tempfile.TemporaryDirectory() as tmp, Trainer(cfg, Path(tmp) / "run") as trainer:
        state, ranks = trainer.state, trainer.ranks
        print(f"{args.layout}: loaded {args.model} ({args.dtype}) on 2 ranks", flush=True)

        def gather() -> None:  # the push before streaming: the whole model, then buckets
            named = ranks.named_weights(state)
            for part in buckets(named, bucket):
                del part
            del named

        stream = WeightStream(lambda: ranks.stream_weights(state), pool, copies=True)

        async def push(serialize: bool) -> None:  # the push loop, with no worker to send to
            run = asyncio.get_running_loop().run_in_executor
            async with stream.buckets(bucket) as parts:
                async for part, _ in parts:
                    payload = await run(pool, sync.serialize, part) if serialize else None
                    del part, payload

        def disk() -> None:
            ranks.save_weights(state, Path(tmp) / "export", bucket)

        cases = {"gather": gather, "stream": lambda: asyncio.run(push(False)),
                 "tensor": lambda: asyncio.run(push(True)), "disk": disk}
        model_mib = 0.0
        runs: dict[str, list[float]] = {name: [] for name in cases}
        for i in range(args.repeat):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                runs[name].append(measure(fn))
                print(f"run {i + 1} {name}: +{runs[name][-1]:.1f} MiB peak RSS "
                      f"({time.perf_counter() - t0:.2f} s)", flush=True)
            model_mib = stream.bytes_read / 2**20
        print(f"one version: {model_mib:.1f} MiB; streamed push held at most "
              f"{stream.peak_held_bytes / 2**20:.1f} MiB of gathered tensors", flush=True)
    pool.shutdown()
    med = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"{k}: median +{med[k]:.1f} MiB (range {min(v):.1f} - {max(v):.1f})")
    print(f"RESULT gather_extra_mib={med['gather']:.1f} stream_extra_mib={med['stream']:.1f} "
          f"tensor_path_extra_mib={med['tensor']:.1f} disk_extra_mib={med['disk']:.1f} "
          f"stream_vs_gather={med['stream'] / max(med['gather'], 1e-9):.3f} "
          f"model_mib={model_mib:.1f} bucket_mib={args.bucket_mib:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
