"""A LoRA student against full fine-tuning: trainer memory, step time, and the push per version.

    python -m bench.lora                                   # H200: Qwen2.5-1.5B shape, rank 32
    python -m bench.lora --device cpu --shape tiny --tokens 512 --steps 1 --pushes 2   # CPU

The model is a random-init Qwen2 of a real HF config (bench/train_mfu.py SHAPES), written once
to a temporary directory (bf16 on CUDA, fp32 on the CPU) that the trainer and the worker both
load. Three child processes, one at a time, so each one's memory is its own:
- `train full` / `train lora`: the trainer's own setup (training/setup.py `load_train_state`:
  AdamW through fp32 master weights for 16-bit weights; with `lora`, the adapters on all seven
  linear layers of each block, rank `--rank`, alpha 2 x rank, the base frozen) and
  `training.step.train_on_batch` over `--tokens` tokens of long-tailed samples in micro-batches
  of at most `--mb-tokens` tokens; step time is the median of `--steps` steps after a warm-up,
  memory is NVML's used bytes on the device after them (what nvidia-smi shows; torch's peak
  reserved beside it), CPU: the process's peak RSS. `--checkpointing`: both trainers with
  `activation_checkpointing = true` (then the weights' and optimizer's share of the memory is
  what differs).
- `push`: one embedded worker (`python -m engine.standalone`, its own process, on the same
  device) serving the model; this process pushes `--pushes` versions of the full weights through
  the fastest full path the placement has (CUDA IPC on one GPU, else safetensors in the body),
  then, with adapters attached, `--pushes` versions of the adapter only (engine/weight_push.py
  `AdapterPush`, each version loaded under its own name by /load_lora_adapter_from_tensors:
  over CUDA IPC on a GPU, as `weight_sync.path = "auto"` sends to a worker on the trainer's
  GPU, then in the request body (base64 safetensors) for comparison; on the CPU, in the body).
  Each push is timed from the call to the worker's answer; after each adapter push the worker
  generates with that adapter and its log-probs are compared with the trainer's (max |d log p|),
  beside the same comparison for the base model before any adapter (the dtype's own noise).
Final line: `RESULT lora_mem_vs_full=<lora memory / full> lora_push_bytes_vs_full=<adapter
bytes / full bytes> lora_push_s=<median adapter push, s> lora_step_vs_full=<lora step time /
full> full_push_s=... lora_logprob_diff=...`. Goals on one H200 at 1.5B, rank 32: memory <= 0.4,
push bytes <= 0.02, push <= 0.1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from algos.logprobs import token_logprobs
from bench.train_mfu import hf_model, lengths_for, nvml_used_gib, samples_of
from bench.weight_sync import start_worker
from engine.client import SglangClient
from engine.weight_push import AdapterPush, adapter_name
from engine.weight_sync import TensorSync
from models import lora
from models.load import load_model
from models.lora import LoraConfig
from models.tokenizer import build_char_tokenizer
from training.config import TrainConfig
from training.setup import load_train_state
from training.step import train_on_batch

GOALS = {"lora_mem_vs_full": 0.4, "lora_push_bytes_vs_full": 0.02, "lora_push_s": 0.1}


def write_model(args, directory: Path) -> None:

    model = hf_model(args.shape, "cpu", dtype_of(args))
    model.save_pretrained(str(directory))
    build_char_tokenizer().save_pretrained(str(directory))


def dtype_of(args) -> torch.dtype:
    return torch.bfloat16 if args.device.startswith("cuda") else torch.float32


def lora_table(args) -> dict:
    return {"rank": args.rank, "alpha": 2.0 * args.rank}


def memory_bytes(device: str) -> tuple[float, float]:
    """(NVML used bytes on the device or the process's peak RSS on the CPU, torch's peak
    reserved bytes or 0)."""
    if not device.startswith("cuda"):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, 0.0

    return nvml_used_gib() * 2**30, float(torch.cuda.max_memory_reserved())


def train_child(args, mode: str) -> dict:

    cfg = {"model": args.model_dir, "device": args.device,
           "dtype": "bfloat16" if args.device.startswith("cuda") else "float32",
           "optimizer": {"lr": 1e-6},
           "micro_batches": {"max_tokens": args.mb_tokens, "forward_by_length": False},
           "activation_checkpointing": args.checkpointing}
    if mode == "lora":
        cfg["lora"] = lora_table(args)

    tcfg = msgspec.convert(cfg, TrainConfig)
    with tempfile.TemporaryDirectory() as run_dir:
        state = load_train_state(tcfg, run_dir, False)
    vocab = state.model.config.vocab_size
    samples = samples_of(lengths_for(args.tokens, args.mb_tokens), vocab)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    train_on_batch(state, samples, tcfg)  # warm-up: optimizer state, kernels
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_on_batch(state, samples, tcfg)
        sync()
        times.append(time.perf_counter() - t0)
    used, reserved = memory_bytes(args.device)
    trained = sum(p.numel() for p in state.model.parameters() if p.requires_grad)
    return {"mode": mode, "step_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times), "memory_bytes": used, "reserved_bytes": reserved,
            "trained_params": trained, "tokens": sum(len(s.prompt_ids) + len(s.response_ids)
                                                     for s in samples)}


async def push_child(args) -> dict:

    dtype = dtype_of(args)
    model, tok = load_model(args.model_dir, args.device, dtype)
    worker_args = argparse.Namespace(model=args.model_dir, dtype=str(dtype).split(".")[-1])
    proc, url = await start_worker(worker_args, args.device)
    client = SglangClient(url, timeout_s=1800)
    sync_ = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    out: dict = {}
    try:
        full_path = "cuda_ipc" if args.device.startswith("cuda") else "safetensors"
        full = TensorSync([client], serializer=full_path, device=args.device)
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        out["full_bytes"] = sum(t.numel() * t.element_size() for _, t in named)
        times = []
        for v in range(1, args.pushes + 1):
            sync_()
            t0 = time.perf_counter()
            await full.push(named, str(v))
            times.append(time.perf_counter() - t0)
        out.update(full_push_s=statistics.median(times), full_path=full_path)
        prompt = [1] + list(range(5, 20))

        async def logprob_diff(lora_path: str | None) -> float:
            """Max |d log p| of the worker's greedy answer against this process's forward."""
            extra = {"lora_path": lora_path} if lora_path else {}
            answer = await client.generate(prompt, {"max_new_tokens": 8, "temperature": 0},
                                           **extra)
            got = torch.tensor([e[0] for e in answer["meta_info"]["output_token_logprobs"]])
            with torch.no_grad():
                want = token_logprobs(model, torch.tensor([prompt + answer["output_ids"]],
                                                          device=args.device))[0]
            return float((got - want[len(prompt) - 1:].float().cpu()).abs().max())

        out["base_logprob_diff"] = await logprob_diff(None)  # the dtype's own noise, no adapter
        spec = LoraConfig(**lora_table(args))
        lora.attach(model, spec)
        config = lora.config_dict(spec, args.model_dir)
        gen = torch.Generator(device="cpu").manual_seed(0)

        async def tensors():
            return lora.adapter_tensors(model)

        async def write(directory):
            return lora.save_adapter(model, spec, directory, args.model_dir)

        # the adapter over the path a worker on this device gets ("auto"), then in the body
        paths = ["cuda_ipc", "tensor"] if args.device.startswith("cuda") else ["tensor"]
        version = 0
        for path in paths:
            with tempfile.TemporaryDirectory() as run_dir:
                push = AdapterPush([client], ["worker"], path, run_dir, config, write, tensors,
                                   keep=2, device=args.device)
                times, diffs = [], []
                for _ in range(args.pushes):
                    version += 1
                    with torch.no_grad():
                        for p in lora.trainable(model):
                            p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(
                                p.device, p.dtype))
                    sync_()
                    t0 = time.perf_counter()
                    report = await push.push(version)
                    times.append(time.perf_counter() - t0)
                    diffs.append(await logprob_diff(adapter_name(version)))
            key = "lora" if path == paths[0] else f"lora_{path}"
            out.update({f"{key}_push_s": statistics.median(times),
                        f"{key}_push_min_s": min(times), f"{key}_push_max_s": max(times),
                        f"{key}_logprob_diff": max(diffs)})
            out.update(lora_bytes=report.bytes, lora_path=paths[0])
    finally:
        await client.close()
        proc.terminate()
        await proc.wait()
    return out


def child(args) -> None:
    result = (asyncio.run(push_child(args)) if args.child == "push"
              else train_child(args, args.child))
    print("CHILD " + json.dumps(result), flush=True)


def run_child(args, what: str) -> dict:
    cmd = [sys.executable, "-m", "bench.lora", "--child", what, "--model-dir", args.model_dir,
           "--device", args.device, "--shape", args.shape, "--rank", str(args.rank),
           "--tokens", str(args.tokens), "--mb-tokens", str(args.mb_tokens),
           "--steps", str(args.steps), "--pushes", str(args.pushes)]
    if args.checkpointing:
        cmd.append("--checkpointing")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CHILD ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench.lora {what} failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("CHILD "):])


def result_line(full: dict, lora: dict, push: dict) -> str:
    return (f"RESULT lora_mem_vs_full={lora['memory_bytes'] / full['memory_bytes']:.3f} "
            f"lora_push_bytes_vs_full={push['lora_bytes'] / push['full_bytes']:.4f} "
            f"lora_push_s={push['lora_push_s']:.4f} "
            f"lora_step_vs_full={lora['step_s'] / full['step_s']:.3f} "
            f"full_push_s={push['full_push_s']:.4f} "
            f"lora_logprob_diff={push['lora_logprob_diff']:.2e} "
            f"base_logprob_diff={push['base_logprob_diff']:.2e}")


def check_result(line: str) -> dict[str, float]:
    """The RESULT line's numbers (ValueError when one is missing or not a number)."""
    if not line.startswith("RESULT "):
        raise ValueError(f"not a RESULT line: {line!r}")
    values = dict(kv.split("=", 1) for kv in line.split()[1:])
    want = ["lora_mem_vs_full", "lora_push_bytes_vs_full", "lora_push_s", "lora_step_vs_full",
            "full_push_s", "lora_logprob_diff"]
    missing = [k for k in want if k not in values]
    if missing:
        raise ValueError(f"RESULT line lacks {missing}")
    return {k: float(values[k]) for k in want}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--shape", default="1.5b", help="bench/train_mfu.py SHAPES: 1.5b, 3b, tiny")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16384, help="real tokens per step")
    p.add_argument("--mb-tokens", type=int, default=8192, help="token cap per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up")
    p.add_argument("--pushes", type=int, default=5, help="versions pushed per kind")
    p.add_argument("--checkpointing", action="store_true",
                   help="both trainers with activation_checkpointing (per-layer recompute)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = tmp
        write_model(args, Path(tmp))
        full = run_child(args, "full")
        lora = run_child(args, "lora")
        push = run_child(args, "push")
    for r in (full, lora):
        print(f"{r['mode']:>4}: step {r['step_s']:.3f} s ({r['min_s']:.3f}-{r['max_s']:.3f}), "
              f"{r['tokens']} tokens, memory {r['memory_bytes'] / 2**30:.2f} GiB "
              f"(torch reserved {r['reserved_bytes'] / 2**30:.2f}), trained "
              f"{r['trained_params'] / 1e6:.2f} M parameters", flush=True)
    print(f"push: full {push['full_bytes'] / 1e6:.1f} MB over {push['full_path']} in "
          f"{push['full_push_s']:.4f} s; adapter {push['lora_bytes'] / 1e6:.2f} MB over "
          f"{push['lora_path']} in {push['lora_push_s']:.4f} s ({push['lora_push_min_s']:.4f}-"
          f"{push['lora_push_max_s']:.4f}), worker vs trainer max |dlogp| "
          f"{push['lora_logprob_diff']:.2e} (base model, no adapter: "
          f"{push['base_logprob_diff']:.2e})", flush=True)
    if "lora_tensor_push_s" in push:
        print(f"push: adapter in the request body (tensor path) {push['lora_tensor_push_s']:.4f} s "
              f"({push['lora_tensor_push_min_s']:.4f}-{push['lora_tensor_push_max_s']:.4f})")
    line = result_line(full, lora, push)
    values = check_result(line)
    for key, goal in GOALS.items():
        print(f"goal {key} <= {goal}: {'met' if values[key] <= goal else 'NOT met'} "
              f"({values[key]:.4g})")
    print(line, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
