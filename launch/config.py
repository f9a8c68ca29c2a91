"""hosts.toml: the schema, its validation, and the resolved plan of actor processes.

Invariant: a config that loads is runnable as far as static checks can tell. Every mistake (a
wrong key, a wrong type, a missing field, an unknown host or actor, a class that does not import,
an actor `config` table its class rejects, an environment or a config class that raises when
constructed, a fixed port that is in use on this machine or given to two actors) is a
`ConfigError` naming the file, the table and the field, in one line, raised before any process
starts (also under `--dry-run`).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
import subprocess
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec

from envs.loader import EnvSpecError, one_line
from launch import rl as rl_table
from launch.plan import PlanError, check_plan
from models import hub
from runtime import passthrough as pt
from runtime.actor import ActorView
from runtime.facts import RunFacts, fact_hint
from runtime.loading import (
    ConfigError,
    actor_config,
    close_fields,
    dotted,
    error_path,
    explain,
    field_names,
    import_actor,
    python_path_hint,
    suggest,
    type_at,
    unwrap,
)
from transport.codec import Limits
from transport.shm import ShmConfig
from transport.sockets import Security


class WandbConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The W&B run of the `wandb` metrics sink (launch/sinks.py)."""

    project: str = "rlx"  # W&B project
    name: str = ""  # W&B run name ("" = the run directory's name)
    entity: str = ""  # W&B team or user ("" = your default entity)
    group: str = ""  # W&B run group ("" = none)
    tags: list[str] = []  # W&B run tags
    # offline: files under <run_dir>/wandb, no network (`wandb sync` uploads them later);
    # online: streamed to W&B (needs `wandb login`); a WANDB_MODE variable, when set, wins
    mode: Literal["offline", "online", "disabled"] = "offline"


class RunConfig(msgspec.Struct, forbid_unknown_fields=True):
    """How the run is laid out and supervised."""

    name: str  # run name; the run directory is <dir>/<name>-<timestamp>
    dir: str = "runs"  # parent of run directories (relative to the working directory)
    transport: Literal["ipc", "tcp"] = "ipc"  # ipc:// on one host, tcp:// across hosts
    # an actor must report READY within this after its start (or within its own
    # start_timeout_s + 30 s where that is longer: launch/supervisor.py `ready_limit`)
    ready_timeout_s: float = 60.0
    shutdown_timeout_s: float = 15.0  # wait after the shutdown message before SIGTERM
    term_timeout_s: float = 5.0  # wait after SIGTERM before SIGKILL
    heartbeat_interval_s: float = 1.0  # actors report liveness this often
    heartbeat_timeout_s: float = 30.0  # an actor silent this long is killed and restarted
    progress_interval_s: float = 5.0  # console progress lines per actor at most this often
    # the console prints one rollout sample (prompt, response, reward) per domain every this many
    # rollout batches (0 = never); <run_dir>/samples/*.jsonl gets samples of every batch anyway
    show_samples_every: int = 10
    # false: a run in which any episode failed (an environment's reward() or step that raised)
    # ends with exit code 1 and a summary of what failed, even when every step ran; true: such a
    # run exits 0 when it completes (the summary is still printed)
    tolerate_failures: bool = False
    stall_report_s: float = 60.0  # a wait on a peer longer than this is said on the console
    request_retry_s: float = 30.0  # idempotent requests (permits, batches) re-sent this often
    # where every metrics record goes (launch/sinks.py): "jsonl" <run_dir>/metrics.jsonl,
    # "tensorboard" <run_dir>/tensorboard (pip install tensorboardX), "wandb" (pip install wandb)
    sinks: list[Literal["jsonl", "tensorboard", "wandb"]] = msgspec.field(
        default_factory=lambda: ["jsonl"])
    wandb: WandbConfig = WandbConfig()  # the W&B run, when `sinks` names "wandb"
    plots: bool = True  # at the end, PNGs into <run_dir>/plots from metrics.jsonl (launch/plot.py)
    # folders (relative to this file) put on the launcher's sys.path and on every actor's
    # PYTHONPATH, so that your own modules (environments, actors) import without exporting
    # PYTHONPATH; resolved to absolute paths at load
    python_path: list[str] = []
    # processes of the launcher's host that share a python and an `env` table are forked from
    # one process that has imported their actor classes (launch/preload.py): each start and
    # restart skips importing torch again (~2.4 s of CPU each on a 2-core machine); false:
    # every process is a new interpreter (`python -m runtime.child`)
    preload: bool = True


class HostConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A machine actors run on: the launcher's own (no `exec`), or a remote one, where the
    launcher runs its agent (`python -m launch.agent`, launch/agent.py) through `exec`."""

    name: str  # letters, digits, '.', '_', '-'; an actor's `host` names it (or "#<index>")
    # the address other hosts reach this one at; its actors bind their tcp sockets (and, on a
    # run over several hosts, their HTTP servers) there. Loopback only works on one machine
    address: str = "127.0.0.1"
    # command prefix that runs a command on the host, e.g. ["ssh", "-o", "BatchMode=yes",
    # "node2"], ["srun", "--nodes=1", "--ntasks=1", "-w", "node2"], ["ip", "netns", "exec",
    # "ns2"]; [] = the launcher's own machine
    exec: list[str] = []
    python: str = ""  # interpreter there ("" = the launcher's own path, sys.executable)
    workdir: str = ""  # the project's folder there ("" = the launcher's working directory)
    gpus: int = 0  # GPUs the host has: actors' devices are checked against it (0 = unchecked)
    # exec hands its command to a shell (the words are quoted for it); None: true for ssh
    shell: bool | None = None


class RestartPolicy(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """When a crashed actor is started again."""

    max_restarts: int = 2  # restarts allowed before the run fails
    stable_after_s: float = 60.0  # READY this long resets the restart count


class ActorEntry(msgspec.Struct, forbid_unknown_fields=True):
    """One actor process."""

    cls: str  # "package.module:ClassName", a subclass of runtime.actor.Actor
    host: str = ""  # a [[hosts]] name ("" = the first host)
    after: list[str] = []  # actors that must be READY first; they become this actor's peers
    primary: bool = False  # when this actor completes its work, the run ends (exit 0)
    env: dict[str, str] = {}  # extra environment variables of the process
    config: dict[str, Any] = {}  # the actor class's own settings (its Config struct)
    restart: RestartPolicy = RestartPolicy()
    start_timeout_s: float = 30.0  # on_start() deadline inside the actor
    stop_timeout_s: float = 10.0  # on_stop() deadline inside the actor


def _local_host() -> list[HostConfig]:
    return [HostConfig(name="local")]


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True):
    run: RunConfig
    actors: dict[str, ActorEntry]
    hosts: list[HostConfig] = msgspec.field(default_factory=_local_host)  # absent: one local host
    rl: rl_table.RLConfig | None = None  # the run in one table; actors derived (launch/rl.py)
    security: Security = Security()
    limits: Limits = Limits()
    shm: ShmConfig = ShmConfig()
    # what the actors agree on (runtime/facts.py), by actor name: derived at load by
    # launch/plan.py from the actors deciding each fact, never written in hosts.toml
    facts: dict[str, RunFacts] = {}


RL_DOCS = " (fields of [rl]: launch/rl.py RLConfig)"  # ends every [rl] schema error
CONFIG_DOCS = " (every field is listed in launch/config.py)"  # ends an unknown field's error

DERIVED = frozenset({"facts"})  # ClusterConfig fields made at load, never written in the file

# actor config fields (at any depth) that name a model checkpoint: a relative path that is a
# checkpoint directory or hub id is made a local absolute path at load (models/hub.py)
MODEL_FIELDS = frozenset({"model", "model_path", "ref_model", "tokenizer_path"})


class Override(msgspec.Struct, frozen=True):
    """One `--set PATH=VALUE` of the command line."""

    text: str  # as given, "actors.trainer.config.optimizer.lr=3e-5"
    keys: list[str]  # the dotted path, split
    value: Any  # the value parsed as a TOML value (a bare word that does not parse: a string)


def parse_overrides(items: list[str] | tuple[str, ...]) -> list[Override]:
    """`--set` texts as Overrides; ConfigError for one that is not PATH=VALUE."""
    out = []
    for text in items:
        dotted, eq, value = text.partition("=")
        keys = [k.strip() for k in dotted.split(".")]
        if not eq or not all(keys):
            raise ConfigError(f"--set {text}: expected PATH=VALUE with PATH a dotted path into "
                              f"hosts.toml, e.g. --set actors.trainer.config.optimizer.lr=3e-5")
        out.append(Override(text, keys, pt.parse_value(value)))
    return out


def load(path: str | Path,
         passthrough: dict[str, dict[str, Any]] | None = None,
         overrides: list[Override] | None = None,
         notes: list[str] | None = None) -> ClusterConfig:
    """Load and check hosts.toml; `passthrough` holds `--<prefix>-<option>` command-line tables
    (runtime/passthrough.py), merged over the actors' hosts.toml tables before any check;
    `overrides` (`--set`, parse_overrides) are applied to the document before that. The
    actors' `check_config` notes (things to know that are no error) are appended to `notes`.

    Paths: `[run] python_path` folders are resolved against the file's folder and put on
    sys.path; an actor config's model field (MODEL_FIELDS) is resolved by models/hub.py: a
    checkpoint directory relative to the file's folder, the working directory or the packaged
    examples is made absolute, a hub id (`org/name[@revision]`) is fetched into the hub cache
    and replaced by its local folder, a built-in name stays as written."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    overrides = list(overrides or [])
    created: dict[str, list[str]] = {}  # --set text -> tables it created
    derived: set[str] = set()
    try:
        # [run] first: python_path must be on sys.path before actor classes are imported; then
        # [rl], from which the actor tables are derived, then the actors' own overrides
        early = [o for o in overrides if o.keys[0] in ("run", "rl")]
        for o in sorted(early, key=lambda o: o.keys[0] != "run"):
            created[o.text] = _apply_override(raw, o, path)
        _python_path(raw, path)
        derived = _expand_rl(raw, path)
        for o in overrides:
            if o.keys[0] not in ("run", "rl"):
                created[o.text] = _apply_override(raw, o, path)
        try:
            _resolve_model_paths(raw.get("actors"), path.resolve().parent)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        return _load_document(raw, path, passthrough, notes)
    except ConfigError as e:
        message = _blame(str(e), overrides, created)
        raise ConfigError(message if isinstance(e, PortTaken) else
                          _derived_hint(message, derived)) from None


