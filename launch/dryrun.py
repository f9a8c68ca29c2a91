"""`python -m launch.cluster HOSTS.toml --dry-run`: the plan, printed and checked; nothing starts.

What it prints, in at most 80 columns: every process in start order (one line: its number,
name, host, class; then who it waits for and its restart budget; then its command), the
placement per host on a run over several hosts (address, GPUs, the command that reaches it),
the actor configs that `[rl]` derived, the run facts every actor reads (launch/plan.py), and
what the engines check found.

The engine check: every actor states what it runs, and the dry run looks for it on the host that
would run it. An actor class says it with `needs` (module -> pip requirement) and, when another
interpreter runs it, `needs_python` (the config field naming that interpreter): SGLang workers
need `sglang` (`python -m sglang.launch_server`), the router `sglang_router`. A trainer's
optional backend is read from its config (`BACKEND_NEEDS`: backend = "megatron" needs
megatron.core), on its host and on the host of every one of its ranks. On the launcher's host the
check is in this process (importlib.util.find_spec, shutil.which); on a remote host it is one
short command through the host's `exec` prefix with its python (`python -m launch.agent --needs
JSON`, launch/agent.py `check_needs`), which also says whether the host's address binds there.
A host that cannot be reached is said in one line. One line per missing engine names the host,
the actors, the module and the pip command; the dry run then exits with code 1 (0 when every
engine is there). The metrics sinks' packages are checked at load (launch/sinks.py: exit 2).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec

from launch.agent import agent_command, check_needs
from launch.config import (
    ClusterConfig,
    HostConfig,
    is_distributed,
    launcher_address,
    placement,
    processes,
)
from launch.preload import template_groups
from runtime.loading import import_actor
from transport.addresses import probe_bind

WIDTH = 80  # every printed line fits this many columns
CHECK_TIMEOUT_S = 60.0  # a remote host's check must answer within this
# the trainer's optional backends (training/backends.py get_backend): module -> pip requirement
BACKEND_NEEDS = {"megatron": {"megatron.core": "megatron-core==0.16.1"}}


@dataclass(frozen=True)
class Need:
    """One module an actor runs, on one host, in one interpreter ("" = the host's own)."""

    host: str
    actor: str
    module: str
    pip: str
    python: str = ""


# ----------------------------------------------------------------------------- the printout
def print_plan(cfg: ClusterConfig, order: list[str], path: str) -> int:
    """Print the plan and check the engines: the dry run's exit code, 0 when everything is
    there, 1 when an engine is missing, a host cannot be checked or an address does not bind
    (each printed first)."""
    entries = processes(cfg)  # the actors and trainers' ranks
    hosts = {h.name: h for h in cfg.hosts}
    say(f"plan for {path}")
    say(f"run {cfg.run.name!r}, transport {cfg.run.transport}, {len(order)} processes in "
        f"start order:")
    forked = {n: i for i, (_, names) in enumerate(template_groups(cfg)) for n in names}
    for i, name in enumerate(order, 1):
        e = entries[name]
        host = hosts[e.host or cfg.hosts[0].name]
        say(f"{i:>2} {name} on {host.name}{', primary' if e.primary else ''}: {e.cls}")
        waits = f"after {', '.join(e.after)}; " if e.after else ""
        say(f"{waits}max restarts {e.restart.max_restarts}", indent=5)
        if name in forked:
            say(f"forked from template {forked[name]} ([run] preload), as:", indent=5)
        command(["python" if not host.python else host.python, "-m", "runtime.child",
                 f"<run_dir>/specs/{name}.json"], indent=5)
    if is_distributed(cfg):
        print_hosts(cfg)
    if cfg.rl is not None:  # what [rl] wrote, merged with the file's own actor tables
        say("actor configs (derived from [rl], merged with the file's [actors.*] tables):")
        for name in order:
            if name not in cfg.actors:
                continue  # a trainer's rank: its config is the trainer's
            e = cfg.actors[name]
            env = f" env={json.dumps(e.env)}" if e.env else ""
            table(f"  {name}:{env} ", e.config, indent=4)
    said: dict[str, list[str]] = {}  # what the actors agree on (launch/plan.py): who reads it
    for name, facts in cfg.facts.items():
        said.setdefault(json.dumps(msgspec.to_builtins(facts)), []).append(name)
    for facts, names in said.items():
        table("run facts: " if len(said) == 1 else f"run facts of {names}: ",
              json.loads(facts), indent=2)
    problems = check_engines(cfg)
    say(f"run directory: {cfg.run.dir}/{cfg.run.name}-<timestamp>; nothing was started "
        f"(--dry-run)")
    return 1 if problems else 0


def print_hosts(cfg: ClusterConfig) -> None:
    """The placement per host, how each remote host is reached, and the transport."""
    say("placement per host:")
    where = placement(cfg)
    for host in cfg.hosts:
        gpus = f", gpus {host.gpus}" if host.gpus else ""
        if not host.exec:
            say(f"  {host.name} ({host.address}{gpus}): the launcher (this machine)")
        else:
            say(f"  {host.name} ({host.address}{gpus}): started through")
            python, workdir = host.python or sys.executable, host.workdir or os.getcwd()
            words = agent_command(host.exec, python, workdir, host.shell)
            if len(words) == len(host.exec) + 1:  # one word, for the shell over there (ssh)
                command([*host.exec, "AGENT"], indent=4)
                say("where AGENT is this line, as one word (quoted):", indent=4)
                command(agent_command([], python, workdir, False), indent=4)
            else:
                command(words, indent=4)
        say(f"runs {', '.join(where[host.name]) or '(none)'}", indent=4)
    sec = cfg.security
    keys = (f"keys from {sec.keys_dir}" if sec.keys_dir else
            "keys made for the run in <run_dir>/keys") if sec.curve else "OFF (security.curve)"
    say(f"transport {cfg.run.transport}; launcher sockets on {launcher_address(cfg)}")
    say(f"CURVE {'on, ' + keys + ', handed to each agent over its stdin' if sec.curve else keys}")


def say(text: str, indent: int = 0) -> None:
    """`text` in lines of at most WIDTH columns (at spaces; continuation lines 2 deeper)."""
    lines = textwrap.wrap(text, WIDTH, initial_indent=" " * indent,
                          subsequent_indent=" " * (indent + 2), break_on_hyphens=False,
                          break_long_words=True)
    print("\n".join(lines or [""]))


def table(head: str, doc: dict[str, Any], indent: int) -> None:
    """`head` + `doc` as JSON: on one line when it fits, else one top-level field a line
    (`indent` deep, each packed), between the braces."""
    whole = json.dumps(doc)
    if len(head) + len(whole) <= WIDTH:
        print(head + whole)
        return
    print(head + "{")
    for i, (key, value) in enumerate(doc.items()):
        comma = "," if i < len(doc) - 1 else ""
        packed(" " * indent + f"{json.dumps(key)}: ", json.dumps(value) + comma, indent + 2)
    print(" " * (indent - 2) + "}")


def packed(head: str, text: str, indent: int) -> None:
    """`head` + JSON `text`, broken only after its commas (a `"key": value` pair stays on one
    line), continuation lines indented `indent`; a piece wider than a line is cut."""
    pieces = [p + "," for p in text.split(", ")]
    pieces[-1] = pieces[-1][:-1]
    line = head
    for piece in pieces:
        if len(line) + len(piece) + (0 if line.endswith(" ") else 1) > WIDTH and line.strip():
            _emit(line, indent)
            line = " " * indent
        line += piece if line.endswith(" ") else " " + piece
    _emit(line, indent)


def _emit(line: str, indent: int) -> None:
    while len(line) > WIDTH:  # one piece wider than the line: cut it
        print(line[:WIDTH])
        line = " " * indent + line[WIDTH:]
    print(line.rstrip())


def command(words: list[str], indent: int) -> None:
    """A command line as the shell reads it, `$ ` first, continued with ` \\` past WIDTH."""
    quoted = [w if w.startswith("<run_dir>") or w == "AGENT" else shlex.quote(w)
              for w in words]
    lines, line = [], " " * indent + "$"
    for word in quoted:
        if len(line) + 1 + len(word) > WIDTH - 2 and line.strip() != "$":
            lines.append(line + " \\")
            line = " " * (indent + 2)
            while len(line) + len(word) > WIDTH - 2:  # one word wider than a line
                room = WIDTH - 2 - len(line)
                lines.append(line + word[:room] + "\\")
                word = word[room:]
            line += word
        else:
            line += " " + word
    print("\n".join([*lines, line]))


# ----------------------------------------------------------------------------- the engines
def needs_of(cls: type, config: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """module -> (pip requirement, interpreter or "") of what one actor runs: its class's
    `needs` (in the interpreter its `needs_python` field names) and a trainer's backend."""
    python = ""
    field = getattr(cls, "needs_python", "")
    if field and isinstance(config.get(field), str):
        python = config[field]
    out = {m: (pip, python) for m, pip in getattr(cls, "needs", {}).items()}
    backend = config.get("backend") if getattr(cls, "role", "") == "trainer" else None
    for module, pip in BACKEND_NEEDS.get(backend, {}).items() if isinstance(backend, str) \
            else ():
        out[module] = (pip, "")
    return out


def plan_needs(cfg: ClusterConfig) -> list[Need]:
    """What every process of the plan runs, on the host that would run it (a trainer's ranks
    run what the trainer runs)."""
    needs: list[Need] = []
    by_actor: dict[str, dict[str, tuple[str, str]]] = {}
    for name, entry in cfg.actors.items():
        by_actor[name] = needs_of(import_actor(entry.cls), entry.config)
    for name, entry in processes(cfg).items():
        owner = name if name in cfg.actors else str(entry.config.get("trainer", ""))
        host = entry.host or cfg.hosts[0].name
        for module, (pip, python) in by_actor.get(owner, {}).items():
            needs.append(Need(host, name, module, pip, python))
    return needs


def check_engines(cfg: ClusterConfig) -> list[str]:
    """Look for every engine on its host (remote hosts in parallel) and print what is found;
    returns the problems printed (empty: everything is there)."""
    needs = plan_needs(cfg)
    distributed = is_distributed(cfg)
    used = {n.host for n in needs} | {h for h, names in placement(cfg).items() if names}
    hosts = [h for h in cfg.hosts if h.name in used]
    specs = {}
    for host in hosts:
        modules: dict[str, list[str]] = {}
        for n in needs:
            if n.host == host.name and n.module not in modules.setdefault(n.python, []):
                modules[n.python].append(n.module)
        check_address = distributed and host.exec  # the launcher's own: checked below
        specs[host.name] = {"modules": modules,
                            **({"address": host.address} if check_address else {})}
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        found = dict(zip([h.name for h in hosts],
                         pool.map(lambda h: _check_host(h, specs[h.name]), hosts)))
    problems: list[str] = []
    if distributed:
        local = next((h for h in cfg.hosts if not h.exec), None)
        why = probe_bind(launcher_address(cfg), 0)
        if why and local is not None:
            problems.append(f"host {local.name}: its address {local.address} (port 0) does "
                            f"not bind here: {why}; set `address` of [[hosts]] "
                            f"{local.name!r} to an address of this machine")
    for host in hosts:
        result = found[host.name]
        if isinstance(result, str):
            problems.append(f"host {host.name}: cannot check it ({result}); nothing of it is "
                            f"known")
            continue
        if result.get("address"):
            problems.append(f"host {host.name}: its address {host.address} (port 0) does not "
                            f"bind there: {result['address']}; set `address` of [[hosts]] "
                            f"{host.name!r} to an address of it")
        for python, why in result.get("broken", {}).items():
            actors = _names(n.actor for n in needs if n.host == host.name and n.python == python)
            problems.append(f"host {host.name}: {python} (the interpreter of {actors}) cannot "
                            f"be asked: {why}")
        for python, modules in result.get("missing", {}).items():
            for module in modules:
                group = [n for n in needs if n.host == host.name and n.python == python
                         and n.module == module]
                in_python = f" in {python}" if python else ""
                problems.append(f"missing on {host.name}: {module}{in_python} for "
                                f"{_names(n.actor for n in group)}; pip install "
                                f"{shlex.quote(group[0].pip)}")
    if problems:
        for text in problems:
            say(text, indent=0)
        say(f"{len(problems)} problem(s) above: the run would fail on those hosts (install "
            f"what is missing with the interpreter that runs the actor, or place the actor "
            f"elsewhere)")
    elif needs or distributed:
        there = sorted({f"{n.module} on {n.host}" for n in needs})
        say(f"engines: all there ({', '.join(there) or 'none needed'})"
            + ("; every host's address binds" if distributed else ""))
    return problems


def _check_host(host: HostConfig, spec: dict[str, Any]) -> dict[str, Any] | str:
    """check_needs on `host`: here for the launcher's machine, else one command through its
    exec prefix; a string says why the host could not be checked."""
    if not host.exec:
        if host.python:  # the actors there run another interpreter than this one
            spec = {**spec, "modules": {p or host.python: m for p, m in
                                        spec["modules"].items()}}
        return check_needs(spec)
    words = agent_command(host.exec, host.python or sys.executable,
                          host.workdir or os.getcwd(), host.shell, needs=json.dumps(spec))
    first = shlex.join(host.exec)
    try:
        done = subprocess.run(words, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return f"{host.exec[0]} is not on PATH here"
    except subprocess.TimeoutExpired:
        return f"`{first} ...` gave no answer within {CHECK_TIMEOUT_S:g} s"
    except OSError as e:
        return f"`{first} ...` cannot run: {e}"
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() \
            else None
    except ValueError:
        result = None
    if done.returncode != 0 or not isinstance(result, dict):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`{first} ...` exited with code {done.returncode}: {last}"
    return result


def _names(names: Any) -> str:
    """Actor names, in order, with runs of numbered names shortened: worker0..worker7."""
    unique = list(dict.fromkeys(names))
    out: list[str] = []
    i = 0
    while i < len(unique):
        m = re.fullmatch(r"(.*?)(\d+)", unique[i])
        j = i
        while m and j + 1 < len(unique) and unique[j + 1] == f"{m[1]}{int(m[2]) + j + 1 - i}":
            j += 1
        out.append(unique[i] if j - i < 2 else f"{unique[i]}..{unique[j]}")
        if 0 < j - i < 2:
            out += unique[i + 1:j + 1]
        i = j + 1
    return ", ".join(out)
