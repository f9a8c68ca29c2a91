"""Actor classes by dotted path and their validated config: what the launcher checks before
anything starts and what every child process does first.

Errors are `ConfigError` (a ValueError) naming where the bad value came from (`where`).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import msgspec

from runtime.actor import Actor
from runtime.facts import fact_hint
from transport.errors import RlxError


class ConfigError(RlxError, ValueError):
    """A mistake in hosts.toml; the message names the file, table and field to change."""


def import_actor(dotted: str, where: str = "actor class") -> type:
    module_name, _, attr = dotted.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{where}: {dotted!r} is not 'package.module:ClassName'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}: cannot import {dotted!r}: {e}") from None
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise ConfigError(f"{where}: {dotted!r} is not a subclass of runtime.actor.Actor")
    return obj


def actor_config(cls: type, raw: dict[str, Any], where: str) -> Any:
    """`raw` as the class's Config struct; ConfigError at `where`, naming the field when the
    error has one (a check of the whole struct, its __post_init__, names none)."""
    try:
        return msgspec.convert(raw, cls.Config)
    except msgspec.ValidationError as e:
        problem, _, at = str(e).partition(" - at `")
        keys = re.findall(r"\.([A-Za-z0-9_\-]+)", at)
        named = re.search(r"(?:unknown|missing required) field `([^`]+)`", problem)
        field = named.group(1) if named else (keys[-1] if keys else None)
        hint = fact_hint(".".join([*keys, field])) if "unknown" in problem else ""
        raise ConfigError(f"{where}, field `{field}`: {problem}{hint}" if field else
                          f"{where}: {problem}") from None
    except Exception as e:  # a __post_init__ that raises something else than ValueError
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"{where}: {cls.Config.__name__} raised {type(e).__name__}: "
                          f"{first}") from None
