"""Weight-sync time per path (disk, safetensors in the body, CUDA IPC, process group) from a
trainer process to embedded workers, each in its own process (`python -m engine.standalone`).

The trainer's model (a built-in name, e.g. `qwen2-0.5b-shape`, 494M parameters) is perturbed
with a fixed seed per version and pushed with engine/weight_sync.py; each push is timed from the
first pause to the version check (disk: the checkpoint write included). After each push every
worker's greedy generation is compared with the trainer's own forward (max |d log p|), so a push
that moved the wrong bytes shows. Paths that the placement cannot serve are skipped, saying why:
`cuda_ipc` needs the trainer and every worker on CUDA; `distributed` from a CUDA trainer is NCCL,
which cannot hold two ranks on one GPU (a worker on the trainer's GPU) and has no CPU ranks.

One GPU (trainer and worker share it: disk, tensor and cuda_ipc; NCCL skipped):
    python -m bench.weight_sync --model qwen2-0.5b-shape --dtype bfloat16 \
        --trainer-device cuda:0 --worker-devices cuda:0
Two GPUs (NCCL too): ... --trainer-device cuda:0 --worker-devices cuda:1
CPU (gloo): python -m bench.weight_sync --model tiny-qwen2 --worker-devices cpu,cpu
Final line: RESULT <path>_s_per_gb=<median s / GB of parameters> <path>_GBps=... per path run,
<path>=skipped per path skipped.
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
from engine.weight_sync import DiskSync, SyncError, make_weight_sync
from models.load import load_model, save_checkpoint
from runtime.devices import gpu_ids
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


async def make_paths(args, clients) -> tuple[dict, dict[str, str]]:
    """The sync object of every path asked for that the placement serves; why the others not."""
    workers = args.worker_devices.split(",")
    syncs, skipped = {}, {}
    for path in args.paths.split(","):
        if path == "disk":
            syncs[path] = DiskSync(clients)
            continue
        try:
            syncs[path] = await make_weight_sync(
                path, clients, args.trainer_device, args.bucket_mb << 20,
                devices=[gpu_ids([d]) for d in workers], own_devices=gpu_ids([args.trainer_device]),
                timeout_s=1800)
        except SyncError as e:
            skipped[path] = str(e)
            continue
        if path == "cuda_ipc" and not all(d.startswith("cuda") for d in workers):
            skipped[path] = "CUDA IPC payloads are read by workers on CUDA only"
            del syncs[path]
        elif path == "distributed":
            await syncs[path].connect()
    return syncs, skipped


async def push(path: str, sync, args, model, tmp: str, version: int) -> float:
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    if args.trainer_device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if path == "disk":
        save_checkpoint(model, args.tokenizer, f"{tmp}/v{version}")
        await sync.push(f"{tmp}/v{version}", str(version))
    else:
        await sync.push(named, str(version))
    return time.perf_counter() - t0


async def main(args) -> None:
    model, args.tokenizer = load_model(args.model, args.trainer_device, model_dtype(args.dtype))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gb = nbytes / 1e9
    procs, clients, syncs = [], [], {}
    try:
        for device in args.worker_devices.split(","):
            proc, url = await start_worker(args, device)
            procs.append(proc)
            clients.append(SglangClient(url, timeout_s=1800))
        syncs, skipped = await make_paths(args, clients)
        for path, why in skipped.items():
            print(f"{path}: skipped: {why}", flush=True)
        results, version = {}, 0
        with tempfile.TemporaryDirectory() as tmp:
            for path, sync in syncs.items():
                times = []
                for _ in range(args.repeats):
                    version += 1
                    perturb(model, version)
                    times.append(await push(path, sync, args, model, tmp, version))
                    diffs = [await max_logprob_diff(c, model, args.trainer_device)
                             for c in clients]
                    print(f"{path} v{version}: {times[-1]:.3f} s ({times[-1] / gb:.3f} s/GB), "
                          f"max |dlogp| {max(diffs):.2e}", flush=True)
                results[path] = statistics.median(times)
        print(f"parameters: {gb:.4f} GB ({args.dtype}), workers: {args.worker_devices}, "
              f"trainer: {args.trainer_device}")
        print("RESULT " + " ".join(
            [f"{p}_s_per_gb={t / gb:.4f} {p}_GBps={gb / t:.2f}" for p, t in results.items()]
            + [f"{p}=skipped" for p in skipped]))
    finally:
        for sync in syncs.values():
            if hasattr(sync, "close"):
                await sync.close()
        for c in clients:
            await c.close()
        for proc in procs:
            proc.terminate()
            await proc.wait()


def default_paths(trainer_device: str) -> str:
    if trainer_device.startswith("cuda"):
        return "disk,tensor,cuda_ipc,distributed"
    return "disk,tensor,distributed"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--trainer-device", default="cpu")
    p.add_argument("--worker-devices", default="cpu", help="comma-separated, one per worker")
    p.add_argument("--paths", default=None,
                   help="comma-separated; default: disk,tensor,distributed (+cuda_ipc on CUDA)")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                   help="the process group's backend: NCCL from a CUDA trainer, else gloo")
    parsed = p.parse_args()
    parsed.paths = parsed.paths or default_paths(parsed.trainer_device)
    implied = "nccl" if parsed.trainer_device.startswith("cuda") else "gloo"
    if parsed.backend not in (None, implied):
        p.error(f"--backend {parsed.backend} with --trainer-device {parsed.trainer_device}: the "
                f"group uses {implied} there")
    asyncio.run(main(parsed))
