"""hosts.toml: the schema, its validation, and the resolved plan of actor processes.

Invariant: a config that loads is runnable as far as static checks can tell. Every mistake (a
wrong key, a wrong type, a missing field, an unknown host or actor, a class that does not import,
an actor `config` table its class rejects) is a `ConfigError` naming the file, the table and the
field, raised before any process starts.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from runtime import passthrough as pt
from runtime.actor import ActorView
from runtime.loading import ConfigError, actor_config, import_actor
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
    ready_timeout_s: float = 60.0  # an actor must report READY within this after its start
    shutdown_timeout_s: float = 15.0  # wait after the shutdown message before SIGTERM
    term_timeout_s: float = 5.0  # wait after SIGTERM before SIGKILL
    heartbeat_interval_s: float = 1.0  # actors report liveness this often
    heartbeat_timeout_s: float = 30.0  # an actor silent this long is killed and restarted
    progress_interval_s: float = 5.0  # console progress lines per actor at most this often
    stall_report_s: float = 60.0  # a wait on a peer longer than this is said on the console
    request_retry_s: float = 30.0  # idempotent requests (permits, batches) re-sent this often
    # where every metrics record goes (launch/sinks.py): "jsonl" <run_dir>/metrics.jsonl,
    # "tensorboard" <run_dir>/tensorboard (pip install tensorboardX), "wandb" (pip install wandb)
    sinks: list[Literal["jsonl", "tensorboard", "wandb"]] = msgspec.field(
        default_factory=lambda: ["jsonl"])
    wandb: WandbConfig = WandbConfig()  # the W&B run, when `sinks` names "wandb"
    plots: bool = True  # at the end, PNGs into <run_dir>/plots from metrics.jsonl (launch/plot.py)


class HostConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A machine actors run on. Only the local host is implemented; exec is reserved."""

    name: str
    address: str = "127.0.0.1"  # address other hosts reach this one at (tcp transport)
    exec: list[str] = []  # remote exec prefix, e.g. ["ssh", "node2"] (not implemented yet)
    python: str = ""  # interpreter for actor processes ("" = the launcher's own)


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


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True):
    run: RunConfig
    hosts: list[HostConfig]
    actors: dict[str, ActorEntry]
    security: Security = Security()
    limits: Limits = Limits()
    shm: ShmConfig = ShmConfig()


def load(path: str | Path,
         passthrough: dict[str, dict[str, Any]] | None = None) -> ClusterConfig:
    """Load and check hosts.toml; `passthrough` holds `--<prefix>-<option>` command-line tables
    (runtime/passthrough.py), merged over the actors' hosts.toml tables before any check."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    actors = raw.get("actors")
    if passthrough:
        _merge_passthrough(actors, passthrough, path)
    for name, entry in (actors.items() if isinstance(actors, dict) else ()):
        try:  # one by one: msgspec's error path does not name dict keys
            msgspec.convert(entry, ActorEntry)
        except msgspec.ValidationError as e:
            raise ConfigError(f"{path}: {_describe(str(e), ['actors', name])}") from None
    try:
        cfg = msgspec.convert(raw, ClusterConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {_describe(str(e))}") from None
    _check(cfg, path)
    return cfg


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


def _describe(err: str, prefix: list[str] | None = None) -> str:
    """msgspec's 'problem - at `$.a.b`' as 'table [a], field `b`: problem'."""
    problem, _, where = err.partition(" - at `")
    parts = re.findall(r"\.([A-Za-z0-9_\-]+)|\[(\d+)\]", where.rstrip("`").removeprefix("$"))
    keys = [*(prefix or []), *(name or f"#{int(idx) + 1}" for name, idx in parts)]
    named = re.search(r"(?:unknown|missing required) field `([^`]+)`", problem)
    if named:
        field, table = named.group(1), keys
        hint = " (check the spelling; every field is listed in launch/config.py)" \
            if "unknown" in problem else ""
    else:
        field, table, hint = (keys[-1] if keys else "?"), keys[:-1], ""
    return f"table [{_table(table)}], field `{field}`: {problem}{hint}"


def _table(keys: list[str]) -> str:
    return ".".join(keys) if keys else "top level"


def _check(cfg: ClusterConfig, path: Path) -> None:
    def fail(table: str, field: str, text: str) -> None:
        raise ConfigError(f"{path}: table [{table}], field `{field}`: {text}")

    if not cfg.hosts:
        fail("hosts", "name", "declare at least one [[hosts]] entry")
    names = [h.name for h in cfg.hosts]
    if len(set(names)) != len(names):
        fail("hosts", "name", f"host names must be unique, got {names}")
    for i, host in enumerate(cfg.hosts):
        if host.exec:
            fail(f"hosts.#{i + 1}", "exec", "remote hosts are not implemented yet; run every "
                 "actor on the local host (leave exec empty)")
    if not cfg.actors:
        fail("actors", "cls", "declare at least one [actors.<name>] table")
    views: dict[str, ActorView] = {}
    for name, entry in cfg.actors.items():
        table = f"actors.{name}"
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_\-]*", name):
            fail(table, "name", "actor names are letters, digits, '_' and '-'")
        if entry.host and entry.host not in names:
            fail(table, "host", f"unknown host {entry.host!r}; hosts are {names}")
        for dep in entry.after:
            if dep not in cfg.actors:
                fail(table, "after", f"unknown actor {dep!r}; actors are {sorted(cfg.actors)}")
        cls = import_actor(entry.cls, f"{path}: table [{table}], field `cls`")
        config = actor_config(cls, entry.config, f"{path}: table [{table}.config]")
        try:
            cls.check_config(config)
            host = entry.host or names[0]
            views[name] = ActorView(cls, config, host,
                                    cls.gpus(config, {**os.environ, **entry.env}, host),
                                    list(entry.after))
        except ValueError as e:
            raise ConfigError(f"{path}: table [{table}.config]: {e}") from None
    for name, view in views.items():
        try:
            view.cls.check_peers(name, view.config, views)
        except ValueError as e:
            raise ConfigError(f"{path}: table [actors.{name}.config]: {e}") from None
    start_order(cfg, path)


def start_order(cfg: ClusterConfig, path: Path | str = "hosts.toml") -> list[str]:
    """Actors in an order where each comes after everything in its `after` list."""
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
    return order
