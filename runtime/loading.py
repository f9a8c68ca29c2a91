"""Actor classes by dotted path and their validated config: what the launcher checks before
anything starts and what every child process does first.

Plan classes. The launcher needs of an actor class only what it checks a plan with: its `Config`
and its class-level hooks and facts (`role`, `check_config`, `check_facts`, `gpus`, `peers`,
`bound_ports`, `ranks`, `rank_cls`, `store_path`, `needs`). An actor whose module is heavy (it
imports torch) keeps those on a *plan class*, an `Actor` subclass in a light module next to it,
and subclasses it: for the actor class `pkg.mod:Name` the plan class is `NamePlan` in the
module `pkg.mod_config` (actors/trainer.py `TrainerActor` subclasses actors/trainer_config.py
`TrainerActorPlan`). In the launcher's process (`plan_side()`, launch/cluster.py) `import_actor`
returns the plan class when there is one, so checking a plan never imports the actor's module;
elsewhere (the actor's own process, runtime/child.py) it returns the actor class. An actor
without a plan class (a light module, a user's actor) is read from its own module everywhere.

Errors are `ConfigError` (a ValueError) naming where the bad value came from (`where`).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import re
import types
import typing
from typing import Any, Iterator

import msgspec

from runtime.actor import Actor
from runtime.facts import fact_hint
from transport.errors import RlxError


class ConfigError(RlxError, ValueError):
    """A mistake in hosts.toml; the message names the file, table and field to change."""


PLAN_MODULE = "{module}_config"  # where the plan class of `module:Name` lives
PLAN_CLASS = "{name}Plan"  # and its name
_plan_side = False  # `import_actor` returns plan classes (within `plan_side()`)


@contextlib.contextmanager
def plan_side() -> Iterator[None]:
    """Within it, `import_actor` returns an actor's plan class when it has one (the launcher's
    process: it checks plans, it never runs an actor)."""
    global _plan_side
    before, _plan_side = _plan_side, True
    try:
        yield
    finally:
        _plan_side = before


def plan_class(dotted: str) -> type | None:
    """The plan class of the actor class `dotted` ('package.module:ClassName'), imported without
    importing the actor's module; None when it has none."""
    module_name, _, attr = dotted.partition(":")
    plan_module = PLAN_MODULE.format(module=module_name)
    try:
        if importlib.util.find_spec(plan_module) is None:
            return None
    except (ImportError, ValueError):  # its package is missing: the actor's import says why
        return None
    plan = getattr(importlib.import_module(plan_module), PLAN_CLASS.format(name=attr), None)
    return plan if isinstance(plan, type) and issubclass(plan, Actor) else None


def import_actor(dotted: str, where: str = "actor class", plan: bool | None = None) -> type:
    """The actor class `dotted` names; with `plan` (None: within `plan_side()`) its plan class
    instead, when it has one (the module's text)."""
    module_name, _, attr = dotted.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{where}: {dotted!r} is not 'package.module:ClassName'")
    try:
        obj = plan_class(dotted) if (_plan_side if plan is None else plan) else None
        obj = obj or getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}: cannot import {dotted!r}: {e}"
                          f"{python_path_hint(e, module_name)}") from None
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise ConfigError(f"{where}: {dotted!r} is not a subclass of runtime.actor.Actor")
    return obj


def actor_config(cls: type, raw: dict[str, Any], where: str) -> Any:
    """`raw` as the class's Config struct; ConfigError at `where`, naming the field when the
    error has one (a check of the whole struct, its __post_init__, names none)."""
    try:
        return msgspec.convert(raw, cls.Config)
    except msgspec.ValidationError as e:
        field, problem = explain(str(e), cls.Config)
        raise ConfigError(f"{where}, field `{field}`: {problem}" if field else
                          f"{where}: {problem}") from None
    except Exception as e:  # a __post_init__ that raises something else than ValueError
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"{where}: {cls.Config.__name__} raised {type(e).__name__}: "
                          f"{first}") from None


# ----------------------------------------------------------------------------- error hints
PATH_STEP = re.compile(r"\.([A-Za-z0-9_\-]+)|\[(\d+|\.\.\.)\]")
CLOSE = 0.6  # difflib's cutoff for a did-you-mean suggestion
LISTED = 40  # fields listed at most when no field is close


def explain(err: str, schema: Any, at: list[str | int] | None = None) -> tuple[str, str]:
    """msgspec's error converting a value to `schema` (found at `at` of its table) as (the
    field's dotted path, '' when the error names none; the problem, with where a run fact is set
    or the closest fields for an unknown field)."""
    problem, keys = error_path(err)
    named = re.search(r"(?:unknown|missing required) field `([^`]+)`", problem)
    field = dotted([*(at or []), *keys, *([named.group(1)] if named else [])])
    if named and "unknown" in problem:
        table = type_at(schema, keys)
        problem += fact_hint(field) or suggest(named.group(1), field_names(table),
                                               [*(at or []), *keys], table)
    return field, problem


