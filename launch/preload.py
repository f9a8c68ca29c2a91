"""The launcher's end of the pre-imported templates (runtime/template.py): actor processes of
this host forked from a process that has already imported their classes' modules.

Role: `[run] preload = true` (the default). At the start of a run the launcher starts one
template per (python, actor `env`) that at least two of this host's processes share, importing
those processes' actor classes, while the first actors start; each such process (and each of
its restarts) is then a fork of it instead of a new interpreter that imports torch again: on a
2-core machine an embedded worker's, a trainer's or a trainer rank's start spends ~2.4 s of CPU
fewer (torch and transformers; megatron-core is imported after the fork, when a rank builds its
backend). What the process runs, and its log, environment, session and exit code, are those of
`python -m runtime.child SPEC.json` (runtime/template.py).

Invariant: a template only ever speeds a start up. When it cannot serve (its imports failed or
left the process unsafe to fork, it died, a fork failed) the launcher says so once and starts
processes the ordinary way. A forked process's exit code comes from its template; a process
whose template died ends with it (parent-death signal, runtime/child.py) and is reported with
LOST_CODE once it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Callable

from launch.config import ClusterConfig, processes
from runtime.procs import ReportedProcess, terminate
from runtime.template import MAX_MESSAGE

LOST_CODE = -int(signal.SIGTERM)  # a forked process whose template died: ended by that death
READY_TIMEOUT_S = 120.0  # the template's imports (a loaded 2-core machine: ~10 s)
FORK_TIMEOUT_S = 30.0


class ForkedProcess(ReportedProcess):
    """An actor process forked by a template, as the supervisor sees any local process; its
    exit code comes from the template."""

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (reaped by whoever adopted it, or never)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"Z"
    except (OSError, IndexError):
        return True


class Template:
    """One template process (runtime/template.py) and the processes forked from it."""

    def __init__(self, python: str, env: dict[str, str], classes: list[str], log_path: Path,
                 say: Callable[[str], None] = print, label: str = "template"):
        self.python, self.env, self.classes = python, env, sorted(set(classes))
        self.log_path, self.say, self.label = log_path, say, label
        self.proc: asyncio.subprocess.Process | None = None
        self.sock: socket.socket | None = None
        self.unusable = ""  # why it cannot serve (said once), "" while it can
        self.ready: asyncio.Future[str] | None = None
        self.forked: dict[int, ForkedProcess] = {}
        self._pending: dict[int, asyncio.Future[ForkedProcess]] = {}
        self._ids = itertools.count()
        self._watchers: list[asyncio.Task] = []

    async def start(self) -> None:
        """Start the process; its imports go on while the run starts (`fork` waits for them)."""
        loop = asyncio.get_running_loop()
        self.ready = loop.create_future()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab", buffering=0) as log:
                self.proc = await asyncio.create_subprocess_exec(
                    self.python, "-m", "runtime.template", str(theirs.fileno()), *self.classes,
                    pass_fds=(theirs.fileno(),), env=self.env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=log, stderr=log, start_new_session=True)
        except OSError as e:
            ours.close()
            self._unusable(f"cannot start: {e}")
            return
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        loop.add_reader(ours.fileno(), self._readable)

    async def fork(self, spec: Path, env: dict[str, str], cwd: str, log_fd: int
                   ) -> ForkedProcess | None:
        """A process of `python -m runtime.child spec` forked from the template, or None when
        the template cannot serve (start it the ordinary way)."""
        if self.ready is None or self.unusable:
            return None
        try:
            why = await asyncio.wait_for(asyncio.shield(self.ready), READY_TIMEOUT_S)
        except TimeoutError:
            self._unusable(f"its imports took more than {READY_TIMEOUT_S:g} s")
            return None
        if why or self.unusable or self.sock is None:
            return None
        n = next(self._ids)
        message = json.dumps({"id": n, "spec": str(spec), "env": env, "cwd": cwd}).encode()
        if len(message) > MAX_MESSAGE:  # an environment of megabytes: this one starts anew
            return None
        reply: asyncio.Future[ForkedProcess] = asyncio.get_running_loop().create_future()
        self._pending[n] = reply
        try:
            socket.send_fds(self.sock, [message], [log_fd])
            return await asyncio.wait_for(reply, FORK_TIMEOUT_S)
        except (OSError, TimeoutError, RuntimeError) as e:
            self._unusable(f"a fork failed: {e}")
            return None
        finally:
            self._pending.pop(n, None)

    def _readable(self) -> None:
        assert self.sock is not None
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError as e:
                self._lost(f"its socket failed: {e}")
                return
            if not data:
                code = self.proc.returncode if self.proc is not None else None
                self._lost("it exited" + (f" with code {code}" if code is not None else ""))
                return
            self._message(json.loads(data))

    def _message(self, m: dict) -> None:
        assert self.ready is not None
        if "ready" in m or "unfit" in m:
            why = m.get("unfit", "")
            if why:
                self._unusable(why)
            if not self.ready.done():
                self.ready.set_result(why)
        elif "exited" in m:
            proc = self.forked.pop(m["exited"], None)
            if proc is not None:
                proc.exited(m["code"])
        elif "pid" in m:
            proc = self.forked[m["pid"]] = ForkedProcess(m["pid"])
            reply = self._pending.get(m["id"])
            if reply is not None and not reply.done():
                reply.set_result(proc)
        elif "error" in m:
            reply = self._pending.get(m.get("id"))
            if reply is not None and not reply.done():
                reply.set_exception(RuntimeError(m["error"]))

    def _unusable(self, why: str) -> None:
        if not self.unusable:
            self.unusable = why
            self.say(f"{self.label} ({', '.join(self.classes)}): {why}; its processes start "
                     f"the ordinary way (log: {self.log_path})")
        if self.ready is not None and not self.ready.done():
            self.ready.set_result(why)

    def _lost(self, why: str) -> None:
        """The template is gone: no more forks; each of its processes, ending with it, is
        reported once it has gone."""
        self._close_socket()
        self._unusable(why)
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(RuntimeError(why))
        forked, self.forked = self.forked, {}
        self._watchers += [asyncio.ensure_future(self._outlive(p)) for p in forked.values()]

    @staticmethod
    async def _outlive(proc: ForkedProcess) -> None:
        while not _gone(proc.pid):
            await asyncio.sleep(0.1)
        proc.exited(LOST_CODE)

    def _close_socket(self) -> None:
        if self.sock is not None:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    async def close(self, term_timeout_s: float = 5.0) -> None:
        """Stop the template (its processes were stopped before: the run's end)."""
        self._close_socket()  # it sees the end of its socket and exits
        if self.proc is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), 2.0)
            await terminate(self.proc, term_timeout_s)
        for task in self._watchers:
            task.cancel()
        if self.ready is not None and not self.ready.done():
            self.ready.set_result("closed")


def template_key(python: str, env: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """Processes share a template when they run the same python with the same `env` table."""
    return python or sys.executable, tuple(sorted(env.items()))


def template_groups(cfg: ClusterConfig) -> list[tuple[tuple, list[str]]]:
    """The templates a run starts (`[run] preload`), in order: (template_key, the processes
    forked from it) for each python and `env` that two or more processes of the launcher's
    host (a host without `exec`) share."""
    if not cfg.run.preload:
        return []
    shared: dict[tuple, list[str]] = {}
    for name, entry in processes(cfg).items():
        host = next(h for h in cfg.hosts if h.name == (entry.host or cfg.hosts[0].name))
        if not host.exec:
            shared.setdefault(template_key(host.python, entry.env), []).append(name)
    return [(key, names) for key, names in sorted(shared.items()) if len(names) >= 2]
