"""Model FLOPs utilisation of one RL optimizer step at real shapes.

    python -m bench.train_mfu --pack --backend torch,megatron  # H200: 1.5B and 3B, 32k tokens
    python -m bench.train_mfu --device cpu --shape tiny --tokens 768 --steps 1   # the script
    python -m bench.train_mfu --shape 30b-a3b-8l --replay      # H200: a MoE step, with replay

One step is the trainer's `training.step.train_on_batch` (the recompute pass, the policy pass
with its backward, AdamW through fp32 master weights; the forward after the update for the
policy-KL metric only with `--policy-kl`) on a random-init model of a real HF config
(Qwen2.5-1.5B: hidden 1536, 28 layers, 12/2 heads, ffn 8960; Qwen2.5-3B: hidden 2048, 36
layers, 16/2 heads, ffn 11008; both V = 151,936, tied embeddings), bf16 on CUDA, over samples
whose lengths follow `bench.dp_schedule`'s long-tailed distribution (lognormal around 1,500
tokens, a tenth of each the prompt) until `--tokens` real tokens, in micro-batches of at most
`--mb-tokens` tokens (first-fit decreasing).

Useful FLOPs per step: 8 N T (recompute 2 + forward 2 + backward 4, N the parameters, T the
real tokens) plus causal attention, 4 x 2 s^2 d per layer and sample (s its length, d the hidden
size; the same four passes); padding, activation recompute and the after-step forward are not
counted (overhead). MFU = useful FLOPs / step time / the peak of a bf16 matrix product measured
in the same run (8192^3). Printed per run: step time (median of `--steps` after a warm-up that
also compiles, with the spread), tokens/s, MFU, the padding fraction, memory (torch's peak
reserved and NVML's used, the user-visible number) and the warm-up step's loss and grad norm
(runs of one shape start from the same weights and samples: equal up to rounding).

Runs: each backend of `--backend` (torch: the transformers model; megatron: megatron-core's
local layers on one rank, `backends/megatron/model.py`) with right-padded micro-batches and,
with `--pack`, packed ones (`micro_batches.pack = true`, training/packing.py: each micro-batch's
samples end to end in rows of at most `--mb-tokens` tokens, attention per sample; torch with
`training.packing.preferred_attn_implementation`, FlashAttention 2 varlen where flash-attn is
installed, else FlexAttention on CUDA; megatron through a block-causal mask, FlexAttention on
CUDA). `--checkpointing` (activation_checkpointing), `--compile` (compile_layers) and
`--head-eager` (micro_batches.head_compile = false) as the trainer's options. `--profile`: one
more step per run under torch.profiler, printed as device kernel time by kind, the host gap and
the top kernels (bench/step_profile.py; `--trace DIR` also writes Chrome traces).
`--host-profile`: one more step per run under cProfile, the host's time by function.
Final line (the largest dense shape): `RESULT mfu_best=... mfu_torch=... mfu_megatron=...
packed_vs_padded=...` (each backend's best run; n/a where none ran; packed_vs_padded = the
torch backend's padded step time / packed step time, > 1: packing is faster) and per run
`step_<backend>_<padded|packed>_s`, `mfu_...`, `padding_...` (with `--profile` on a GPU also
`kernel_ms_...` and `host_gap_ms_...`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from typing import Any

import numpy as np
import torch

from actors.trainer import TrainerConfig
from bench.step_profile import host_profiled, profiled
from models.moe import MoeShape, moe_shape
from models.tiny import build_char_tokenizer
from training.backends import get_backend
from training.config import MicroBatchConfig, MoeConfig, OptimizerConfig
from training.data_parallel import plan_micro_batches
from training.master_weights import make_optimizer
from training.moe import attach as attach_routing
from training.packing import attention_mechanism, pack, preferred_attn_implementation
from training.setup import (
    checkpoint_activations,
    checkpoint_layers,
    compile_layers,
    decoder_layers,
)
from training.step import TrainState, train_on_batch
from transport.schema import Sample, routed_experts_dtype
from transport.sockets import free_port

# (hidden, layers, heads, kv heads, ffn, vocab): real HF configs' shapes, written out
SHAPES = {"1.5b": (1536, 28, 12, 2, 8960, 151936), "3b": (2048, 36, 16, 2, 11008, 151936),
          "tiny": (64, 2, 4, 2, 128, 1024)}
# mixture of experts (Qwen3-MoE): (hidden, layers, heads, kv heads, head dim, experts, top-k,
# expert ffn, vocab). "30b-a3b-8l": Qwen3-30B-A3B's layer shapes (of its 48 layers, 8: the
# whole model's optimizer state does not fit one GPU)
MOE_SHAPES = {"30b-a3b-8l": (2048, 8, 32, 4, 128, 128, 8, 768, 151936),
              "tiny-moe": (64, 2, 4, 2, 16, 4, 2, 64, 1024)}


def dims(shape: str) -> tuple[int, int, int]:
    """(hidden, layers, vocab) of a dense or MoE shape."""
    if shape in MOE_SHAPES:
        hidden, layers, *_, vocab = MOE_SHAPES[shape]
    else:
        hidden, layers, _, _, _, vocab = SHAPES[shape]
    return hidden, layers, vocab


def hf_config(shape: str):
    from transformers import Qwen2Config, Qwen3MoeConfig

    common = dict(max_position_embeddings=32768, tie_word_embeddings=True,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)
    if shape in MOE_SHAPES:
        hidden, layers, heads, kv, head_dim, experts, top_k, ffn, vocab = MOE_SHAPES[shape]
        return Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                              num_attention_heads=heads, num_key_value_heads=kv,
                              head_dim=head_dim, num_experts=experts, num_experts_per_tok=top_k,
                              moe_intermediate_size=ffn, norm_topk_prob=True, **common)
    hidden, layers, heads, kv, ffn, vocab = SHAPES[shape]
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ffn,
                       **common)


def active_params(model: torch.nn.Module) -> int:
    """Parameters a token uses: all but the experts it is not routed to (a MoE model's routed
    experts count top_k / num_experts)."""
    shape = moe_shape(model.config)
    total = sum(p.numel() for p in model.parameters())
    if shape is None:
        return total
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return int(total - experts * (1 - shape.top_k / shape.num_experts))


def hf_model(shape: str, device: str, dtype: torch.dtype, attn: str | None = None):
    from transformers import AutoModelForCausalLM

    cfg = hf_config(shape)
    torch.manual_seed(0)
    with torch.device(device):
        if attn is None:
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)


def lengths_for(tokens: int, vocab_cap: int, seed: int = 0) -> list[int]:
    """Long-tailed sample lengths (bench.dp_schedule's lognormal) summing to about `tokens`,
    each at most `vocab_cap` and at least 2."""
    rng = np.random.default_rng(seed)
    scale = min(1500.0, tokens / 8)  # small runs keep several samples
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(np.clip(rng.lognormal(np.log(scale), 1.0), 2, vocab_cap)))
    return out


def samples_of(lengths: list[int], vocab: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        prompt = max(1, n // 10)
        ids = rng.integers(3, vocab, n).tolist()
        out.append(Sample(group_id=f"g{i // 4}", index=i % 4, domain="d", prompt_ids=ids[:prompt],
                          response_ids=ids[prompt:], loss_mask=[1] * (n - prompt),
                          rollout_logprobs=[-5.0] * (n - prompt), reward=float(i % 2)))
    return out


def useful_flops(params: int, lengths: list[int], hidden: int, layers: int) -> float:
    """8 N T + 4 passes x causal attention (2 s^2 d per layer and sample)."""
    return 8.0 * params * sum(lengths) + 4 * sum(2.0 * s * s * hidden * layers for s in lengths)


def matmul_peak(device: str, dtype: torch.dtype, n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of an n^3 matrix product in `dtype` (the best of `reps`)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def computed_tokens(samples: list[Sample], mb_tokens: int, packed: bool, varlen: bool) -> int:
    """Tokens the step's forwards compute per pass: each planned micro-batch's rows x its
    longest row (padded: one row per sample; packed: rows of <= mb_tokens; varlen: the real
    tokens only)."""
    total = 0
    for idx in plan_micro_batches(samples, 16, mb_tokens).micro_batches:
        mine = [samples[i] for i in idx]
        if not packed:
            total += len(mine) * max(len(s.prompt_ids) + len(s.response_ids) for s in mine)
            continue
        rows = pack(mine, mb_tokens)
        total += rows.num_tokens if varlen else rows.num_computed_tokens
    return total


def add_routes(samples: list[Sample], shape: MoeShape, seed: int = 0) -> None:
    """Give each sample `routed_experts`: top_k distinct random experts per position and layer
    (all but the last token)."""
    rng = np.random.default_rng(seed)
    dtype = routed_experts_dtype(shape.num_experts)
    for s in samples:
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        keys = rng.random((n, shape.num_layers, shape.num_experts))
        s.routed_experts = np.argsort(keys, axis=-1)[..., :shape.top_k].astype(dtype)


def megatron_model(shape: str, device: str, dtype: torch.dtype):
    """The megatron backend's model of `shape` (one rank: TP = PP = 1), the random weights of
    `hf_model`, built on the device (megatron's CPU initialisation off on CUDA)."""
    from backends.megatron.model import from_hf_model, initialize_parallel, parallel_state

    if not device.startswith("cuda") and not parallel_state.model_parallel_is_initialized():
        from backends.megatron import cpu_shim  # megatron-core's CUDA calls, on the CPU

        cpu_shim.install()
    if not torch.distributed.is_initialized():  # one rank of its own
        torch.distributed.init_process_group(
            "nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1,
            init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}")
    if not parallel_state.model_parallel_is_initialized():
        initialize_parallel(1, 1)
    options = {"use_cpu_initialization": False} if device.startswith("cuda") else {}
    hf = hf_model(shape, device, dtype)
    model = from_hf_model(hf, options, dtype, device)
    del hf
    return model


def run_shape(shape: str, args, dtype: torch.dtype, peak: float, packed: bool = False,
              replay: bool = False, backend: str = "torch") -> dict[str, Any]:
    hidden, layers, vocab = dims(shape)
    attn = (args.pack_attn or preferred_attn_implementation(args.device)) if packed else None
    if backend == "megatron":
        model = megatron_model(shape, args.device, dtype)
    else:
        model = hf_model(shape, args.device, dtype, attn)
    if args.checkpointing:  # per-layer recompute in the backward (not counted as useful FLOPs)
        if backend == "torch":
            checkpoint_activations(model)
        else:
            checkpoint_layers(decoder_layers(model))
    if args.compile:  # the first (warm-up) step compiles
        compile_layers(model)
    params = active_params(model)
    tok = build_char_tokenizer()  # only its pad id is read
    state = TrainState(model, tok, make_optimizer(model.parameters(), dtype, None, 1e-6),
                       backend=get_backend(backend))
    routing = state.backend.routing(model)  # a MoE model: its routes measured (replayed)
    attach_routing(model, routing)
    replay = replay and routing is not None
    cfg = TrainerConfig(model="bench", workers=["w"], dtype=str(dtype).split(".")[-1],
                        device=args.device, optimizer=OptimizerConfig(lr=1e-6),
                        backend=backend, measure_policy_kl=args.policy_kl,
                        micro_batches=MicroBatchConfig(max_tokens=args.mb_tokens,
                                                       forward_by_length=False, pack=packed,
                                                       head_compile=not args.head_eager),
                        moe=MoeConfig(routing_replay="rollout" if replay else "off"))
    lengths = lengths_for(args.tokens, args.mb_tokens)
    samples = samples_of(lengths, vocab)
    if replay:  # routes as an engine would record them: random experts per token and layer
        add_routes(samples, routing.shape)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    first = train_on_batch(state, samples, cfg)  # warm-up: optimizer state, kernels
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_on_batch(state, samples, cfg)
        sync()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    profile = None
    if args.profile:  # one more step, under the profiler (bench/step_profile.py)
        label = f"{shape}-{backend}-{'packed' if packed else 'padded'}{'-replay' * replay}"
        profile = profiled(partial(train_on_batch, state, samples, cfg), args.device,
                           args.trace or None, label)
    computed = computed_tokens(samples, args.mb_tokens, packed,
                               attention_mechanism(model) == "varlen")
    out = {"params": params, "tokens": sum(lengths), "samples": len(lengths),
           "first_loss": first["train/loss"], "first_grad_norm": first["train/grad_norm"],
           "total_params": sum(p.numel() for p in model.parameters()),
           "padding": 1 - sum(lengths) / computed,
           "step_s": step, "min_s": min(times), "max_s": max(times),
           "tokens_per_s": sum(lengths) / step,
           "mfu": useful_flops(params, lengths, hidden, layers) / step / peak}
    if profile is not None:
        out["profile"] = profile
    if args.host_profile:  # one more step, under cProfile (bench/step_profile.py)
        out["host_profile"] = host_profiled(partial(train_on_batch, state, samples, cfg),
                                            args.device)
    if cuda:
        out["torch_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        out["nvml_used_gib"] = nvml_used_gib()
    del state, model
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def nvml_used_gib() -> float:
    """The device memory NVML says is used (what `nvidia-smi` shows); nan without pynvml."""
    try:
        import pynvml
    except ImportError:
        return float("nan")
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
    finally:
        pynvml.nvmlShutdown()


def result_line(runs: dict[tuple[str, str, bool], dict[str, Any]]) -> str:
    """The largest dense shape's runs, keyed (shape, backend, packed): each backend's best MFU
    (padded or packed; n/a where it did not run), the best of all, and the torch backend's
    padded over packed step time (n/a without both)."""
    largest = max({k[0] for k in runs}, key=lambda s: max(r["params"] for k, r in runs.items()
                                                            if k[0] == s))
    mine = {k[1:]: r for k, r in runs.items() if k[0] == largest}
    best = {b: max((r["mfu"] for (rb, _), r in mine.items() if rb == b), default=None)
            for b in ("torch", "megatron")}
    fields = {"mfu_best": max(v for v in best.values() if v is not None)}
    fields |= {f"mfu_{b}": v for b, v in best.items()}
    padded, packed = mine.get(("torch", False)), mine.get(("torch", True))
    fields["packed_vs_padded"] = (padded["step_s"] / packed["step_s"] if padded and packed
                                  else None)
    for (b, is_packed), r in sorted(mine.items()):
        tag = f"{b}_{'packed' if is_packed else 'padded'}"
        fields[f"step_{tag}_s"] = r["step_s"]
        fields[f"mfu_{tag}"] = r["mfu"]
        fields[f"padding_{tag}"] = r["padding"]
        if "profile" in r and r["profile"].kernel_ms:  # bench/step_profile.py, on a GPU
            fields[f"kernel_ms_{tag}"] = r["profile"].kernel_ms
            fields[f"host_gap_ms_{tag}"] = r["profile"].host_gap_ms
    return "RESULT " + " ".join(f"{k}={'n/a' if v is None else f'{v:.4f}'}"
                                for k, v in fields.items())


def moe_keys(moe: dict[str, dict[str, Any]]) -> str:
    """RESULT keys of the largest MoE shape: its MFU (active parameters), step time, and with
    replay its time over the step without."""
    plain = {k: v for k, v in moe.items() if not k.endswith("+replay")}
    if not plain:
        return ""
    shape = max(plain, key=lambda k: plain[k]["total_params"])
    r = plain[shape]
    out = f" mfu_moe={r['mfu']:.3f} step_moe_s={r['step_s']:.4f}"
    if shape + "+replay" in moe:
        out += f" replay_overhead={moe[shape + '+replay']['step_s'] / r['step_s']:.3f}"
    return out


def describe(shape: str, r: dict[str, Any], steps: int, mode: str) -> str:
    memory = (f", memory: torch reserved {r['torch_reserved_gib']:.1f} GiB, NVML used "
              f"{r['nvml_used_gib']:.1f} GiB" if "nvml_used_gib" in r else "")
    active = (f" ({r['params'] / 1e9:.2f}B active)" if r["total_params"] != r["params"]
              else "")
    return (f"{shape} {mode}: {r['total_params'] / 1e9:.2f}B params{active}, "
            f"{r['samples']} samples, "
            f"{r['tokens']} tokens: step {r['step_s']:.3f} s (median of {steps}, "
            f"{r['min_s']:.3f}-{r['max_s']:.3f}), {r['tokens_per_s']:.0f} tokens/s, "
            f"MFU {100 * r['mfu']:.1f}%, padding {100 * r['padding']:.0f}% of the tokens "
            f"computed{memory}; first step's loss {r['first_loss']:.6g}, grad norm "
            f"{r['first_grad_norm']:.6g}")


def print_profiles(r: dict[str, Any], label: str) -> None:
    """A run's `--profile` and `--host-profile` summaries, where it has them."""
    for key in ("profile", "host_profile"):
        if key in r:
            print("\n".join(r[key].lines(label)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="1.5b,3b",
                   help=f"comma-separated: {', '.join([*SHAPES, *MOE_SHAPES])}")
    p.add_argument("--replay", action="store_true", help="MoE shapes: also time the step with "
                   "routing replay (moe.routing_replay = 'rollout', random recorded routes)")
    p.add_argument("--tokens", type=int, default=32768, help="real tokens per step")
    p.add_argument("--mb-tokens", type=int, default=8192, help="token cap per micro-batch "
                   "(16,384 runs out of an H200's memory at 3B without --checkpointing)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per shape (median shown)")
    p.add_argument("--pack", action="store_true", help="also time the step with packed "
                   "micro-batches (micro_batches.pack = true) and compare")
    p.add_argument("--backend", default="torch", help="comma-separated: torch, megatron "
                   "(megatron-core's local layers on one rank; with --pack, packed rows through "
                   "a block-causal mask)")
    p.add_argument("--compile", action="store_true", help="compile_layers: torch.compile "
                   "each decoder layer (the warm-up step compiles)")
    p.add_argument("--policy-kl", action="store_true", help="also run the no-grad forward "
                   "after the update for train/policy_kl (measure_policy_kl = true, the "
                   "trainer's default; overhead, not in the useful FLOPs)")
    p.add_argument("--no-padded", action="store_true", help="with --pack: the packed step only")
    p.add_argument("--checkpointing", action="store_true", help="activation_checkpointing: "
                   "each layer's activations recomputed in the backward (its forward is "
                   "overhead, not in the useful FLOPs)")
    p.add_argument("--head-eager", action="store_true", help="micro_batches.head_compile = "
                   "false: the loss head's chunk passes eager (default: compiled on CUDA)")
    p.add_argument("--pack-attn", default="", help="attn_implementation of the packed model "
                   "(sdpa, flex_attention, flash_attention_2; default: "
                   "training.packing.preferred_attn_implementation)")
    p.add_argument("--profile", action="store_true", help="after the timed steps, one more "
                   "under torch.profiler: device kernel time by kind, the host gap, the top "
                   "kernels (bench/step_profile.py)")
    p.add_argument("--trace", default="", help="with --profile: write a Chrome trace of each "
                   "profiled step into this folder")
    p.add_argument("--host-profile", action="store_true", help="after the timed steps, one "
                   "more under cProfile: the host's time by function, its own and inside "
                   "(bench/step_profile.py host_profiled)")
    args = p.parse_args()
    if args.trace and not args.profile:
        p.error("--trace needs --profile")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    peak = matmul_peak(args.device, dtype, 8192 if args.device.startswith("cuda") else 512, 5)
    print(f"{args.device}, {str(dtype).split('.')[-1]}: matrix product peak "
          f"{peak / 1e12:.1f} TFLOP/s (measured)", flush=True)
    runs: dict[tuple[str, str, bool], dict[str, Any]] = {}
    moe: dict[str, dict[str, Any]] = {}
    backends = args.backend.split(",")
    layouts = ([] if args.pack and args.no_padded else [False]) + ([True] if args.pack else [])
    for shape in args.shape.split(","):
        if shape in MOE_SHAPES:  # active-parameter FLOPs; own RESULT keys
            for replay in [False] + [True] * args.replay:
                key, mode = (shape + "+replay", "MoE padded, routing replay") if replay else (
                    shape, "MoE padded")
                moe[key] = r = run_shape(shape, args, dtype, peak, replay=replay)
                print(describe(shape, r, args.steps, mode), flush=True)
                print_profiles(r, f"{shape} {mode}")
            continue
        for backend in backends:
            for packed in layouts:
                runs[shape, backend, packed] = r = run_shape(shape, args, dtype, peak, packed,
                                                             backend=backend)
                attn = ("block-causal mask" if backend == "megatron" else
                        args.pack_attn or preferred_attn_implementation(args.device))
                print(describe(shape, r, args.steps, f"{backend} " + (
                    f"packed (attention {attn})" if packed else "padded")), flush=True)
                print_profiles(r, f"{shape} {backend} {'packed' if packed else 'padded'}")
    line = result_line(runs) if runs else "RESULT"
    print(line + moe_keys(moe))


if __name__ == "__main__":
    main()
