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
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import tempfile

import torch

from actors.inference import InferenceWorker
from algos.logprobs import response_slice, token_logprobs
from engine.client import SglangClient
from engine.session import HttpSession
from models.load import load_model, load_tokenizer
from runtime.actor import ActorContext
from training.batching import make_micro_batch
from training.step import TrainState, forward
from transport.dtypes import model_dtype
from transport.schema import Endpoints

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
                 num_prompts: int):
    sock = tempfile.mkdtemp(prefix="rlx-align-")
    ctx = ActorContext(name="w", endpoints=Endpoints(control=f"ipc://{sock}/ctl"))
    worker = InferenceWorker(ctx, InferenceWorker.Config(model=model, device=device, dtype=dtype))
    task = asyncio.ensure_future(worker.serve())
    await worker.wait_running()
    client = SglangClient(worker.bound.http)
    tok = load_tokenizer(model)
    try:
        sessions = [HttpSession(client, tok, p, {"temperature": temperature, "sampling_seed": i},
                                f"k{i}", max_new) for i, p in enumerate(prompts(num_prompts))]
        await asyncio.gather(*(s.generate() for s in sessions))
    finally:
        await client.close()
        worker.stop("done")
        await task
    return [s.to_sample(f"g{i}", 0, "d", 0.0) for i, s in enumerate(sessions)]


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
    mb = make_micro_batch(samples, tokenizer.pad_token_id or 0).to(device)
    with torch.no_grad():
        logp, _ = forward(state, mb, temperature)
        unpadded, _ = forward(state, mb, temperature, by_length=True)
    diff = (logp - mb.rollout_logp).abs() * mb.mask
    extra = attribute(net, samples, mb, logp, temperature) if with_attribution else {}
    extra["by_length_mean_abs_diff"] = float(((unpadded - mb.rollout_logp).abs() * mb.mask).sum()
                                             / mb.mask.sum())
    return float(diff.sum() / mb.mask.sum()), float(diff.max()), int(mb.mask.sum()), extra


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
    args = parser.parse_args()
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
