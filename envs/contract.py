"""The environment contract checker: run any environment through the rules the rollout relies on.

    python -m envs.contract package.module:ClassName [--options '{"k": 1}'] [--num-tasks 20]

prints the report and exits 0 when the environment passes, 1 when it fails, 2 when it cannot be
loaded. Checks: `domain` is a non-empty str; `tasks("train", 0)` yields Tasks with unique ids and
non-empty prompts, the same ones again for seed 0 and others for seed 1; `tasks("eval", 0)` ends
and its ids are unique; `episode()` through a `ScriptedSession` answering garbage, empty text and
(when the environment has `reference_response(task) -> str`) the correct answer calls
`generate()`, never raises, never hangs, and returns a finite float; the correct answer earns at
least the reward of garbage and of empty text.

Agent environments (an episode that talks to `session.base_url` with the `openai` client,
docs/agents.md) are checked the same way: the session's base_url is an OpenAI-compatible endpoint
(envs/openai_api.py) answering each completion request with the script's next response, and
the check `agent_requests` fails when the endpoint refused a request of the agent (a 4xx: an
unsupported option such as n > 1, a malformed message, ...).

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
from envs.openai_api import (
    AgentEndpoint,
    ChatRequest,
    Completion,
    CompletionRequest,
    OpenAIError,
    parse_tool_calls,
)
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
        endpoint = AgentEndpoint()
        await endpoint.start()
        try:
            report.checks += await _check_episodes(env, tasks, timeout_s, endpoint)
        finally:
            await endpoint.close()
    return report


class ScriptedAgentSession(ScriptedSession):
    """A ScriptedSession whose `base_url` serves the same script over the OpenAI-compatible
    endpoint: each completion request (chat or text) answers the next response, cut before its
    first stop sequence (an OpenAI server leaves the stop out), with tool calls parsed in
    `tool_format`. Each request is a `calls` entry and a policy segment, as `generate()` is;
    usage counts characters (there is no tokenizer here)."""

    model_id = "scripted"

    def __init__(self, prompt: str, responses: list[str], endpoint: AgentEndpoint,
                 tool_format: str = "tags"):
        super().__init__(prompt, responses)
        self.endpoint, self.tool_format = endpoint, tool_format
        self.requests = 0
        self.refusals: list[str] = []  # the endpoint's 4xx answers to this episode
        self._key: str | None = None

    @property
    def base_url(self) -> str:
        if self._key is None:
            self._key = self.endpoint.register(self)
        return self.endpoint.base_url(self._key)

    def close(self) -> None:
        if self._key is not None:
            self.endpoint.unregister(self._key)
            self._key = None

    def refused(self, error: OpenAIError) -> None:
        where = f" ({error.param})" if error.param else ""
        self.refusals.append(f"HTTP {error.status}{where}: {error.message}")

    def _next(self, max_tokens: int | None, stop: list[str]) -> str:
        self.requests += 1
        turn = len(self.calls)
        self.calls.append((max_tokens, list(stop) or None))
        text = self.responses[turn] if turn < len(self.responses) else ""
        cuts = [text.find(s) for s in stop if s in text]
        text = text[:min(cuts)] if cuts else text
        self.segments.append((text, True))
        return text

    async def chat_completion(self, request: ChatRequest) -> Completion:
        text = self._next(request.max_tokens, request.stop)
        content, calls = text, []
        if request.tool_choice != "none":
            content, calls = parse_tool_calls(text, self.tool_format, request.tools)
        return Completion(text=text, finish_reason="tool_calls" if calls else "stop",
                          prompt_tokens=sum(len(m.get("content") or "")
                                            for m in request.messages),
                          completion_tokens=len(text), content=content, tool_calls=calls)

    async def text_completion(self, request: CompletionRequest) -> Completion:
        text = self._next(request.max_tokens, request.stop)
        return Completion(text=text, finish_reason="stop", prompt_tokens=len(request.prompt),
                          completion_tokens=len(text), content=text)


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
async def _check_episodes(env: Environment, tasks: list[Task], timeout_s: float,
                          endpoint: AgentEndpoint) -> list[Check]:
    scripts: dict[str, Callable[[Task], list[str]]] = {
        "garbage": lambda t: GARBAGE * 2, "empty": lambda t: [""] * 4}
    reference = getattr(env, "reference_response", None)
    if callable(reference):
        scripts["reference"] = lambda t: [reference(t)]
    checks = {name: Check(f"episode_{name}") for name in scripts}
    rewards: dict[str, list[float | None]] = {name: [] for name in scripts}  # None: failed
    agent = AgentCount()
    for task in tasks:
        for name, script in scripts.items():
            rewards[name].append(await _play(env, task, script, timeout_s, checks[name],
                                             endpoint, agent))
    for name, check in checks.items():
        check.detail = _mean_detail(rewards[name])
    out = list(checks.values())
    if "reference" in scripts:
        out.append(_check_order(tasks, rewards))
    if agent.episodes:  # the environment used session.base_url
        agent.check.detail = (f"{agent.requests} requests over {agent.episodes} episodes, "
                              f"{len(agent.check.problems)} refused")
        out.append(agent.check)
    return out


@dataclass
class AgentCount:
    """What the episodes asked of session.base_url."""

    check: Check = field(default_factory=lambda: Check("agent_requests"))
    episodes: int = 0
    requests: int = 0

    def add(self, task: Task, session: ScriptedAgentSession) -> None:
        if not (session.requests or session.refusals):
            return
        self.episodes += 1
        self.requests += session.requests
        for refusal in session.refusals:
            self.check.fail(f"task {task.id!r}: the endpoint refused a request of the agent: "
                            f"{refusal}")


async def _play(env: Environment, task: Task, script: Callable[[Task], list[str]],
                timeout_s: float, check: Check, endpoint: AgentEndpoint,
                agent: AgentCount) -> float | None:
    """The episode's reward, or None (and a problem in `check`) when it broke a rule; what it
    asked of session.base_url is counted in `agent`."""
    try:
        session = ScriptedAgentSession(task.prompt, script(task), endpoint)
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
    finally:
        session.close()
        agent.add(task, session)
    if not session.calls:
        check.fail(f"task {task.id!r}: episode never called session.generate() nor asked "
                   f"session.base_url for a completion")
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
