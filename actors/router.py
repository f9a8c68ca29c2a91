"""The router actor: runs sglang-router in front of the inference workers it depends on.

The router process is a child of this actor: started in on_start with the workers' HTTP URLs
(from the peers listed in `after`), waited for until it answers /health and routes to every one of
them (/readiness), stopped in on_stop. Its
URL is reported as this actor's `http` endpoint. `/generate` goes through the router; control
calls (weight updates, pause/continue) must go to each worker directly, since the router does not
forward them. Every option of the `router` table (and `--router-<option>` on the launcher's
command line, see runtime/passthrough.py) passes through to sglang-router: `key = value` becomes
`--key value`, `true` a bare flag. With `dynamic_workers = true` the router may start with no
worker: SGLang workers register themselves at run time (actors/sglang_worker.py, POST /workers).

Hostile HTTP input: this actor parses no request itself; sglang-router does, typed (serde, with
its nesting limit: malformed or too deep JSON gets 400, wrong types 422), after refusing a body
over `max_body_bytes` with 413 unread. That bound is the embedded workers' own (64 MiB) instead
of sglang-router's 512 MiB default, which it would buffer per request only for the worker to
refuse it. A bad request never reaches a worker and never stops the router.

A worker that stops answering (hung, SIGSTOPped, its machine gone) is out of rotation within a
few seconds: sglang-router checks every worker's /health each second and takes one out after two
failed checks of a second each (`HEALTH_DEFAULTS`, any of them overridden by the `router`
table); a lone worker, which has no other to take its requests, after ten
(`LONE_WORKER_FAILURES`: two slow answers on a loaded machine would otherwise turn every request
into a 503 and fail its episode). Requests already sent to it would still wait for that process
until it is killed (the launcher's heartbeat timeout, 30 s): so the workers listed at start are
reached through a TCP relay in this actor (`relay = true`), which cuts every connection to a
worker as soon as sglang-router reports it unhealthy; sglang-router then retries those requests
on the other workers (its retries, which connection errors trigger). Workers that register
themselves (`dynamic_workers`) are reached directly.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from engine.client import wait_for_health
from runtime.actor import Actor
from runtime.child import die_with_parent
from runtime.passthrough import refuse_owned, render
from runtime.procs import terminate
from transport.sockets import free_port

log = logging.getLogger(__name__)
ALL_WORKERS_WAIT_S = 15.0  # READY waits this long at most for the router to route to every worker
# sglang-router options this actor sets unless the `router` table does: a worker that does not
# answer /health within 1 s twice in a row is out of rotation (sglang-router's defaults: 60 s
# between checks, 5 s each, 3 failures); a circuit opened by failed requests (those of a worker
# that hung, cut by the relay) is tried again after 5 s, not 60 s, once the worker is healthy
HEALTH_DEFAULTS = {"health_check_interval_secs": 1, "health_check_timeout_secs": 1,
                   "health_failure_threshold": 2, "cb_timeout_duration_secs": 5}
# a lone worker (one listed, none registering) has no other to take its requests: out of
# rotation after two slow checks (a loaded machine), every request would get 503 "no available
# workers" and its episode fail; it leaves rotation after this many failed checks instead (a
# hung one is still ended by the launcher's heartbeat timeout and restarted)
LONE_WORKER_FAILURES = 10


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of the sglang-router process."""

    workers: list[str] = []  # peer actor names of the inference workers ([] = every http peer)
    policy: str = "consistent_hashing"  # sticky by X-SMG-Routing-Key; or round_robin, cache_aware
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    health_timeout_s: float = 60.0  # the router must answer /health within this
    dynamic_workers: bool = False  # workers register themselves (POST /workers); may start empty
    max_body_bytes: int = 64 << 20  # larger request bodies get 413 before they are read (bytes;
    # sglang-router's max_payload_size; as the embedded workers' max_body_bytes)
    router: dict[str, Any] = {}  # sglang-router options, passed through as --key value
    # reach the workers through relays of this actor that cut a worker's connections once
    # sglang-router finds it unhealthy, so its in-flight requests are retried on the others
    relay: bool = True
    watch_interval_s: float = 0.5  # how often sglang-router's view of the workers is read (s)


