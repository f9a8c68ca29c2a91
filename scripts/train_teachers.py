"""Train the MOPD demo's two specialist teachers from the main job's weak base model.

`python -m scripts.train_teachers --out-dir examples` writes `examples/teacher-arith/` and
`examples/teacher-reverse/`. Each teacher starts from `examples/base-tiny`'s weights (same
architecture, config and tokenizer: a teacher whose vocabulary differs from the student's is
refused) and is supervised on its own domain only, with fixed seeds, until it is strong there;
it may forget the other domain. Arithmetic uses max_operand 9, reversal the main job's options
(`examples/local.toml`).

`--cross-vocab` writes `examples/teacher-arith-bpe/` instead: the arithmetic teacher with a
vocabulary of its own (`build_bpe_tokenizer`: the base's characters at other ids plus BPE merges
"10".."19", so a two-digit sum is one teacher token against two student tokens), for the
demo of distillation across vocabularies (`examples/mopd-cross-vocab.toml`). It starts from the
base's weights too: each of its tokens' embedding rows is the base's row of the same text, a
merge's the mean of its characters' rows (the embeddings are tied, so the output head follows).

Invariant: every number printed and written to `<teacher>/eval.json` is measured with the
project's own evaluation on the environments' fixed "eval" split: greedy exact match (as
`scripts/train_base.py` measures, what the rollout's evaluation reports) and sampled accuracy at
temperature 1.0 with a fixed seed (what the RL rollout's reward sees).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from envs.builtin.arith import ArithEnv
from envs.builtin.reverse import ReverseEnv
from models.load import load_model, save_checkpoint
from scripts.train_base import DATA_SEED, accuracy, decode, sft_loss

BASE_DIR = "examples/base-tiny"
SAMPLE_TEMPERATURE = 1.0  # the rollout's default temperature
SAMPLE_SEED = 0  # torch generator seed for sampled evaluation
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
NUM_EVAL_TASKS = 200  # the environments' default eval split size (arith max_operand 9 has 100)


def demo_envs() -> dict[str, object]:
    """The main job's two environments, keyed by domain, with its options."""
    return {"math": ArithEnv(max_operand=9), "reverse": ReverseEnv(partial=False)}


@dataclass
class TeacherSpec:
    """How one teacher is trained."""

    name: str  # checkpoint directory name under --out-dir
    domain: str  # the one domain it is supervised on ("math" or "reverse")
    num_steps: int  # optimizer steps
    lr: float  # AdamW peak learning rate (cosine decay to 10% over num_steps)
    batch_size: int  # tasks per step
    seed: int  # torch seed (dropout-free model: only the data order and sampling depend on it)
    # "student": the base's tokenizer; "bpe": build_bpe_tokenizer's; "permuted": the same
    # without merges (the base's characters at other ids: a control for the alignment)
    vocab: str = "student"


TEACHERS = [
    TeacherSpec("teacher-arith", "math", num_steps=200, lr=3e-3, batch_size=64, seed=1),
    TeacherSpec("teacher-reverse", "reverse", num_steps=300, lr=3e-3, batch_size=64, seed=2),
]

CROSS_VOCAB_TEACHERS = [
    TeacherSpec("teacher-arith-bpe", "math", num_steps=400, lr=3e-3, batch_size=64, seed=1,
                vocab="bpe"),
]
BPE_MERGES = [("1", str(d)) for d in range(10)]  # "10".."19": every two-digit sum of a+b <= 18


def build_bpe_tokenizer(base, merges: list[tuple[str, str]] = BPE_MERGES
                        ) -> PreTrainedTokenizerFast:
    """A BPE tokenizer over the base's characters with other ids (in reverse order, after the
    same special tokens) and `merges`; the same special strings and roles."""
    specials = list(base.all_special_tokens)
    base_vocab = base.get_vocab()
    ordered = sorted((t for t in base_vocab if t not in specials), key=base_vocab.get,
                     reverse=True)
    vocab = {t: base_vocab[t] for t in specials}
    for t in ordered + [a + b for a, b in merges]:
        vocab[t] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), unk_token=base.unk_token))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=base.pad_token,
                                   bos_token=base.bos_token, eos_token=base.eos_token,
                                   unk_token=base.unk_token, padding_side="left")


@torch.no_grad()
def move_to_vocab(model, base, tokenizer) -> None:
    """Give `model` (with `base`'s vocabulary) the vocabulary of `tokenizer`: each token's
    embedding row is the base's row of the same text, a merge's the mean of its characters'."""
    old = model.get_input_embeddings().weight.detach().clone()
    base_vocab = base.get_vocab()
    vocab = tokenizer.get_vocab()
    model.resize_token_embeddings(len(vocab), mean_resizing=False)
    new = model.get_input_embeddings().weight
    for text, i in vocab.items():
        parts = [text] if text in base_vocab else list(text)
        new[i] = old[[base_vocab[p] for p in parts]].mean(0)
    model.config.vocab_size = len(vocab)


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], temperature: float, max_new_tokens: int,
           generator: torch.Generator) -> list[str]:
    """Batched ancestral sampling at `temperature` (left padding, no cache; the model is tiny)."""
    return decode(model, tokenizer, prompts, max_new_tokens, temperature, generator)


