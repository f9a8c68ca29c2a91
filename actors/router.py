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
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

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


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of the sglang-router process."""

    workers: list[str] = []  # peer actor names of the inference workers ([] = every http peer)
    policy: str = "consistent_hashing"  # sticky by X-SMG-Routing-Key; or round_robin, cache_aware...
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    health_timeout_s: float = 60.0  # the router must answer /health within this
    dynamic_workers: bool = False  # workers register themselves (POST /workers); may start empty
    max_body_bytes: int = 64 << 20  # larger request bodies get 413 before they are read (bytes;
    # sglang-router's max_payload_size; as the embedded workers' max_body_bytes)
    router: dict[str, Any] = {}  # sglang-router options, passed through as --key value


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
    options = dict(cfg.router)
    if "prometheus_port" not in options:  # its fixed default collides between routers
        cmd += ["--prometheus-port", str(free_port(cfg.host))]
    return cmd + render(options)


# Options the router actor sets itself -> the config field that sets each.
OWNED = {"host": "host", "port": "port", "worker_urls": "workers", "policy": "policy",
         "max_payload_size": "max_body_bytes"}


class RouterActor(Actor):
    Config = RouterConfig
    role = "router"

    @classmethod
    def check_config(cls, config: RouterConfig) -> None:
        refuse_owned(config.router, OWNED, "router")
        if config.max_body_bytes < 1:
            raise ValueError(f"router: max_body_bytes must be >= 1, got {config.max_body_bytes}")

    @classmethod
    def bound_ports(cls, config: RouterConfig) -> list[tuple[str, str, str, int]]:
        """Fixed ports besides `port` that sglang-router binds, as (table under this actor's
        config, field, address, port), for the launcher's check at load: the Prometheus port."""
        port = config.router.get("prometheus_port")
        address = str(config.router.get("prometheus_host", "0.0.0.0"))  # sglang-router's default
        return [("router", "prometheus_port", address, port)] if isinstance(port, int) else []

    async def on_start(self) -> None:
        cfg = self.config
        names = cfg.workers or [n for n, ep in self.ctx.peers.items() if ep.http]
        urls = [self.peer(n).http for n in names]
        if not urls and not cfg.dynamic_workers:
            raise ValueError(f"{self.name}: no inference workers; list them in `after`, or set "
                             f"dynamic_workers = true for workers that register themselves")
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
        code = await self.proc.wait()
        raise RuntimeError(f"sglang-router exited unexpectedly with code {code}")

    async def on_stop(self, reason: str) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None:
            await terminate(proc, 5.0, group=True)
