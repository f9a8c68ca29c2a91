"""Train-rollout log-prob agreement of the embedded worker and the trainer, per dtype and device.

Starts an embedded inference worker in-process, samples responses over HTTP exactly as the
rollout does (HttpSession), then recomputes their log-probs with the trainer's batching and
forward (training.step.forward) on the same weights. Prints mean and max |Δ log p| over the
policy tokens for each dtype, the trainer forwarding the whole batch as one right-padded
micro-batch.

Attribution (`--attribute`, float32 only): the same tokens are also scored by a float64 copy of
the model, one unpadded sequence at a time, and each side's error is reported against it:
`worker_vs_f64` (the worker's KV-cache decode inside a left-padded wave), `trainer_vs_f64` (the
trainer's right-padded batched forward) and `trainer_solo_vs_f64` (the trainer's forward on each
sample alone, no padding). The logit scale (mean max |logit|) is printed too: an fp32 error is
relative, so a trained model with sharp, large logits shows a larger absolute |Δ log p| than a
random-init one on the same code path.

`by_length_mean_abs_diff` is the same comparison with the trainer's `forward_by_length` (one
unpadded forward per distinct length in the micro-batch, the trainer's default for fp32 on CPU).

`python -m bench.logprob_alignment [--model tiny-qwen2] [--device cpu] [--dtypes float32,bfloat16]
[--num-prompts 8] [--attribute]`. Final line: RESULT <dtype>_mean_abs_diff=... ...

True on-policy (`--true-on-policy`): each dtype runs twice in one process, with the default
kernels and with `true_on_policy = true` on both sides (the worker's batch-invariant forward and
the trainer's, models/invariant). For each: mean and max |Δ log p| between the worker's reported
log-probs and the trainer's forward that trains (with gradients, one micro-batch of every
sample), the fraction of bitwise-equal tokens, the worker's generation speed (output tokens/s
over HTTP, after a warm-up round that also compiles the Triton kernels) and the trainer's step
time (`training.step.train_on_batch` on those samples, median of --train-reps after a warm-up).
Final line: RESULT bf16_default_mean_abs=... bf16_true_mean_abs=... bf16_true_equal_frac=...
float32_true_equal_frac=... true_gen_speed_vs_default=... true_train_speed_vs_default=... (the
speed ratios are true / default tokens/s and default / true step time, of the first dtype
listed; every dtype's own ratios are printed above it).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import statistics
import tempfile
import time

import torch

from actors.inference import InferenceWorker
from algos.logprobs import response_slice, token_logprobs
from engine.client import SglangClient
from engine.session import HttpSession
from models.load import load_model, load_tokenizer
from runtime.actor import ActorContext
from training.batching import make_micro_batch
from training.config import MicroBatchConfig, OptimizerConfig, TrainConfig
from training.step import TrainState, forward, train_on_batch
from transport.dtypes import model_dtype
from transport.schema import Endpoints

SHORT = {"bfloat16": "bf16", "float32": "float32", "float16": "fp16"}

PROMPTS = ["12+7=", "rev abcd=", "3+4=", "rev xyz=", "8+8=", "rev hello=", "1+9=", "rev ab="]


def prompts(n: int) -> list[str]:
    """The fixed 8 prompts first, then seeded arithmetic/reverse prompts of the same shape."""
    rng = random.Random(0)
    out = list(PROMPTS[:n])
    while len(out) < n:
        if rng.random() < 0.5:
            out.append(f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=")
        else:
            out.append("rev " + "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 6)))
                       + "=")
    return out


async def sample(model: str, device: str, dtype: str, temperature: float, max_new: int,
                 num_prompts: int, true_on_policy: bool = False, timed: dict | None = None):
    """Responses from an in-process worker over HTTP; with `timed`, a warm-up round first and
    the measured round's output tokens/s in timed["tokens_per_s"]."""
    sock = tempfile.mkdtemp(prefix="rlx-align-")
    ctx = ActorContext(name="w", endpoints=Endpoints(control=f"ipc://{sock}/ctl"))
    worker = InferenceWorker(ctx, InferenceWorker.Config(model=model, device=device, dtype=dtype,
                                                         true_on_policy=true_on_policy))
    task = asyncio.ensure_future(worker.serve())
    await worker.wait_running()
    client = SglangClient(worker.bound.http)
    tok = load_tokenizer(model)

    async def play(seed0: int) -> list[HttpSession]:
        sessions = [HttpSession(client, tok, p, {"temperature": temperature,
                                                 "sampling_seed": seed0 + i}, f"k{i}", max_new)
                    for i, p in enumerate(prompts(num_prompts))]
        await asyncio.gather(*(s.generate() for s in sessions))
        return sessions

    try:
        if timed is not None:
            await play(1000)  # warm-up: allocator, kernel compilation
            _sync(device)
            t0 = time.perf_counter()
        sessions = await play(0)
        if timed is not None:
            _sync(device)
            tokens = sum(len(s.response_ids) for s in sessions)
            timed["tokens_per_s"] = tokens / (time.perf_counter() - t0)
    finally:
        await client.close()
        worker.stop("done")
        await task
    return [s.to_sample(f"g{i}", 0, "d", 0.0) for i, s in enumerate(sessions)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def solo_logprobs(net, samples, temperature: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per sample, unpadded: the response tokens' log-probs from a full forward in `dtype`."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device=next(net.parameters()).device)
        lp = token_logprobs(net, ids, temperature=temperature).to(dtype)
        out.append(response_slice(lp, torch.tensor([len(s.prompt_ids)], device=ids.device),
                                  len(s.response_ids))[0].double().cpu())
    return out


def mean_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    diffs = torch.cat([(x - y).abs() for x, y in zip(a, b)])
    return float(diffs.mean())


def attribute(net, samples, mb, batched: torch.Tensor, temperature: float) -> dict[str, float]:
    """Each side's error against a float64 recompute of the same tokens."""
    net64 = copy.deepcopy(net).double()
    with torch.no_grad():
        ref = solo_logprobs(net64, samples, temperature, torch.float64)
        solo = solo_logprobs(net, samples, temperature, torch.float32)
        ids = mb.input_ids
        scale = float(net(input_ids=ids, attention_mask=mb.attention_mask).logits.abs()
                      .amax(-1)[mb.attention_mask.bool()].mean())
    n = [len(s.response_ids) for s in samples]
    worker = [torch.tensor(s.rollout_logprobs, dtype=torch.float64) for s in samples]
    trainer = [batched[i, :k].double().cpu() for i, k in enumerate(n)]
    return {"worker_vs_f64": mean_abs(worker, ref), "trainer_vs_f64": mean_abs(trainer, ref),
            "trainer_solo_vs_f64": mean_abs(solo, ref), "worker_vs_trainer_solo":
            mean_abs(worker, solo), "mean_max_abs_logit": scale}


def measure(model: str, device: str, dtype: str, temperature: float, max_new: int,
            num_prompts: int, with_attribution: bool):
    samples = asyncio.run(sample(model, device, dtype, temperature, max_new, num_prompts))
    net, tokenizer = load_model(model, device, model_dtype(dtype))
    state = TrainState(net, tokenizer, torch.optim.SGD(net.parameters(), lr=0.0))
    state.temperature = temperature  # the run's sampling temperature
    mb = make_micro_batch(samples, tokenizer.pad_token_id or 0).to(device)
    with torch.no_grad():
        logp, _ = forward(state, mb, temperature)
        unpadded, _ = forward(state, mb, temperature, by_length=True)
    diff = (logp - mb.rollout_logp).abs() * mb.mask
    extra = attribute(net, samples, mb, logp, temperature) if with_attribution else {}
    extra["by_length_mean_abs_diff"] = float(((unpadded - mb.rollout_logp).abs() * mb.mask).sum()
                                             / mb.mask.sum())
    return float(diff.sum() / mb.mask.sum()), float(diff.max()), int(mb.mask.sum()), extra


def measure_mode(model: str, device: str, dtype: str, temperature: float, max_new: int,
                 num_prompts: int, true_on_policy: bool, train_reps: int) -> dict[str, float]:
    """One mode end to end: worker samples (timed), the trainer's training forward on them
    (the |Δ| and the bitwise-equal fraction), and the trainer's step time."""
    timed: dict[str, float] = {}
    samples = asyncio.run(sample(model, device, dtype, temperature, max_new, num_prompts,
                                 true_on_policy, timed))
    samples = [s for s in samples if s.response_ids]
    cfg = TrainConfig(model=model, device=device, dtype=dtype, true_on_policy=true_on_policy,
                      micro_batches=MicroBatchConfig(size=len(samples)),
                      optimizer=OptimizerConfig(lr=0.0, grad_clip=0.0))
    net, tokenizer = load_model(model, device, model_dtype(dtype))
    state = TrainState(net, tokenizer, torch.optim.SGD(net.parameters(), lr=0.0))
    state.temperature = temperature  # the run's sampling temperature
    by_length = device == "cpu" and dtype == "float32"  # the trainer's default (training.step)
    train_on_batch(state, samples, cfg)  # warm-up (and it marks the model in true mode)
    mb = make_micro_batch(samples, tokenizer.pad_token_id or 0).to(device)
    logp, _ = forward(state, mb, temperature, by_length)  # with gradients: the training pass
    logp = logp.detach()
    diff = (logp - mb.rollout_logp).abs() * mb.mask
    tokens = float(mb.mask.sum())
    equal = float(((logp == mb.rollout_logp) & (mb.mask > 0)).sum()) / tokens
    times, stats = [], {}
    for _ in range(train_reps):
        _sync(device)
        t0 = time.perf_counter()
        stats = train_on_batch(state, samples, cfg)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"mean_abs": float(diff.sum()) / tokens, "max_abs": float(diff.max()),
            "equal_frac": equal, "tokens": tokens, "gen_tokens_per_s": timed["tokens_per_s"],
            "train_step_s": statistics.median(times),
            "step_equal_frac": stats.get("train/logprob_bitwise_equal_frac", float("nan"))}


def compare_modes(args: argparse.Namespace) -> None:
    """Default kernels and true on-policy side by side, per dtype; the RESULT line."""
    result: dict[str, float] = {}
    speeds: dict[str, tuple[float, float]] = {}
    for dtype in args.dtypes.split(","):
        runs = {mode: measure_mode(args.model, args.device, dtype, args.temperature,
                                   args.max_new_tokens, args.num_prompts, mode == "true",
                                   args.train_reps) for mode in ("default", "true")}
        short = SHORT.get(dtype, dtype)
        print(f"{args.model} on {args.device} in {dtype} ({int(runs['true']['tokens'])} tokens):")
        print(f"  {'':24}{'default':>12}{'true':>12}")
        for key in ("mean_abs", "max_abs", "equal_frac", "step_equal_frac", "gen_tokens_per_s",
                    "train_step_s"):
            print(f"  {key:24}{runs['default'][key]:12.4g}{runs['true'][key]:12.4g}")
        gen = runs["true"]["gen_tokens_per_s"] / runs["default"]["gen_tokens_per_s"]
        train = runs["default"]["train_step_s"] / runs["true"]["train_step_s"]
        print(f"  true/default speed: generation {gen:.3f}x, training {train:.3f}x "
              f"(cost {1 / gen:.2f}x and {1 / train:.2f}x)")
        speeds[short] = (gen, train)
        for mode in ("default", "true"):
            for key in ("mean_abs", "max_abs", "equal_frac"):
                result[f"{short}_{mode}_{key}"] = runs[mode][key]
    gen, train = next(iter(speeds.values()))
    result["true_gen_speed_vs_default"], result["true_train_speed_vs_default"] = gen, train
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in result.items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--attribute", action="store_true",
                        help="float32: each side's error against a float64 recompute")
    parser.add_argument("--true-on-policy", action="store_true",
                        help="default kernels and true_on_policy side by side (RESULT keys in "
                             "the module docstring)")
    parser.add_argument("--train-reps", type=int, default=3,
                        help="--true-on-policy: timed trainer steps per mode (median)")
    args = parser.parse_args()
    if args.true_on_policy:
        return compare_modes(args)
    results = {}
    for dtype in args.dtypes.split(","):
        mean, worst, n, extra = measure(args.model, args.device, dtype, args.temperature,
                                        args.max_new_tokens, args.num_prompts,
                                        args.attribute and dtype == "float32")
        results[dtype] = mean
        print(f"{args.model} on {args.device} in {dtype}: mean |Δ log p| = {mean:.3e}, "
              f"max = {worst:.3e} over {n} tokens")
        for key, value in extra.items():
            print(f"  {key} = {value:.3e}")
    print("RESULT " + " ".join(f"{d}_mean_abs_diff={v:.3e}" for d, v in results.items()))


if __name__ == "__main__":
    main()
