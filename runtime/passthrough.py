"""Native option pass-through: `--<prefix>-<option> [value]` on the command line -> a table.

Role: lets a user hand any option to an engine the project wraps (SGLang's launch_server,
sglang-router, megatron-core) without this project keeping a list of those options. The mapping
is generic, by prefix:

    command line                          lands in every actor whose Config has the table
    --sglang-<option> [value]       ->    sglang     = { <option> = value }
    --router-<option> [value]       ->    router     = { <option> = value }
    --megatron-<option> [value]     ->    megatron   = { <option> = value }

Invariants:
- `<option>` is stored with `_` for `-` (SGLang's and Megatron's own field names); the engine
  wrapper turns it back into `--<option-with-dashes>` where it builds a command line.
- A value is parsed as a TOML value where that works (`2` int, `0.8` float, `true` bool,
  `[1, 2]` array, `"x"` string), else kept as the raw string; a flag with no value is `true`.
  `--sglang-opt=value` is accepted too (useful when the value starts with `--`).
- The same option given twice collects its values into a list (repeated flags).
- Command-line values are merged over the hosts.toml table of the same name (command line wins).
- A prefix given on the command line that no actor takes is an error, never silently dropped.
"""

from __future__ import annotations

import tomllib
import typing
from typing import Any

PREFIXES = ("sglang", "router", "megatron")  # command-line prefix == config field name
HELP = """engine pass-through (not listed above: any option, by prefix):
  --sglang-<option> [VALUE]    into the `sglang` table of every actor that has one
                               (SGLang launch_server options, e.g. --sglang-mem-fraction-static 0.8)
  --router-<option> [VALUE]    into the `router` table (sglang-router options)
  --megatron-<option> [VALUE]  into the `megatron` table (megatron-core options of the trainer)
  VALUE is read as TOML like --set's; no VALUE means true; a repeated option makes a list.
"""  # the launcher's --help epilog


def parse_value(text: str) -> Any:
    """A command-line value as a TOML value where possible, else the string itself."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return value if isinstance(value, (str, int, float, bool, list, dict)) else text  # dates


def _split(token: str) -> tuple[str, str, str | None] | None:
    """'--sglang-mem-fraction-static=0.8' -> ('sglang', 'mem_fraction_static', '0.8')."""
    if not token.startswith("--"):
        return None
    name, eq, value = token[2:].partition("=")
    for prefix in PREFIXES:
        if name.startswith(prefix + "-") and len(name) > len(prefix) + 1:
            return prefix, name[len(prefix) + 1:].replace("-", "_"), value if eq else None
    return None


def _is_value(token: str) -> bool:
    """A token that is a value, not the next option ('-1' is a value, '--x' is not)."""
    return not token.startswith("--")


def parse(argv: list[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Split `argv` into ({prefix: {option: value}}, the tokens that are not pass-through)."""
    tables: dict[str, dict[str, Any]] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        split = _split(argv[i])
        if split is None:
            rest.append(argv[i])
            i += 1
            continue
        prefix, option, value = split
        if value is None and i + 1 < len(argv) and _is_value(argv[i + 1]):
            value, i = argv[i + 1], i + 1
        i += 1
        parsed = True if value is None else parse_value(value)
        table = tables.setdefault(prefix, {})
        if option in table:
            previous = table[option]
            table[option] = [*(previous if isinstance(previous, list) else [previous]), parsed]
        else:
            table[option] = parsed
    return tables, rest


def tables_of(config_type: type) -> set[str]:
    """The prefixes a Config struct takes: fields named like a prefix whose type is a table
    (a `router: str` peer name is not a pass-through table)."""
    import msgspec

    return {f.name for f in msgspec.structs.fields(config_type)
            if f.name in PREFIXES and (f.type is dict or typing.get_origin(f.type) is dict)}


def merge(raw_actors: dict[str, Any], tables: dict[str, dict[str, Any]],
          takes: dict[str, set[str]]) -> list[str]:
    """Merge command-line tables into the raw hosts.toml actor entries, in place.

    `takes[actor]` is the set of prefixes the actor's Config has a field for. Returns the
    prefixes that no actor takes (the caller reports them as an error).
    """
    unused = []
    for prefix, options in tables.items():
        takers = [name for name, fields in takes.items() if prefix in fields]
        if not takers:
            unused.append(prefix)
        for name in takers:
            config = raw_actors[name].setdefault("config", {})
            current = config.get(prefix, {})
            if not isinstance(current, dict):
                continue  # the config check reports the wrong type with its table and field
            config[prefix] = {**current, **options}
    return unused


def refuse_owned(table: dict[str, Any], owned: dict[str, str], prefix: str) -> None:
    """ValueError naming the options of a pass-through table that the project sets itself;
    `owned` maps each such option (and its aliases) to the config field that sets it."""
    clash = sorted(k for k in table if k in owned)
    if clash:
        fixes = "; ".join(f"instead of {prefix}.{k} set `{owned[k]}` in the actor's config"
                          for k in clash)
        raise ValueError(f"{prefix} options {clash} are set by the project and cannot be passed "
                         f"through (--{prefix}-* / {prefix} table): {fixes}")


def render(options: dict[str, Any]) -> list[str]:
    """A table as command-line arguments the way argparse-based servers expect them:
    `true` -> `--flag`, `false` -> omitted, a list -> `--opt a b c` (nargs), a table -> its JSON
    text, anything else -> `--opt value`."""
    import json

    out: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            out += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out
