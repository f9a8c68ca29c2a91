"""The router actor: runs sglang-router in front of the inference workers it depends on.

The router process is a child of this actor: started in on_start with the workers' HTTP URLs
(from the peers listed in `after`), waited for until it answers /health, stopped in on_stop. Its
URL is reported as this actor's `http` endpoint. `/generate` goes through the router; control
calls (weight updates, pause/continue) must go to each worker directly, since the router does not
forward them. Options in the `router_args` table pass through to sglang-router as `--key value`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time

import aiohttp
import msgspec

from actors.base import Actor


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of the sglang-router process."""

    workers: list[str] = []  # peer actor names of the inference workers ([] = every http peer)
    policy: str = "consistent_hashing"  # sticky by X-SMG-Routing-Key; or round_robin, cache_aware...
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    health_timeout_s: float = 60.0  # the router must answer /health within this
    router_args: dict[str, str | int | float | bool] = {}  # passed as --key value to sglang-router


def free_port(host: str) -> int:
    """A port free right now (the router binds it itself a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_command(cfg: RouterConfig, worker_urls: list[str], port: int) -> list[str]:
    cmd = [sys.executable, "-m", "engine.router_main", "--worker-urls", *worker_urls,
           "--host", cfg.host, "--port", str(port)]
    cli_policies = {"random", "round_robin", "cache_aware", "power_of_two"}
    if cfg.policy in cli_policies:
        cmd += ["--policy", cfg.policy]
    else:
        cmd += ["--then-policy", cfg.policy]
    if "prometheus_port" not in cfg.router_args:  # its fixed default collides between routers
        cmd += ["--prometheus-port", str(free_port(cfg.host))]
    for key, value in cfg.router_args.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            cmd.append(flag)
        elif value is not False:
            cmd += [flag, str(value)]
    return cmd


class RouterActor(Actor):
    Config = RouterConfig
    role = "router"

    async def on_start(self) -> None:
        cfg = self.config
        names = cfg.workers or [n for n, ep in self.ctx.peers.items() if ep.http]
        urls = [self.peer(n).http for n in names]
        if not urls:
            raise ValueError(f"{self.name}: no inference workers; list them in `after`")
        port = cfg.port or free_port(cfg.host)
        self.proc = await asyncio.create_subprocess_exec(
            *router_command(cfg, urls, port), start_new_session=True,
            stdout=None, stderr=None)
        self.bound.http = f"http://{cfg.host}:{port}"
        await self._wait_healthy(cfg.health_timeout_s)

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.returncode is not None:
                    raise RuntimeError(f"sglang-router exited with code {self.proc.returncode}")
                try:
                    async with session.get(f"{self.bound.http}/health",
                                           timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.2)
        raise TimeoutError(f"sglang-router did not answer /health within {timeout_s:g} s")

    async def run(self) -> None:
        code = await self.proc.wait()
        raise RuntimeError(f"sglang-router exited unexpectedly with code {code}")

    async def on_stop(self, reason: str) -> None:
        proc = getattr(self, "proc", None)
        if proc is None or proc.returncode is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
