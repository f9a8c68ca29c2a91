"""Built-in environments for the tiny character-level policy, plus the helpers they share.

Invariant: every prompt and answer uses only the policy's vocabulary (digits, lowercase letters,
space and `+-*=:?,.!()<>`); prompts stay within 24 characters and answers within 8. The "train"
split is an endless stream that depends on the seed; the "eval" split is one fixed finite list
(the same for every seed, so evaluations of different runs compare), drawn from its own random
stream.
"""

from __future__ import annotations

import random
from typing import Callable, Iterator

from envs.base import Task

VOCAB = frozenset("0123456789abcdefghijklmnopqrstuvwxyz +-*=:?,.!()<>")
MAX_PROMPT_CHARS = 24
MAX_ANSWER_CHARS = 8
MAX_EVAL_TASKS = 100_000
BUILTINS = {
    "arith": "envs.builtin.arith:ArithEnv",
    "reverse": "envs.builtin.reverse:ReverseEnv",
    "calc_tool": "envs.builtin.calc_tool:CalcToolEnv",
    "agent_calc": "envs.builtin.agent_calc:AgentCalcEnv",  # needs the openai package
}

# Makes one (prompt, answer) pair from a seeded random stream.
Maker = Callable[[random.Random], tuple[str, str]]


def check_int(owner: str, name: str, value: object, lo: int, hi: int) -> int:
    """`value` as an int in [lo, hi], else ValueError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}: option {name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{owner}: option {name} must be in [{lo}, {hi}], got {value}")
    return value


def split_tasks(prefix: str, split: str, seed: int, make: Maker,
                num_eval: int) -> Iterator[Task]:
    """Tasks of `split`: endless for "train" (seeded), `num_eval` distinct prompts for "eval".

    Raises ValueError at once (not on first `next()`) for an unknown split."""
    if split == "train":
        return _train(prefix, seed, make)
    if split == "eval":
        return iter(_eval(prefix, make, num_eval))
    raise ValueError(f"{prefix}: unknown split {split!r}; use 'train' or 'eval'")


def _train(prefix: str, seed: int, make: Maker) -> Iterator[Task]:
    rng = random.Random(f"{prefix}/train/{seed}")
    index = 0
    while True:
        prompt, answer = make(rng)
        yield Task(id=f"{prefix}-train-{seed}-{index}", prompt=prompt, answer=answer)
        index += 1


def _eval(prefix: str, make: Maker, num_eval: int) -> list[Task]:
    """Up to `num_eval` distinct prompts (fewer when the task space is smaller)."""
    rng = random.Random(f"{prefix}/eval")
    seen: set[str] = set()
    tasks: list[Task] = []
    for _ in range(50 * num_eval):
        if len(tasks) == num_eval:
            break
        prompt, answer = make(rng)
        if prompt not in seen:
            seen.add(prompt)
            tasks.append(Task(id=f"{prefix}-eval-{len(tasks)}", prompt=prompt, answer=answer))
    return tasks


def leading_answer(text: str, allowed: str = "0123456789-") -> str:
    """The answer part of a response: stripped, cut at the first character not in `allowed`."""
    text = text.strip()
    for i, char in enumerate(text):
        if char not in allowed:
            return text[:i]
    return text
