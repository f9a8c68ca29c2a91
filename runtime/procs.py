"""Stopping child processes and quoting their logs: one implementation for the launcher and for
every actor that owns a subprocess (sglang.launch_server, sglang-router, trainer ranks).

Shutdown escalates: SIGTERM, then SIGKILL after `term_timeout_s`; the returned step says which
one ended the process ("exited" when it had already gone). With `group=True` the signals go to
the process group the child leads (started with `start_new_session=True`), so what it started
itself goes too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path


def send_signal(pid: int, sig: int, group: bool = False) -> None:
    """`sig` to the process (or its group); a process already gone is not an error."""
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


class ReportedProcess:
    """A process this one is not the parent of, as the supervisor sees its own children:
    `pid`, `returncode`, `wait()`, `send_signal()`, `terminate()`, `kill()`; whoever learns its
    exit code calls `exited(code)` (a remote host's agent, launch/agent.py; the template it was
    forked from, launch/preload.py). Subclasses say how a signal reaches it."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._done = asyncio.Event()

    async def wait(self) -> int:
        await self._done.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        raise NotImplementedError

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._done.set()


async def wait_exit(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """True when `proc` exits within `timeout_s` (the wait itself is not cancelled)."""
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), timeout_s)
        return True
    except TimeoutError:
        return False


async def terminate(proc: asyncio.subprocess.Process, term_timeout_s: float,
                    group: bool = False) -> str:
    """SIGTERM, then SIGKILL past `term_timeout_s`; returns "exited", "sigterm" or "sigkill"."""
    if proc.returncode is not None:
        return "exited"
    send_signal(proc.pid, signal.SIGTERM, group)
    if await wait_exit(proc, term_timeout_s):
        return "sigterm"
    send_signal(proc.pid, signal.SIGKILL, group)
    await proc.wait()
    return "sigkill"


def terminate_sync(proc: subprocess.Popen, term_timeout_s: float) -> str:
    """`terminate` for a `subprocess.Popen` (blocking; from threads and tests)."""
    if proc.poll() is not None:
        return "exited"
    proc.terminate()
    try:
        proc.wait(term_timeout_s)
        return "sigterm"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "sigkill"


def log_tail(path: Path | str, lines: int, max_bytes: int = 16384) -> str:
    """The last `lines` lines of a log (read from its last `max_bytes`), or "(no log)"."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