def router_command(cfg: RouterConfig, worker_urls: list[str], port: int) -> list[str]:
    cmd = [sys.executable, "-m", "engine.router_main", "--host", cfg.host, "--port", str(port)]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    cli_policies = {"random", "round_robin", "cache_aware", "power_of_two"}
    if cfg.policy in cli_policies:
        cmd += ["--policy", cfg.policy]
    else:
        cmd += ["--then-policy", cfg.policy]
    cmd += ["--max-payload-size", str(cfg.max_body_bytes)]
    defaults = dict(HEALTH_DEFAULTS)
    if len(worker_urls) == 1 and not cfg.dynamic_workers:
        defaults["health_failure_threshold"] = LONE_WORKER_FAILURES
    options = {**defaults, **cfg.router}
    if "prometheus_port" not in options:  # its fixed default collides between routers
        cmd += ["--prometheus-port", str(free_port(cfg.host))]
    return cmd + render(options)


# Options the router actor sets itself -> the config field that sets each.
OWNED = {"host": "host", "port": "port", "worker_urls": "workers", "policy": "policy",
         "max_payload_size": "max_body_bytes"}


class RouterActor(Actor):
    Config = RouterConfig
    role = "router"
    # what it runs (engine/router_main.py), checked on its host by `--dry-run`
    needs = {"sglang_router": "sglang-router==0.3.2"}

    @classmethod
    def check_config(cls, config: RouterConfig) -> None:
        refuse_owned(config.router, OWNED, "router")
        if config.max_body_bytes < 1:
            raise ValueError(f"router: max_body_bytes must be >= 1, got {config.max_body_bytes}")
        if not config.watch_interval_s > 0:
            raise ValueError(f"router: watch_interval_s must be > 0 (seconds), got "
                             f"{config.watch_interval_s}")

    @classmethod
    def bound_ports(cls, config: RouterConfig) -> list[tuple[str, str, str, int]]:
        """Its HTTP port and sglang-router's Prometheus port."""
        port = config.router.get("prometheus_port")
        address = str(config.router.get("prometheus_host", "0.0.0.0"))  # sglang-router's default
        return [("", "port", config.host, config.port)] + (
            [("router", "prometheus_port", address, port)] if isinstance(port, int) else [])

    async def on_start(self) -> None:
        cfg = self.config
        names = cfg.workers or [n for n, ep in self.ctx.peers.items() if ep.http]
        urls = [self.peer(n).http for n in names]
        if not urls and not cfg.dynamic_workers:
            raise ValueError(f"{self.name}: no inference workers; list them in `after`, or set "
                             f"dynamic_workers = true for workers that register themselves")
        self.relays: dict[str, Relay] = {}  # the URL sglang-router knows -> its relay
        if cfg.relay:
            for name, url in zip(names, urls):
                relay = Relay(name, url)
                self.relays[await relay.start(cfg.host)] = relay
            urls = list(self.relays)
        port = self.stable_port("http", cfg.host, cfg.port)  # kept across restarts
        self.proc = await asyncio.create_subprocess_exec(
            *router_command(cfg, urls, port), start_new_session=True,
            stdout=None, stderr=None, preexec_fn=die_with_parent)  # dies with this actor
        self.bound.http = f"http://{cfg.host}:{port}"
        await self._wait_healthy(cfg.health_timeout_s)
        await self._wait_workers(len(urls), time.monotonic() + ALL_WORKERS_WAIT_S)

    async def _wait_healthy(self, timeout_s: float) -> None:
        def exited() -> str | None:
            code = self.proc.returncode
            return None if code is None else f"sglang-router exited with code {code}"

        if await wait_for_health(self.bound.http, exited, timeout_s, request_timeout_s=1.0):
            return
        raise TimeoutError(f"sglang-router did not answer /health within {timeout_s:g} s")

    async def _wait_workers(self, expected: int, deadline: float) -> None:
        """READY once the router routes to every worker it was given (GET /readiness:
        healthy_workers): a request before that would hash its routing key over fewer workers,
        and the key would move when the rest join. After `ALL_WORKERS_WAIT_S` (a worker that is
        down, restarting) it goes on with the workers it has, and says so; a router without
        /readiness is not waited for."""
        if not expected:
            return
        seen = 0
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.returncode is not None:
                    raise RuntimeError(f"sglang-router exited with code {self.proc.returncode}")
                try:
                    async with session.get(f"{self.bound.http}/readiness",
                                           timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                        if r.status == 404:
                            return
                        body = await r.json(content_type=None) if r.status in (200, 503) \
                            else {}
                    seen = int(body.get("healthy_workers", 0)) if isinstance(body, dict) else 0
                    if seen >= expected:
                        return
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
                await asyncio.sleep(0.1)
        log.warning("%s: sglang-router routes to %d of its %d workers after %g s; going on "
                    "(routing keys may move when the others become healthy)", self.name, seen,
                    expected, ALL_WORKERS_WAIT_S)

    async def run(self) -> None:
        if self.relays:
            self.spawn(self._watch_workers(), "watch-workers")
        code = await self.proc.wait()
        raise RuntimeError(f"sglang-router exited unexpectedly with code {code}")

    async def _watch_workers(self) -> None:
        """Cut a relayed worker's connections when sglang-router turns it unhealthy (GET
        /workers), and say so; say when it is healthy again."""
        healthy = {url: True for url in self.relays}
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.sleep(self.config.watch_interval_s)
                states = await self._worker_states(session)
                for url, relay in self.relays.items():
                    now = states.get(url, healthy[url])
                    if healthy[url] and not now:
                        cut = relay.cut()
                        self.notify(f"{relay.name} ({relay.target}) stopped answering "
                                    f"sglang-router's health checks: out of rotation, {cut} "
                                    f"connection(s) to it cut, their requests are retried on "
                                    f"the other workers")
                    elif now and not healthy[url]:
                        self.notify(f"{relay.name} ({relay.target}) is healthy again: back "
                                    f"in rotation")
                    healthy[url] = now

    async def _worker_states(self, session: aiohttp.ClientSession) -> dict[str, bool]:
        """URL -> is_healthy of every worker sglang-router has ({} when it does not answer)."""
        try:
            async with session.get(f"{self.bound.http}/workers",
                                   timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                body = await r.json(content_type=None)
            return {w["url"]: bool(w["is_healthy"]) for w in body["workers"]}
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return {}

    async def on_stop(self, reason: str) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None:
            await terminate(proc, 5.0, group=True)
        for relay in getattr(self, "relays", {}).values():
            await relay.close()


class Relay:
    """A TCP relay in front of one worker: every connection accepted is piped to the worker on
    a connection of its own, byte for byte, until either side ends it or `cut` aborts them all
    (sglang-router sees its requests there fail, and retries them elsewhere)."""

    def __init__(self, name: str, target: str):
        self.name, self.target = name, target  # the worker's actor name and http://host:port
        # every accepted connection's serving task -> its open ends (the accepted one, and the
        # worker's once connected): `cut` and `close` reach a connection still connecting too
        self.links: dict[asyncio.Task, list[asyncio.StreamWriter]] = {}
        self.server: asyncio.Server | None = None

    async def start(self, host: str) -> str:
        """Listen on a free port of `host`; returns the relay's URL."""
        self.server = await asyncio.start_server(self._serve, host, 0)
        return f"http://{host}:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        ends = self.links[task] = [writer]
        try:  # every way out (a failed connect, a cut, a cancelled task) aborts both ends
            target = urlsplit(self.target)
            try:
                up_reader, up_writer = await asyncio.open_connection(target.hostname, target.port)
            except OSError:  # the worker is down: the router sees a failed connection
                return
            ends.append(up_writer)
            if writer.is_closing():  # cut while connecting
                return
            await asyncio.gather(_pipe(reader, up_writer, ends), _pipe(up_reader, writer, ends))
        finally:
            self.links.pop(task, None)
            for end in ends:
                end.transport.abort()

    def cut(self) -> int:
        """Abort every open connection, also those still connecting to the worker (their tasks
        are cancelled); returns how many there were."""
        for task, ends in self.links.items():
            for end in ends:
                end.transport.abort()
            task.cancel()
        return len(self.links)

    async def close(self) -> None:
        """Stop listening, abort every connection, and wait for their tasks to end."""
        if self.server is not None:
            self.server.close()
        tasks = list(self.links)
        self.cut()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                ends: list[asyncio.StreamWriter]) -> None:
    """Copy `reader` into `writer` until end of stream (passed on as a half close); a failed
    side aborts both ends of the connection."""
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
    except (OSError, RuntimeError):
        for end in ends:
            end.transport.abort()