def sampled_accuracy(model, tokenizer, env, n: int = NUM_EVAL_TASKS,
                     temperature: float = SAMPLE_TEMPERATURE, seed: int = SAMPLE_SEED) -> float:
    """Mean reward of one sample per eval task at `temperature` (the rollout's reward)."""
    tasks = list(env.tasks("eval", 0))[:n]
    gen = torch.Generator().manual_seed(seed)
    responses = sample(model, tokenizer, [t.prompt for t in tasks], temperature,
                       env.max_new_tokens, gen)
    return sum(env.reward(t, r) for t, r in zip(tasks, responses)) / len(tasks)


def evaluate(model, tokenizer, envs: dict, n: int = NUM_EVAL_TASKS) -> dict[str, dict]:
    """{domain: {"greedy": acc, "sampled_t1": acc, "num_tasks": k}} on each env's eval split."""
    model.eval()
    return {domain: {"greedy": accuracy(model, tokenizer, env, n),
                     "sampled_t1": sampled_accuracy(model, tokenizer, env, n),
                     "num_tasks": len(list(env.tasks("eval", 0))[:n])}
            for domain, env in envs.items()}


def train_teacher(spec: TeacherSpec, env, base_dir: str = BASE_DIR):
    """(model, tokenizer, seconds): base weights, supervised on `env` for spec.num_steps."""
    torch.manual_seed(spec.seed)
    random.seed(spec.seed)
    model, tokenizer = load_model(base_dir)
    if spec.vocab != "student":  # "bpe", or "permuted": the base's characters at other ids
        base = tokenizer
        tokenizer = build_bpe_tokenizer(base, BPE_MERGES if spec.vocab == "bpe" else [])
        move_to_vocab(model, base, tokenizer)
    stream = env.tasks("train", DATA_SEED + spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, spec.num_steps,
                                                       eta_min=spec.lr / 10)
    model.train()
    t0 = time.time()
    for step in range(1, spec.num_steps + 1):
        loss = sft_loss(model, tokenizer, [next(stream) for _ in range(spec.batch_size)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == spec.num_steps:
            print(f"{spec.name} step {step} loss {loss.item():.4f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    return model.eval(), tokenizer, time.time() - t0


def format_table(results: dict[str, dict]) -> str:
    """Rows per model, columns per domain x (greedy, sampled at T=1)."""
    domains = list(next(iter(results.values())))
    head = f"{'model':<16}" + "".join(f"{d + ' greedy':>16}{d + ' T=1':>14}" for d in domains)
    rows = [head]
    for name, accs in results.items():
        rows.append(f"{name:<16}" + "".join(
            f"{accs[d]['greedy']:>16.3f}{accs[d]['sampled_t1']:>14.3f}" for d in domains))
    return "\n".join(rows)


def write_eval(path: str, spec: TeacherSpec, base: dict, teacher: dict, seconds: float) -> None:
    """The teacher's eval.json: its accuracy and the base's, and how it was trained."""
    record = {"domain": spec.domain, "teacher": teacher, "base": base,
              "metrics": {"greedy": "greedy exact match (reward 1.0), max 6 new tokens",
                          "sampled_t1": f"one sample per task at temperature "
                                        f"{SAMPLE_TEMPERATURE}, torch seed {SAMPLE_SEED}"},
              "train": {**asdict(spec), "data_seed": DATA_SEED + spec.seed, "base": BASE_DIR,
                        "seconds": round(seconds, 1)}}
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


def save_teacher(model, tokenizer, directory: str, base_dir: str = BASE_DIR,
                 vocab: str = "student") -> None:
    """The checkpoint, with the base's tokenizer files copied byte for byte (re-saving a loaded
    tokenizer adds loader bookkeeping keys, and the teacher's tokenizer must be the student's),
    or for a teacher of its own vocabulary, its tokenizer as built."""
    save_checkpoint(model, tokenizer, directory)
    if vocab != "student":
        return
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(base_dir, name), os.path.join(directory, name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default="examples",
                        help="parent directory of teacher-arith/ and teacher-reverse/")
    parser.add_argument("--cross-vocab", action="store_true",
                        help="train only the teachers of their own vocabulary "
                             "(teacher-arith-bpe/)")
    args = parser.parse_args()
    envs = demo_envs()
    base_model, tokenizer = load_model(BASE_DIR)
    results = {"base-tiny": evaluate(base_model, tokenizer, envs)}
    t_start = time.time()
    for spec in CROSS_VOCAB_TEACHERS if args.cross_vocab else TEACHERS:
        model, tokenizer, seconds = train_teacher(spec, envs[spec.domain])
        results[spec.name] = evaluate(model, tokenizer, envs)
        out = os.path.join(args.out_dir, spec.name)
        save_teacher(model, tokenizer, out, vocab=spec.vocab)
        write_eval(os.path.join(out, "eval.json"), spec, results["base-tiny"],
                   results[spec.name], seconds)
        print(f"saved {out} (trained in {seconds:.0f} s)", flush=True)
    print(f"total {time.time() - t_start:.0f} s; accuracy on {NUM_EVAL_TASKS} eval tasks "
          f"per domain (arith max_operand 9 has only {results['base-tiny']['math']['num_tasks']})")
    print(format_table(results))


if __name__ == "__main__":
    main()
