"""Test classes for the launcher's fault handling: restarts that fail, a run that waits for the
test before it completes, an environment and an actor config that raise when constructed."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec

from envs.builtin.arith import ArithEnv
from runtime.actor import Actor


class FailingRestartsConfig(msgspec.Struct, forbid_unknown_fields=True):
    marker_dir: str  # one file per process start, counted across restarts
    failed_starts: int = 2  # restarted processes that fail in on_start before one starts
    after_s: float = 0.3  # the first process dies this long after READY


class FailingRestarts(Actor):
    """The first process dies hard (os._exit(7)) after READY; the next `failed_starts` fail in
    on_start; the one after starts and completes."""

    Config = FailingRestartsConfig

    async def on_start(self) -> None:
        folder = Path(self.config.marker_dir)
        self.start = len(list(folder.glob("start-*")))
        (folder / f"start-{self.start}").write_text(str(os.getpid()))
        if 1 <= self.start <= self.config.failed_starts:
            raise RuntimeError(f"deliberate failure of start {self.start}")

    async def run(self) -> None:
        if self.start == 0:
            await asyncio.sleep(self.config.after_s)
            os._exit(7)


class WaitsForFileConfig(msgspec.Struct, forbid_unknown_fields=True):
    path: str  # completes once this file exists
    interval_s: float = 0.05  # a metrics record this often until then


class WaitsForFile(Actor):
    """Publishes a metrics record every `interval_s` until `path` exists, then completes."""

    Config = WaitsForFileConfig

    async def run(self) -> None:
        step = 0
        while not os.path.exists(self.config.path):
            step += 1
            if self.metrics:
                self.metrics.publish({"value": float(step)}, step=step)
            await asyncio.sleep(self.config.interval_s)


class MissingDataset(ArithEnv):
    """Its constructor fails as one that reads a dataset file that is not there."""

    def __init__(self, path: str = "/nowhere/tasks.jsonl"):
        raise FileNotFoundError(f"dataset {path} does not exist\n(a second line)")


class StrictConfig(msgspec.Struct, forbid_unknown_fields=True):
    limit: int = 1  # below 0 fails in __post_init__; -1 with ValueError, less with RuntimeError

    def __post_init__(self) -> None:
        if self.limit == -1:
            raise ValueError(f"limit = {self.limit}: use 0 or more")
        if self.limit < -1:
            raise RuntimeError("the limit service is down")


class Strict(Actor):
    Config = StrictConfig
