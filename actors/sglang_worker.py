"""The SGLang worker actor: one `python -m sglang.launch_server` process, supervised.

Role: starts SGLang's own server with the options the project owns (`--model-path`, `--host`,
`--port`, `--tp-size`, `--dp-size`) and every other option passed through natively from the
`sglang` table (hosts.toml `sglang = { option = value }` or `--sglang-<option> [value]` on the
launcher's command line; see runtime/passthrough.py for the value rules). Waits for `/health`,
registers with a router actor started with `dynamic_workers = true` (sglang-router 0.3.2:
`POST /workers {"url"}` answers 202 with a `worker_id`; the worker is routable once
`GET /workers` lists it healthy; `DELETE /workers/<worker_id>` removes it), and reports its
URL as this actor's `http` endpoint, so trainers and rollouts reach it like an embedded worker.

    [actors.router]
    cls = "actors.router:RouterActor"
    config = { dynamic_workers = true, router = { log_level = "warn" } }

    [actors.sg0]
    cls = "actors.sglang_worker:SglangWorker"
    after = ["router"]
    start_timeout_s = 900        # above health_timeout_s: loading takes minutes
    config = { model_path = "Qwen/Qwen3-8B", tp_size = 2, register_with = "router",
               env = { CUDA_VISIBLE_DEVICES = "0,1" },
               sglang = { mem_fraction_static = 0.7, enable_memory_saver = true } }

`python -m launch.cluster hosts.toml --sglang-cuda-graph-max-bs 256` adds
`--cuda-graph-max-bs 256` to every SGLang worker's command line.

Invariants:
- The server's output goes to `<run_dir>/logs/<actor>.sglang.log`. When the server exits during
  start (an SGLang option that does not exist: argparse exits at once), the start fails quoting
  argparse's `error:` line and the log path; when it does not answer /health within
  `health_timeout_s`, the start fails with the log path and its last lines.
- The server process (its own session, and its children: SGLang's scheduler and detokenizer
  processes) is stopped whatever point start-up had reached, after deregistering from the router;
  it also gets SIGTERM if this actor's process dies (PR_SET_PDEATHSIG).
- Timeouts here raise RuntimeError (a TimeoutError escaping on_start would be reported as the
  actor's own start_timeout_s, without the log). The health wait ends 2 s before the actor's
  `start_timeout_s` if that comes first, saying so: raise `start_timeout_s` in the actor's table
  (and the run's `ready_timeout_s`) above `health_timeout_s`, since loading takes minutes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from engine.client import wait_for_health
from runtime.actor import Actor
from runtime.child import die_with_parent
from runtime.devices import gpu_ids
from runtime.passthrough import refuse_owned, render
from runtime.procs import log_tail, terminate

log = logging.getLogger(__name__)

# Options the project sets itself, with the SGLang aliases of each (argparse also accepts a
# unique prefix, so `tp`/`dp` are refused too): field of this actor's config that sets it.
OWNED = {"model_path": "model_path", "model": "model_path", "host": "host", "port": "port",
         "tp_size": "tp_size", "tensor_parallel_size": "tp_size", "tp": "tp_size",
         "dp_size": "dp_size", "data_parallel_size": "dp_size", "dp": "dp_size"}


class SglangWorkerConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of one SGLang server."""

    model_path: str  # HF checkpoint directory or hub id (--model-path)
    host: str = "127.0.0.1"  # address the server binds (--host)
    port: int = 0  # HTTP port (--port); 0 = a port free at start
    tp_size: int = 1  # tensor-parallel GPUs of this server (--tp-size)
    dp_size: int = 1  # data-parallel replicas inside this server (--dp-size)
    sglang: dict[str, Any] = {}  # every other launch_server option, passed through natively
    register_with: str = ""  # router actor (a peer in `after`) to register with; "" = none
    python: str = ""  # interpreter with sglang installed ("" = this actor's own)
    env: dict[str, str] = {}  # extra environment of the server (e.g. CUDA_VISIBLE_DEVICES)
    health_timeout_s: float = 600.0  # /health must answer 200 within this after the start
    register_timeout_s: float = 30.0  # the router must list this worker healthy within this
    term_timeout_s: float = 5.0  # wait after SIGTERM before SIGKILL when stopping
    log_tail_lines: int = 30  # lines of the server log quoted when the start fails


def server_command(cfg: SglangWorkerConfig, port: int) -> list[str]:
    """The launch_server command line: owned options first, then the pass-through table."""
    return [cfg.python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", cfg.model_path, "--host", cfg.host, "--port", str(port),
            "--tp-size", str(cfg.tp_size), "--dp-size", str(cfg.dp_size), *render(cfg.sglang)]


def server_devices(cfg: SglangWorkerConfig) -> list[str]:
    """The CUDA devices (as the server's process numbers them) its tp_size x dp_size ranks
    use: SGLang places rank i on `base_gpu_id + i * gpu_id_step`."""
    opts = {k.replace("-", "_"): v for k, v in cfg.sglang.items()}
    base, step = int(opts.get("base_gpu_id", 0)), int(opts.get("gpu_id_step", 1))
    return [f"cuda:{base + i * step}" for i in range(cfg.tp_size * cfg.dp_size)]


