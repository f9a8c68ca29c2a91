"""Train the main job's weak base model: tiny-qwen2, supervised on the built-in domains, briefly.

`python -m scripts.train_base --out examples/base-tiny` (fixed seeds: the result is reproducible);
`--model tiny-qwen3-moe --out examples/moe-tiny` trains the mixture-of-experts base of
examples/moe.toml the same way.
The model sees `<bos>prompt answer<eos>` for addition ("12+7=19") and reversal ("rev abc=cba")
tasks drawn with seeds the RL run never uses, for few enough steps that it stays weak on both
domains; GRPO then has something to improve. Prints greedy accuracy per domain as it goes.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from algos.logprobs import position_ids_from_mask
from envs.builtin.arith import ArithEnv
from envs.builtin.reverse import ReverseEnv
from models.load import save_checkpoint
from models.tiny import build_tiny

DATA_SEED = 12345  # the RL run draws train tasks with its own seed (0 by default)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make_batch(tokenizer, tasks, device="cpu"):
    """Right-padded ids, attention mask and a loss mask on answer + <eos> tokens."""
    seqs, masks = [], []
    for t in tasks:
        prompt = [tokenizer.bos_token_id] + encode(tokenizer, t.prompt)
        answer = encode(tokenizer, t.answer) + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.float)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        loss_mask[i, :len(m)] = torch.tensor(m, dtype=torch.float)
    return ids, attn, loss_mask


def sft_loss(model, tokenizer, tasks) -> torch.Tensor:
    """Mean cross-entropy over the answer + <eos> tokens of `tasks`."""
    ids, attn, mask = make_batch(tokenizer, tasks)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], max_new_tokens: int = 6) -> list[str]:
    """Batched greedy decoding (left padding, no cache; the model is tiny)."""
    return decode(model, tokenizer, prompts, max_new_tokens)


@torch.no_grad()
def decode(model, tokenizer, prompts: list[str], max_new_tokens: int,
           temperature: float = 0.0, generator: torch.Generator | None = None) -> list[str]:
    """Batched decoding: greedy at temperature 0, else ancestral sampling at `temperature`."""
    seqs = [[tokenizer.bos_token_id] + encode(tokenizer, p) for p in prompts]
    done = [False] * len(seqs)
    out: list[list[int]] = [[] for _ in seqs]
    for _ in range(max_new_tokens):
        width = max(map(len, seqs))
        ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
        attn = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        logits = model(input_ids=ids, attention_mask=attn,
                       position_ids=position_ids_from_mask(attn)).logits[:, -1]
        if temperature > 0:
            probs = torch.softmax(logits.double() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist()
        else:
            nxt = logits.argmax(-1).tolist()
        for i, tok in enumerate(nxt):
            if done[i]:
                continue
            if tok == tokenizer.eos_token_id:
                done[i] = True
            else:
                out[i].append(tok)
            seqs[i].append(tok)
        if all(done):
            break
    return [tokenizer.decode(o) for o in out]


def accuracy(model, tokenizer, env, n: int = 200) -> float:
    tasks = list(env.tasks("eval", 0))[:n]
    responses = greedy(model, tokenizer, [t.prompt for t in tasks])
    return sum(env.reward(t, r) for t, r in zip(tasks, responses)) / len(tasks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="examples/base-tiny")
    parser.add_argument("--model", default="tiny-qwen2",
                        help="the tiny architecture (models/tiny.py), e.g. tiny-qwen3-moe")
    parser.add_argument("--steps", type=int, default=125)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--reverse-every", type=int, default=2,
                        help="one sample in this many is a reversal task (they learn faster)")
    args = parser.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    model, tokenizer = build_tiny(args.model, seed=0)
    envs = [ArithEnv(max_operand=args.max_operand), ReverseEnv()]
    streams = [env.tasks("train", DATA_SEED) for env in envs]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        tasks = [next(streams[1 if i % args.reverse_every == 0 else 0])
                 for i in range(args.batch)]
        model.train()
        loss = sft_loss(model, tokenizer, tasks)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            accs = {env.domain: accuracy(model, tokenizer, env) for env in envs}
            print(f"step {step} loss {loss.item():.3f} greedy accuracy {accs} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    model.eval()
    save_checkpoint(model, tokenizer, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