class PortTaken(ConfigError):
    """A fixed port an actor would bind is taken: the file's (or a --set's) value, as [rl] sets
    no port."""


def _expand_rl(raw: dict[str, Any], path: Path) -> set[str]:
    """`[rl]` into actor tables (launch/rl.py); ConfigError naming [rl] and the field."""
    if "rl" in raw and not isinstance(raw["rl"], dict):
        raise ConfigError(f"{path}: `rl` must be a table ([rl]), got {raw['rl']!r}")
    try:
        derived = rl_table.expand(raw)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {_describe(str(e), ['rl'], rl_table.RLConfig, '')}"
                          f"{RL_DOCS}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: table [rl]: {e}") from None
    _check_rl_envs(raw, path)
    return derived


def _check_rl_envs(raw: dict[str, Any], path: Path) -> None:
    """[rl]'s `envs` entries against the rollout's schema of one (its Config's `envs`), so that
    a mistake in one is named where it is written: `[rl]`, field `envs[i]...`."""
    if "rl" not in raw:
        return
    rollout = raw["actors"].get("rollout")
    try:
        config = import_actor(rollout["cls"]).Config
    except (ConfigError, KeyError, TypeError):
        return  # reported with the rollout's table
    schema = type_at(config, ["envs"])
    if schema is Any:
        return
    try:
        msgspec.convert(raw["rl"]["envs"], schema)
    except msgspec.ValidationError as e:
        field, problem = explain(str(e), schema, ["envs"])
        entry = unwrap(type_at(schema, [0]))
        docs = f"; of an env entry: {entry.__module__}.{entry.__qualname__}" \
            if field_names(entry) else ""
        raise ConfigError(f"{path}: table [rl], field `{field}`: {problem}"
                          f"{RL_DOCS[:-1]}{docs})") from None


def _derived_hint(message: str, derived: set[str]) -> str:
    """Say where a table the file does not have comes from: [rl]."""
    named = sorted({m for m in re.findall(r"\[actors\.([A-Za-z0-9_\-]+)", message)
                    if m in derived})
    if not named:
        return message
    tables = ", ".join(f"[actors.{n}]" for n in named)
    return (f"{message} ({tables} {'is' if len(named) == 1 else 'are'} derived from [rl]: change "
            f"the value in [rl], or set it in a table [actors.<name>.config] of that name, "
            f"which is merged over the derived one; --dry-run prints the derived actors)")


