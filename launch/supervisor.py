"""Starts, watches, restarts and stops the actor processes of one run.

Invariants:
- Actors start in dependency order; each must report READY within `ready_timeout_s`, or within
  its own `start_timeout_s` plus `START_MARGIN_S` (the process's start and imports) where that
  is longer: an actor allowed minutes for its on_start (an SGLang server loading) gets them.
- An actor that exits abnormally (non-zero code, DEAD report, signal, heartbeat timeout) is
  restarted while its restart budget lasts; READY for `stable_after_s` refills the budget. A
  restart that fails before READY (exits, or stays silent past that limit) spends one
  more restart and is tried again while the budget lasts. Past the budget the run fails:
  everything stops and the launcher exits non-zero naming the actor and its error or log tail.
- Stopping an actor escalates: Shutdown message -> SIGTERM -> SIGKILL; the step that ended the
  process is recorded (`ActorProcess.shutdown_step`, run_dir/exit.json).
- When a `primary` actor completes its work, the run ends with exit code 0.
- Actors on a remote host (`[[hosts]] exec`) are started through that host's agent
  (launch/agent.py) and supervised by these same rules: READY and heartbeats come straight to
  the supervisor socket over tcp://, the Shutdown message is sent from here, and SIGTERM /
  SIGKILL travel through the agent. A lost host (its agent exits or stops beating) is said by
  name; each of its actors then counts as failed (restart policy: a restart starts a new agent
  there, or the run fails naming the host). Every remote host's agent is started, and its code
  and environment compared with the launcher's (launch/agent.py `compare`), before any actor.
- A trainer with ranks (launch/config.py `rank_entries`: `<trainer>.rank<r>`, processes like
  any actor, on the hosts its `parallel` places them) is one restart group with them: the group
  starts together (every member spawned, then every READY awaited; rank 0's TCP store on a port
  picked for that start on the trainer's host); when any member fails, the others are stopped
  and the whole group is started again on the trainer's restart budget (the trainer resumes
  from its checkpoint). A rank that completed (rank 0 told it to stop) is no failure.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import json
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

import msgspec

from launch.agent import (
    AgentError,
    AgentLink,
    Init,
    RemoteProcess,
    agent_command,
    compare,
    environment_report,
    terminate_remote,
)
from launch.config import (
    ActorEntry,
    ClusterConfig,
    HostConfig,
    is_distributed,
    launcher_address,
    placement,
    processes,
    rank_groups,
    rank_hosts,
)
from launch.console import wrap
from launch.files import write_json
from launch.preload import (
    FORK_TIMEOUT_S,
    ForkedProcess,
    Template,
    template_groups,
    template_key,
)
from runtime.actor import ActorContext
from runtime.loading import actor_config, import_actor
from runtime.procs import log_tail, terminate, wait_exit
from transport.errors import RlxError
from transport.metrics import MetricsProxy
from transport.rpc import DeadlineExceeded, RemoteError, RpcClient, RpcServer
from transport.schema import (
    Ack,
    Dead,
    Endpoints,
    Heartbeat,
    Notice,
    Ready,
    Shutdown,
    Stopped,
)
from transport.sockets import BindError, SocketFactory, free_port

log = logging.getLogger(__name__)


# seconds a process may take to start and import before its on_start runs (added to an actor's
# start_timeout_s where that sets a longer READY limit than the run's ready_timeout_s)
START_MARGIN_S = 30.0


@dataclass
class ActorProcess:
    name: str
    entry: ActorEntry
    context: ActorContext
    spec_path: Path
    log_path: Path
    host: str = ""
    proc: asyncio.subprocess.Process | RemoteProcess | ForkedProcess | None = None
    pid: int = 0
    restarts: int = 0
    ready_at: float = 0.0
    last_heartbeat: float = 0.0
    endpoints: Endpoints | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # set once a start knows its process's pid: a forked process (launch/preload.py) can
    # report READY before the template's answer naming it has been read
    spawned: asyncio.Event = field(default_factory=asyncio.Event)
    dead: Dead | None = None
    stopped: Stopped | None = None
    exit_code: int | None = None
    shutdown_step: str = ""  # "", "message", "sigterm", "sigkill", "exited"
    env: dict[str, str] = field(default_factory=dict)  # set per start (a group's store)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def completed(self) -> bool:
        """It ended its run itself: Stopped as completed, then exit code 0."""
        return (self.proc is not None and self.proc.returncode == 0
                and self.stopped is not None and self.stopped.completed)


class RunFailed(RlxError):
    """The run cannot continue; the message names the actor and its error."""


class AddressError(RunFailed, OSError):
    """A host's address or port cannot serve the run (the launcher's sockets do not bind, a
    host does not reach another): one line per problem, naming the host, the address and the
    port, and what to change."""


class StartFailed(RunFailed):
    """An actor exited or stayed silent before READY: `what` happened, `why` quotes its error
    or log tail."""

    def __init__(self, what: str, why: str):
        super().__init__(f"{what}\n{why}")
        self.what, self.why = what, why


def write_spec(path: Path, spec: dict) -> None:
    """An actor's spec file (its owner's only), whole or not at all; RunFailed naming the file
    when it cannot be written (a full disk)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, spec, mode=0o600)
    except OSError as e:
        raise RunFailed(f"cannot write {path}: {e}; the actor cannot start without it") \
            from None


