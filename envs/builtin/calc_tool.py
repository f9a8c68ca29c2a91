"""A two-turn tool-use environment (domain "tool"); it exists to exercise loss masks.

Protocol (every character is in the policy's vocabulary):

    prompt        "12*34="
    turn 1        the policy writes either the answer ("408", then <eos>): the episode ends,
                  or a calculator call "calc(12*34)": generation stops at ")"
    observation   the environment appends "=408 " (or "=err " when the call does not parse) with
                  `session.observe()`: in the token sequence, never trained on
    turn 2        the policy writes the answer ("408"); a second call is not run, it is a wrong
                  answer

    transcript of a tool episode: "12*34=calc(12*34)=408 408"

The calculator evaluates `a op b` for integers of at most 8 digits (an optional leading "-") and
op in "+-*", whatever expression the policy wrote (not necessarily the task's). The text returned
by turn 1 may or may not end with the stop string ")"; both parse.

Invariant: at most two `generate()` calls and at most one `observe()` per episode; the reward is
1.0 exactly when the final answer (stripped, cut at its first character that is not a digit or
"-") equals the task's answer, else 0.0. Using the tool costs nothing.
"""

from __future__ import annotations

import operator
import random
import re
from typing import Iterator

from envs.base import Environment, Session, Task
from envs.builtin import MAX_EVAL_TASKS, check_int, leading_answer, split_tasks

CALL = "calc("
STOP = ")"
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_EXPR = re.compile(r"(-?\d{1,8})([-+*])(-?\d{1,8})")


def calculate(expression: str) -> str:
    """The tool: `"12*34"` -> `"408"`; `"err"` for anything that is not `a op b`."""
    match = _EXPR.fullmatch(expression.strip())
    if match is None:
        return "err"
    a, op, b = match.groups()
    return str(_OPS[op](int(a), int(b)))


def parse_call(text: str) -> str | None:
    """The expression of a calculator call at the start of `text`, or None if it is no call."""
    text = text.lstrip()
    if not text.startswith(CALL):
        return None
    return text[len(CALL):].split(STOP, 1)[0]


class CalcToolEnv(Environment):
    """`a op b=` with an optional calculator turn. Options: max_operand, ops, num_eval_tasks."""

    domain = "tool"

    def __init__(self, *, max_operand: int = 99, ops: str = "+-*", num_eval_tasks: int = 200):
        name = type(self).__name__
        check_int(name, "max_operand", max_operand, 1, 9999)  # a product fits in 8 characters
        check_int(name, "num_eval_tasks", num_eval_tasks, 0, MAX_EVAL_TASKS)
        if not isinstance(ops, str) or not ops or set(ops) - set(_OPS) or len(set(ops)) < len(ops):
            raise ValueError(f"{name}: option ops must be distinct characters of '+-*', "
                             f"got {ops!r}")
        super().__init__(max_operand=max_operand, ops=ops, num_eval_tasks=num_eval_tasks)
        self.max_operand, self.ops, self.num_eval_tasks = max_operand, ops, num_eval_tasks
        digits = len(str(max_operand))
        self.max_new_tokens = len(CALL) + 2 * digits + 2  # "calc(a*b)"; an answer is shorter
        self.answer_tokens = 2 * digits + 1  # the longest answer (a product) and <eos>

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        return split_tasks("calc", split, seed, self._make, self.num_eval_tasks)

    def _make(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        return f"{a}{op}{b}=", calculate(f"{a}{op}{b}")

    async def episode(self, task: Task, session: Session) -> float:
        first = await session.generate(self.max_new_tokens, [STOP])
        expression = parse_call(first)
        if expression is None:
            return self.reward(task, first)
        session.observe("=" + calculate(expression) + " ")
        final = await session.generate(self.answer_tokens, None)
        return self.reward(task, final)

    def reward(self, task: Task, answer: str) -> float:
        return 1.0 if leading_answer(answer) == task.answer else 0.0

    def reference_response(self, task: Task) -> str:
        """A first-turn response that earns full reward without the tool."""
        return task.answer
