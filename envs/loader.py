"""Loading environments by dotted path ("package.module:ClassName") and mixing several.

Invariant: every user mistake (bad path, missing class, not an Environment, rejected options,
a constructor that raises, bad mix spec) is a ValueError that names the dotted path and says what
to change, in one line; a mix's (`load_envs`, `check_at_load`) is an `EnvSpecError` that also
names the spec's index, which the launcher reports as `[rl] envs[<i>] (cls = "...")`. `EnvMix` hands
out the tasks of its environments interleaved by weight (smooth weighted round robin: no
randomness, each environment's share of any prefix is within one task of its weight's share),
labels each task with its environment's domain when the task has none, and routes a task back to
its environment by that domain, so domains must be distinct across the mix.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import json
import math
from typing import Any, Iterator

from envs.base import Environment, Session, Task
from envs.builtin import BUILTINS
from transport.errors import RlxError

SPEC_KEYS = {"cls", "weight", "options", "domain"}
_END = object()


class EnvSpecError(RlxError, ValueError):
    """Environment `index` of a mix (its spec's `cls`) is wrong: `reason`, one line."""

    def __init__(self, index: int, cls: object, reason: str):
        shown = json.dumps(cls) if isinstance(cls, str) else repr(cls)
        super().__init__(f"envs[{index}] (cls = {shown}): {reason}")
        self.index, self.cls, self.reason = index, cls, reason


def one_line(e: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, at most `limit` characters."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def load_env(dotted: str, options: dict[str, Any] | None = None) -> Environment:
    """Import `dotted` ("package.module:ClassName") and construct it with `options`."""
    cls = load_env_class(dotted)
    options = dict(options or {})
    if not all(isinstance(k, str) for k in options):
        raise ValueError(f"{dotted}: option names must be strings, "
                         f"got {sorted(map(repr, options))}")
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:  # the options do not fit the constructor
        raise ValueError(f"{dotted}: the constructor rejected options {sorted(options)}: "
                         f"{one_line(e)}; fix the `options` of this env in the rollout's "
                         f"`envs` (in [rl] or [actors.<rollout>.config]) to match "
                         f"{cls.__name__}'s keyword arguments") from e
    except Exception as e:  # its own failure: a missing dataset, a service that is down
        args = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise ValueError(f"{dotted}: {cls.__name__}({args}) raised {one_line(e)}") from e


def load_env_class(dotted: str) -> type[Environment]:
    """The Environment subclass named by `dotted`, imported but not constructed."""
    module_name, attr = _split(dotted)
    module = _import(dotted, module_name)
    if not hasattr(module, attr):
        found = ", ".join(_env_classes(module)) or "none"
        raise ValueError(f"{dotted}: module {module_name!r} has no attribute {attr!r}; "
                         f"Environment subclasses it defines: {found}")
    cls = getattr(module, attr)
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise ValueError(f"{dotted}: {attr} is {_describe(cls)}, not a subclass of "
                         f"envs.base.Environment; subclass Environment or SingleTurnEnv")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"{dotted}: {attr} is abstract; implement {missing}")
    return cls


def _split(dotted: object) -> tuple[str, str]:
    if not isinstance(dotted, str) or dotted.count(":") != 1:
        known = isinstance(dotted, str) and dotted in BUILTINS
        hint = f"; did you mean {BUILTINS[dotted]!r}?" if known else ""
        raise ValueError(f"environment path {dotted!r} must look like "
                         f"'package.module:ClassName'{hint}")
    module_name, attr = dotted.split(":")
    if not module_name or not attr.isidentifier():
        raise ValueError(f"environment path {dotted!r} must look like 'package.module:ClassName'")
    return module_name, attr


def _import(dotted: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"{dotted}: module {module_name!r} not found (no module named "
                             f"{e.name!r}); check the spelling and that it is installed or "
                             f"on PYTHONPATH") from e
        raise ValueError(f"{dotted}: importing {module_name!r} failed: it imports the missing "
                         f"module {e.name!r}; install it") from e
    except Exception as e:
        raise ValueError(f"{dotted}: importing {module_name!r} raised {type(e).__name__}: "
                         f"{e}") from e


def _env_classes(module) -> list[str]:
    return sorted(name for name, obj in vars(module).items()
                  if inspect.isclass(obj) and issubclass(obj, Environment)
                  and not inspect.isabstract(obj))


def _describe(obj: object) -> str:
    if inspect.isclass(obj):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__name__}"