def python_path_hint(e: Exception, module: str) -> str:
    """For a class whose own module (or a package above it) is not found: where to put it."""
    name = getattr(e, "name", None)
    if not isinstance(e, ModuleNotFoundError) or not name or not (
            module == name or module.startswith(name + ".")):
        return ""
    return ("; if it is your own module, put its folder in [run] python_path = [...] "
            "(relative to hosts.toml)")


def error_path(err: str) -> tuple[str, list[str | int]]:
    """msgspec's 'problem - at `$.a[0].b`' as ('problem', ['a', 0, 'b']); a dict key, which
    msgspec does not say, is '...'."""
    problem, _, at = err.partition(" - at `")
    steps = PATH_STEP.findall(at.rstrip("`").removeprefix("$"))
    return problem, [name or (int(i) if i.isdigit() else i) for name, i in steps]


def dotted(keys: list[str | int]) -> str:
    """['a', 0, 'b'] as 'a[0].b' (a dict's unknown key as '[...]')."""
    out = ""
    for key in keys:
        out += f"[{key}]" if isinstance(key, int) or key == "..." else (
            f".{key}" if out else key)
    return out


def unwrap(tp: Any) -> Any:
    """`X | None` -> X (a table that may be absent is still that table)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return tp


def type_at(schema: Any, keys: list[str | int]) -> Any:
    """The type found at `keys` below `schema`: struct fields, list items, dict values (Any
    where the schema does not say)."""
    for key in keys:
        tp, args = unwrap(schema), typing.get_args(unwrap(schema))
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct) and isinstance(key, str):
            schema = {f.name: f.type for f in msgspec.structs.fields(tp)}.get(key, Any)
        elif typing.get_origin(tp) in (list, tuple, set, frozenset) and args:
            schema = args[0]
        elif typing.get_origin(tp) is dict and len(args) == 2:
            schema = args[1]
        else:
            return Any
    return unwrap(schema)


def field_names(schema: Any) -> list[str]:
    """The fields of a struct type ([] for anything else)."""
    if isinstance(schema, type) and issubclass(schema, msgspec.Struct):
        return [f.name for f in msgspec.structs.fields(schema)]
    return []


def close_fields(key: str, names: list[str]) -> list[str]:
    """The names in `names` closest to the unknown `key` (up to 3, best first; may be none)."""
    return difflib.get_close_matches(key, names, n=3, cutoff=CLOSE)


def nested_fields(schema: Any, depth: int = 2) -> list[list[str]]:
    """The paths of the fields of the tables inside struct `schema`, up to `depth` levels below
    its own fields (`optimizer.lr`, `checkpoint.save_every`)."""
    out: list[list[str]] = []
    if depth <= 0 or not (isinstance(schema, type) and issubclass(schema, msgspec.Struct)):
        return out
    for f in msgspec.structs.fields(schema):
        for sub in field_names(unwrap(f.type)):
            out.append([f.name, sub])
            out += [[f.name, *p] for p in nested_fields(unwrap(f.type), depth - 1)
                    if p[0] == sub]
    return out


def moved_to(key: str, schema: Any) -> list[list[str]]:
    """Where a field written at the wrong depth most likely lives: the nested fields named
    `key` (`lr` -> optimizer.lr), else those whose path joined by '_' is close to it
    (`micro_batch_size` -> micro_batches.size)."""
    paths = nested_fields(schema)
    same = [p for p in paths if p[-1] == key]
    if same:
        return same[:3]
    joined = {"_".join(p): p for p in paths}
    return [joined[j] for j in difflib.get_close_matches(key, list(joined), n=2, cutoff=0.8)]


def suggest(key: str, names: list[str], at: list[str | int], schema: Any = None) -> str:
    """For an unknown `key` among the fields `names` of the table at `at` (struct `schema`,
    when known): '; did you mean `at.field`?' with the closest ones, the fields of its tables
    first (an old flat name that moved into a table), else the fields listed ('' when there
    are none)."""
    if not names:
        return ""
    close = [".".join(p) for p in moved_to(key, schema)] + close_fields(key, names)
    if close:
        return f"; did you mean {' or '.join(f'`{dotted([*at, c])}`' for c in close)}?"
    shown = sorted(names)
    more = f" and {len(shown) - LISTED} more" if len(shown) > LISTED else ""
    here = f" of `{dotted(at)}`" if at else ""
    return f"; no field is close to it: the fields{here} are {', '.join(shown[:LISTED])}{more}"
