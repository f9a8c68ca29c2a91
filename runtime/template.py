"""A pre-imported template that actor processes are forked from: `python -m runtime.template FD
CLASS...` (started by the launcher, launch/preload.py).

Role: an actor process spends most of its start importing (torch, transformers, megatron-core:
2-4 s of CPU each), and every actor of a run, and every restart after a crash, imports the same
modules again. The template imports the actor classes' modules once; each actor is then a fork
of it, which runs `runtime.child.run` exactly as `python -m runtime.child SPEC.json` would, with
the environment, working folder, log (stdout and stderr) and new session the launcher gives it.

Protocol, on the Unix SOCK_SEQPACKET socket inherited as FD (one JSON object per message):
- template -> launcher, once: {"ready": true} after the imports, or {"unfit": why}: an import
  failed, or the imports left the process unsafe to fork (a Python thread, an OS thread beyond
  those numpy's BLAS starts, which re-makes its pool after a fork; CUDA initialised). The
  launcher then starts processes the ordinary way.
- launcher -> template: {"id": n, "spec": path, "env": {...}, "cwd": path}, with the log's file
  descriptor attached (SCM_RIGHTS); answered {"id": n, "pid": pid} or {"id": n, "error": why}.
- template -> launcher: {"exited": pid, "code": c} when a forked process ends (c as asyncio
  reports it: the exit status, or -N for signal N).
Invariant: the template never runs actor code itself, starts no thread and no event loop; it
dies with the launcher (parent-death signal, and the socket's end), and each forked process dies
with the template as a process of `python -m runtime.child` dies with its launcher
(runtime/child.py), so none outlives the launcher. The fork resets what a fresh process would
not share: signal handlers, numpy's global random state (Python's `random` reseeds itself).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import warnings
from typing import Any

from runtime.child import die_with_parent, run

try:  # imported before the environment is replaced: it finds the title's memory through it
    from setproctitle import setproctitle
except ImportError:  # the process keeps the template's command line
    setproctitle = None

MAX_MESSAGE = 1 << 20  # bytes of one request: a spec path, an environment


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def preload(classes: list[str]) -> str:
    """Import the modules of `classes` ("pkg.mod:Name"); "" when the process may fork after
    them, else why not."""
    try:
        import numpy  # noqa: F401  (its BLAS pool: threads that survive a fork by design)
    except ImportError:
        pass
    baseline = _os_threads()
    for dotted in classes:
        module = dotted.partition(":")[0]
        try:
            importlib.import_module(module)
        except BaseException as e:  # an import that fails here fails in the actor too
            return f"importing {module} failed: {type(e).__name__}: {e}"
    if threading.active_count() > 1:
        return f"importing {', '.join(classes)} started a thread ({threading.enumerate()})"
    if _os_threads() > baseline:
        return f"importing {', '.join(classes)} started {_os_threads() - baseline} OS thread(s)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return f"importing {', '.join(classes)} initialised CUDA"
    return ""


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def serve(sock: socket.socket) -> tuple[dict[str, Any], int] | None:
    """Answer fork requests until the launcher closes the socket (None). In a forked process
    it returns that process's request and its log descriptor instead."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the pipe
    try:
        while True:
            readable, _, _ = select.select([sock, wake_r], [], [])
            if wake_r in readable:
                os.read(wake_r, 4096)
                _reap(sock)
            if sock not in readable:
                continue
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
            if not data:
                return None  # the launcher is gone
            request = json.loads(data)
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                _send(sock, {"id": request.get("id"), "error": "no log descriptor attached"})
                continue
            try:
                with warnings.catch_warnings():  # 3.12 warns of numpy's BLAS threads
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
            except OSError as e:
                os.close(fds[0])
                _send(sock, {"id": request["id"], "error": f"fork failed: {e}"})
                continue
            if pid == 0:  # the actor's process
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                sock.close()
                return request, fds[0]
            os.close(fds[0])
            _send(sock, {"id": request["id"], "pid": pid})
    except ConnectionError:  # the launcher is gone
        return None


def _reap(sock: socket.socket) -> None:
    """Every forked process that ended: its exit code to the launcher."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def become(request: dict[str, Any], log_fd: int) -> list[str]:
    """Turn this forked process into the one `python -m runtime.child SPEC` would start: a new
    session, stdin from /dev/null, stdout and stderr to the log, the environment and working
    folder asked for; returns runtime.child's arguments."""
    os.setsid()
    if setproctitle is not None:  # what `ps` shows, and what finds it there: its command
        setproctitle(f"{sys.executable} -m runtime.child {request['spec']}")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # from the OS's entropy, as a fresh process's
    sys.argv = [sys.argv[0], request["spec"]]
    return [request["spec"]]


def main(argv: list[str]) -> int:
    die_with_parent()
    sock = socket.socket(fileno=int(argv[0]))
    why = preload(argv[1:])
    _send(sock, {"unfit": why} if why else {"ready": True})
    if why:
        return 0
    forked = serve(sock)
    if forked is None:
        return 0
    return run(become(*forked))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
