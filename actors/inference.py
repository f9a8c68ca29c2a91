"""The inference worker actor: one model behind SGLang's HTTP API.

Role: loads a model (a tiny built-in name or a local HF checkpoint directory), runs the batching
engine (engine/scheduler.py) and serves it over HTTP (engine/server.py); rollout actors reach it
with `engine.client.SglangClient(endpoints.http)`. Invariant: once RUNNING, `self.bound.http` is
the base URL of a server that answers; on stop the HTTP server, the scheduler loop and the
engine's forward thread are all closed, whatever point start-up had reached.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from actors.inference_config import (  # noqa: F401 - InferenceWorkerConfig: also read from here
    InferenceWorkerConfig,
    InferenceWorkerPlan,
)
from engine.scheduler import Scheduler
from engine.server import EngineServer, start_server
from memory.device_usage import process_device_bytes, storage_bytes
from runtime.devices import gpu_ids
from transport.dtypes import model_dtype
from transport.http import stop_http

log = logging.getLogger(__name__)


class InferenceWorker(InferenceWorkerPlan):
    """The worker itself: its settings and launcher checks are `InferenceWorkerPlan`'s
    (actors/inference_config.py)."""

    def __init__(self, ctx, config=None):
        super().__init__(ctx, config)
        self.scheduler: Scheduler | None = None
        self.server: EngineServer | None = None
        self._runner = None

    async def on_start(self) -> None:
        cfg = self.config
        self.scheduler = await Scheduler.create(
            cfg.model, device=cfg.device, dtype=model_dtype(cfg.dtype), seed=cfg.seed,
            max_batch_size=cfg.max_batch_size, batch_wait_ms=cfg.batch_wait_ms,
            weight_version=cfg.weight_version, true_on_policy=cfg.true_on_policy,
            weights_backup=cfg.weights_cpu_backup)
        self.scheduler.on_memory_change = self._publish_memory  # every phase switch, exactly
        self.spawn(self.scheduler.run(), "scheduler")
        if cfg.catch_up and self.ctx.run_dir:
            await self._catch_up(Path(self.ctx.run_dir) / "weights")
        info = {"model_path": cfg.model, "tokenizer_path": cfg.model, "host": cfg.host,
                "device": cfg.device, "dtype": cfg.dtype, "random_seed": cfg.seed,
                "batch_wait_ms": cfg.batch_wait_ms, "true_on_policy": cfg.true_on_policy}
        self.server = EngineServer(self.scheduler, info, max_body_bytes=cfg.max_body_bytes,
                                   routes_always=cfg.return_routed_experts)
        self._runner, port = await start_server(self.server, cfg.host,
                                                self.stable_port("http", cfg.host, cfg.port))
        info["port"] = port
        self.bound.http = f"http://{cfg.host}:{port}"
        self.bound.devices = gpu_ids([cfg.device])

    async def _catch_up(self, folder: Path) -> None:
        """Load the newest complete version in `folder` (v<N> directories); a partial one (the
        trainer died while writing it) is skipped for the one before."""
        versions = sorted((int(p.name[1:]), p) for p in folder.glob("v*") if p.name[1:].isdigit())
        for version, path in reversed(versions):
            ok, message, _ = await self.scheduler.update_weights_from_disk(str(path), str(version))
            if ok:
                log.info("%s: caught up to weight version %d (%s)", self.name, version, path)
                return
            log.warning("%s: cannot load weight version %d: %s", self.name, version, message)

    async def run(self) -> None:
        """Publish what the worker holds on its device, and whether its memory is released, so
        that colocated runs show each side's memory per phase: periodically, and right after
        every release / resume (a periodic sample alone can miss a short phase)."""
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            self._publish_memory()

    def _publish_memory(self) -> None:
        """`memory/nvml_bytes`: what NVML (nvidia-smi) shows for this process, the CUDA context
        and the allocator's cache included; `memory/device_bytes`: what torch's allocator
        reserves (CUDA) or the model's storages (CPU)."""
        if self.metrics and self.scheduler is not None:
            s = self.scheduler.stats()
            values = {"memory/device_bytes": device_bytes(self.scheduler.model,
                                                          self.config.device),
                      "memory/released": float(bool(s["released"])),
                      "engine/waves": s["waves"], "engine/running": s["running"]}
            nvml = process_device_bytes() if self.config.device.startswith("cuda") else None
            if nvml is not None:  # what nvidia-smi shows for this process
                values["memory/nvml_bytes"] = nvml
            self.metrics.publish(values)

    async def on_stop(self, reason: str) -> None:
        if self._runner is not None:
            await stop_http(self._runner)
        if self.server is not None:
            await self.server.weights.close()
        if self.scheduler is not None:
            await self.scheduler.close()

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        if self.scheduler is not None:
            s = self.scheduler.stats()
            out.update(waves=s["waves"], decode_steps=s["decode_steps"],
                       max_wave_size=s["max_wave_size"])
        return out


def device_bytes(model, device: str) -> int:
    """Bytes the process holds on its device as torch's allocator sees them (cached blocks
    included: they are not free for another process), or, on CPU, in the model's storages
    (0 for released weights)."""
    if device.startswith("cuda"):
        return torch.cuda.memory_reserved(torch.device(device))
    return storage_bytes(model.parameters())