def _load_document(raw: dict[str, Any], path: Path,
                   passthrough: dict[str, dict[str, Any]] | None,
                   notes: list[str] | None = None) -> ClusterConfig:
    actors = raw.get("actors")
    if passthrough:
        _merge_passthrough(actors, passthrough, path)
    _expand_hosts(raw, path, notes if notes is not None else [])
    for name, entry in (actors.items() if isinstance(actors, dict) else ()):
        try:  # one by one: msgspec's error path does not name dict keys
            msgspec.convert(entry, ActorEntry)
        except msgspec.ValidationError as e:
            raise ConfigError(f"{path}: {_describe(str(e), ['actors', name], ActorEntry)}"
                              ) from None
    for key in DERIVED & set(raw):
        raise ConfigError(f"{path}: `{key}` is derived from the actors at load, not written: "
                          f"remove the [{key}] table (set [rl] or the actors' tables instead)")
    try:
        cfg = msgspec.convert(raw, ClusterConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {_describe(str(e), [], ClusterConfig)}") from None
    _check(cfg, path, notes if notes is not None else [])
    return cfg


def _blame(message: str, overrides: list[Override], created: dict[str, list[str]]) -> str:
    """`message` with the `--set` options that set what it is about (same table and field, or
    a table the `--set` created)."""
    if " (set on the command line by --set " in message:
        return message
    blamed = []
    for o in overrides:
        tables = [".".join(o.keys[:j]) for j in range(1, len(o.keys))]
        named = any(f"[{t}]" in message or f"[{t}." in message for t in tables)
        made = any(f"[{t}]" in message for t in created.get(o.text, []))
        if (named and re.search(rf"\b{re.escape(o.keys[-1])}\b", message)) or made or (
                f"--set {o.text}" in message):
            blamed.append(o.text)
    if not blamed or all(f"--set {b}" in message for b in blamed):
        return message
    return f"{message} (set on the command line by --set {', --set '.join(blamed)})"


def _child(schema: Any, key: str, node: dict[str, Any], where: str, table: str) -> Any:
    """The schema type of `node[key]` (Any where anything goes); ConfigError when the schema
    of `table` has no field `key`."""
    if isinstance(schema, type) and issubclass(schema, msgspec.Struct):
        fields = {f.name: f.type for f in msgspec.structs.fields(schema)
                  if not (schema is ClusterConfig and f.name in DERIVED)}
        if key not in fields:
            what = "the top level of hosts.toml" if table == "top level" else f"table [{table}]"
            inner = table.partition(".config")[2].lstrip(".")  # the path in an actor's config
            hint = fact_hint(f"{inner}.{key}" if inner else key) if ".config" in table else ""
            at = [] if table == "top level" else table.split(".")
            close = close_fields(key, list(fields))
            if close and not hint:  # the whole --set path, as it would be written
                hint = f" (did you mean {' or '.join(f'`{dotted([*at, c])}`' for c in close)}?)"
            docs = RL_DOCS if at[:1] == ["rl"] else \
                " (every field is listed in launch/config.py and the actor's Config)"
            raise ConfigError(f"{where}: {what} has no field `{key}`{hint or ''}; its fields "
                              f"are {', '.join(sorted(fields))}{docs}")
        if schema is ActorEntry and key == "config" and isinstance(node.get("cls"), str):
            return import_actor(node["cls"], f"{where}: table [{table}], field `cls`").Config
        return unwrap(fields[key])
    if typing.get_origin(schema) is dict:
        return typing.get_args(schema)[1] if typing.get_args(schema) else Any
    return Any


def _is_table(schema: Any) -> bool:
    return schema is Any or typing.get_origin(schema) is dict or (
        isinstance(schema, type) and issubclass(schema, msgspec.Struct))


def _apply_override(raw: dict[str, Any], o: Override, path: Path) -> list[str]:
    """Set `o` in the raw document. A missing table on the way is created where the schema
    has one (a struct field or a table of free keys), never under an unknown name. Returns the
    tables it created."""
    where = f"{path}: --set {o.text}"
    created: list[str] = []
    node: Any = raw
    schema: Any = ClusterConfig
    for i, key in enumerate(o.keys):
        table = ".".join(o.keys[:i]) or "top level"
        schema = _child(schema, key, node, where, table)
        if i == len(o.keys) - 1:
            node[key] = o.value
            return created
        here = ".".join(o.keys[:i + 1])
        if key not in node:
            if not _is_table(schema):
                raise ConfigError(f"{where}: `{here}` is a value, not a table; set it whole "
                                  f"(--set {here}=VALUE)")
            node[key] = {}
            created.append(here)
        if not isinstance(node[key], dict):
            kind, example = (("an array", ", VALUE in TOML, e.g. '[{ name = \"local\" }]'")
                             if isinstance(node[key], list) else ("a value", ""))
            raise ConfigError(f"{where}: `{here}` is {kind} in {path.name}, not a table; set "
                              f"it whole (--set {here}=VALUE{example})")
        node = node[key]
    return created


def _python_path(raw: dict[str, Any], path: Path) -> None:
    """`[run] python_path` resolved against the file's folder (in place) and on sys.path."""
    run = raw.get("run")
    entries = run.get("python_path") if isinstance(run, dict) else None
    if entries is None:
        return
    if not (isinstance(entries, list) and all(isinstance(p, str) for p in entries)):
        raise ConfigError(f"{path}: table [run], field `python_path`: expected an array of "
                          f"folder paths (strings), got {entries!r}")
    base = path.resolve().parent
    resolved = []
    for entry in entries:
        folder = (base / os.path.expanduser(entry)).resolve()
        if not folder.is_dir():
            raise ConfigError(f"{path}: table [run], field `python_path`: {entry!r} is not a "
                              f"folder ({folder}; relative paths are read from {base})")
        resolved.append(str(folder))
    run["python_path"] = resolved
    for folder in reversed(resolved):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def _resolve_model_paths(node: Any, base: Path, fetched: dict[str, str] | None = None,
                         where: str = "actors") -> None:
    """In place: model fields (MODEL_FIELDS, at any depth of the actors' tables) become what
    every actor can load (models/hub.py: a checkpoint folder next to the file, in the working
    directory or the packaged examples made absolute; a hub id fetched into the cache and
    replaced by its local folder); ConfigError naming the field when a hub id cannot be had."""
    fetched = {} if fetched is None else fetched
    if isinstance(node, list):
        for i, item in enumerate(node):
            _resolve_model_paths(item, base, fetched, f"{where}[{i}]")
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in MODEL_FIELDS and isinstance(value, str):
            try:
                node[key] = hub.resolve(value, base, fetched)
            except hub.HubError as e:
                raise ConfigError(f"field {where}.{key}: {e}") from None
        else:
            _resolve_model_paths(value, base, fetched, f"{where}.{key}")


def _merge_passthrough(actors: Any, tables: dict[str, dict[str, Any]], path: Path) -> None:
    takes: dict[str, set[str]] = {}
    for name, entry in (actors.items() if isinstance(actors, dict) else ()):
        if isinstance(entry, dict) and isinstance(entry.get("cls"), str):
            cls = import_actor(entry["cls"], f"{path}: table [actors.{name}], field `cls`")
            takes[name] = pt.tables_of(cls.Config)
    unused = pt.merge(actors, tables, takes)
    if unused:
        raise ConfigError(f"{path}: command-line options {', '.join(f'--{p}-*' for p in unused)}"
                          f" were given, but no actor in this file takes a "
                          f"{' / '.join(f'`{p}`' for p in unused)} table; remove them or add "
                          f"an actor of that kind")


def _describe(err: str, prefix: list[str], schema: Any, docs: str = CONFIG_DOCS) -> str:
    """msgspec's 'problem - at `$.a.b`' as 'table [a], field `b`: problem', where the document
    below `prefix` was converted to `schema`: an unknown field gets the closest fields of its
    table and `docs`; a struct's own check (its __post_init__) is put on the field its message
    names, if any."""
    problem, steps = error_path(err)
    keys = [*prefix, *(s if isinstance(s, str) else f"#{s + 1}" for s in steps if s != "...")]
    named = re.search(r"(?:unknown|missing required) field `([^`]+)`", problem)
    if named:
        field, table = named.group(1), keys
        if "unknown" in problem:
            problem += suggest(field, field_names(type_at(schema, steps)), []) + docs
    else:
        field, table = _named_field(problem, type_at(schema, steps)), keys
        if not field:
            if not keys:
                return f"table [top level]: {problem}"
            field, table = keys[-1], keys[:-1]
    return f"table [{_table(table)}], field `{field}`: {problem}"


def _named_field(problem: str, schema: Any) -> str:
    """The field of `schema` a check's message is about: the first it names ('' if none)."""
    names = field_names(schema)
    return next((w for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", problem) if w in names), "")


def _table(keys: list[str]) -> str:
    return ".".join(keys) if keys else "top level"


def _check(cfg: ClusterConfig, path: Path, notes: list[str]) -> None:
    def fail(table: str, field: str, text: str) -> None:
        raise ConfigError(f"{path}: table [{table}], field `{field}`: {text}")

    _check_hosts(cfg, path, notes)
    names = [h.name for h in cfg.hosts]
    hosts = {h.name: h for h in cfg.hosts}
    distributed = is_distributed(cfg)
    if not cfg.actors:
        fail("actors", "cls", "declare at least one [actors.<name>] table")
    views: dict[str, ActorView] = {}
    taken: dict[tuple[str, int], str] = {}  # fixed (address, port) -> the field that binds it
    for name, entry in cfg.actors.items():
        table = f"actors.{name}"
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_\-]*", name):
            fail(table, "name", "actor names are letters, digits, '_' and '-'")
        if entry.host and entry.host not in names:
            fail(table, "host", f"unknown host {entry.host!r}; hosts are {names} (or "
                 f"\"#<index>\", 0 to {len(names) - 1})")
        for dep in entry.after:
            if dep not in cfg.actors:
                fail(table, "after", f"unknown actor {dep!r}; actors are {sorted(cfg.actors)}")
        cls = import_actor(entry.cls, f"{path}: table [{table}], field `cls`")
        host = entry.host or names[0]
        if distributed and "host" not in entry.config and _binds_host(cls.Config):
            entry.config["host"] = hosts[host].address  # its HTTP server, reached from others
        _place_ranks(entry.config, host, hosts, table, fail)
        config = actor_config(cls, entry.config, f"{path}: table [{table}.config]")
        try:
            notes += [f"[actors.{name}]: {n}" for n in cls.check_config(config) or []]
            # a remote host's environment is not the launcher's: only the actor's own env
            env = entry.env if hosts[host].exec else {**os.environ, **entry.env}
            views[name] = ActorView(cls, config, host, cls.gpus(config, env, host),
                                    list(entry.after))
        except EnvSpecError as e:  # the environments it constructed: where they were written
            raise ConfigError(f"{path}: {_envs_table(cfg, name, e.index)} {e}"
                              f"{_env_import_hint(e)}") from None
        except ValueError as e:
            raise ConfigError(f"{path}: table [{table}.config]: {e}") from None
        except Exception as e:  # a class its check constructs failed in its own way
            raise ConfigError(f"{path}: table [{table}.config]: checking it raised "
                              f"{one_line(e)}") from None
        _check_gpus(views[name].gpus, hosts[host], table, fail)
        if not hosts[host].exec:  # another machine's ports are its agent's to find
            _check_ports(name, cls, config, taken, path)
    try:
        cfg.facts = check_plan(views)
    except PlanError as e:
        raise ConfigError(f"{path}: table [actors.{e.actor}.config]: {e}") from None
    start_order(cfg, path)


def _env_import_hint(e: EnvSpecError) -> str:
    """For an environment class whose own module is not found: [run] python_path."""
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, ModuleNotFoundError):
        cause = cause.__cause__ or cause.__context__
    module = e.cls.partition(":")[0] if isinstance(e.cls, str) else ""
    return python_path_hint(cause, module) if cause is not None else ""


def _envs_table(cfg: ClusterConfig, name: str, index: int) -> str:
    """Where environment `index` of actor `name` is written: `[rl]` when the actor's `envs` are
    [rl]'s, else the actor's own table."""
    envs = cfg.actors[name].config.get("envs")
    rl_envs = cfg.rl.envs if cfg.rl is not None else None
    if isinstance(envs, list) and rl_envs is not None and len(envs) == len(rl_envs) and \
            index < len(envs) and envs[index].get("cls") == rl_envs[index].get("cls"):
        return "[rl]"
    return f"[actors.{name}.config]"


def _check_ports(name: str, cls: type, config: Any, taken: dict[tuple[str, int], str],
                 path: Path) -> None:
    """Every fixed port the actor binds on this machine (`Actor.bound_ports`: an HTTP server's
    `port`, the router's metrics port) is free now and no other actor's; ConfigError naming the
    table and field."""
    ports = [(f"actors.{name}.config{'.' + t if t else ''}", f, h, p)
             for t, f, h, p in cls.bound_ports(config)]
    for table, field, address, port in ports:
        if isinstance(port, bool) or not isinstance(port, int) or port <= 0:
            continue  # 0: a free port picked at start
        where = f"{path}: [{table}] {field} = {port}"
        other = taken.get((address, port))
        if other is not None:
            raise PortTaken(f"{where} is also {other} on {address}: pick another or 0")
        taken[(address, port)] = f"[{table}] {field}"
        if _in_use(address, port):
            raise PortTaken(f"{where} is in use on {address}: pick another or 0")


def _in_use(address: str, port: int) -> bool:
    """True when another socket holds `port` on `address` (bound as servers bind, with
    SO_REUSEADDR); an address that is not this machine's is not for this check to judge."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _place_ranks(config: dict[str, Any], host: str, hosts: dict[str, HostConfig], table: str,
                 fail: Any) -> None:
    """A trainer's `parallel.hosts`: each a [[hosts]] name, the first the actor's own host (rank
    0 is the actor), addresses the ranks reach across machines; the launcher copies each host's
    address into `parallel.placement` (training/config.py RankHost), from which the ranks'
    hosts are read (`rank_entries`: the launcher starts ranks 1..N-1 there)."""
    parallel = config.get("parallel")
    if not isinstance(parallel, dict) or not parallel.get("hosts"):
        return
    where = f"{table}.config.parallel"
    if "placement" in parallel:
        fail(where, "placement", "is filled by the launcher from [[hosts]]: leave it out")
    names = parallel["hosts"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        fail(where, "hosts", f"{names!r}: give a list of [[hosts]] names")
    unknown = [n for n in names if n not in hosts]
    if unknown:
        fail(where, "hosts", f"unknown host(s) {unknown}; hosts are {list(hosts)}")
    if names[0] != host:
        fail(where, "hosts", f"the first host runs rank 0, which is this actor, on host "
             f"{host!r}; start the list with {host!r} (got {names[0]!r})")
    if len(names) > 1:
        for n in names:
            if _is_loopback(hosts[n].address):
                fail(where, "hosts", f"host {n!r} has the loopback address "
                     f"{hosts[n].address!r}, but ranks on {', '.join(names)} reach each other "
                     f"at their hosts' addresses: give it an address the others reach")
    parallel["placement"] = [{"name": n, "address": hosts[n].address} for n in names]


# ----------------------------------------------------------------------------- hosts
HOST_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
SLURM_SRUN = ["srun", "--nodes=1", "--ntasks=1", "--overlap"]  # + ["-w", node]


def used_hosts(cfg: ClusterConfig) -> list[str]:
    """Names of the hosts at least one actor runs on, in [[hosts]] order."""
    placed = {e.host or cfg.hosts[0].name for e in cfg.actors.values()}
    return [h.name for h in cfg.hosts if h.name in placed]


def rank_hosts(cfg: ClusterConfig) -> set[str]:
    """Hosts named in a trainer's `parallel.hosts` (its ranks run there, started with it)."""
    out: set[str] = set()
    for entry in cfg.actors.values():
        parallel = entry.config.get("parallel") if isinstance(entry.config, dict) else None
        if isinstance(parallel, dict) and isinstance(parallel.get("hosts"), list):
            out |= {h for h in parallel["hosts"] if isinstance(h, str)}
    return out


def is_distributed(cfg: ClusterConfig) -> bool:
    """True when the run spans machines: actors (or a trainer's ranks) on more than one host,
    or on a remote one."""
    used = set(used_hosts(cfg)) | rank_hosts(cfg)
    remote = {h.name for h in cfg.hosts if h.exec}
    return len(used) > 1 or any(h in remote for h in used)


def rank_entries(cfg: ClusterConfig) -> dict[str, ActorEntry]:
    """The processes of trainers' ranks 1..N-1, by name `<actor>.rank<r>`: for an actor whose
    class names a `rank_cls` and whose `ranks(config)` lists the host of each of them ("" = the
    actor's own), one entry each of that class on that host, with the actor's environment,
    restart policy and timeouts; its config carries the actor's own table, the rank, the group's
    size and the host's address (ranks on several hosts). The supervisor starts, restarts and
    stops them with the actor, as one group (`rank_groups`)."""
    out: dict[str, ActorEntry] = {}
    for name, entry in cfg.actors.items():
        cls = import_actor(entry.cls, f"table [actors.{name}], field `cls`")
        if not cls.rank_cls:
            continue
        hosts = cls.ranks(actor_config(cls, entry.config, f"table [actors.{name}.config]"))
        by_name = {h.name: h for h in cfg.hosts}
        for r, host in enumerate(hosts, start=1):
            out[f"{name}.rank{r}"] = ActorEntry(
                cls=cls.rank_cls, host=host or entry.host, env=dict(entry.env),
                config={"trainer": name, "rank": r, "world_size": len(hosts) + 1,
                        "config": entry.config,
                        "address": by_name[host].address if host else ""},
                restart=entry.restart, start_timeout_s=entry.start_timeout_s,
                stop_timeout_s=entry.stop_timeout_s)
    return out


def processes(cfg: ClusterConfig) -> dict[str, ActorEntry]:
    """Every process the launcher starts: the actors, then the trainers' ranks."""
    return {**cfg.actors, **rank_entries(cfg)}


def rank_groups(cfg: ClusterConfig) -> dict[str, list[str]]:
    """Restart groups: an actor with ranks -> [the actor, its rank processes]; started, and
    restarted after any member fails, together."""
    groups: dict[str, list[str]] = {}
    for name in rank_entries(cfg):
        leader = name.rpartition(".rank")[0]
        groups.setdefault(leader, [leader]).append(name)
    return groups


def launcher_address(cfg: ClusterConfig) -> str:
    """Where the launcher binds its sockets (supervisor, metrics): the address of the first
    host without `exec` (the launcher's machine), else this machine's name."""
    local = next((h for h in cfg.hosts if not h.exec), None)
    return local.address if local is not None else socket.gethostname()


def placement(cfg: ClusterConfig) -> dict[str, list[str]]:
    """Host name -> the processes on it, actors and trainers' ranks (every host, in [[hosts]]
    order)."""
    out: dict[str, list[str]] = {h.name: [] for h in cfg.hosts}
    for name, entry in processes(cfg).items():
        out[entry.host or cfg.hosts[0].name].append(name)
    return out


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _binds_host(config_cls: type) -> bool:
    """The actor's Config has a `host` field (the address its HTTP server binds)."""
    return isinstance(config_cls, type) and issubclass(config_cls, msgspec.Struct) and any(
        f.name == "host" and f.type is str for f in msgspec.structs.fields(config_cls))


def _check_gpus(ids: list[str], host: HostConfig, table: str, fail: Any) -> None:
    if not host.gpus:
        return
    for gid in ids:
        index = gid.rpartition("/gpu")[2]
        if index.isdigit() and int(index) >= host.gpus:
            fail(table, "host", f"its device is GPU {index} of host {host.name!r}, which has "
                 f"gpus = {host.gpus} (0 to {host.gpus - 1}): choose another device or host")


def _check_hosts(cfg: ClusterConfig, path: Path, notes: list[str]) -> None:
    """Host names, `exec`, `#<index>` references, addresses across machines; a run over
    several machines gets tcp:// and CURVE (unless `security.curve = false`)."""
    def fail(table: str, field: str, text: str) -> None:
        raise ConfigError(f"{path}: table [{table}], field `{field}`: {text}")

    if not cfg.hosts:
        fail("hosts", "name", "declare at least one [[hosts]] entry")
    names = [h.name for h in cfg.hosts]
    if len(set(names)) != len(names):
        fail("hosts", "name", f"host names must be unique, got {names}")
    for i, host in enumerate(cfg.hosts):
        where = f"hosts.#{i + 1}"
        if not re.fullmatch(HOST_NAME, host.name):
            fail(where, "name", f"{host.name!r}: host names are letters, digits, '.', '_' and "
                 f"'-' (they name folders of the run directory)")
        if host.exec and not all(isinstance(w, str) and w for w in host.exec):
            fail(where, "exec", f"{host.exec!r}: every word must be a non-empty string")
        if host.gpus < 0:
            fail(where, "gpus", f"{host.gpus}: use 0 (not checked) or the host's GPU count")
    for name, entry in cfg.actors.items():
        ref = re.fullmatch(r"#(\d+)", entry.host)
        if ref:
            if int(ref.group(1)) >= len(names):
                fail(f"actors.{name}", "host", f"{entry.host!r}: there are {len(names)} hosts "
                     f"(#0 to #{len(names) - 1}): {names}")
            entry.host = names[int(ref.group(1))]
    if not is_distributed(cfg):
        if cfg.security.curve is None:
            cfg.security = msgspec.structs.replace(cfg.security, curve=False)
        return
    used = used_hosts(cfg)
    for i, host in enumerate(cfg.hosts):
        if host.name in used and _is_loopback(host.address):
            why = (f"host {host.name!r} is another machine (it has `exec`), whose actors the "
                   f"launcher and the other hosts reach at its address" if host.exec else
                   f"actors run on {', '.join(used)} and reach each other at their addresses")
            fail(f"hosts.#{i + 1}", "address", f"{host.address!r} is loopback, but {why}: give "
                 f"host {host.name!r} an address the other hosts reach")
    local = next((h for h in cfg.hosts if not h.exec), None)
    if local is not None and _is_loopback(local.address):
        fail(f"hosts.#{cfg.hosts.index(local) + 1}", "address", f"{local.address!r} is "
             f"loopback, but the launcher runs on host {local.name!r} and the remote hosts' "
             f"actors report to it there: give it an address they reach")
    if cfg.run.transport == "ipc":
        cfg.run.transport = "tcp"
        notes.append(f"actors run on {', '.join(used)}: transport tcp (ipc:// reaches one "
                     f"machine only)")
    if cfg.security.curve is None:
        cfg.security = msgspec.structs.replace(cfg.security, curve=True)
    elif not cfg.security.curve:
        notes.append("security.curve = false on a run over several machines: anyone who "
                     "reaches these ports can talk to the actors and read the metrics")


def _expand_hosts(raw: dict[str, Any], path: Path, notes: list[str]) -> None:
    """`hosts = "slurm"` (or `hosts = { from = "slurm", srun = [...], gpus = N, python = "...",
    workdir = "..." }`): the hosts of the Slurm allocation this runs in, from
    SLURM_JOB_NODELIST through `scontrol show hostnames`, named and addressed by node name;
    the node the launcher runs on (SLURMD_NODENAME) is local, every other is reached through
    `srun ... -w <node>`."""
    spec = raw.get("hosts")
    if isinstance(spec, str):
        if spec != "slurm":
            raise ConfigError(f"{path}: top level, field `hosts`: {spec!r}; write `hosts = "
                              f"\"slurm\"` or [[hosts]] tables")
        spec = {"from": "slurm"}
    if not isinstance(spec, dict):
        return
    if spec.get("from") != "slurm":
        raise ConfigError(f"{path}: table [hosts], field `from`: expected \"slurm\" (for a "
                          f"list of hosts write [[hosts]] tables), got {spec.get('from')!r}")
    allowed = {"from", "srun", "gpus", "python", "workdir"}
    if set(spec) - allowed:
        raise ConfigError(f"{path}: table [hosts], field `{sorted(set(spec) - allowed)[0]}`: "
                          f"unknown; with from = \"slurm\" the fields are "
                          f"{', '.join(sorted(allowed))}")
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError(f"{path}: hosts = \"slurm\", but SLURM_JOB_NODELIST is not set: run "
                          f"the launcher inside a Slurm allocation (sbatch, salloc) or list "
                          f"[[hosts]] tables")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"{path}: hosts = \"slurm\": `scontrol show hostnames {nodelist}` "
                          f"failed: {e}") from None
    nodes = out.stdout.split()
    if out.returncode != 0 or not nodes:
        raise ConfigError(f"{path}: hosts = \"slurm\": `scontrol show hostnames {nodelist}` "
                          f"exited {out.returncode}: {out.stderr.strip() or '(no node names)'}")
    here = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    srun = spec.get("srun", SLURM_SRUN)
    gpus = spec.get("gpus")
    if gpus is None:
        found = re.match(r"\d+", os.environ.get("SLURM_GPUS_ON_NODE", ""))
        gpus = int(found.group()) if found else 0
    extra = {k: spec[k] for k in ("python", "workdir") if k in spec}
    raw["hosts"] = [{"name": n, "address": n, "gpus": gpus, **extra,
                     "exec": [] if n == here else [*srun, "-w", n]} for n in nodes]
    where = "the launcher's node" if here in nodes else "no node of it (all through srun)"
    notes.append(f"hosts from Slurm: {', '.join(nodes)} ({here} is {where})")


def start_order(cfg: ClusterConfig, path: Path | str = "hosts.toml") -> list[str]:
    """Actors in an order where each comes after everything in its `after` list; a trainer's
    rank processes right after it (the supervisor starts the group together)."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(name: str, chain: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise ConfigError(f"{path}: table [actors.{name}], field `after`: dependency cycle "
                              f"{' -> '.join([*chain, name])}")
        state[name] = 1
        for dep in cfg.actors[name].after:
            visit(dep, [*chain, name])
        state[name] = 2
        order.append(name)

    for name in cfg.actors:
        visit(name, [])
    groups = rank_groups(cfg)
    return [member for name in order for member in groups.get(name, [name])]
