"""Data-parallel trainer step on several processes vs one process, on GPUs (NCCL) or CPU (gloo).

Run under torchrun: every rank builds the same model and the same synthetic batch (groups of
responses with long-tailed lengths), rank 0 first takes one optimizer step alone (the
one-process reference), then all ranks take the same step from the same initial weights with
`training.data_parallel.DataParallel` (micro-batches from the DP schedule under a token cap). Rank 0
reports the largest parameter difference between the two updates and the step times.
`torchrun --nproc_per_node 2 -m bench.dp_train [--device cuda] [--model tiny-qwen2]
[--dtype float32] [--samples 64] [--max-tokens-per-mb 512]`.
Final line: RESULT dp_max_abs_param_diff=... one_process_s=... dp_s=... world_size=...
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.distributed as dist

from actors.trainer import TrainerConfig
from models.load import load_model, load_tokenizer
from training.config import MicroBatchConfig, OptimizerConfig
from training.data_parallel import DataParallel
from training.master_weights import make_optimizer
from training.step import TrainState, train_on_batch
from transport.dtypes import model_dtype
from transport.schema import Sample


def make_batch(num_samples: int, group_size: int, vocab: int, max_len: int) -> list[Sample]:
    rng = random.Random(0)
    out = []
    for i in range(num_samples):
        g = i // group_size
        prompt = [1] + [rng.randint(3, vocab - 1) for _ in range(8)]
        n = min(max_len - len(prompt), max(2, int(rng.lognormvariate(3.0, 0.8))))
        resp = [rng.randint(3, vocab - 1) for _ in range(n)]
        out.append(Sample(group_id=f"g{g}", index=i % group_size, domain="d", prompt_ids=prompt,
                          response_ids=resp, loss_mask=[1] * n, rollout_logprobs=[-4.0] * n,
                          reward=rng.random()))
    return out


def one_step(args, samples, dp=None) -> tuple[dict[str, torch.Tensor], float]:
    cfg = TrainerConfig(model=args.model, workers=["w"], device=args.device, dtype=args.dtype,
                        micro_batches=MicroBatchConfig(max_tokens=args.max_tokens_per_mb),
                        optimizer=OptimizerConfig(lr=1e-5))
    model, tok = load_model(args.model, args.device, model_dtype(args.dtype), seed=0)
    state = TrainState(model, tok, make_optimizer(model.parameters(), model_dtype(args.dtype),
                                                  None, cfg.optimizer.lr))  # trainer's default
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    train_on_batch(state, samples, cfg, dp)
    sync()
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}, \
        time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--max-tokens-per-mb", type=int, default=512)
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    try:
        vocab = len(load_tokenizer(args.model))
        samples = make_batch(args.samples, 8, vocab, 120)
        single, t_single = one_step(args, samples) if dist.get_rank() == 0 else ({}, 0.0)
        dist.barrier()
        multi, t_dp = one_step(args, samples, DataParallel())
        if dist.get_rank() == 0:
            diff = max(float((single[k] - multi[k]).abs().max()) for k in single)
            print(f"RESULT dp_max_abs_param_diff={diff:.3e} one_process_s={t_single:.3f} "
                  f"dp_s={t_dp:.3f} world_size={dist.get_world_size()}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