def argparse_error(path: Path) -> str:
    """The `prog: error: ...` line argparse printed before exiting, or ''."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    errors = [line.strip() for line in text.splitlines() if ": error: " in line]
    return errors[-1] if errors else ""


class SglangWorker(Actor):
    Config = SglangWorkerConfig
    role = "inference"
    # what it runs, checked on its host by `--dry-run` (launch/dryrun.py): module -> the pip
    # requirement that installs it, importable by the interpreter in config field `python`
    needs = {"sglang": "sglang[all]"}
    needs_python = "python"

    @classmethod
    def bound_ports(cls, config: SglangWorkerConfig) -> list[tuple[str, str, str, int]]:
        return [("", "port", config.host, config.port)]  # the SGLang server (--port)

    @classmethod
    def check_config(cls, config: SglangWorkerConfig) -> None:
        refuse_owned(config.sglang, OWNED, "sglang")
        if config.tp_size < 1 or config.dp_size < 1:
            raise ValueError("tp_size and dp_size must be at least 1")

    @classmethod
    def gpus(cls, config: SglangWorkerConfig, env: dict[str, str], host: str) -> list[str]:
        return gpu_ids(server_devices(config), {**env, **config.env}, host)

    def __init__(self, ctx, config=None):
        super().__init__(ctx, config)
        self.proc: asyncio.subprocess.Process | None = None
        self.worker_id = ""
        self.router_url = ""
        self.log_path = Path(ctx.run_dir or ".") / "logs" / f"{ctx.name}.sglang.log"

    async def on_start(self) -> None:
        cfg = self.config
        self.check_config(cfg)
        port = self.stable_port("http", cfg.host, cfg.port)  # kept across restarts
        self.url = f"http://{cfg.host}:{port}"
        await self._spawn(server_command(cfg, port))
        await self._wait_healthy()
        if cfg.register_with:
            self.router_url = self.peer(cfg.register_with).http
            await self._register()
        self.bound.http = self.url
        self.bound.devices = self.gpus(cfg, dict(os.environ), socket.gethostname())

    async def _spawn(self, cmd: list[str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.config.env, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as logf:
            logf.write(f"=== {time.ctime()}: {' '.join(cmd)}\n".encode())
            logf.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *cmd, stdout=logf, stderr=logf, stdin=asyncio.subprocess.DEVNULL, env=env,
                start_new_session=True, preexec_fn=die_with_parent)
        log.info("%s: started launch_server (pid %d), log %s", self.name, self.proc.pid,
                 self.log_path)

    async def _wait_healthy(self) -> None:
        cfg = self.config
        # the actor's own start deadline must not fire first: its message would lose the log
        limit_s, limit = cfg.health_timeout_s, f"health_timeout_s = {cfg.health_timeout_s:g}"
        if self.ctx.start_timeout_s - 2.0 < limit_s:
            limit_s = max(self.ctx.start_timeout_s - 2.0, 1.0)
            limit = (f"the actor's start_timeout_s = {self.ctx.start_timeout_s:g} (raise it in "
                     f"the actor's table, above health_timeout_s)")

        def exited() -> str | None:
            return self._exit_message() if self.proc.returncode is not None else None

        if await wait_for_health(self.url, exited, limit_s):
            return
        raise RuntimeError(f"sglang.launch_server did not answer /health within {limit}; log "
                           f"{self.log_path}, last lines:\n"
                           f"{log_tail(self.log_path, cfg.log_tail_lines)}")

    def _exit_message(self) -> str:
        code = self.proc.returncode
        error = argparse_error(self.log_path)
        if error:
            return (f"sglang.launch_server rejected its arguments (exit code {code}): {error}; "
                    f"log {self.log_path}")
        return (f"sglang.launch_server exited with code {code} during start; log "
                f"{self.log_path}, last lines:\n"
                f"{log_tail(self.log_path, self.config.log_tail_lines)}")

    async def _register(self) -> None:
        """POST /workers, then wait until the router lists this worker as healthy."""
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(f"{self.router_url}/workers", json={"url": self.url}) as r:
                body = await r.json(content_type=None)
                if r.status >= 300 or not isinstance(body, dict):
                    raise RuntimeError(f"router {self.router_url} refused worker {self.url}: "
                                       f"HTTP {r.status} {body}")
                self.worker_id = str(body.get("worker_id", ""))
            deadline = time.monotonic() + self.config.register_timeout_s
            while time.monotonic() < deadline:
                if await registered(session, self.router_url, self.url):
                    log.info("%s: registered with %s as %s", self.name, self.router_url,
                             self.worker_id)
                    return
                await asyncio.sleep(0.2)
        raise RuntimeError(f"router {self.router_url} did not list {self.url} as healthy within "
                           f"register_timeout_s = {self.config.register_timeout_s:g}")

    async def run(self) -> None:
        code = await self.proc.wait()
        raise RuntimeError(f"sglang.launch_server exited unexpectedly with code {code}; log "
                           f"{self.log_path}, last lines:\n"
                           f"{log_tail(self.log_path, self.config.log_tail_lines)}")

    async def on_stop(self, reason: str) -> None:
        if self.worker_id:
            await self._deregister()
        if self.proc is not None:
            await terminate(self.proc, self.config.term_timeout_s, group=True)

    async def _deregister(self) -> None:
        url = f"{self.router_url}/workers/{self.worker_id}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                async with session.delete(url) as r:
                    if r.status >= 300:
                        log.warning("%s: DELETE %s answered %d", self.name, url, r.status)
        except (aiohttp.ClientError, TimeoutError) as e:  # the router may be gone already
            log.warning("%s: could not deregister from %s: %s", self.name, self.router_url, e)
        self.worker_id = ""


async def registered(session: aiohttp.ClientSession, router_url: str, url: str) -> bool:
    """True when the router's GET /workers lists `url` as healthy."""
    async with session.get(f"{router_url}/workers") as r:
        body = await r.json(content_type=None)
    workers = body.get("workers", []) if isinstance(body, dict) else []
    return any(w.get("url") == url and w.get("is_healthy", True) for w in workers)
