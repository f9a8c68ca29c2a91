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


_RANK_CONTEXT: list = []


def rank_context():
    """A forkserver context whose server has tests/rank_preload.py imported (started once per
    test process, on first use): the tests' rank processes are forks of it. A forked rank ends
    with os._exit (multiprocessing's forkserver children do): no C++ static destructors after
    its group is gone (a gloo thread met there aborts a finished process now and then)."""
    if not _RANK_CONTEXT:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.rank_preload"])
        _RANK_CONTEXT.append(ctx)
    return _RANK_CONTEXT[0]


def run_forked(target, args_of_rank, world: int, timeout_s: float, log_dir: Path) -> list:
    """`target(*args_of_rank(r))` in `world` forked rank processes (`rank_context`), each
    given `timeout_s` from the start, its stdout and stderr in `<log_dir>/rank<r>.log`;
    returns their exit codes (None: killed at the deadline)."""
    import time

    ctx = rank_context()
    procs = [ctx.Process(target=_forked_rank, args=(target, args_of_rank(r),
                                                      str(Path(log_dir) / f"rank{r}.log")))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [p.exitcode for p in procs]


def _forked_rank(target, args: tuple, log: str) -> None:
    import os

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(Path(__file__).resolve().parent.parent)
    target(*args)


def two_gloo_ranks(module: str, tmp_path: Path, timeout_s: float = 120) -> list[dict]:
    """Run `module`'s `worker(rank, port, out)` as ranks 0 and 1 of a gloo group, each in a
    forked process of its own (`run_forked`); each writes its report (a dict) with torch.save
    to `<out>.<rank>`. Returns both reports; a rank that fails fails the test with its output."""
    import importlib

    import torch

    from transport.sockets import free_port

    port = free_port("127.0.0.1")
    worker = importlib.import_module(module).worker
    codes = run_forked(_one_thread, lambda r: (worker, r, port, str(tmp_path / "out")), 2,
                       timeout_s, tmp_path)
    for r, code in enumerate(codes):
        assert code == 0, f"rank {r} exit {code}: " + (tmp_path / f"rank{r}.log").read_text()[
            -3000:]
    return [torch.load(tmp_path / f"out.{rank}") for rank in range(2)]


def _one_thread(worker, rank: int, port: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)  # two ranks on the machine's cores, as OMP_NUM_THREADS = 1
    worker(rank, port, out)


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


def actor_processes(launcher_pid: int) -> dict:
    """The launcher's actor processes by actor name: `python -m runtime.child .../<name>.json`,
    started by the launcher itself or forked from one of its templates (launch/preload.py),
    which name themselves so (setproctitle): name -> psutil.Process."""
    import psutil

    out = {}
    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline()).split()  # a title set by setproctitle is one string
        except psutil.Error:
            continue
        if "runtime.child" in cmd and cmd[-1].endswith(".json"):
            out[Path(cmd[-1]).stem] = p
    return out