# ----------------------------------------------------------------------------- mixing
def load_envs(specs: list[dict[str, Any]]) -> EnvMix:
    """Load a mix from specs `{"cls": dotted, "weight": float, "options": {...}, "domain": str}`;
    weight defaults to 1.0, options to {}, domain to the class's (override it to mix two
    environments of the same class)."""
    if not isinstance(specs, list) or not specs:
        raise ValueError(f"env specs must be a non-empty list of dicts, got {specs!r}")
    envs, weights = [], []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or "cls" not in spec:
            raise ValueError(f"env spec #{i} must be a dict with a 'cls' key, got {spec!r}")
        try:
            env, weight = _load_spec(spec)
        except ValueError as e:
            raise EnvSpecError(i, spec["cls"], str(e).removeprefix(f"{spec['cls']}: ")) \
                from e.__cause__
        envs.append(env)
        weights.append(weight)
    return EnvMix(envs, weights)


def _load_spec(spec: dict[str, Any]) -> tuple[Environment, float]:
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; use {sorted(SPEC_KEYS)}")
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ValueError(f"weight must be a number, got {weight!r}")
    options = spec.get("options", {})
    if not isinstance(options, dict):
        raise ValueError(f"options must be a dict, got {options!r}")
    env = load_env(spec["cls"], options)
    if "domain" in spec:
        if not isinstance(spec["domain"], str) or not spec["domain"]:
            raise ValueError(f"domain must be a non-empty string, got {spec['domain']!r}")
        env.domain = spec["domain"]
    return env, float(weight)


class EnvMix(Environment):
    """Several environments as one: tasks interleaved by weight; `episode` goes to the owner."""

    domain = "mix"

    def __init__(self, envs: list[Environment], weights: list[float]):
        _check_mix(envs, weights)
        super().__init__()
        self.envs = list(envs)
        self.weights = [float(w) for w in weights]
        self.max_new_tokens = max(env.max_new_tokens for env in envs)
        self._owner = {env.domain: i for i, env in enumerate(envs)}

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        streams = [env.tasks(split, seed) for env in self.envs]  # bad splits raise here
        return self._interleave(streams)

    def _interleave(self, streams: list[Iterator[Task]]) -> Iterator[Task]:
        credit = [0.0] * len(streams)
        active = list(range(len(streams)))
        while active:
            total = sum(self.weights[i] for i in active)
            for i in active:
                credit[i] += self.weights[i]
            pick = max(active, key=lambda i: credit[i])  # ties: the lowest index
            credit[pick] -= total
            task = next(streams[pick], _END)
            if task is _END:  # a finite split ran out; the others go on
                active.remove(pick)
                continue
            yield self._label(pick, task)

    def _label(self, i: int, task: Task) -> Task:
        env = self.envs[i]
        if not task.domain:
            task = dataclasses.replace(task, domain=env.domain)
        owner = self._owner.setdefault(task.domain, i)
        if owner != i:
            raise ValueError(f"tasks of {_name(env)} and {_name(self.envs[owner])} both have "
                             f"domain {task.domain!r}; give each environment its own domain")
        return task

    def env_for(self, task: Task) -> Environment:
        """The environment that owns `task` (by its domain)."""
        if task.domain not in self._owner:
            raise ValueError(f"task {task.id!r} has domain {task.domain!r}, which no environment "
                             f"of this mix owns ({sorted(self._owner)}); pass tasks from "
                             f"EnvMix.tasks()")
        return self.envs[self._owner[task.domain]]

    async def episode(self, task: Task, session: Session) -> float:
        return await self.env_for(task).episode(task, session)


