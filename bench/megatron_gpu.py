"""Megatron backend on GPUs: fp32 log-prob agreement with transformers, and bf16 step time.

Every rank builds the same random Qwen2-0.5B-shaped model (transformers, seeded), converts it to
a megatron-core GPTModel on the tensor-parallel layout given by --tp (torchrun world size =
tp), then:
1. fp32: log-probs of a padded batch from `algos.logprobs.token_logprobs_and_entropy` on the
   transformers model and on the megatron model (TF32 off); max / mean |diff| over real tokens;
2. bf16 (Float16Module): `training.step.train_on_batch` steps (AdamW on the bf16 weights)
   timed after a warm-up, next to the same steps on the transformers model (TP=1 only).
`python -m bench.megatron_gpu [--hidden 896 --layers 24 ...]` (with `--experts E --top-k K` a
Qwen3-MoE model, `--ffn` each expert's width), or for TP=2
`torchrun --nproc_per_node 2 -m bench.megatron_gpu --tp 2`. Final line (rank 0): RESULT tp=...
params=... logprob_max_abs_diff_fp32=... logprob_mean_abs_diff_fp32=... megatron_step_s=...
torch_step_s=... (torch only at tp=1). `--device cpu --cpu-shim` runs it on CPU with tiny
sizes, through the tests' torch.cuda shim, to check the script itself.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
import warnings

import torch
import torch.distributed as dist

from actors.trainer import TrainerConfig
from algos.logprobs import token_logprobs_and_entropy
from backends.megatron import cpu_shim
from models.tiny import build_char_tokenizer
from training.config import MicroBatchConfig, OptimizerConfig
from training.step import TrainState, train_on_batch
from transport.schema import Sample


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cpu-shim", action="store_true", help="CPU smoke run (tests' shim)")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=4864)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--experts", type=int, default=0, help="> 0: a Qwen3-MoE model with this "
                   "many experts per layer (--ffn is then each expert's width)")
    p.add_argument("--top-k", type=int, default=8, help="MoE: experts per token")
    p.add_argument("--head-dim", type=int, default=128, help="MoE (Qwen3): attention head dim")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=384)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    return p.parse_args()


def hf_config(args):
    from transformers import Qwen2Config, Qwen3MoeConfig

    if args.experts:  # a Qwen3-MoE layer stack (megatron: SequentialMLP experts without TE)
        return Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                              num_hidden_layers=args.layers, num_attention_heads=args.heads,
                              num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                              num_experts=args.experts, num_experts_per_tok=args.top_k,
                              moe_intermediate_size=args.ffn, norm_topk_prob=True,
                              max_position_embeddings=4096, tie_word_embeddings=True,
                              rope_theta=1000000.0, rms_norm_eps=1e-6)
    return Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, intermediate_size=args.ffn,
                       max_position_embeddings=4096, tie_word_embeddings=True,
                       rope_theta=1000000.0, rms_norm_eps=1e-6)


def random_hf_model(args, device: str, dtype: torch.dtype):
    """The same random weights on every rank and every call (seed 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(args), dtype=torch.float32)
    return model.to(dtype).eval()


def make_samples(args) -> list[Sample]:
    rng = random.Random(0)
    out = []
    for i in range(args.samples):
        n = rng.randint(args.response_len // 2, args.response_len)
        prompt = [rng.randint(3, args.vocab - 1) for _ in range(args.prompt_len)]
        out.append(Sample(group_id=f"g{i // 4}", index=i % 4, domain="d", prompt_ids=prompt,
                          response_ids=[rng.randint(3, args.vocab - 1) for _ in range(n)],
                          loss_mask=[1] * n, rollout_logprobs=[-5.0] * n, reward=rng.random()))
    return out


def logprob_agreement(args, device: str) -> tuple[float, float]:
    """fp32: max and mean |megatron - transformers| log-prob over real tokens of a padded batch."""
    from backends.megatron.model import from_hf_model

    hf = random_hf_model(args, device, torch.float32)
    model = from_hf_model(hf, {"use_cpu_initialization": device == "cpu"}, torch.float32, device)
    gen = torch.Generator().manual_seed(1)
    lengths = [args.prompt_len + args.response_len - 37 * i for i in range(4)]
    ids = torch.randint(3, args.vocab, (4, max(lengths)), generator=gen)
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        want = token_logprobs_and_entropy(hf, ids, mask)[0]
        got = token_logprobs_and_entropy(model, ids, mask)[0]
    diff = (got - want).abs()[(mask[:, 1:] * mask[:, :-1]).bool()]
    return float(diff.max()), float(diff.mean())


def step_time(args, model, device: str) -> float:
    """Mean seconds of one bf16 train_on_batch step after one warm-up step."""
    tok = build_char_tokenizer()  # only its pad id is read
    state = TrainState(model, tok, torch.optim.AdamW(model.parameters(), lr=1e-6))
    cfg = TrainerConfig(model="bench", workers=["w"], dtype="bfloat16", device=device,
                        micro_batches=MicroBatchConfig(size=args.micro_batch_size),
                        optimizer=OptimizerConfig(grad_clip=1.0 if args.tp == 1 else 0.0))
    samples = make_samples(args)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    train_on_batch(state, samples, cfg)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_on_batch(state, samples, cfg)
    sync()
    return (time.perf_counter() - t0) / args.steps


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    if args.cpu_shim:
        cpu_shim.install()
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != args.tp:
        raise ValueError(f"run with torchrun --nproc_per_node {args.tp} (world size {world})")
    device = f"cuda:{local}" if args.device == "cuda" else args.device
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=rank,
                            world_size=world)
    from backends.megatron.model import from_hf_model, initialize_parallel, parallel_state

    initialize_parallel(args.tp, 1, seed=0)
    max_diff, mean_diff = logprob_agreement(args, device)
    gc.collect()
    hf = random_hf_model(args, device, torch.bfloat16)
    params = sum(p.numel() for p in hf.parameters())
    megatron = from_hf_model(hf, {"use_cpu_initialization": device == "cpu"}, torch.bfloat16,
                             device)
    megatron_s = step_time(args, megatron, device)
    torch_s = step_time(args, hf, device) if args.tp == 1 else float("nan")
    if rank == 0:
        print(f"RESULT tp={args.tp} params={params} logprob_max_abs_diff_fp32={max_diff:.3e} "
              f"logprob_mean_abs_diff_fp32={mean_diff:.3e} megatron_step_s={megatron_s:.3f} "
              f"torch_step_s={torch_s:.3f}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
