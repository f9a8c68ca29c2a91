"""The environment contract checker: run any environment through the rules the rollout relies on.

    python -m envs.contract package.module:ClassName [--options '{"k": 1}'] [--num-tasks 20]

prints the report and exits 0 when the environment passes, 1 when it fails, 2 when it cannot be
loaded. Checks: `domain` is a non-empty str; `tasks("train", 0)` yields Tasks with unique ids and
non-empty prompts, the same ones again for seed 0 and others for seed 1; `tasks("eval", 0)` ends
and its ids are unique; `episode()` through a `ScriptedSession` answering garbage, empty text and
(when the environment has `reference_response(task) -> str`) the correct answer calls
`generate()`, never raises, never hangs, and returns a finite float; the correct answer earns at
least the reward of garbage and of empty text.

Invariant: `check_env` never raises because of the environment under test; everything it finds is
a line in `ContractReport.problems` (with the task id and a traceback summary for exceptions).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from envs.base import Environment, Task
from envs.loader import load_env
from envs.scripted import ScriptedSession

GARBAGE = ["zq!?x", ")(<>:,."]  # in the vocabulary, never a correct answer of a sane task
EVAL_LIMIT = 100_000  # an eval split longer than this is reported as endless
MAX_LINES = 5  # problems listed per check; the rest are counted


@dataclass
class Check:
    """One rule: passed or not, and what was seen."""

    name: str
    ok: bool = True
    detail: str = ""
    problems: list[str] = field(default_factory=list)

    def fail(self, problem: str) -> None:
        self.ok = False
        self.problems.append(problem)


@dataclass
class ContractReport:
    env: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def problems(self) -> list[str]:
        """Every problem, prefixed with its check's name (at most MAX_LINES per check)."""
        lines = []
        for c in self.checks:
            lines += [f"{c.name}: {p}" for p in c.problems[:MAX_LINES]]
            if len(c.problems) > MAX_LINES:
                lines.append(f"{c.name}: ... and {len(c.problems) - MAX_LINES} more")
        return lines

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def format(self) -> str:
        head = f"{self.env}: {'PASS' if self.ok else 'FAIL'}"
        rows = [f"  [{'ok' if c.ok else 'FAIL':>4}] {c.name}: {c.detail}" for c in self.checks]
        return "\n".join([head, *rows, *(f"  - {p}" for p in self.problems)])


