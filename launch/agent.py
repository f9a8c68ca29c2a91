"""`python -m launch.agent`: the launcher's hands on one remote host.

The launcher starts one agent per remote `[[hosts]]` entry through that host's `exec` prefix
(`["ssh", "-o", "BatchMode=yes", "node2"]`, `["srun", "--nodes=1", "--ntasks=1", "-w",
"node2"]`, `["ip", "netns", "exec", "ns2"]`, ...). The agent starts that host's actor processes
(`python -m runtime.child SPEC.json`), streams their output back, reports their exits and signals
them on request; everything else (READY waits, restart budgets, the Shutdown message, heartbeat
deadlines, exit records) stays in the launcher's supervisor, so a remote actor is supervised by
exactly the rules of a local one.

The channel is the exec'd process's stdin (launcher -> agent) and stdout (agent -> launcher):
frames of a 4-byte big-endian length and one msgpack message (`ChannelMsg`, below). Its stderr is
the agent's own log (the launcher writes it to `logs/<host>/agent.log`). The exchange:

    agent    -> AgentHello(pid, report)    the code and environment there (`environment_report`)
    launcher -> Init(...)                  after comparing the report with its own (`compare`);
                                           carries the run's CURVE keys (never on a command line)
    launcher -> Start(actor, seq, spec)    agent -> Started(pid) | StartFailed(error)
    agent    -> Log(actor, data)           the actor's stdout and stderr, as they come
    agent    -> Exited(actor, seq, code)   after the last Log of that process
    launcher -> Signal(actor, seq, sig)    SIGTERM / SIGKILL escalation, heartbeat kills
    launcher -> PickPort(seq, address)     agent -> PortPicked(port) | a free port there, for a
                                           server an actor binds (a trainer's TCP store)
    launcher -> Probe(seq, address, ...)   agent -> Probed(port, errors): before any actor starts,
                                           the host's address binds there, the launcher's
                                           sockets are reached from there (and the address from
                                           the launcher), the fixed ports are free
    both     -> Beat()                     every heartbeat_interval_s
    launcher -> Bye(reason)                the run ended: stop what is left, remove the keys, exit

Invariants:
- The agent dies with its launcher: end of stdin, or no message for `heartbeat_timeout_s`, sends
  SIGTERM to every actor process and exits at once, so its actors see their parent gone (as
  under a dead local launcher: they stop without waiting on reports, hard exit within 4 s).
- Keys arrive in `Init` over stdin and are written into a private folder (0700, secret files
  0600) on the agent's host, removed when the agent exits; actor specs point at that folder.
- A restarted agent (after a lost host) waits until the processes of an actor from the previous
  agent are gone before it starts that actor again, so the new one can bind the same ports.
- The agent imports the standard library, msgspec and psutil only, so `--check` reports a host
  whose environment lacks the heavy packages instead of failing to import.

`python -m launch.agent --needs JSON` (what `--dry-run` runs through a host's exec prefix,
launch/dryrun.py) prints, as one JSON line, which of the given modules do not import there (in
the given interpreters), which programs are not on PATH, and whether the host's address binds.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Union

import msgspec
import psutil

from runtime.procs import ReportedProcess
from transport.addresses import bind_advice, connect_advice, probe_bind
from transport.errors import RlxError

ROOT = Path(__file__).resolve().parent.parent  # the project's folder
PACKAGE = "rlx"
# the project's top-level packages (pyproject.toml), and its tests (actors of the test suite)
PROJECT_PACKAGES = ("actors", "algos", "backends", "bench", "engine", "envs", "examples",
                    "launch", "logic", "memory", "models", "runtime", "scripts", "training",
                    "transport", "tests")
# packages whose version must agree across hosts (they shape what crosses the wire)
WIRE_PACKAGES = ("msgspec", "pyzmq")
MAX_FRAME = 256 << 20  # a channel frame larger than this is a broken channel
LOG_CHUNK = 1 << 16
LEFTOVER_WAIT_S = 15.0  # a restarted agent waits this long for a previous agent's actor to exit


# ----------------------------------------------------------------------------- the report
def code_digests(root: Path = ROOT) -> dict[str, str]:
    """`relative/path.py` -> short sha256 of its bytes, for every .py file of the project's
    packages under `root`; a difference names the file."""
    out: dict[str, str] = {}
    for pkg in (root / name for name in PROJECT_PACKAGES):
        if not (pkg / "__init__.py").is_file():
            continue
        for path in sorted(pkg.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            try:
                out[str(path.relative_to(root))] = hashlib.sha256(
                    path.read_bytes()).hexdigest()[:16]
            except OSError:
                continue
    return out


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _requirements() -> list[str]:
    """The project's dependency names (from its installed metadata)."""
    try:
        reqs = importlib.metadata.requires(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return list(WIRE_PACKAGES)
    names = []
    for req in reqs:
        if "extra ==" in req:
            continue
        name = req.split(";")[0].strip()
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        if name:
            names.append(name.lower())
    return sorted(set(names) | set(WIRE_PACKAGES))


def environment_report(root: Path = ROOT) -> dict[str, Any]:
    """What must match across hosts: the interpreter, the project's version and files, and the
    versions of its dependencies (read from metadata, nothing is imported)."""
    return {"hostname": socket.gethostname(), "executable": sys.executable,
            "python": platform.python_version(), "workdir": str(root),
            "version": _dist_version(PACKAGE),
            "packages": {name: _dist_version(name) for name in _requirements()},
            "files": code_digests(root)}


def compare(local: dict[str, Any], remote: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(differences that stop the run, differences that are only said) between the launcher's
    report and a host's. Errors: the Python minor version, the project's version, any project
    file, a wire package (msgspec, pyzmq), a dependency missing there. Notes: other dependency
    versions (e.g. a CUDA build of torch against a CPU build)."""
    errors: list[str] = []
    notes: list[str] = []
    lpy, rpy = local["python"], remote.get("python", "?")
    if lpy.split(".")[:2] != str(rpy).split(".")[:2]:
        errors.append(f"Python {rpy} there, {lpy} here")
    elif lpy != rpy:
        notes.append(f"Python {rpy} there, {lpy} here")
    if local.get("version") != remote.get("version"):
        errors.append(f"{PACKAGE} {remote.get('version') or '(not installed)'} there, "
                      f"{local.get('version') or '(not installed)'} here")
    rpk = remote.get("packages", {})
    for name, version in sorted(local.get("packages", {}).items()):
        there = rpk.get(name, "")
        if not version or there == version:
            continue
        text = f"{name} {there or '(not installed)'} there, {version} here"
        (errors if name in WIRE_PACKAGES or not there else notes).append(text)
    lf, rf = local.get("files", {}), remote.get("files", {})
    changed = sorted(p for p in lf if p in rf and lf[p] != rf[p])
    missing = sorted(p for p in lf if p not in rf)
    extra = sorted(p for p in rf if p not in lf)
    for what, paths in (("files that differ", changed), ("files missing there", missing),
                        ("files only there", extra)):
        if paths:
            shown = ", ".join(paths[:8]) + (f" (and {len(paths) - 8} more)" if len(paths) > 8
                                            else "")
            errors.append(f"{what}: {shown}")
    return errors, notes


# ----------------------------------------------------------------------------- the channel
class ChannelMsg(msgspec.Struct, tag=True, kw_only=True):
    """Base of the messages on the launcher <-> agent channel."""


class AgentHello(ChannelMsg):
    pid: int
    report: dict[str, Any]


class Init(ChannelMsg):
    host: str  # the [[hosts]] name of this agent's host
    run_dir: str  # the run directory's path (made on this host when missing)
    python: str  # interpreter of the actor processes
    keys: dict[str, bytes] = {}  # CURVE key files by name (server.key, server.key_secret, ...)
    python_path: list[str] = []  # extra PYTHONPATH entries of every actor ([run] python_path)
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    term_timeout_s: float = 5.0


class Start(ChannelMsg):
    actor: str
    seq: int  # this launcher's start number of the process (answers and signals carry it)
    spec: bytes  # the runtime.child spec (JSON)
    env: dict[str, str] = {}


class Started(ChannelMsg):
    actor: str
    seq: int
    pid: int


class StartFailed(ChannelMsg):
    actor: str
    seq: int
    error: str


class Signal(ChannelMsg):
    actor: str
    seq: int
    signal: int


class PickPort(ChannelMsg):
    seq: int
    address: str  # the address the port is bound on there


class PortPicked(ChannelMsg):
    seq: int
    port: int = 0  # 0: none, `error` says why
    error: str = ""


class Probe(ChannelMsg):
    """Can this host serve the run? Its `address` is bound (port 0) and listened on for
    `timeout_s` (the launcher connects to it), every `connect` target (host:port, the
    launcher's sockets) is connected to, and every fixed port (`ports`: [address, port,
    the field that binds it]) is bound once."""

    seq: int
    address: str
    connect: list[str] = []
    ports: list[tuple[str, int, str]] = []
    timeout_s: float = 5.0


class Probed(ChannelMsg):
    seq: int
    port: int = 0  # where it listens on the address (0: it could not bind it)
    # one (kind, line) each; kind: "address" (it does not bind there), "connect" (the
    # launcher's sockets are not reached from there), "port" (a fixed port is taken there)
    errors: list[tuple[str, str]] = []


class Exited(ChannelMsg):
    actor: str
    seq: int
    code: int


class Log(ChannelMsg):
    actor: str
    data: bytes


class Beat(ChannelMsg):
    pass


class Bye(ChannelMsg):
    reason: str = ""


AnyMsg = Union[AgentHello, Init, Start, Started, StartFailed, Signal, PickPort, PortPicked,
               Probe, Probed, Exited, Log, Beat, Bye]


class ChannelClosed(RlxError):
    """The other end of the channel is gone (end of stream) or sent a broken frame."""


class Channel:
    """Length-prefixed msgpack messages over a pair of asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(AnyMsg)

    async def send(self, msg: ChannelMsg) -> None:
        data = self._enc.encode(msg)
        try:
            self.writer.write(struct.pack(">I", len(data)) + data)
            await self.writer.drain()
        except (ConnectionError, RuntimeError) as e:  # closed pipe / transport
            raise ChannelClosed(f"cannot send: {e}") from None

    async def recv(self) -> ChannelMsg:
        try:
            (size,) = struct.unpack(">I", await self.reader.readexactly(4))
            if size > MAX_FRAME:
                raise ChannelClosed(f"frame of {size} bytes (limit {MAX_FRAME})")
            return self._dec.decode(await self.reader.readexactly(size))
        except asyncio.IncompleteReadError:
            raise ChannelClosed("end of stream") from None
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ChannelClosed(f"undecodable frame: {e}") from None
        except ConnectionError as e:
            raise ChannelClosed(str(e)) from None


# ----------------------------------------------------------------------------- the agent
class Child:
    def __init__(self, seq: int, proc: asyncio.subprocess.Process):
        self.seq, self.proc = seq, proc


def _owner_alive(folder: Path) -> bool:
    """Whether the agent that last claimed `folder` (its OWNER file: pid and start time) runs."""
    try:
        pid, started = (folder / "OWNER").read_text().split()
        return abs(psutil.Process(int(pid)).create_time() - float(started)) < 1.0
    except (OSError, ValueError, psutil.Error):
        return False


def remove_abandoned(base: Path) -> list[Path]:
    """This user's agent folders whose agent is gone without removing it (killed: SIGKILL, a
    lost node): removed, so the keys of finished runs do not stay on the host. A folder
    claimed less than a minute ago without an owner yet is left alone."""
    removed = []
    for folder in base.glob(f"rlx-agent-{os.getuid()}-*"):
        try:
            st = folder.lstat()
        except OSError:
            continue
        if (st.st_uid != os.getuid() or folder.is_symlink() or not folder.is_dir()
                or time.time() - st.st_mtime < 60 and not (folder / "OWNER").exists()):
            continue
        if not _owner_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def agent_folder(run_dir: str, host: str) -> Path:
    """Where the agent of `host` for the run in `run_dir` keeps its specs and keys."""
    token = hashlib.sha256(f"{run_dir}\0{host}".encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"rlx-agent-{os.getuid()}-{token}"


def private_dir(run_dir: str, host: str) -> Path:
    """This run's folder of the agent on its host (specs, keys): the same path for a restarted
    agent of the same run, under the temp folder, owned by this user, 0700, claimed by this
    process (OWNER). Folders of agents that died without removing theirs are removed first."""
    path = agent_folder(run_dir, host)
    remove_abandoned(path.parent)
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if st.st_uid != os.getuid() or not path.is_dir() or path.is_symlink():
        raise RuntimeError(f"{path} exists and is not this user's own folder")
    os.chmod(path, 0o700)
    me = psutil.Process()
    (path / "OWNER").write_text(f"{me.pid} {me.create_time()}")
    return path


def write_keys(folder: Path, keys: dict[str, bytes]) -> None:
    """The key files into `folder` (0700): secret files 0600, created that way (never
    readable by others, not even briefly), public ones 0644."""
    folder.mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    for name, data in keys.items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad key file name {name!r}")
        mode = 0o600 if name.endswith("_secret") else 0o644
        path = folder / name
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(path, mode)


IMPORTABLE = """import importlib.util, json, sys
def found(m):
    try:
        return importlib.util.find_spec(m) is not None
    except (ImportError, ValueError):
        return False
print(json.dumps([m for m in json.loads(sys.argv[1]) if not found(m)]))
"""


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken one
        return False


def check_needs(spec: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    """What this host lacks of what its actors run (`--dry-run`, launch/dryrun.py). `spec`:
    {"modules": {python: [module, ...]}, "programs": [...], "address": "..."}: each module must
    import in that interpreter ("" = this one; another is asked in a subprocess), each program
    be on PATH, the address bind (port 0). Returns {"hostname", "python", "missing": {python:
    [module, ...]}, "programs": [missing ...], "broken": {python: why it could not be asked},
    "address": "" or why it does not bind}."""
    out: dict[str, Any] = {"hostname": socket.gethostname(), "python": sys.executable,
                           "missing": {}, "programs": [], "broken": {}, "address": ""}
    for python, modules in spec.get("modules", {}).items():
        if not python or python == sys.executable:
            missing = [m for m in modules if not _importable(m)]
        else:
            try:
                done = subprocess.run([python, "-c", IMPORTABLE, json.dumps(modules)],
                                      capture_output=True, text=True, timeout=timeout_s)
                missing = json.loads(done.stdout) if done.returncode == 0 else None
                if missing is None:
                    why = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    out["broken"][python] = f"it exited with code {done.returncode}: {why}"
                    continue
            except (OSError, subprocess.SubprocessError, ValueError) as e:
                out["broken"][python] = f"it cannot be run: {e}"
                continue
        if missing:
            out["missing"][python] = missing
    out["programs"] = [p for p in spec.get("programs", []) if shutil.which(p) is None]
    if spec.get("address"):
        out["address"] = probe_bind(spec["address"], 0)
    return out


def pick_port(msg: PickPort) -> PortPicked:
    """A TCP port free right now on `msg.address` of this host (the kernel's pick)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in msg.address else socket.AF_INET) as s:
            s.bind((msg.address, 0))
            return PortPicked(seq=msg.seq, port=s.getsockname()[1])
    except OSError as e:
        return PortPicked(seq=msg.seq, error=f"cannot bind {msg.address}: {e}")


async def _hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


def _leftovers(spec_path: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if spec_path in cmd and "runtime.child" in cmd and p.pid != os.getpid():
            out.append(p)
    return out


class Agent:
    def __init__(self, chan: Channel, say: Callable[[str], None]):
        self.chan, self.say = chan, say
        self.init: Init | None = None
        self.children: dict[str, Child] = {}
        self.last_heard = time.monotonic()
        self.folder: Path | None = None
        self.tasks: set[asyncio.Task] = set()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def run(self) -> int:
        """Serve the launcher until Bye (0) or until it is gone (3)."""
        await self.chan.send(AgentHello(pid=os.getpid(), report=environment_report()))
        try:
            first = await self.chan.recv()
        except ChannelClosed as e:
            self.say(f"launcher gone before Init ({e})")
            return 3
        if not isinstance(first, Init):
            self.say(f"launcher sent {type(first).__name__} instead of Init: exiting")
            return 0
        self.init = first
        self.folder = private_dir(first.run_dir, first.host)
        if first.keys:
            write_keys(self.folder / "keys", first.keys)
        Path(first.run_dir).mkdir(parents=True, exist_ok=True)
        self.say(f"agent of host {first.host} (pid {os.getpid()}) serving run {first.run_dir}")
        beats = self._spawn(self._beat())
        reader = self._spawn(self._read())
        watchdog = self._spawn(self._watchdog())
        done, _ = await asyncio.wait({reader, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        beats.cancel()
        why = next(iter(done)).result()
        if why == "bye":
            await self._stop_children()
            self._cleanup()
            return 0
        self.say(f"launcher gone ({why}): SIGTERM to every actor, exiting")
        self._signal_all(signal.SIGTERM)
        self._cleanup()
        return 3

    async def _read(self) -> str:
        while True:
            try:
                msg = await self.chan.recv()
            except ChannelClosed as e:
                return str(e)
            self.last_heard = time.monotonic()
            if isinstance(msg, Start):
                self._spawn(self._start(msg))
            elif isinstance(msg, Signal):
                child = self.children.get(msg.actor)
                if child is not None and child.seq == msg.seq and child.proc.returncode is None:
                    try:
                        os.kill(child.proc.pid, msg.signal)
                    except ProcessLookupError:
                        pass
            elif isinstance(msg, PickPort):
                self._spawn(self._answer(pick_port(msg)))
            elif isinstance(msg, Probe):
                self._spawn(self._probe(msg))
            elif isinstance(msg, Bye):
                self.say(f"launcher says bye ({msg.reason})")
                return "bye"

    async def _answer(self, msg: ChannelMsg) -> None:
        try:
            await self.chan.send(msg)
        except ChannelClosed:
            pass  # the reader notices the lost launcher

    async def _probe(self, msg: Probe) -> None:
        """Answer a Probe: listen on the host's address while the launcher connects, reach
        the launcher's sockets, try the fixed ports."""
        errors, server, port = [], None, 0
        try:  # one socket of the address's family (as ZMQ binds it), not one per resolution
            listener = socket.socket(socket.AF_INET6 if ":" in msg.address else socket.AF_INET)
            try:
                listener.bind((msg.address, 0))
                listener.listen()
            except OSError:
                listener.close()
                raise
            server = await asyncio.start_server(_hang_up, sock=listener)
            port = listener.getsockname()[1]
        except socket.gaierror as e:
            errors.append(("address", f"its address {msg.address} does not resolve there "
                                      f"({e.strerror})"))
        except OSError as e:
            why = bind_advice(e.errno, msg.address, 0, "that host") if e.errno else str(e)
            errors.append(("address", f"cannot bind its address {msg.address} (port 0) there: "
                                      f"{why}"))
        for target in msg.connect:
            address, _, target_port = target.rpartition(":")
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(
                    address.strip("[]"), int(target_port)), msg.timeout_s)
                writer.close()
            except (OSError, TimeoutError) as e:
                errors.append(("connect", f"cannot reach the launcher at {target} from there: "
                                          f"{connect_advice(e)}"))
        for address, fixed, field in msg.ports:
            why = probe_bind(address, fixed)
            if why:
                errors.append(("port", f"{field} = {fixed} cannot be bound on {address} there: "
                                       f"{why}"))
        await self._answer(Probed(seq=msg.seq, port=port, errors=errors))
        if server is not None:  # the launcher connects now; then the socket goes
            await asyncio.sleep(msg.timeout_s + 1.0)
            server.close()

    async def _beat(self) -> None:
        assert self.init is not None
        while True:
            await asyncio.sleep(self.init.heartbeat_interval_s)
            try:
                await self.chan.send(Beat())
            except ChannelClosed:
                return

    async def _watchdog(self) -> str:
        assert self.init is not None
        timeout_s = self.init.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            silent = time.monotonic() - self.last_heard
            if silent > timeout_s:
                return f"no message for {silent:.0f} s (heartbeat_timeout_s = {timeout_s:g})"

    async def _start(self, msg: Start) -> None:
        assert self.init is not None and self.folder is not None
        old = self.children.get(msg.actor)
        if old is not None and old.proc.returncode is None:
            await self.chan.send(StartFailed(actor=msg.actor, seq=msg.seq, error=(
                f"{msg.actor} is still running on this host (pid {old.proc.pid})")))
            return
        try:
            spec_path = self._write_spec(msg)
            await self._wait_leftovers(spec_path, msg.actor)
            env = {**os.environ, **msg.env, "PYTHONUNBUFFERED": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [
                       str(ROOT), *self.init.python_path, os.environ.get("PYTHONPATH")]))}
            proc = await asyncio.create_subprocess_exec(
                self.init.python, "-m", "runtime.child", spec_path, env=env,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        except (OSError, ValueError, RuntimeError) as e:
            await self.chan.send(StartFailed(actor=msg.actor, seq=msg.seq,
                                             error=f"{type(e).__name__}: {e}"))
            return
        child = self.children[msg.actor] = Child(msg.seq, proc)
        await self.chan.send(Started(actor=msg.actor, seq=msg.seq, pid=proc.pid))
        self._spawn(self._pump(msg.actor, child))

    def _write_spec(self, msg: Start) -> str:
        assert self.folder is not None
        spec = json.loads(msg.spec)
        security = spec.get("context", {}).get("security")
        if isinstance(security, dict) and security.get("curve"):
            security["keys_dir"] = str(self.folder / "keys")
        path = self.folder / "specs" / f"{msg.actor}.json"
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec, indent=2))
        os.replace(tmp, path)
        return str(path)

    async def _wait_leftovers(self, spec_path: str, actor: str) -> None:
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        while (left := _leftovers(spec_path)) and time.monotonic() < deadline:
            self.say(f"{actor}: waiting for pid {', '.join(str(p.pid) for p in left)} of a "
                     f"previous agent to exit")
            await asyncio.sleep(0.2)

    async def _pump(self, actor: str, child: Child) -> None:
        """The process's output to the launcher, then its exit code."""
        assert child.proc.stdout is not None
        while True:
            data = await child.proc.stdout.read(LOG_CHUNK)
            if not data:
                break
            try:
                await self.chan.send(Log(actor=actor, data=data))
            except ChannelClosed:
                pass  # keep draining, so the process never blocks on a full pipe
        code = await child.proc.wait()
        try:
            await self.chan.send(Exited(actor=actor, seq=child.seq, code=code))
        except ChannelClosed:
            pass

    def _signal_all(self, sig: int) -> None:
        for child in self.children.values():
            if child.proc.returncode is None:
                try:
                    os.kill(child.proc.pid, sig)
                except ProcessLookupError:
                    pass

    async def _stop_children(self) -> None:
        """After Bye: what is still running gets SIGTERM, then SIGKILL."""
        alive = [c.proc for c in self.children.values() if c.proc.returncode is None]
        if not alive:
            return
        self._signal_all(signal.SIGTERM)
        term_s = self.init.term_timeout_s if self.init else 5.0
        _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in alive],
                                        timeout=term_s)
        self._signal_all(signal.SIGKILL)
        if pending:
            await asyncio.wait(pending, timeout=5.0)

    def _cleanup(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


# ----------------------------------------------------------------------------- launcher side
LOST_CODE = 255  # the exit code recorded for an actor whose host was lost


class AgentError(RlxError):
    """An agent could not be started, or its host's environment differs from the launcher's."""


def agent_command(exec_prefix: list[str], python: str, workdir: str,
                  shell: bool | None = None, needs: str = "") -> list[str]:
    """`exec_prefix` + the words that start the agent in `workdir` with `python` (with `needs`,
    a JSON spec of `check_needs`: the words that run that one check there instead). A prefix
    that hands its command to a shell (ssh; `shell = True`) gets them as one quoted line."""
    words = ["sh", "-c", 'cd "$0" && exec "$1" -m launch.agent', workdir, python]
    if needs:
        words = ["sh", "-c", 'cd "$0" && exec "$1" -m launch.agent --needs "$2"', workdir,
                 python, needs]
    if shell is None:
        shell = bool(exec_prefix) and os.path.basename(exec_prefix[0]) == "ssh"
    return [*exec_prefix, shlex.join(words)] if shell else [*exec_prefix, *words]


class RemoteProcess(ReportedProcess):
    """An actor process on a remote host, as the supervisor sees a local one (signals go
    through the agent)."""

    def __init__(self, link: AgentLink, actor: str, seq: int, pid: int):
        super().__init__(pid)
        self.link, self.actor, self.seq = link, actor, seq
        self.lost = ""  # why the host was lost, when that ended the process

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.link.signal(self.actor, self.seq, sig)

    def exited(self, code: int, lost: str = "") -> None:
        if self.returncode is None:
            self.lost = lost
        super().exited(code)


async def terminate_remote(proc: RemoteProcess, term_timeout_s: float) -> str:
    """runtime.procs.terminate for a remote process: SIGTERM, then SIGKILL past
    `term_timeout_s`; "exited", "sigterm" or "sigkill"."""
    if proc.returncode is not None:
        return "exited"
    proc.terminate()
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), term_timeout_s)
        return "sigterm"
    except TimeoutError:
        pass
    proc.kill()
    await proc.wait()
    return "sigkill"