def open_log(ap: ActorProcess) -> BinaryIO:
    """The actor's log file, opened unbuffered for appending (its process writes there too);
    RunFailed naming the file when it cannot be opened."""
    try:
        ap.log_path.parent.mkdir(parents=True, exist_ok=True)
        return open(ap.log_path, "ab", buffering=0)
    except OSError as e:
        raise RunFailed(f"{ap.name}: cannot open its log {ap.log_path}: {e}") from None


class Supervisor:
    def __init__(self, cfg: ClusterConfig, run_dir: Path, sock_dir: Path, order: list[str],
                 say: Callable[[str], None] = print, resume: bool = False):
        self.cfg, self.run_dir, self.sock_dir, self.order, self.say = (
            cfg, run_dir, sock_dir, order, say)
        self.resume = resume
        self.run_token = secrets.token_hex(16)  # proves roles between this run's actors
        self.factory = SocketFactory(security=cfg.security)
        self.actors: dict[str, ActorProcess] = {}
        self.events: asyncio.Queue = asyncio.Queue()
        self.stopping = False
        self.completed: str | None = None  # the primary actor whose completion ended the run
        self.proxy: MetricsProxy | None = None
        self.server: RpcServer | None = None
        self._tasks: list[asyncio.Task] = []
        self.hosts: dict[str, HostConfig] = {h.name: h for h in cfg.hosts}
        self.entries: dict[str, ActorEntry] = processes(cfg)  # actors and trainers' ranks
        self.groups: dict[str, list[str]] = rank_groups(cfg)  # leader -> members (itself first)
        self.group_of = {m: leader for leader, ms in self.groups.items() for m in ms}
        self.distributed = is_distributed(cfg)
        self.links: dict[str, AgentLink] = {}  # remote host -> its agent
        self.lost_hosts: dict[str, list[str]] = {}  # host -> why, each time it was lost
        self._local_report: dict | None = None
        self._probed: set[str] = set()  # remote hosts whose address and ports were checked
        self.templates: dict[tuple, Template] = {}  # pre-imported templates (launch/preload.py)

    # ------------------------------------------------------------------ endpoints and specs
    def endpoint(self, name: str, host: HostConfig | None = None) -> str:
        """ipc:// under the socket folder, or tcp:// on `host`'s address (None: the
        launcher's) with a port the kernel picks."""
        if self.cfg.run.transport == "ipc" and not self.distributed:
            return f"ipc://{self.sock_dir}/{name}"
        if host is None:
            address = launcher_address(self.cfg) if self.distributed else \
                self.cfg.hosts[0].address
        else:
            address = host.address
        return f"tcp://{address}:0"

    def host_of(self, name: str) -> HostConfig:
        return self.hosts[self.entries[name].host or self.cfg.hosts[0].name]

    def open(self) -> dict:
        """Bind the supervisor socket and metrics proxy; returns the endpoints document."""
        counters: collections.Counter = collections.Counter()
        handlers = {Ready: self._on_ready, Heartbeat: self._on_heartbeat, Dead: self._on_dead,
                    Stopped: self._on_stopped, Notice: self._on_notice}
        try:
            self.server = RpcServer(self.factory, self.endpoint("supervisor"), "launcher",
                                    handlers, counters, self.cfg.limits, prefix="supervisor")
            self._tasks.append(asyncio.ensure_future(self.server.serve()))
            self.proxy = MetricsProxy(self.factory, self.endpoint("metrics-in"),
                                      self.endpoint("metrics-out"))
        except BindError as e:
            raise AddressError(self._launcher_bind_error(e)) from None
        return self.endpoints_document()

    def _launcher_bind_error(self, e: BindError) -> str:
        """One line: the launcher's sockets do not bind; which host entry to change."""
        local = next((h for h in self.cfg.hosts if not h.exec), None)
        if local is None:  # every host has exec: the launcher's name is its address
            fix = "give the launcher's machine a [[hosts]] entry without `exec`, with its address"
        elif e.errno == errno.EADDRNOTAVAIL:
            fix = f"set `address` of [[hosts]] {local.name!r} (the launcher's host) to one of them"
        else:
            fix = f"check `address` of [[hosts]] {local.name!r} (the launcher's host)"
        name = local.name if local is not None else "of the launcher"
        return (f"host {name}: the launcher's sockets cannot bind {e.address} (port {e.port}: "
                f"{'any free port' if e.port == '0' else 'as given'}): "
                f"{str(e).partition(': ')[2]}; {fix}")

    @property
    def supervisor_endpoint(self) -> str:
        assert self.server is not None
        return self.server.sock.last_endpoint.decode()

    def prepare(self, name: str) -> ActorProcess:
        entry, run = self.entries[name], self.cfg.run
        host = self.host_of(name)
        assert self.proxy is not None
        ctx = ActorContext(
            name=name,
            endpoints=Endpoints(control=self.endpoint(f"{name}.ctl", host),
                                rpc=self.endpoint(f"{name}.rpc", host),
                                inbox=self.endpoint(f"{name}.inbox", host)),
            supervisor=self.supervisor_endpoint, metrics=self.proxy.frontend,
            peers={dep: self.actors[dep].endpoints for dep in entry.after},
            security=self.cfg.security, limits=self.cfg.limits, shm=self.cfg.shm,
            heartbeat_interval_s=run.heartbeat_interval_s,
            start_timeout_s=entry.start_timeout_s, stop_timeout_s=entry.stop_timeout_s,
            run_dir=str(self.run_dir), resume=self.resume, stall_report_s=run.stall_report_s,
            request_retry_s=run.request_retry_s, run_token=self.run_token,
            facts=self.cfg.facts.get(name))
        spec_path = self.run_dir / "specs" / f"{name}.json"  # 0600: it holds the run token
        write_spec(spec_path, {"cls": entry.cls, "config": entry.config,
                               "context": msgspec.to_builtins(ctx)})
        # one host: logs/<actor>.log; several: logs/<host>/<actor>.log for every actor
        logs = self.run_dir / "logs" / host.name if self.distributed else self.run_dir / "logs"
        ap = ActorProcess(name, entry, ctx, spec_path, logs / f"{name}.log", host.name)
        self.actors[name] = ap
        return ap

    def command(self, ap: ActorProcess) -> list[str]:
        host = next((h for h in self.cfg.hosts if h.name == ap.entry.host), self.cfg.hosts[0])
        return [host.python or sys.executable, "-m", "runtime.child", str(ap.spec_path)]

    # ------------------------------------------------------------------ starting
    @staticmethod
    def local_env(extra: dict[str, str]) -> dict[str, str]:
        """The environment of a process on the launcher's host, `extra` over the launcher's."""
        return {**os.environ, **extra, "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(),
                                                            os.environ.get("PYTHONPATH")]))}

    async def open_templates(self) -> None:
        """`[run] preload`: the run's templates (launch/preload.py `template_groups`), each
        importing its processes' classes while the run starts."""
        logs = self.run_dir / "logs" / self.cfg.hosts[0].name if self.distributed else \
            self.run_dir / "logs"
        for i, (key, names) in enumerate(template_groups(self.cfg)):
            template = Template(key[0], self.local_env(dict(key[1])),
                                [self.entries[n].cls for n in names],
                                logs / f"template{i}.log", self.say, f"template {i}")
            self.templates[key] = template
            await template.start()

    async def close_templates(self) -> None:
        templates, self.templates = list(self.templates.values()), {}
        await asyncio.gather(*(t.close(self.cfg.run.term_timeout_s) for t in templates))

    async def spawn(self, ap: ActorProcess) -> None:
        ap.spawned.clear()
        try:
            await self._spawn(ap)
        finally:
            ap.spawned.set()

    async def _spawn(self, ap: ActorProcess) -> None:
        host = self.hosts[ap.host]
        if host.exec:
            await self._spawn_remote(ap, host)
            return
        env = self.local_env({**ap.entry.env, **ap.env})
        template = self.templates.get(template_key(host.python, ap.entry.env))
        with open_log(ap) as logf:
            with contextlib.suppress(OSError):  # a full disk: the actor may run all the same
                logf.write(f"=== start {ap.restarts} at {time.ctime()}\n".encode())
            forked = None if template is None else await template.fork(
                ap.spec_path, env, os.getcwd(), logf.fileno())
            ap.proc = forked or await asyncio.create_subprocess_exec(
                *self.command(ap), stdout=logf, stderr=logf, stdin=asyncio.subprocess.DEVNULL,
                env=env, start_new_session=True)
        ap.pid, ap.ready_at, ap.exit_code, ap.dead, ap.stopped = ap.proc.pid, 0.0, None, None, None
        ap.shutdown_step = ""
        ap.ready.clear()
        self._tasks.append(asyncio.ensure_future(self._reap(ap, ap.proc)))

    async def _spawn_remote(self, ap: ActorProcess, host: HostConfig) -> None:
        link = await self.link_for(host)
        with open_log(ap) as logf, contextlib.suppress(OSError):
            logf.write(f"=== start {ap.restarts} at {time.ctime()} on host {host.name}\n"
                       .encode())
        try:
            ap.proc = await link.start(ap.name, ap.spec_path.read_bytes(),
                                       {**ap.entry.env, **ap.env}, ap.log_path,
                                       self.cfg.run.ready_timeout_s)
        except AgentError as e:
            raise RunFailed(f"{ap.name}: {e}") from None
        ap.pid, ap.ready_at, ap.exit_code, ap.dead, ap.stopped = ap.proc.pid, 0.0, None, None, None
        ap.shutdown_step = ""
        ap.ready.clear()
        self._tasks.append(asyncio.ensure_future(self._reap(ap, ap.proc)))

    # ------------------------------------------------------------------ remote hosts
    def remote_hosts(self) -> list[HostConfig]:
        """The hosts with `exec` that at least one actor or a trainer's rank runs on (their
        agent checks the host's code and versions before anything starts)."""
        used = {ap_host for ap_host, names in placement(self.cfg).items() if names}
        used |= rank_hosts(self.cfg)
        return [h for h in self.cfg.hosts if h.exec and h.name in used]

    async def open_hosts(self) -> None:
        """Start every remote host's agent (in parallel) and check each host's code and
        environment against the launcher's; RunFailed naming every host that failed."""
        hosts = self.remote_hosts()
        if not hosts:
            return
        results = await asyncio.gather(*(self.link_for(h) for h in hosts),
                                       return_exceptions=True)
        errors = [str(r) for r in results if isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, (RunFailed, AgentError)):
                raise r
        if errors:
            raise RunFailed("\n".join(errors))

    async def link_for(self, host: HostConfig) -> AgentLink:
        """The live agent of `host`, started (and checked) when there is none."""
        link = self.links.get(host.name)
        if link is not None and link.alive:
            return link
        if link is not None:
            await link.close("replaced")
        run = self.cfg.run
        python = host.python or sys.executable
        workdir = host.workdir or os.getcwd()
        link = AgentLink(host.name, agent_command(host.exec, python, workdir, host.shell),
                         self.run_dir / "logs" / host.name / "agent.log", self._host_lost,
                         run.heartbeat_interval_s, run.heartbeat_timeout_s)
        self.links[host.name] = link
        try:
            report = await link.open(run.ready_timeout_s)
        except AgentError as e:
            raise RunFailed(str(e)) from None
        first = host.name not in self._probed
        if self._local_report is None:
            self._local_report = await asyncio.to_thread(environment_report)
        errors, notes = compare(self._local_report, report)
        if errors:
            await link.close("the host's code or environment differs")
            raise RunFailed(f"host {host.name}: its code or environment differs from the "
                            f"launcher's (python {python} in {workdir} there; the launcher "
                            f"does not copy code: install the same version there):\n  "
                            + "\n  ".join(errors + notes))
        for note in notes:
            self.say(f"host {host.name}: note: {note}")
        await link.init(Init(host=host.name, run_dir=str(self.run_dir), python=python,
                             keys=self._key_files(), python_path=list(run.python_path),
                             heartbeat_interval_s=run.heartbeat_interval_s,
                             heartbeat_timeout_s=run.heartbeat_timeout_s,
                             term_timeout_s=run.term_timeout_s))
        if first:  # before its first actor: its address, the way to the launcher, its ports
            self._probed.add(host.name)
            await self._probe(host, link)
        self.say(f"host {host.name}: agent pid {link.agent_pid} ready ({report.get('hostname')}, "
                 f"python {report.get('python')}, {len(report.get('files', {}))} project files "
                 f"as here)")
        return link

    async def _probe(self, host: HostConfig, link: AgentLink) -> None:
        """AddressError naming the host, address, port and the fix, for each way `host`
        cannot serve the run: its address does not bind there, the launcher's supervisor
        socket is not reached from there (or the host's address from here), a fixed port of
        one of its actors is taken there."""
        target = self.supervisor_endpoint.partition("://")[2]
        ports = []
        for name, entry in self.entries.items():
            if (entry.host or self.cfg.hosts[0].name) != host.name or name not in self.cfg.actors:
                continue
            cls = import_actor(entry.cls)
            config = actor_config(cls, entry.config, f"[actors.{name}.config]")
            for table, field_, address, port in cls.bound_ports(config):
                if isinstance(port, int) and not isinstance(port, bool) and port > 0:
                    where = f"[actors.{name}.config{'.' + table if table else ''}] {field_}"
                    ports.append((address, port, where))
        try:
            errors = await link.probe(host.address, [target], ports)
        except AgentError as e:
            raise RunFailed(str(e)) from None
        if not errors:
            return
        await link.close("its address or ports cannot serve the run")
        local = next((h.name for h in self.cfg.hosts if not h.exec), "")
        fixes = {"address": f"set `address` of [[hosts]] {host.name!r} to an address of it",
                 "connect": (f"set `address` of [[hosts]] {local!r} (the launcher's host) to "
                             f"an address {host.name} reaches, or let it reach that port"),
                 "reach": (f"set `address` of [[hosts]] {host.name!r} to an address the "
                           f"launcher's host reaches, or let it reach that port"),
                 "port": ""}  # the bind's own advice says it (another port, or 0)
        raise AddressError("\n".join(f"host {host.name}: {text}"
                                     + (f"; {fixes[kind]}" if fixes.get(kind) else "")
                                     for kind, text in errors))

    def _key_files(self) -> dict[str, bytes]:
        """The run's CURVE key files, for the agents (over their stdin, never a command line)."""
        sec = self.cfg.security
        if not sec.curve or not sec.keys_dir:
            return {}
        folder = Path(sec.keys_dir)
        return {name: (folder / name).read_bytes() for name in
                ("server.key", "server.key_secret", "client.key", "client.key_secret")
                if (folder / name).is_file()}

    def _host_lost(self, host: str, why: str) -> None:
        self.lost_hosts.setdefault(host, []).append(why)
        if self.stopping:
            return
        names = [n for n, ap in self.actors.items() if ap.host == host and ap.alive is False
                 and isinstance(ap.proc, RemoteProcess) and ap.proc.lost]
        self.say(f"host {host} lost: {why}; its actors ({', '.join(names) or 'none'}) follow "
                 f"their restart policy (a restart starts a new agent there)")

    async def close_hosts(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links.values()))

    def ready_limit(self, ap: ActorProcess) -> float:
        """Seconds the launcher waits for `ap`'s READY: the run's ready_timeout_s, or the actor's
        own start_timeout_s plus the process's start (START_MARGIN_S) when that is longer."""
        return max(self.cfg.run.ready_timeout_s, ap.entry.start_timeout_s + START_MARGIN_S)

    def ready_words(self, ap: ActorProcess) -> str:
        """The limit of `ready_limit` as a message says it (with the setting to raise)."""
        run_limit = self.cfg.run.ready_timeout_s
        if self.ready_limit(ap) == run_limit:
            return f"ready_timeout_s = {run_limit:g} (raise [run] ready_timeout_s)"
        return (f"{self.ready_limit(ap):g} s (its start_timeout_s = "
                f"{ap.entry.start_timeout_s:g} + {START_MARGIN_S:g} s to start the process)")

    async def start_one(self, ap: ActorProcess) -> None:
        """Spawn and wait for READY; RunFailed if it dies or stays silent."""
        await self.spawn(ap)
        ready = asyncio.ensure_future(ap.ready.wait())
        exited = asyncio.ensure_future(ap.proc.wait())
        done, _ = await asyncio.wait({ready, exited}, timeout=self.ready_limit(ap),
                                     return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        exited.cancel()
        if ap.ready.is_set():
            self.say(f"{ap.name} READY (pid {ap.pid})")
            return
        if not done:
            await self.stop_one(ap)
            raise StartFailed(f"{ap.name} did not report READY within "
                              f"{self.ready_words(ap)}", self.describe_failure(ap))
        await ap.proc.wait()
        raise StartFailed(f"{ap.name} exited with code {ap.proc.returncode} during start",
                          self.describe_failure(ap))

    async def start_all(self) -> None:
        await self.open_hosts()
        await self.open_templates()
        for name in self.order:
            if self.group_of.get(name, name) != name:
                continue  # a rank: started with its trainer
            members = self.groups.get(name, [name])
            try:
                aps = [self.prepare(m) for m in members]
            except OSError as e:  # a full disk
                raise RunFailed(f"{name}: cannot write its spec under {self.run_dir}: {e}") \
                    from None
            if len(aps) == 1:
                await self.start_one(aps[0])
            else:
                await self.start_group(aps)
        self._tasks.append(asyncio.ensure_future(self._watch_heartbeats()))

    # ------------------------------------------------------------------ restart groups
    async def pick_store(self, leader: str) -> str:
        """host:port of rank 0's TCP store for one start of `leader`'s group: the trainer
        host's address when its ranks span hosts (else loopback), a port free there now."""
        host = self.host_of(leader)
        spread = any(self.entries[m].config.get("address") for m in self.groups[leader][1:])
        address = host.address if spread else "127.0.0.1"
        try:
            if host.exec:
                port = await (await self.link_for(host)).pick_port(address)
            else:
                port = free_port(address)
        except (AgentError, OSError) as e:
            raise RunFailed(f"{leader}: no port for its ranks' store on {address}: {e}") \
                from None
        return f"{address}:{port}"

    def give_store(self, ap: ActorProcess, store: str) -> None:
        """The group's store in a member's spec: the leader's at its class's `store_path`, a
        rank's at `store`."""
        leader = self.group_of[ap.name] == ap.name
        path = import_actor(ap.entry.cls).store_path if leader else "store"
        spec = json.loads(ap.spec_path.read_text())
        *tables, key = path.split(".")
        node = spec["config"]
        for t in tables:
            node = node.setdefault(t, {})
        node[key] = store
        write_spec(ap.spec_path, spec)

    async def start_group(self, aps: list[ActorProcess]) -> None:
        """Spawn every member of a restart group, then wait for every READY; StartFailed naming
        the first member that exits or stays silent (the others are stopped first). A member
        that completed its run meanwhile (READY, then done: a leader quicker than a slow member's
        start) has not failed: `supervise` records its completion once the group is started."""
        store = await self.pick_store(aps[0].name)
        for ap in aps:
            self.give_store(ap, store)
        try:
            for ap in aps:
                await self.spawn(ap)
        except RunFailed:
            await self.stop_members(aps)
            raise
        deadline = time.monotonic() + max(self.ready_limit(ap) for ap in aps)
        failed: ActorProcess | None = None
        while failed is None and not all(ap.ready.is_set() for ap in aps):
            waits = {asyncio.ensure_future(ap.ready.wait()) for ap in aps
                     if not ap.ready.is_set()}
            waits |= {asyncio.ensure_future(ap.proc.wait()) for ap in aps if not ap.completed}
            done, _ = await asyncio.wait(waits, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            failed = next((ap for ap in aps if not ap.alive and not ap.completed), None)
            if failed is None and not done:
                silent = [ap for ap in aps if not ap.ready.is_set()]
                await self.stop_members(aps)
                raise StartFailed(f"{', '.join(ap.name for ap in silent)} did not report READY "
                                  f"within {self.ready_words(silent[0])}",
                                  self.describe_failure(silent[0]))
        if failed is not None:
            await failed.proc.wait()
            await self.stop_members(aps)
            raise StartFailed(f"{failed.name} exited with code {failed.proc.returncode} during "
                              f"start", self.describe_failure(failed))
        for ap in aps:
            self.say(f"{ap.name} READY (pid {ap.pid})")

    async def stop_members(self, aps: list[ActorProcess], reason: str = "its group restarts"
                           ) -> None:
        await asyncio.gather(*(self.stop_one(ap, reason) for ap in aps if ap.alive))

    async def restart_group(self, leader: ActorProcess, what: str, why: str) -> None:
        """`restart` for a restart group: the members still running are stopped, then the whole
        group starts again; each attempt spends one restart of the trainer's budget."""
        aps = [self.actors[m] for m in self.groups[leader.name]]
        budget = leader.entry.restart.max_restarts
        while True:
            await self.stop_members(aps)
            if leader.restarts >= budget:
                raise RunFailed(f"{what} after {leader.restarts} restart(s); restart.max_restarts "
                                f"= {budget}\n{why}")
            leader.restarts += 1
            for ap in aps[1:]:
                ap.restarts = leader.restarts
            self.say(f"{what}; restart {leader.restarts}/{budget} of "
                     f"{', '.join(ap.name for ap in aps)} together\n{why}")
            for ap in aps:
                self.respec(ap)
            try:
                await self.start_group(aps)
                return
            except StartFailed as e:
                dead = next((ap.dead for ap in aps if ap.dead is not None and ap.dead.end_run),
                            None)
                if dead is not None:
                    raise RunFailed(f"{dead.actor} ended the run: {dead.error}") from None
                what, why = e.what.replace(" during start", " during restart"), e.why

    # ------------------------------------------------------------------ supervising
    async def supervise(self) -> int:
        """Handle events until the run ends; returns the exit code."""
        while True:
            kind, name = await self.events.get()
            if kind == "interrupt":
                self.say("interrupted: stopping every actor")
                return 0
            ap = self.actors[name]
            if ap.alive:  # the exit of an earlier process (one whose restart failed, since retried)
                continue
            leader = self.actors[self.group_of.get(name, name)]
            if ap.stopped is not None and ap.stopped.completed and ap.exit_code == 0:
                if ap is not leader:  # a rank its trainer told to stop
                    continue
                self.say(f"{name} completed ({ap.stopped.reason})")
                if ap.entry.primary:
                    self.completed = name
                    return 0
                continue
            if leader.ready_at and (time.monotonic() - leader.ready_at
                                    >= leader.entry.restart.stable_after_s):
                leader.restarts = 0
            if ap.dead is not None and ap.dead.end_run:  # restarting would not help
                raise RunFailed(f"{name} ended the run: {ap.dead.error}")
            what, why = f"{name} failed (exit code {ap.exit_code})", self.describe_failure(ap)
            if name in self.group_of:
                await self.restart_group(leader, what, why)
            else:
                await self.restart(ap, what, why)

    async def restart(self, ap: ActorProcess, what: str, why: str) -> None:
        """Start `ap` again after `what` happened: each attempt spends one restart of its budget,
        an attempt that fails before READY is followed by the next while the budget lasts;
        RunFailed once it is spent, with the last failure's error or log tail (`why`)."""
        budget = ap.entry.restart.max_restarts
        while True:
            if ap.restarts >= budget:
                raise RunFailed(f"{what} after {ap.restarts} restart(s); restart.max_restarts "
                                f"= {budget}\n{why}")
            ap.restarts += 1
            self.say(f"{what}; restart {ap.restarts}/{budget}\n{why}")
            self.respec(ap)
            try:
                await self.start_one(ap)
                return
            except StartFailed as e:
                if ap.dead is not None and ap.dead.end_run:
                    raise RunFailed(f"{ap.name} ended the run: {ap.dead.error}") from None
                what, why = e.what.replace(" during start", " during restart"), e.why

    def respec(self, ap: ActorProcess) -> None:
        """The spec of a restart: the ports it had, and resume (continue from its checkpoint)."""
        ap.context.endpoints = ap.endpoints or ap.context.endpoints
        spec = json.loads(ap.spec_path.read_text())
        spec["context"]["endpoints"] = msgspec.to_builtins(ap.context.endpoints)
        spec["context"]["resume"] = True
        write_spec(ap.spec_path, spec)

    async def _reap(self, ap: ActorProcess, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if proc is not ap.proc:
            return
        ap.exit_code = code
        if not self.stopping:
            await self.events.put(("exit", ap.name))

    async def _watch_heartbeats(self) -> None:
        timeout_s = self.cfg.run.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            now = time.monotonic()
            for ap in self.actors.values():
                if ap.alive and ap.ready.is_set() and now - ap.last_heartbeat > timeout_s:
                    self.say(f"{ap.name} sent no heartbeat for {timeout_s:g} s: killing it")
                    ap.last_heartbeat = now
                    ap.proc.kill()

    def describe_failure(self, ap: ActorProcess) -> str:
        if isinstance(ap.proc, RemoteProcess) and ap.proc.lost:
            return f"  {ap.proc.lost}\n  log tail ({ap.log_path}):\n" + "\n".join(
                f"  | {line}" for line in log_tail(ap.log_path, 6).splitlines())
        if ap.dead is not None:
            tb = ap.dead.traceback.strip().splitlines()[-12:]
            return f"  error: {ap.dead.error}\n" + "\n".join(f"  | {line}" for line in tb)
        return f"  log tail ({ap.log_path}):\n" + "\n".join(
            f"  | {line}" for line in log_tail(ap.log_path, 12).splitlines())

    # ------------------------------------------------------------------ supervisor rpc
    def _known(self, name: str, pid: int = 0) -> ActorProcess | None:
        ap = self.actors.get(name)
        return ap if ap is not None and (not pid or pid == ap.pid) else None

    async def _on_ready(self, msg: Ready) -> Ack:
        ap = self.actors.get(msg.actor)
        if ap is not None and msg.pid != ap.pid:  # its start may not know the pid yet
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ap.spawned.wait(), FORK_TIMEOUT_S)
        ap = self._known(msg.actor, msg.pid)
        if ap is None:
            return Ack(ok=False, stop=True)
        ap.endpoints = msg.endpoints
        ap.ready_at = ap.last_heartbeat = time.monotonic()
        ap.ready.set()
        return Ack()

    async def _on_heartbeat(self, msg: Heartbeat) -> Ack:
        ap = self._known(msg.actor)
        if ap is None:
            return Ack(ok=False, stop=True)
        ap.last_heartbeat = time.monotonic()
        return Ack()

    async def _on_dead(self, msg: Dead) -> Ack:
        if (ap := self._known(msg.actor)) is not None:
            ap.dead = msg
        return Ack()

    async def _on_notice(self, msg: Notice) -> Ack:
        if self._known(msg.actor) is not None:
            self.say(wrap(f"{msg.actor}: {msg.text[:2000]}"))  # 80 columns, between words
        return Ack()

    async def _on_stopped(self, msg: Stopped) -> Ack:
        if (ap := self._known(msg.actor)) is not None:
            ap.stopped = msg
        return Ack()

    # ------------------------------------------------------------------ stopping
    async def stop_one(self, ap: ActorProcess, reason: str = "run ending") -> None:
        if not ap.alive:
            ap.shutdown_step = ap.shutdown_step or "exited"
            return
        run = self.cfg.run
        if ap.endpoints is not None:
            client = RpcClient(self.factory, ap.endpoints.control, "launcher")
            try:
                await client.call(Shutdown(reason=reason),
                                  timeout_s=min(5.0, run.shutdown_timeout_s))
            except (RemoteError, DeadlineExceeded):
                pass
            finally:
                await client.close()
            ap.shutdown_step = "message"
            if await wait_exit(ap.proc, run.shutdown_timeout_s):
                return
        if isinstance(ap.proc, RemoteProcess):
            ap.shutdown_step = await terminate_remote(ap.proc, run.term_timeout_s)
        else:
            ap.shutdown_step = await terminate(ap.proc, run.term_timeout_s)

    async def stop_all(self) -> None:
        """Stop every actor: an actor only after every actor that has it in its `after` list
        (its dependents) has stopped, and independent actors at the same time, so the run's
        shutdown takes its longest chain of stops, not the sum of them all."""
        self.stopping = True
        names = [n for n in reversed(self.order) if n in self.actors]
        stopped = {n: asyncio.Event() for n in names}
        dependents = {n: [m for m in names if n in self.entries[m].after] for n in names}
        for n in names:  # a trainer's ranks after it: its stop tells them to leave
            leader = self.group_of.get(n, n)
            if leader != n and leader in stopped:
                dependents[n].append(leader)

        async def stop(name: str) -> None:
            try:
                for dependent in dependents[name]:
                    await stopped[dependent].wait()
                await self.stop_one(self.actors[name])
            finally:
                stopped[name].set()
        await asyncio.gather(*(stop(n) for n in names))
        await self.close_hosts()
        await self.close_templates()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.server is not None:
            self.server.close()
        if self.proxy is not None:
            self.proxy.close()
        self.factory.close()

    def summary(self) -> dict:
        out = {}
        for name, ap in self.actors.items():
            out[name] = {"pid": ap.pid, "exit_code": ap.exit_code, "restarts": ap.restarts,
                         "shutdown_step": ap.shutdown_step,
                         "error": ap.dead.error if ap.dead else None}
            if self.distributed:
                out[name]["host"] = ap.host
                if isinstance(ap.proc, RemoteProcess) and ap.proc.lost:
                    out[name]["error"] = out[name]["error"] or ap.proc.lost
        return out

    def hosts_summary(self) -> dict:
        """Every host: its address, actors, and for a remote one its agent and losses."""
        out = {}
        for host, names in placement(self.cfg).items():
            h = self.hosts[host]
            entry: dict = {"address": h.address, "actors": names, "remote": bool(h.exec)}
            if host in self.links:
                entry["agent"] = self.links[host].summary()
            if host in self.lost_hosts:
                entry["lost"] = self.lost_hosts[host]
            out[host] = entry
        return out

    def endpoints_document(self) -> dict:
        """endpoints.json: the launcher's sockets and, once started, every actor's, by host."""
        assert self.proxy is not None
        doc: dict = {"supervisor": self.supervisor_endpoint, "metrics": self.proxy.backend,
                     "metrics_in": self.proxy.frontend}
        if self.actors:
            doc["actors"] = {n: {"host": ap.host, **{k: v for k, v in msgspec.to_builtins(
                ap.endpoints).items() if k != "type"}}
                for n, ap in self.actors.items() if ap.endpoints is not None}
        if self.distributed:
            doc["hosts"] = {h: {"address": self.hosts[h].address, "actors": names}
                            for h, names in placement(self.cfg).items() if names}
        return doc