def _check_mix(envs: list[Environment], weights: list[float]) -> None:
    if not envs or len(envs) != len(weights):
        raise ValueError(f"EnvMix needs one weight per environment, got {len(envs)} "
                         f"environments and {len(weights)} weights")
    for env, w in zip(envs, weights):
        if not isinstance(env, Environment):
            raise ValueError(f"EnvMix takes Environment instances, got {_describe(env)}")
        number = isinstance(w, (int, float)) and not isinstance(w, bool)
        if not (number and math.isfinite(w) and w > 0):
            raise ValueError(f"{_name(env)}: weight must be a finite number > 0, got {w}")
    domains = [env.domain for env in envs]
    for d in set(domains):
        if domains.count(d) > 1:
            raise ValueError(f"{domains.count(d)} environments of the mix have domain {d!r}; "
                             f"give each its own domain (spec key 'domain')")


def _name(env: Environment) -> str:
    return f"{type(env).__name__}(domain={env.domain!r})"


LOAD_SAMPLE = 20  # train tasks per environment the launcher looks at before the run starts


def check_at_load(mix: EnvMix, eval_tasks: int, sample: int = LOAD_SAMPLE) -> list[str]:
    """The environment contract where it is cheap, at load: the first `sample` train tasks
    (seed 0) of each environment and at most `eval_tasks` + 1 of its eval tasks. Raises
    EnvSpecError (naming the environment's index in the mix) for what would waste the run (a
    task that is not a Task, an empty prompt, a repeated id, a split that raises); returns notes
    the user should read (tasks without an answer, an eval split smaller than `eval_tasks`).
    `python -m envs.contract` runs the whole contract, episodes included."""
    notes: list[str] = []
    for i, env in enumerate(mix.envs):
        try:
            notes += _check_env(env, eval_tasks, sample)
        except ValueError as e:
            cls = type(env)
            raise EnvSpecError(i, f"{cls.__module__}:{cls.__qualname__}", str(e)) from None
    return notes


def _check_env(env: Environment, eval_tasks: int, sample: int) -> list[str]:
    notes: list[str] = []
    name = _name(env)
    for split, limit in (("train", sample), ("eval", eval_tasks + 1)):
        try:
            tasks = list(itertools.islice(env.tasks(split, 0), limit))
        except Exception as e:  # the environment's own failure, named
            raise ValueError(f"{name}: tasks({split!r}, 0) raised {one_line(e)}") from None
        seen: set[str] = set()
        for i, task in enumerate(tasks):
            where = f"{name}: {split} task #{i + 1}"
            if not isinstance(task, Task):
                raise ValueError(f"{where} is {_describe(task)}, not envs.base.Task")
            if not isinstance(task.prompt, str) or not task.prompt.strip():
                raise ValueError(f"{where} (id {task.id!r}) has an empty prompt "
                                 f"({task.prompt!r}); the policy would be asked nothing: "
                                 f"give every task a prompt")
            if task.id in seen:
                raise ValueError(f"{where}: id {task.id!r} repeats within the first "
                                 f"{len(tasks)} tasks; task ids must be unique")
            seen.add(task.id)
        missing = sum(t.answer is None for t in tasks)
        if split == "train" and missing:
            notes.append(f"{name}: {missing} of its first {len(tasks)} train tasks have no "
                         f"answer (answer = None); fine when its reward needs none")
        if split == "eval" and eval_tasks and len(tasks) < eval_tasks:
            notes.append(f"{name}: eval_tasks = {eval_tasks}, but its eval split has "
                         f"{len(tasks)} tasks; evaluations score those {len(tasks)}")
    return notes
