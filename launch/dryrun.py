"""`python -m launch.cluster HOSTS.toml --dry-run`: the plan, printed; nothing is started.

What it prints: one row per process in start order (actor, host, class, who it waits for,
restarts, its command), the placement per host on a run over several hosts, the actor configs
that `[rl]` derived, and the run facts every actor reads (launch/plan.py).
"""

from __future__ import annotations

import json
import os
import sys

import msgspec
from rich.console import Console
from rich.table import Table

from launch.agent import agent_command
from launch.config import ClusterConfig, is_distributed, launcher_address, placement, processes


def print_plan(cfg: ClusterConfig, order: list[str], path: str) -> None:
    table = Table(title=f"plan for {path} (run {cfg.run.name!r}, transport {cfg.run.transport})")
    for col in ("#", "actor", "host", "class", "after", "primary", "max restarts", "command"):
        table.add_column(col)
    entries = processes(cfg)  # the actors and trainers' ranks
    for i, name in enumerate(order, 1):
        e = entries[name]
        table.add_row(str(i), name, e.host or cfg.hosts[0].name, e.cls, ", ".join(e.after),
                      "yes" if e.primary else "", str(e.restart.max_restarts),
                      f"python -m runtime.child <run_dir>/specs/{name}.json")
    Console(width=200).print(table)
    if is_distributed(cfg):
        print_hosts(cfg)
    if cfg.rl is not None:  # what [rl] wrote, merged with the file's own actor tables
        print("actor configs (derived from [rl], merged with the file's [actors.*] tables):")
        for name in order:
            if name not in cfg.actors:
                continue  # a trainer's rank: its config is the trainer's
            e = cfg.actors[name]
            env = f" env={json.dumps(e.env)}" if e.env else ""
            print(f"  {name}:{env} {json.dumps(e.config)}")
    said: dict[str, list[str]] = {}  # what the actors agree on (launch/plan.py): who reads it
    for name, facts in cfg.facts.items():
        said.setdefault(json.dumps(msgspec.to_builtins(facts)), []).append(name)
    for facts, names in said.items():
        print(f"run facts: {facts}" if len(said) == 1 else f"run facts of {names}: {facts}")
    print(f"run directory: {cfg.run.dir}/{cfg.run.name}-<timestamp>; nothing was started "
          "(--dry-run)")


def print_hosts(cfg: ClusterConfig) -> None:
    """The placement per host, how each remote host is reached, and the transport."""
    table = Table(title="placement per host")
    for col in ("host", "address", "actors", "gpus", "started through"):
        table.add_column(col)
    for host in cfg.hosts:
        names = placement(cfg)[host.name]
        how = "the launcher (this machine)" if not host.exec else " ".join(agent_command(
            host.exec, host.python or sys.executable, host.workdir or os.getcwd(), host.shell))
        table.add_row(host.name, host.address, ", ".join(names) or "(none)",
                      str(host.gpus or "-"), how)
    Console(width=200).print(table)
    sec = cfg.security
    keys = (f"keys from {sec.keys_dir}" if sec.keys_dir else
            "keys made for the run in <run_dir>/keys") if sec.curve else "OFF (security.curve)"
    print(f"transport {cfg.run.transport}; launcher sockets on {launcher_address(cfg)}; CURVE "
          f"{'on, ' + keys + ', handed to each agent over its stdin' if sec.curve else keys}")


