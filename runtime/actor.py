"""The base class of every actor process: lifecycle, control socket, heartbeats, metrics.

Invariants:
- `start()` is idempotent and bounded by `start_timeout_s`; `stop(reason)` is idempotent and
  always ends in a terminal status (STOPPED, or FAILED when the reason is an error).
- One `asyncio.TaskGroup` owns every task of the actor (`spawn()` adds to it); an exception that
  escapes any task is fatal: the actor publishes DEAD to its supervisor and exits non-zero.
- The control socket (ping/stats/shutdown) is its own ROUTER served by its own task, apart from
  the data sockets, so it answers while the data path is saturated (keep CPU-heavy work off the
  event loop with `asyncio.to_thread`).
Subclasses override hooks (`on_start`, `run`, `on_inbox`, `rpc_handlers`, `on_stop`), never
`start()`/`stop()`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import json
import logging
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Coroutine

import msgspec

from runtime.facts import RunFacts
from transport.codec import Limits
from transport.errors import Unrecoverable, ends_run
from transport.metrics import MetricsPublisher
from transport.rpc import DeadlineExceeded, Handler, RpcClient, RpcServer
from transport.schema import (
    Ack,
    Dead,
    Endpoints,
    Heartbeat,
    Msg,
    Notice,
    Ping,
    Pong,
    Ready,
    Shutdown,
    ShutdownReply,
    StatsReply,
    StatsRequest,
    Stopped,
)
from transport.shm import ShmConfig
from transport.sockets import Security, SocketFactory, free_port, port_is_free
from transport.streams import StreamReceiver, StreamSender

log = logging.getLogger(__name__)


class Status(enum.StrEnum):
    CREATED = "created"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


TERMINAL = (Status.STOPPED, Status.FAILED)


class ActorContext(msgspec.Struct, forbid_unknown_fields=True):
    """Everything an actor process is told by its launcher (written as JSON per process)."""

    name: str
    endpoints: Endpoints  # where this actor binds its control/rpc/inbox sockets
    supervisor: str = ""  # launcher's supervisor endpoint ("" when run standalone)
    metrics: str = ""  # metrics proxy endpoint publishers connect to ("" disables metrics)
    peers: dict[str, Endpoints] = {}  # actors this one talks to, by name
    security: Security = Security()
    limits: Limits = Limits()
    shm: ShmConfig = ShmConfig()
    heartbeat_interval_s: float = 1.0
    start_timeout_s: float = 30.0
    stop_timeout_s: float = 10.0  # on_stop() and the final report must finish within this
    call_timeout_s: float = 10.0  # default deadline of calls to peers and the supervisor
    run_dir: str = ""  # the run directory (checkpoints, weights, logs live under it)
    resume: bool = False  # continue from the latest checkpoint in run_dir
    stall_report_s: float = 60.0  # a wait on a peer longer than this is reported on the console
    request_retry_s: float = 30.0  # an idempotent request unanswered this long is sent again
    # shared by the actors of one run (the launcher draws it): proves an actor's role to its
    # peers (transport.rpc role_proof); "" (run on its own): roles are taken as claimed
    run_token: str = ""
    # what every actor of the run agrees on (runtime/facts.py; launch/plan.py derives it);
    # None when run on its own
    facts: RunFacts | None = None


class EndRun(Unrecoverable):
    """Raised by an actor when the run cannot go on and a restart would not help (the launcher
    ends the run with this message, exit code 1, instead of restarting the actor)."""


class EmptyConfig(msgspec.Struct, forbid_unknown_fields=True):
    """This actor takes no settings."""


class ActorView(msgspec.Struct, frozen=True):
    """One actor of a run as the launcher sees it before anything starts (launch/plan.py)."""

    cls: type  # the Actor subclass
    config: Any  # its decoded Config
    host: str  # the [[hosts]] name it runs on
    gpus: list[str]  # its cls.gpus(config, env, host)
    after: list[str] = []  # actors it starts after: its peers


class Actor:
    Config: type[msgspec.Struct] = EmptyConfig
    role = "actor"
    # an actor with ranks (the trainer): the class of its rank processes ("" = none), which the
    # launcher starts with it as one restart group, and the dotted config path that gets the
    # group's store address (host:port) at each start
    rank_cls = ""
    store_path = ""
    # leave the process with os._exit after a clean stop (runtime/child.py), skipping C++
    # teardown that can abort (the trainer's ranks: torch.distributed threads)
    exit_hard = False

    def __init__(self, ctx: ActorContext, config: Any = None):
        self.ctx = ctx
        self.name = ctx.name
        self.config = config if config is not None else self.Config()
        self.status = Status.CREATED
        self.counters: collections.Counter = collections.Counter()
        self.factory = SocketFactory(security=ctx.security)
        self.metrics: MetricsPublisher | None = None
        self.bound = Endpoints(control="")
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task] = set()
        self._start_task: asyncio.Task | None = None
        self._stop_event = asyncio.Event()
        self._running = asyncio.Event()
        self._stop_reason = ""
        self._completed = False
        self._error: BaseException | None = None
        self._closers: list[Any] = []
        self._supervisor: RpcClient | None = None
        # False once the supervising launcher is gone (set by runtime.child): reports are skipped
        self.supervisor_alive: Callable[[], bool] = lambda: True
        self._started_at = time.monotonic()

    # ------------------------------------------------------------------ hooks for subclasses
    @classmethod
    def check_config(cls, config: Any) -> list[str] | None:
        """Checks that need more than types (paths exist, classes import); raise ValueError.
        The launcher calls this when it loads hosts.toml, before anything starts, and prints
        the notes it returns (things to know that are no error), if any."""

    @classmethod
    def check_facts(cls, config: Any, facts: RunFacts) -> None:
        """Checks of this actor's own settings against the run's facts (runtime/facts.py: what
        other actors decide, e.g. the buffer's bounds against the rollout's batch); raise
        ValueError. The launcher calls this after every `check_config` (launch/plan.py)."""

    @property
    def facts(self) -> RunFacts:
        """The run's facts, as the launcher delivered them; an actor started without a launcher
        is given them in its context (tests: `ActorContext(..., facts=RunFacts(...))`)."""
        if self.ctx.facts is None:
            raise ValueError(f"{self.name}: this actor reads the run's facts (model, group size, "
                             f"temperature...), and its context has none: start it from the "
                             f"launcher, or pass ActorContext(facts=RunFacts(...))")
        return self.ctx.facts

    @classmethod
    def gpus(cls, config: Any, env: dict[str, str], host: str) -> list[str]:
        """The physical GPUs this actor computes on (runtime/devices.py ids) when started
        with `env` on `host`; [] for CPU-only actors (launch/plan.py checks placements)."""
        return []

    @classmethod
    def bound_ports(cls, config: Any) -> list[tuple[str, str, str, int]]:
        """Fixed ports this actor binds, as (table under its config, "" = the config itself;
        field; address; port): the launcher checks at load that each is free and no other
        actor's (port 0: picked at start)."""
        return []

    @classmethod
    def ranks(cls, config: Any) -> list[str]:
        """With `rank_cls`: the [[hosts]] name of each of its ranks 1..N-1 ("" = its own)."""
        return []

    @classmethod
    def peers(cls, config: Any) -> dict[str, str]:
        """The peers `config` names, by field (`"workers[0]"` -> `"worker0"`; "" = none): the
        launcher checks each is an actor this one starts after (launch/plan.py)."""
        return {}

    async def on_start(self) -> None:
        """Open resources and connect to peers; raising fails the start."""

    async def run(self) -> None:
        """Main work; returning means the actor's work is complete (orderly stop)."""
        await asyncio.Event().wait()

    def rpc_handlers(self) -> dict[type, Handler]:
        """Request types this actor serves on its rpc socket."""
        return {}

    def rpc_roles(self) -> dict[type, str]:
        """Request types of rpc_handlers that only a peer of one role may send: {type: role}."""
        return {}

    async def on_inbox(self, msg: Msg) -> None:
        """Called for each stream message arriving in this actor's inbox."""
        raise NotImplementedError

    async def on_stop(self, reason: str) -> None:
        """Release resources; runs after every task was cancelled, within stop_timeout_s."""

    # ------------------------------------------------------------------ lifecycle
    async def serve(self, handle_signals: bool = False) -> int:
        """Start, run until stopped, report, close. Returns the process exit code."""
        if handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop, f"signal {signal.Signals(sig).name}")
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._start_task = self.spawn(self._start(), "start")
                await self._stop_event.wait()
                for task in list(self._tasks):
                    task.cancel()
        except BaseException as e:  # noqa: BLE001 - every failure must reach a terminal state
            self._error = _unwrap(e)
            if not isinstance(self._error, (Exception, asyncio.CancelledError)):
                raise
        return await self._finish()

    async def start(self) -> None:
        """Wait until started (serve() starts the actor once; calling this again is harmless)."""
        if self._start_task is None:
            self._start_task = self.spawn(self._start(), "start")
        await asyncio.shield(self._start_task)

    def stop(self, reason: str = "requested", completed: bool = False) -> None:
        if self._stop_event.is_set() or self.status in TERMINAL:
            return
        self._stop_reason, self._completed = reason, completed
        self.status = Status.STOPPING
        log.info("%s: stopping (%s)", self.name, reason)
        self._stop_event.set()

    async def wait_running(self) -> None:
        await self._running.wait()

    def spawn(self, coro: Coroutine, name: str = "") -> asyncio.Task:
        """Run `coro` in the actor's task group; its failure is the actor's failure."""
        assert self._tg is not None, "spawn() before serve()"
        task = self._tg.create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _start(self) -> None:
        self.status = Status.STARTING
        ep = self.ctx.endpoints
        control = RpcServer(self.factory, ep.control, self.name, self._control_handlers(),
                            self.counters, self.ctx.limits, self.spawn, "control")
        self._closers.append(control.close)
        self.bound.control = control.sock.last_endpoint.decode()
        self.spawn(control.serve(), "control")
        if self.ctx.supervisor:
            self._supervisor = RpcClient(self.factory, self.ctx.supervisor, self.name,
                                         self.ctx.call_timeout_s)
            await self._supervisor.handshake()
        if self.ctx.metrics:
            self.metrics = MetricsPublisher(self.factory, self.ctx.metrics, self.name)
            self._closers.append(self.metrics.close)
        try:
            async with asyncio.timeout(self.ctx.start_timeout_s):
                await self.on_start()
        except TimeoutError:
            raise TimeoutError(f"{self.name}: on_start() took longer than start_timeout_s = "
                               f"{self.ctx.start_timeout_s:g}") from None
        self._bind_data_sockets()
        self.status = Status.RUNNING
        self._running.set()
        if self._supervisor is not None:
            await self._report(Ready(actor=self.name, pid=os.getpid(), endpoints=self.bound))
            self.spawn(self._heartbeat(), "heartbeat")
        self.spawn(self._main(), "main")

    def _bind_data_sockets(self) -> None:
        ep = self.ctx.endpoints
        handlers = self.rpc_handlers()
        if handlers and ep.rpc:
            rpc = RpcServer(self.factory, ep.rpc, self.name, handlers, self.counters,
                            self.ctx.limits, self.spawn, "rpc", self.ctx.shm,
                            self.ctx.run_token, self.rpc_roles())
            self._closers.append(rpc.close)
            self.bound.rpc = rpc.sock.last_endpoint.decode()
            self.spawn(rpc.serve(), "rpc")
        if type(self).on_inbox is not Actor.on_inbox and ep.inbox:
            inbox = StreamReceiver(self.factory, ep.inbox, self.counters,
                                   limits=self.ctx.limits, shm=self.ctx.shm, name=self.name)
            self._closers.append(inbox.close)
            self.bound.inbox = inbox.sock.last_endpoint.decode()
            self.spawn(self._drain_inbox(inbox), "inbox")

    async def _drain_inbox(self, inbox: StreamReceiver) -> None:
        async for msg in inbox:
            await self.on_inbox(msg)

    async def _main(self) -> None:
        await self.run()
        self.stop("completed", completed=True)

    async def _heartbeat(self) -> None:
        seq = 0
        while True:
            await asyncio.sleep(self.ctx.heartbeat_interval_s)
            seq += 1
            ack = await self._report(Heartbeat(actor=self.name, status=self.status, seq=seq))
            if isinstance(ack, Ack) and ack.stop:
                self.stop("supervisor asked to stop")

    async def call_retrying(self, client: RpcClient, msg: Msg, total_s: float) -> Msg:
        """`client.call(msg)` for an idempotent request, sent again after every
        `request_retry_s` without an answer (a peer that restarted lost the first), until
        `total_s` has passed (then DeadlineExceeded, as a plain call)."""
        deadline = time.monotonic() + total_s
        while True:
            left = deadline - time.monotonic()
            try:
                return await client.call(msg, min(self.ctx.request_retry_s, max(left, 0.001)))
            except DeadlineExceeded:
                if time.monotonic() >= deadline:
                    raise
                self.counters[f"retried.{type(msg).__name__}"] += 1

    @contextlib.asynccontextmanager
    async def waiting_for(self, what: str, limit_s: float | None = None,
                          setting: str = "") -> AsyncIterator[None]:
        """Wrap a wait on a peer: while it lasts longer than `stall_report_s`, the console says
        which actor waits for what, and since when (repeated at that interval). A wait that
        times out (`limit_s`, the config field `setting` sets it) ends the run with a message
        naming both (EndRun): restarting the waiting actor would not make the peer answer."""
        since = time.time()
        reporter = self.spawn(self._report_stall(what, since), "stall")
        try:
            yield
        except TimeoutError:  # DeadlineExceeded included
            if limit_s is None:
                raise
            raise EndRun(f"{self.name} waited {time.time() - since:.0f} s for {what} without an "
                         f"answer (limit {limit_s:g} s, `{setting}`): see the stall reports and "
                         f"that actor's log; raise `{setting}` if such waits are expected") \
                from None
        finally:
            reporter.cancel()

    async def _report_stall(self, what: str, since: float) -> None:
        every = self.ctx.stall_report_s
        while True:
            await asyncio.sleep(every)
            started = time.strftime("%H:%M:%S", time.localtime(since))
            self.notify(f"still waiting for {what} since {started} "
                        f"({time.time() - since:.0f} s)")

    def notify(self, text: str) -> None:
        """A line for the launcher's console (and this actor's log); never blocks the caller."""
        log.warning("%s: %s", self.name, text)
        if self._supervisor is not None and self._tg is not None:
            self.spawn(self._notice(text), "notice")

    async def _notice(self, text: str) -> None:
        try:
            await self._report(Notice(actor=self.name, text=text))
        except Exception as e:  # noqa: BLE001 - a lost notice must not fail the actor
            log.warning("%s: notice not delivered: %s", self.name, e)

    async def _report(self, msg: Msg) -> Msg | None:
        assert self._supervisor is not None
        return await self._supervisor.call(msg)

    async def _finish(self) -> int:
        error = self._error
        if isinstance(error, asyncio.CancelledError):
            error, self._stop_reason = None, self._stop_reason or "cancelled"
        elif error is not None:
            self._stop_reason = f"{type(error).__name__}: {error}"
        try:
            async with asyncio.timeout(self.ctx.stop_timeout_s):
                await self.on_stop(self._stop_reason or "cancelled")
                await self._final_report(error)
        except Exception as e:  # noqa: BLE001 - stop must always reach a terminal state
            log.error("%s: error while stopping: %s", self.name, e)
            error = error or e
        for close in reversed(self._closers):
            result = close()
            if asyncio.iscoroutine(result):
                await result
        if self._supervisor is not None:
            await self._supervisor.close()
        self.factory.close()
        self.status = Status.FAILED if error is not None else Status.STOPPED
        self._stop_event.set()
        log.info("%s: %s (%s)", self.name, self.status, self._stop_reason)
        return 1 if error is not None else 0

    async def _final_report(self, error: BaseException | None) -> None:
        if self._supervisor is None:
            return
        if not self.supervisor_alive():  # nobody to tell: do not wait call_timeout_s for it
            log.warning("%s: the launcher is gone; exiting without the final report", self.name)
            return
        if error is not None:
            tb = "".join(traceback.format_exception(error))
            log.error("%s: fatal error\n%s", self.name, tb)
            await self._report(Dead(actor=self.name, error=self._stop_reason, traceback=tb,
                                    end_run=ends_run(error)))
        else:
            await self._report(Stopped(actor=self.name, reason=self._stop_reason,
                                       completed=self._completed))

    # ------------------------------------------------------------------ control plane
    def _control_handlers(self) -> dict[type, Handler]:
        return {Ping: self._ping, StatsRequest: self._stats, Shutdown: self._shutdown}

    def _ping(self, msg: Ping) -> Pong:
        return Pong(actor=self.name, status=self.status, payload=msg.payload)

    def _stats(self, msg: StatsRequest) -> StatsReply:
        return StatsReply(actor=self.name, status=self.status,
                          uptime_s=time.monotonic() - self._started_at,
                          counters=dict(self.stats()))

    def _shutdown(self, msg: Shutdown) -> ShutdownReply:
        self.stop(msg.reason)
        return ShutdownReply(actor=self.name, status=self.status)

    def stats(self) -> dict[str, int]:
        """Counters reported by StatsRequest; subclasses may add their own."""
        return dict(self.counters)

    # ------------------------------------------------------------------ peers
    def peer(self, name: str) -> Endpoints:
        if name not in self.ctx.peers:
            raise ValueError(f"{self.name} has no peer {name!r}; list it in `after` for this "
                             f"actor in hosts.toml (known: {sorted(self.ctx.peers)})")
        return self.ctx.peers[name]

    async def connect(self, name: str) -> RpcClient:
        """A handshaken client of peer `name`'s rpc socket, closed when this actor stops."""
        client = RpcClient(self.factory, self.peer(name).rpc, self.name,
                           self.ctx.call_timeout_s, self.ctx.limits, self.ctx.shm, self.role,
                           self.ctx.run_token)
        self._closers.append(client.close)
        await client.handshake()
        return client

    def stable_port(self, key: str, host: str, requested: int = 0) -> int:
        """`requested`, or a port kept for this actor across restarts: the first start picks a
        free one and records it in the run directory (`ports/<actor>.json`), a restarted
        process binds the same one again, so clients and routers that know the old address
        reach the new process. Without a run directory: a fresh free port."""
        if requested:
            return requested
        if not self.ctx.run_dir:
            return free_port(host)
        path = Path(self.ctx.run_dir) / "ports" / f"{self.name}.json"
        known = json.loads(path.read_text()) if path.exists() else {}
        if key in known and not port_is_free(host, int(known[key])):
            log.warning("%s: port %s of %s is taken by another process; using a new one (its "
                        "clients must learn the new address)", self.name, known[key], key)
            del known[key]
        if key not in known:
            known[key] = free_port(host)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, path)
        return int(known[key])

    def stream_to(self, name: str, hwm: int = 64) -> StreamSender:
        sender = StreamSender(self.factory, self.peer(name).inbox, hwm=hwm, shm=self.ctx.shm)
        self._closers.append(sender.close)
        return sender


def _unwrap(e: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups."""
    while isinstance(e, BaseExceptionGroup):
        inner = [x for x in e.exceptions if not isinstance(x, asyncio.CancelledError)]
        e = (inner or list(e.exceptions))[0]
    return e
