"""Helpers for in-process actor tests."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from pathlib import Path

from runtime.actor import Actor, ActorContext
from transport.schema import Endpoints


def context(name: str, ipc, **kw) -> ActorContext:
    """An ActorContext binding fresh ipc:// endpoints (no supervisor, no metrics)."""
    eps = Endpoints(control=ipc(f"{name}.ctl"), rpc=ipc(f"{name}.rpc"), inbox=ipc(f"{name}.in"))
    return ActorContext(name=name, endpoints=eps, **kw)


@asynccontextmanager
async def running(actor: Actor, timeout_s: float = 10.0):
    """Serve `actor` in a task; yields once RUNNING; stops it and checks the exit code after."""
    task = asyncio.ensure_future(actor.serve())
    try:
        async with asyncio.timeout(timeout_s):
            waiter = asyncio.ensure_future(actor.wait_running())
            await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        if task.done():
            task.result()
            raise AssertionError(f"{actor.name} stopped during start: {actor.status}")
        yield actor
    finally:
        actor.stop("test over")
        await asyncio.wait_for(task, timeout_s)


def two_gloo_ranks(module: str, tmp_path: Path, timeout_s: float = 120) -> list[dict]:
    """Run `module`'s `worker(rank, port, out)` as ranks 0 and 1 of a gloo group, each in a
    process of its own; each writes its report (a dict) with torch.save to `<out>.<rank>`.
    Returns both reports; a rank that fails fails the test with its stderr."""
    import os
    import subprocess
    import sys

    import torch

    from transport.sockets import free_port

    root = Path(__file__).resolve().parent.parent
    port = free_port("127.0.0.1")
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    # os._exit: no C++ static destructors after the group is gone (a gloo thread met there
    # aborts a finished process now and then; runtime/child.py leaves the same way for actors
    # with `exit_hard`, the trainer's ranks)
    code = (f"import os, sys; from {module} import worker; "
            "worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]); "
            "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port),
                               str(tmp_path / "out")], cwd=root, env=env,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout_s)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:  # the other rank of a failed one: ended, its pipe closed
            if p.poll() is None:
                p.kill()
            p.communicate()
    return [torch.load(tmp_path / f"out.{rank}") for rank in range(2)]


def console_messages(stdout: str) -> list[str]:
    """The launcher's console output as whole messages: a message's later lines (indented, as
    launch/console.py wraps it at 80 columns) joined back to its first by single spaces."""
    messages: list[str] = []
    for line in stdout.splitlines():
        if line.startswith(" ") and messages:
            messages[-1] += " " + line.strip()
        else:
            messages.append(line)
    return messages


class MessageReader:
    """Reads the launcher's console output from a pipe line by line and keeps the message the
    last line belongs to whole (`message`: its later, indented lines joined back to its first
    by single spaces), so that a test waits for a message that wraps at 80 columns."""

    def __init__(self) -> None:
        self.message = ""

    def add(self, line: str) -> str:
        """The message `line` belongs to, with `line` in it."""
        text = line.rstrip("\n")
        if text.startswith(" ") and self.message:
            self.message += " " + text.strip()
        else:
            self.message = text
        return self.message


def metric_records(run_dir: Path) -> list[dict]:
    """Every record of a run's metrics.jsonl ({"actor", "values", ...}), in order."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text()
            .splitlines()]


def trainer_steps(run: Path | list[dict]) -> list[dict]:
    """The trainer's per-step values (its records that carry a version), in order, from a run
    directory or its `metric_records`."""
    records = run if isinstance(run, list) else metric_records(run)
    return [r["values"] for r in records if r["actor"] == "trainer" and "version" in r["values"]]
