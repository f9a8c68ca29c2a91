"""MOPD step time: 4 teachers time-sharing the GPU vs one resident teacher vs synchronous switching.

    python -m bench.mopd                      # H200: student and 4 teachers of ~1B params, bf16
    python -m bench.mopd --device cpu --hidden 64 --layers 2 --ffn 128 --vocab 256 --seq 32

One MOPD step is the trainer's real `train_on_batch` with colocated teachers
(`training/colocated_teachers.py`): teacher forwards from weight memory, streamed into the policy
pass (micro-batches packed and run by teacher, one switch per teacher),
the student's recompute, forward/backward with the OPD loss, AdamW. Modes, each after a warm-up
step, on the same batch:
- `1t`: every sample routed to one teacher that stays resident (no switching);
- `4t`: samples spread over 4 teachers, 2 device slots (so teachers are swapped every step),
  prefetch one switch ahead plus the hint of the next step's first teacher;
- `sync`: the same 4 teachers, demand loads only (slime's restore-then-compute).
Teacher weights are random (normal, std 0.02), written straight into the pinned host arena.
Final line: `RESULT step_4t_vs_1t=... step_4t_vs_sync=...`.
"""

from __future__ import annotations

import argparse
import time

import torch

from actors.trainer import TrainerConfig
from algos.opd import OpdConfig
from logic.teachers import TeacherSpec
from memory.layout import FlatLayout, bind
from memory.manager import WeightMemory
from training.colocated_teachers import ColocatedTeachers, meta_skeleton
from training.config import MicroBatchConfig
from training.master_weights import make_optimizer
from training.state import TrainState
from training.step import train_on_batch
from transport.dtypes import dtype_name, model_dtype
from transport.schema import Sample


def qwen2(args, dtype: torch.dtype, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=args.hidden, num_hidden_layers=args.layers,
                      intermediate_size=args.ffn, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      tie_word_embeddings=False, max_position_embeddings=4096)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    return model


def teachers(args, names: list[str], slots: int, lookahead: int, dtype, device: str
             ) -> ColocatedTeachers:
    """Teachers with random weights in the host arena, `slots` device slots."""
    layout = FlatLayout.from_shapes((n, t.dtype, tuple(t.shape))
                                    for n, t in qwen2(args, dtype, "meta").state_dict().items())
    skeleton = meta_skeleton(_rotary_ready(args, dtype), device)
    mem = WeightMemory(device, gpu_slots=slots, slot_bytes=layout.total_bytes,
                       host_budget_bytes=len(names) * layout.total_bytes, lookahead=lookahead)
    gen = torch.Generator(device=device).manual_seed(0)
    for name in names:
        mem.register(f"teacher:{name}", layout)
        for view in bind(mem.reserve_host(f"teacher:{name}"), layout).values():
            view.copy_(torch.randn(view.shape, generator=gen, device=device, dtype=view.dtype)
                       * 0.02)
    specs = [TeacherSpec(name=n, model="random") for n in names]
    return ColocatedTeachers(mem, {n: skeleton for n in names}, specs)


def _rotary_ready(args, dtype):
    """The model built on the meta device (1B random weights are never materialised), with real
    rotary tables (non-persistent buffers a skeleton keeps)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=args.hidden, num_hidden_layers=args.layers,
                      intermediate_size=args.ffn, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      tie_word_embeddings=False, max_position_embeddings=4096)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    rot = type(model.model.rotary_emb)(config=cfg)  # real rotary tables (non-persistent)
    model.model.rotary_emb = rot
    return model


def batch(args, names: list[str], seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(args.samples):
        ids = torch.randint(3, args.vocab, (args.seq,), generator=g).tolist()
        p = args.seq // 4
        out.append(Sample(group_id=f"g{i // 4}", index=i % 4, domain="d", prompt_ids=ids[:p],
                          response_ids=ids[p:], loss_mask=[1] * (args.seq - p),
                          rollout_logprobs=[-5.0] * (args.seq - p), reward=float(i % 2),
                          teacher=names[(i * len(names)) // args.samples]))
    return out


def step_time(args, mode: str, dtype, device: str) -> float:
    names = ["t0", "t1", "t2", "t3"] if mode != "1t" else ["t0"]
    pool = teachers(args, names, slots=2 if mode != "1t" else 1,
                    lookahead=0 if mode == "sync" else 1, dtype=dtype, device=device)
    torch.manual_seed(0)
    model = qwen2(args, dtype, device)
    cfg = TrainerConfig(model="random", workers=["w"],
                        dtype=dtype_name(dtype),
                        opd=OpdConfig(mode="sampled", kl_coef=1.0),
                        teachers=[TeacherSpec(name=n, model="random") for n in names],
                        micro_batches=MicroBatchConfig(size=args.micro_batch,
                                                       forward_by_length=False))
    state = TrainState(model, _Tok(), make_optimizer(model.parameters(), dtype, None, 1e-5))
    state.teachers = pool
    samples = batch(args, names)
    try:
        times = []
        for i in range(args.steps + 1):
            state.next_teachers = names[:1] if mode != "sync" else []
            _sync(device)
            t0 = time.perf_counter()
            train_on_batch(state, samples, cfg)
            _sync(device)
            times.append(time.perf_counter() - t0)
        print(f"{mode}: steps {[round(t, 3) for t in times]} s, teacher loads "
              f"{pool.memory.counters['gpu_loads']}", flush=True)
        return min(times[1:])
    finally:
        pool.close()
        del state, model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


class _Tok:
    pad_token_id = 0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    dtype = model_dtype(args.dtype)
    params = sum(t.numel() for t in qwen2(args, dtype, "meta").state_dict().values())
    print(f"student and each teacher: {params / 1e9:.2f}B params, {args.samples} samples x "
          f"{args.seq} tokens per step", flush=True)
    t = {mode: step_time(args, mode, dtype, args.device) for mode in ("1t", "4t", "sync")}
    print(f"step time: 1 resident teacher {t['1t']:.3f} s, 4 teachers with prefetch "
          f"{t['4t']:.3f} s, 4 teachers synchronous {t['sync']:.3f} s")
    print(f"RESULT step_4t_vs_1t={t['4t'] / t['1t']:.3f} step_4t_vs_sync={t['4t'] / t['sync']:.3f}")


if __name__ == "__main__":
    main()
