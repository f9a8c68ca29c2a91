"""Train-rollout log-prob agreement of the embedded worker and the trainer, per dtype and device.

Starts an embedded inference worker in-process, samples responses over HTTP exactly as the
rollout does (HttpSession), then recomputes their log-probs with the trainer's batching and
forward (actors.train_step.forward) on the same weights. Prints mean and max |Δ log p| over the
policy tokens for each dtype. `python -m bench.logprob_alignment [--model tiny-qwen2]
[--device cpu] [--dtypes float32,bfloat16]`. Final line: RESULT <dtype>_mean_abs_diff=... ...
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile

import torch

from actors.base import ActorContext
from actors.inference import InferenceWorker
from actors.rollout_session import HttpSession
from actors.train_step import TrainState, forward
from algos.batching import make_micro_batch
from engine.client import SglangClient
from models.load import load_model, load_tokenizer
from transport.schema import Endpoints

PROMPTS = ["12+7=", "rev abcd=", "3+4=", "rev xyz=", "8+8=", "rev hello=", "1+9=", "rev ab="]


async def sample(model: str, device: str, dtype: str, temperature: float, max_new: int):
    sock = tempfile.mkdtemp(prefix="rlx-align-")
    ctx = ActorContext(name="w", endpoints=Endpoints(control=f"ipc://{sock}/ctl"))
    worker = InferenceWorker(ctx, InferenceWorker.Config(model=model, device=device, dtype=dtype))
    task = asyncio.ensure_future(worker.serve())
    await worker.wait_running()
    client = SglangClient(worker.bound.http)
    tok = load_tokenizer(model)
    try:
        sessions = [HttpSession(client, tok, p, {"temperature": temperature, "sampling_seed": i},
                                f"k{i}", max_new) for i, p in enumerate(PROMPTS)]
        await asyncio.gather(*(s.generate() for s in sessions))
    finally:
        await client.close()
        worker.stop("done")
        await task
    return [s.to_sample(f"g{i}", 0, "d", 0.0) for i, s in enumerate(sessions)]


def measure(model: str, device: str, dtype: str, temperature: float, max_new: int):
    samples = asyncio.run(sample(model, device, dtype, temperature, max_new))
    net, tokenizer = load_model(model, device, getattr(torch, dtype))
    state = TrainState(net, tokenizer, torch.optim.SGD(net.parameters(), lr=0.0))
    mb = make_micro_batch(samples, tokenizer.pad_token_id or 0).to(device)
    with torch.no_grad():
        logp, _ = forward(state, mb, temperature)
    diff = (logp - mb.rollout_logp).abs() * mb.mask
    return float(diff.sum() / mb.mask.sum()), float(diff.max()), int(mb.mask.sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    results = {}
    for dtype in args.dtypes.split(","):
        mean, worst, n = measure(args.model, args.device, dtype, args.temperature,
                                 args.max_new_tokens)
        results[dtype] = mean
        print(f"{args.model} on {args.device} in {dtype}: mean |Δ log p| = {mean:.3e}, "
              f"max = {worst:.3e} over {n} tokens")
    print("RESULT " + " ".join(f"{d}_mean_abs_diff={v:.3e}" for d, v in results.items()))


if __name__ == "__main__":
    main()
