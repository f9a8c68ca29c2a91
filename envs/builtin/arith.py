"""Integer addition, the smallest math task: prompt "12+7=", answer "19" (domain "math").

Invariant: operands are in [0, max_operand]; the reward is 1.0 exactly when the response, stripped
and cut at its first character that is not a digit or "-", equals the sum; else 0.0.
"""

from __future__ import annotations

import random
from typing import Iterator

from envs.base import SingleTurnEnv, Task
from envs.builtin import MAX_EVAL_TASKS, check_int, leading_answer, split_tasks


class ArithEnv(SingleTurnEnv):
    """`a+b=` -> `a+b`. Options: max_operand (largest operand), num_eval_tasks (eval size)."""

    domain = "math"

    def __init__(self, *, max_operand: int = 99, num_eval_tasks: int = 200):
        name = type(self).__name__
        check_int(name, "max_operand", max_operand, 1, 49_999_999)  # sum fits in 8 characters
        check_int(name, "num_eval_tasks", num_eval_tasks, 0, MAX_EVAL_TASKS)
        super().__init__(max_operand=max_operand, num_eval_tasks=num_eval_tasks)
        self.max_operand = max_operand
        self.num_eval_tasks = num_eval_tasks
        self.max_new_tokens = len(str(2 * max_operand)) + 1  # the digits and <eos>

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        return split_tasks("arith", split, seed, self._make, self.num_eval_tasks)

    def _make(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return f"{a}+{b}=", str(a + b)

    def reward(self, task: Task, response: str) -> float:
        return 1.0 if leading_answer(response) == task.answer else 0.0

    def reference_response(self, task: Task) -> str:
        """The response that earns full reward (used by `envs.contract`)."""
        return task.answer