class AgentLink:
    """The launcher's end of one host's agent: starts it through the host's exec prefix,
    checks its report, hands it the run (and keys), starts actor processes through it, writes
    their output to their log files, and notices when the host is lost (the agent exits, or
    sends nothing for `heartbeat_timeout_s`): every process of the host then ends with
    LOST_CODE and `on_lost(host, why)` is called once."""

    def __init__(self, host: str, command: list[str], agent_log: Path,
                 on_lost: Callable[[str, str], None], heartbeat_interval_s: float = 1.0,
                 heartbeat_timeout_s: float = 30.0):
        self.host, self.command, self.agent_log = host, command, agent_log
        self.on_lost = on_lost
        self.interval_s, self.timeout_s = heartbeat_interval_s, heartbeat_timeout_s
        self.proc: asyncio.subprocess.Process | None = None
        self.chan: Channel | None = None
        self.report: dict[str, Any] = {}
        self.agent_pid = 0
        self.lost = ""
        self.closing = False
        self.last_heard = time.monotonic()
        self._seq = 0
        self._procs: dict[str, RemoteProcess] = {}  # actor -> its current process
        self._starting: dict[tuple[str, int], asyncio.Future] = {}
        self._logs: dict[str, Any] = {}  # actor -> open log file
        self._log_paths: dict[str, Path] = {}
        self._tasks: list[asyncio.Task] = []

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self.lost

    async def open(self, timeout_s: float) -> dict[str, Any]:
        """Start the agent and read its hello; returns its environment report. AgentError
        (with the agent's stderr) when it does not start or say hello within `timeout_s`."""
        self.agent_log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.agent_log, "ab") as logf:
            logf.write(f"=== agent at {time.ctime()}: {shlex.join(self.command)}\n".encode())
            logf.flush()
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *self.command, stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, stderr=logf, start_new_session=True,
                    limit=MAX_FRAME)
            except OSError as e:
                raise AgentError(f"host {self.host}: cannot run {shlex.join(self.command)}: "
                                 f"{e}") from None
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.chan = Channel(self.proc.stdout, self.proc.stdin)
        try:
            hello = await asyncio.wait_for(self.chan.recv(), timeout_s)
        except (ChannelClosed, TimeoutError) as e:
            why = (f"no hello within {timeout_s:g} s" if isinstance(e, TimeoutError)
                   else f"exited with code {await self._exit_code()}")
            await self.kill()
            raise AgentError(f"host {self.host}: the agent ({shlex.join(self.command)}) {why}; "
                             f"its stderr ({self.agent_log}):\n{self.stderr_tail()}") from None
        if not isinstance(hello, AgentHello):
            await self.kill()
            raise AgentError(f"host {self.host}: the agent sent {type(hello).__name__} first")
        self.report, self.agent_pid = hello.report, hello.pid
        return self.report

    def stderr_tail(self, lines: int = 12) -> str:
        try:
            text = self.agent_log.read_bytes()[-16384:].decode(errors="replace")
        except OSError:
            return "  | (no log)"
        return "\n".join(f"  | {line}" for line in text.splitlines()[-lines:])

    async def _exit_code(self, timeout_s: float = 3.0) -> int | None:
        assert self.proc is not None
        try:
            return await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout_s)
        except TimeoutError:
            return None

    async def init(self, msg: Init) -> None:
        """Hand the agent the run; from here on it is heart-beaten and read."""
        assert self.chan is not None
        await self.chan.send(msg)
        self.last_heard = time.monotonic()
        self._tasks += [asyncio.ensure_future(self._read()),
                        asyncio.ensure_future(self._beat())]

    async def start(self, actor: str, spec: bytes, env: dict[str, str], log_path: Path,
                    timeout_s: float = 60.0) -> RemoteProcess:
        """Start one actor process there; its output is appended to `log_path`."""
        seq = self._next_seq()
        self._open_log(actor, log_path)
        pid = await self._ask((actor, seq), Start(actor=actor, seq=seq, spec=spec, env=env),
                              timeout_s, f"did not start {actor}")
        proc = self._procs[actor] = RemoteProcess(self, actor, seq, pid)
        return proc

    async def pick_port(self, address: str, timeout_s: float = 30.0) -> int:
        """A port free now on `address` of this host (its agent asks the kernel there)."""
        seq = self._next_seq()
        return await self._ask(("", seq), PickPort(seq=seq, address=address), timeout_s,
                               "picked no port")  # no actor: a port's answer

    async def probe(self, address: str, connect: list[str],
                    ports: list[tuple[str, int, str]], timeout_s: float = 5.0
                    ) -> list[tuple[str, str]]:
        """Whether this host can serve the run (see Probe): its answers, then the launcher's
        own connect to the host's address (kind "reach"); (kind, line) per problem."""
        seq = self._next_seq()
        answer = await self._ask(("", seq), Probe(seq=seq, address=address, connect=connect,
                                                  ports=ports, timeout_s=timeout_s),
                                 timeout_s * (len(connect) + 2) + 10.0, "did not answer a probe")
        errors = [tuple(e) for e in answer.errors]
        if answer.port:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(
                    address, answer.port, family=socket.AF_INET6 if ":" in address
                    else socket.AF_INET), timeout_s)
                writer.close()
            except (OSError, TimeoutError) as e:
                errors.append(("reach", f"the launcher cannot reach {address}:{answer.port} "
                                        f"there: {connect_advice(e)}"))
        return errors

    def _next_seq(self) -> int:
        """The next request number; AgentError when the agent is gone."""
        if not self.alive or self.chan is None:
            raise AgentError(f"host {self.host}: its agent is gone ({self.lost or 'exited'})")
        self._seq += 1
        return self._seq

    async def _ask(self, key: tuple[str, int], msg: Any, timeout_s: float, late: str) -> Any:
        """Send `msg` and wait for the answer filed under `key`: AgentError when the channel
        breaks or nothing comes within `timeout_s` (`late`: what the agent then did not do)."""
        fut = self._starting[key] = asyncio.get_running_loop().create_future()
        try:
            await self.chan.send(msg)
            return await asyncio.wait_for(fut, timeout_s)
        except ChannelClosed as e:
            raise AgentError(f"host {self.host}: cannot reach its agent ({e})") from None
        except TimeoutError:
            raise AgentError(f"host {self.host}: its agent {late} within {timeout_s:g} s") \
                from None
        finally:
            self._starting.pop(key, None)

    def signal(self, actor: str, seq: int, sig: int) -> None:
        if self.alive and self.chan is not None:
            self._tasks.append(asyncio.ensure_future(self._send_quietly(
                Signal(actor=actor, seq=seq, signal=sig))))

    async def _send_quietly(self, msg: ChannelMsg) -> None:
        try:
            assert self.chan is not None
            await self.chan.send(msg)
        except ChannelClosed:
            pass  # the reader notices the lost agent

    def _open_log(self, actor: str, path: Path) -> None:
        if self._log_paths.get(actor) != path:
            if actor in self._logs:
                self._logs.pop(actor).close()
            path.parent.mkdir(parents=True, exist_ok=True)
            self._logs[actor] = open(path, "ab")
            self._log_paths[actor] = path

    async def _read(self) -> None:
        assert self.chan is not None
        while True:
            try:
                msg = await self.chan.recv()
            except ChannelClosed as e:
                if not self.closing:
                    code = await self._exit_code()
                    why = (f"its agent exited with code {code}" if code is not None
                           else f"its agent's channel closed ({e})")
                    self._lose(why)
                return
            self.last_heard = time.monotonic()
            if isinstance(msg, Log):
                f = self._logs.get(msg.actor)
                if f is not None:
                    f.write(msg.data)
                    f.flush()
            elif isinstance(msg, Exited):
                proc = self._procs.get(msg.actor)
                if proc is not None and proc.seq == msg.seq:
                    proc.exited(msg.code)
            elif isinstance(msg, Probed):
                fut = self._starting.get(("", msg.seq))
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, PortPicked):
                fut = self._starting.get(("", msg.seq))
                if fut is not None and not fut.done():
                    if msg.port:
                        fut.set_result(msg.port)
                    else:
                        fut.set_exception(AgentError(f"host {self.host}: {msg.error}"))
            elif isinstance(msg, (Started, StartFailed)):
                fut = self._starting.get((msg.actor, msg.seq))
                if fut is not None and not fut.done():
                    if isinstance(msg, Started):
                        fut.set_result(msg.pid)
                    else:
                        fut.set_exception(AgentError(
                            f"host {self.host}: could not start {msg.actor}: {msg.error}"))

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            silent = time.monotonic() - self.last_heard
            if silent > self.timeout_s:
                self._lose(f"no heartbeat from its agent for {silent:.0f} s "
                           f"(heartbeat_timeout_s = {self.timeout_s:g})")
                await self.kill()
                return
            await self._send_quietly(Beat())

    def _lose(self, why: str) -> None:
        if self.lost or self.closing:
            return
        self.lost = why
        for fut in self._starting.values():
            if not fut.done():
                fut.set_exception(AgentError(f"host {self.host} lost: {why}"))
        for proc in self._procs.values():
            proc.exited(LOST_CODE, f"host {self.host} lost: {why}")
        self.on_lost(self.host, why)

    async def kill(self) -> None:
        """End the agent's local process (the exec prefix: ssh, srun, ...) and its group."""
        if self.proc is None or self.proc.returncode is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            if await self._exit_code(3.0) is not None:
                return

    async def close(self, reason: str = "run ended", timeout_s: float = 10.0) -> None:
        """Bye to the agent (it stops what is left and exits), then stop reading."""
        self.closing = True
        if self.proc is not None and self.proc.returncode is None and self.chan is not None:
            try:
                await self.chan.send(Bye(reason=reason))
            except ChannelClosed:
                pass
            if await self._exit_code(timeout_s) is None:
                await self.kill()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for f in self._logs.values():
            f.close()
        self._logs = {}
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()

    def summary(self) -> dict[str, Any]:
        return {"agent_pid": self.agent_pid, "command": self.command,
                "exit_code": self.proc.returncode if self.proc is not None else None,
                "lost": self.lost or None}


