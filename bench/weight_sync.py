"""Weight-sync time per path (disk, process group, serialized tensors) from a trainer process to
embedded workers, each in its own process (`python -m engine.standalone`).

The trainer's model (a built-in name, e.g. `qwen2-0.5b-shape`, 358M parameters) is perturbed
with a fixed seed per version and pushed with engine/weight_sync.py; each push is timed from the
first pause to the version check. After each push every worker's greedy generation is compared
with the trainer's own forward (max |Δ log p|), so a push that moved the wrong bytes shows.

GPU (NCCL needs the trainer and every worker on distinct GPUs, so 2 GPUs for one worker):
    python -m bench.weight_sync --model qwen2-0.5b-shape --trainer-device cuda:0 \
        --worker-devices cuda:1 --backend nccl --dtype bfloat16
CPU (gloo): python -m bench.weight_sync --model tiny-qwen2 --worker-devices cpu,cpu
Final line: RESULT <path>_s=<median seconds> <path>_GBps=<parameter bytes / median> ...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import torch

from algos.logprobs import token_logprobs
from engine.client import SglangClient
from engine.weight_sync import DiskSync, DistributedSync, TensorSync
from models.load import load_model, save_checkpoint
from transport.dtypes import model_dtype
from transport.sockets import free_port

PROMPT = [5, 6, 41, 7, 44]


async def start_worker(args, device: str) -> tuple[asyncio.subprocess.Process, str]:
    port = free_port("127.0.0.1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine.standalone", "--model-path", args.model, "--device", device,
        "--dtype", args.dtype, "--port", str(port), stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = (await asyncio.wait_for(proc.stdout.readline(), 600)).decode()
    if not line.startswith("serving"):
        raise RuntimeError(f"worker on {device} did not start: {line!r}")
    return proc, f"http://127.0.0.1:{port}"


def perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * 0.02).to(p.device, p.dtype))


async def max_logprob_diff(client: SglangClient, model, device: str) -> float:
    out = await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0.0,
                                         "ignore_eos": True})
    ids = torch.tensor([PROMPT + out["output_ids"]], device=device)
    with torch.no_grad():
        ref = token_logprobs(model, ids)[0, len(PROMPT) - 1:].float().cpu()
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    return float((got - ref).abs().max())


async def run_path(path: str, args, model, clients, tmp: str, version: int) -> float:
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    t0 = time.perf_counter()
    if path == "disk":
        save_checkpoint(model, args.tokenizer, f"{tmp}/v{version}")
        await DiskSync(clients).push(f"{tmp}/v{version}", str(version))
    elif path == "tensor":
        await TensorSync(clients, bucket_bytes=args.bucket_mb << 20).push(named, str(version))
    else:
        await args.group.push(named, str(version))
    if args.trainer_device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


async def main(args) -> None:
    model, args.tokenizer = load_model(args.model, args.trainer_device, model_dtype(args.dtype))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    procs, clients = [], []
    try:
        for device in args.worker_devices.split(","):
            proc, url = await start_worker(args, device)
            procs.append(proc)
            clients.append(SglangClient(url, timeout_s=1800))
        args.group = DistributedSync(clients, backend=args.backend,
                                     bucket_bytes=args.bucket_mb << 20, timeout_s=1800)
        await args.group.connect()
        results, version = {}, 0
        with tempfile.TemporaryDirectory() as tmp:
            for path in args.paths.split(","):
                times = []
                for _ in range(args.repeats):
                    version += 1
                    perturb(model, version)
                    times.append(await run_path(path, args, model, clients, tmp, version))
                    diffs = [await max_logprob_diff(c, model, args.trainer_device)
                             for c in clients]
                    print(f"{path} v{version}: {times[-1]:.3f} s, max |dlogp| {max(diffs):.2e}",
                          flush=True)
                results[path] = statistics.median(times)
        print(f"parameters: {nbytes / 1e9:.3f} GB ({args.dtype}), workers: {len(clients)}")
        print("RESULT " + " ".join(f"{p}_s={t:.3f} {p}_GBps={nbytes / t / 1e9:.2f}"
                                   for p, t in results.items()))
    finally:
        if getattr(args, "group", None) is not None:
            await args.group.close()
        for c in clients:
            await c.close()
        for proc in procs:
            proc.terminate()
            await proc.wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--trainer-device", default="cpu")
    p.add_argument("--worker-devices", default="cpu", help="comma-separated, one per worker")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--paths", default="disk,distributed,tensor")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(p.parse_args()))