def check_env(env: Environment, num_tasks: int = 20, timeout_s: float = 10.0) -> ContractReport:
    """Run every check on `env` (blocking; inside an event loop use `check_env_async`)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(check_env_async(env, num_tasks, timeout_s))
    raise RuntimeError("check_env() called inside a running event loop; "
                       "use `await check_env_async(...)` there")


async def check_env_async(env: Environment, num_tasks: int = 20,
                          timeout_s: float = 10.0) -> ContractReport:
    if num_tasks < 1:
        raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
    report = ContractReport(env=type(env).__qualname__)
    report.checks.append(_check_domain(env))
    tasks, check = _check_train(env, num_tasks)
    report.checks += [check, _check_determinism(env, num_tasks, tasks), _check_eval(env)]
    if tasks:
        report.checks += await _check_episodes(env, tasks, timeout_s)
    return report


# ----------------------------------------------------------------------------- tasks
def _check_domain(env: Any) -> Check:
    check = Check("domain")
    if not isinstance(env, Environment):
        check.fail(f"{type(env).__name__} is not an envs.base.Environment; subclass it")
    domain = getattr(env, "domain", None)
    check.detail = repr(domain)
    if not isinstance(domain, str) or not domain:
        check.fail(f"domain must be a non-empty str, got {domain!r}")
    return check


def _take(env: Environment, split: str, seed: int, n: int) -> list:
    return list(itertools.islice(env.tasks(split, seed), n))


def _check_train(env: Environment, num_tasks: int) -> tuple[list[Task], Check]:
    check = Check("train_tasks")
    try:
        items = _take(env, "train", 0, num_tasks)
    except Exception as e:
        check.fail(f"tasks('train', 0) raised {summarize(e)}")
        return [], check
    check.detail = f"{len(items)} tasks"
    if not items:
        check.fail("tasks('train', 0) yielded no tasks")
    tasks = _valid_tasks(items, "tasks('train', 0)", check)
    return tasks, check


def _valid_tasks(items: list, where: str, check: Check) -> list[Task]:
    """The Tasks among `items`; reports non-Tasks, empty prompts and repeated ids."""
    tasks, seen = [], set()
    for i, item in enumerate(items):
        if not isinstance(item, Task):
            check.fail(f"{where} item {i} is a {type(item).__name__}; yield envs.base.Task")
            continue
        if not isinstance(item.id, str) or not item.id:
            check.fail(f"{where} item {i}: id must be a non-empty str, got {item.id!r}")
            continue
        if not isinstance(item.prompt, str) or not item.prompt:
            check.fail(f"task {item.id!r}: prompt must be a non-empty str, got {item.prompt!r}")
        if item.id in seen:
            check.fail(f"task id {item.id!r} repeats in {where}; ids must be unique")
        seen.add(item.id)
        tasks.append(item)
    return tasks


def _check_determinism(env: Environment, num_tasks: int, first: list[Task]) -> Check:
    check = Check("train_determinism")
    try:
        again, other = _take(env, "train", 0, num_tasks), _take(env, "train", 1, num_tasks)
    except Exception as e:
        check.fail(f"tasks('train', seed) raised {summarize(e)}")
        return check
    if _fingerprint(again) != _fingerprint(first):
        check.fail("tasks('train', 0) gave different tasks the second time; derive all "
                   "randomness from (split, seed)")
    if _fingerprint(other) == _fingerprint(first):
        check.fail("tasks('train', 1) gave the same tasks as seed 0; use the seed")
    check.detail = "same for seed 0, different for seed 1" if check.ok else "see problems"
    return check


def _fingerprint(items: list) -> list[str]:
    """Comparable without trusting `==` of arbitrary answers (arrays, tensors)."""
    return [repr(item) for item in items]


def _check_eval(env: Environment) -> Check:
    check = Check("eval_tasks")
    try:
        items = _take(env, "eval", 0, EVAL_LIMIT + 1)
    except Exception as e:
        check.fail(f"tasks('eval', 0) raised {summarize(e)}")
        return check
    if len(items) > EVAL_LIMIT:
        check.fail(f"tasks('eval', 0) yielded more than {EVAL_LIMIT} tasks; make it finite")
        return check
    _valid_tasks(items, "tasks('eval', 0)", check)
    check.detail = f"{len(items)} tasks"
    return check


# ----------------------------------------------------------------------------- episodes
async def _check_episodes(env: Environment, tasks: list[Task], timeout_s: float) -> list[Check]:
    scripts: dict[str, Callable[[Task], list[str]]] = {
        "garbage": lambda t: GARBAGE * 2, "empty": lambda t: [""] * 4}
    reference = getattr(env, "reference_response", None)
    if callable(reference):
        scripts["reference"] = lambda t: [reference(t)]
    checks = {name: Check(f"episode_{name}") for name in scripts}
    rewards: dict[str, list[float | None]] = {name: [] for name in scripts}  # None: failed
    for task in tasks:
        for name, script in scripts.items():
            rewards[name].append(await _play(env, task, script, timeout_s, checks[name]))
    for name, check in checks.items():
        check.detail = _mean_detail(rewards[name])
    if "reference" in scripts:
        return [*checks.values(), _check_order(tasks, rewards)]
    return list(checks.values())


async def _play(env: Environment, task: Task, script: Callable[[Task], list[str]],
                timeout_s: float, check: Check) -> float | None:
    """The episode's reward, or None (and a problem in `check`) when it broke a rule."""
    try:
        session = ScriptedSession(task.prompt, script(task))
    except Exception as e:
        check.fail(f"task {task.id!r}: reference_response() raised {summarize(e)}")
        return None
    try:
        reward = await asyncio.wait_for(env.episode(task, session), timeout_s)
    except asyncio.TimeoutError:
        check.fail(f"task {task.id!r}: episode did not finish within {timeout_s}s")
        return None
    except Exception as e:
        check.fail(f"task {task.id!r}: episode raised {summarize(e)}")
        return None
    if not session.calls:
        check.fail(f"task {task.id!r}: episode never called session.generate()")
    if isinstance(reward, bool) or not isinstance(reward, float):
        check.fail(f"task {task.id!r}: episode returned {reward!r} ({type(reward).__name__}); "
                   f"return a float")
        return None
    if not math.isfinite(reward):
        check.fail(f"task {task.id!r}: episode returned {reward}; return a finite float")
        return None
    return reward


def _mean_detail(rewards: list[float | None]) -> str:
    valid = [r for r in rewards if r is not None]
    mean = f"mean reward {sum(valid) / len(valid):.3f}" if valid else "no reward"
    return f"{mean} over {len(valid)}/{len(rewards)} episodes"


def _check_order(tasks: list[Task], rewards: dict[str, list[float | None]]) -> Check:
    check = Check("reward_order", detail="reference >= garbage and >= empty on every task")
    for i, task in enumerate(tasks):
        best = rewards["reference"][i]
        for name in ("garbage", "empty"):
            other = rewards[name][i]
            if best is not None and other is not None and best < other:
                check.fail(f"task {task.id!r}: the reference response earned {best}, less than "
                           f"{name} text ({other}); check reward() or reference_response()")
    return check


def summarize(e: BaseException) -> str:
    """`Type: message (at file:line in function)` of the innermost frame."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames \
        else ""
    return f"{type(e).__name__}: {e}{where}"


# ----------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.contract", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("env", help="package.module:ClassName")
    parser.add_argument("--options", default="{}", help="constructor options as a JSON object")
    parser.add_argument("--num-tasks", type=int, default=20)
    args = parser.parse_args(argv)

    try:
        options = json.loads(args.options)
        if not isinstance(options, dict):
            raise ValueError(f"--options must be a JSON object, got {args.options!r}")
        env = load_env(args.env, options)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = check_env(env, args.num_tasks)
    print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