def _channel_streams() -> tuple[int, int]:
    """The channel's fds (dups of stdin/stdout, not inherited by children); fd 0 becomes
    /dev/null and fd 1 stderr, so a stray print cannot corrupt the channel."""
    chan_in, chan_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return chan_in, chan_out


async def serve_channel(chan_in: int, chan_out: int) -> int:
    """Run the agent on the channel's fds; ends the process (os._exit) with its code."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_FRAME)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                 os.fdopen(chan_in, "rb", buffering=0))
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(chan_out, "wb", buffering=0))
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)

    def say(text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} agent: {text}", file=sys.stderr, flush=True)

    agent = Agent(Channel(reader, writer), say)
    serving = asyncio.ensure_future(agent.run())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not serving.done():  # a signal: as a lost launcher
        say("signalled: SIGTERM to every actor, exiting")
        agent._signal_all(signal.SIGTERM)
        agent._cleanup()
        code = 3
    else:
        code = serving.result()
    # exit here, while the actor processes are still referenced: a garbage-collected asyncio
    # subprocess transport would SIGKILL its process, and the actors must see their parent gone
    # (runtime/child.py) and stop in order instead
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="print this host's environment report (JSON) and exit")
    parser.add_argument("--needs", metavar="JSON",
                        help="print (JSON) what this host lacks of the modules, programs and "
                             "address in JSON (check_needs; `--dry-run` asks it) and exit")
    args = parser.parse_args(argv)
    if args.check:
        print(json.dumps(environment_report(), indent=2))
        return 0
    if args.needs:
        print(json.dumps(check_needs(json.loads(args.needs))))
        return 0
    chan_in, chan_out = _channel_streams()
    return asyncio.run(serve_channel(chan_in, chan_out))  # exits inside (os._exit)


if __name__ == "__main__":
    sys.exit(main())
