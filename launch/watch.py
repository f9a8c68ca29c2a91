"""`python -m launch.watch ADDRESS|RUN_DIR`: a live table of every actor's latest metrics.

ADDRESS is the metrics endpoint a launcher prints (ipc://... or tcp://...); RUN_DIR is a run
directory, whose endpoints.json names it. `--jsonl FILE` appends every record as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.live import Live
from rich.table import Table

from transport.metrics import MetricsSubscriber
from transport.schema import Metrics
from transport.sockets import Security, SocketFactory


def resolve(target: str) -> str:
    if "://" in target:
        return target
    path = Path(target) / "endpoints.json"
    if not path.is_file():
        raise ValueError(f"{target} is neither an endpoint (ipc://..., tcp://...) nor a run "
                         f"directory with endpoints.json")
    return json.loads(path.read_text())["metrics"]


class Board:
    """Latest record per actor, rendered as a table."""

    def __init__(self) -> None:
        self.latest: dict[str, Metrics] = {}
        self.count: dict[str, int] = {}

    def update(self, m: Metrics) -> None:
        self.latest[m.actor] = m
        self.count[m.actor] = self.count.get(m.actor, 0) + 1

    def table(self, sub: MetricsSubscriber) -> Table:
        table = Table(title=f"metrics ({time.strftime('%H:%M:%S')})")
        for col in ("actor", "step", "records", "lost", "age s", "values"):
            table.add_column(col)
        now = time.time()
        for actor in sorted(self.latest):
            m = self.latest[actor]
            step = "" if m.step is None else f"{m.step}" + (
                f"/{m.total_steps}" if m.total_steps is not None else "")
            values = "  ".join(f"{k}={v:.4g}" for k, v in m.values.items())
            lost = m.dropped + sub.gaps.get(actor, 0)
            table.add_row(actor, step, str(self.count[actor]), str(lost),
                          f"{now - m.time_s:.1f}", values)
        return table


def security_of(target: str, keys_dir: str | None) -> Security:
    """CURVE settings: `--keys-dir`, else those of the run directory's config.json (so a run
    with CURVE on is watched with its keys), else none."""
    if keys_dir:
        return Security(curve=True, keys_dir=keys_dir)
    config = Path(target) / "config.json"
    if config.is_file():
        return msgspec.convert(json.loads(config.read_text()).get("security", {}), Security)
    return Security()


async def watch(endpoint: str, jsonl: str | None, duration_s: float | None,
                live: bool, security: Security | None = None) -> int:
    factory = SocketFactory(security=security)
    sub = MetricsSubscriber(factory, endpoint)
    board = Board()
    out = open(jsonl, "a") if jsonl else None
    console = Console()
    deadline = None if duration_s is None else time.monotonic() + duration_s
    try:
        with Live(board.table(sub), console=console, refresh_per_second=4,
                  transient=False) if live else _Null() as view:
            while deadline is None or time.monotonic() < deadline:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    m = await asyncio.wait_for(sub.recv(), left)
                except TimeoutError:
                    break
                board.update(m)
                if out is not None:
                    out.write(msgspec.json.encode(m).decode() + "\n")
                    out.flush()
                view.update(board.table(sub))
    finally:
        if out is not None:
            out.close()
        sub.close()
        factory.close()
    return 0


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, _):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.watch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="metrics endpoint or run directory")
    parser.add_argument("--jsonl", help="append every record to this file as JSON lines")
    parser.add_argument("--duration-s", type=float, help="stop after this many seconds")
    parser.add_argument("--no-live", action="store_true", help="no table (with --jsonl)")
    parser.add_argument("--keys-dir", help="CURVE keys of a run with security.curve = true "
                                           "(read from RUN_DIR/config.json when not given)")
    args = parser.parse_args(argv)
    try:
        endpoint = resolve(args.target)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        security = security_of(args.target, args.keys_dir)
        return asyncio.run(watch(endpoint, args.jsonl, args.duration_s, not args.no_live,
                                 security))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
