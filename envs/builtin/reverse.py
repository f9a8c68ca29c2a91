"""Reverse a short lowercase word: prompt "rev abc=", answer "cba" (domain "reverse").

Invariant: words have min_len..max_len letters a-z; the reward is 1.0 for an exact match of the
stripped response, else 0.0, or with `partial=True` the fraction of positions that match, out of
the longer of response and answer (so extra characters cost as much as missing ones).
"""

from __future__ import annotations

import random
import string
from typing import Iterator

from envs.base import SingleTurnEnv, Task
from envs.builtin import MAX_ANSWER_CHARS, MAX_EVAL_TASKS, check_int, split_tasks


class ReverseEnv(SingleTurnEnv):
    """`rev abc=` -> `cba`. Options: min_len, max_len, num_eval_tasks, partial."""

    domain = "reverse"

    def __init__(self, *, min_len: int = 2, max_len: int = 5, num_eval_tasks: int = 200,
                 partial: bool = False):
        name = type(self).__name__
        check_int(name, "min_len", min_len, 1, MAX_ANSWER_CHARS)
        check_int(name, "max_len", max_len, min_len, MAX_ANSWER_CHARS)
        check_int(name, "num_eval_tasks", num_eval_tasks, 0, MAX_EVAL_TASKS)
        if not isinstance(partial, bool):
            raise ValueError(f"{name}: option partial must be true or false, got {partial!r}")
        super().__init__(min_len=min_len, max_len=max_len, num_eval_tasks=num_eval_tasks,
                         partial=partial)
        self.min_len, self.max_len = min_len, max_len
        self.num_eval_tasks = num_eval_tasks
        self.partial = partial
        self.max_new_tokens = max_len + 1  # the letters and <eos>

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        return split_tasks("reverse", split, seed, self._make, self.num_eval_tasks)

    def _make(self, rng: random.Random) -> tuple[str, str]:
        length = rng.randint(self.min_len, self.max_len)
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
        return f"rev {word}=", word[::-1]

    def reward(self, task: Task, response: str) -> float:
        response = response.strip()
        if not self.partial:
            return 1.0 if response == task.answer else 0.0
        hits = sum(r == a for r, a in zip(response, task.answer))
        return hits / max(len(response), len(task.answer))

    def reference_response(self, task: Task) -> str:
        """The response that earns full reward (used by `envs.contract`)."""
        return task.answer
