"""Deliberately misbehaving actors that prove the supervisor and the lifecycle."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import msgspec

from runtime.actor import Actor, EndRun


class Idle(Actor):
    """Behaves: serves control requests and does nothing else."""


class FinisherConfig(msgspec.Struct, forbid_unknown_fields=True):
    after_s: float = 1.0  # complete this long after start
    steps: int = 5  # metrics records published on the way


class Finisher(Actor):
    """Publishes a few metrics records, then completes."""

    Config = FinisherConfig

    async def run(self) -> None:
        for step in range(1, self.config.steps + 1):
            await asyncio.sleep(self.config.after_s / self.config.steps)
            if self.metrics:
                self.metrics.publish({"value": float(step)}, step=step,
                                     total_steps=self.config.steps)


class NeverAnswersShutdown(Actor):
    """Swallows the Shutdown request: the launcher must escalate to SIGTERM."""

    def _control_handlers(self):
        handlers = super()._control_handlers()
        from transport.schema import Shutdown

        async def never(msg):
            await asyncio.Event().wait()

        handlers[Shutdown] = never
        return handlers


class IgnoresSigterm(NeverAnswersShutdown):
    """Also ignores SIGTERM: only SIGKILL ends it."""

    async def on_start(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class FailsOnStart(Actor):
    async def on_start(self) -> None:
        raise RuntimeError("deliberate start failure")


class SlowStartConfig(msgspec.Struct, forbid_unknown_fields=True):
    delay_s: float = 1.0


class SlowStart(Actor):
    Config = SlowStartConfig

    async def on_start(self) -> None:
        await asyncio.sleep(self.config.delay_s)


class CrashOnceConfig(msgspec.Struct, forbid_unknown_fields=True):
    marker: str  # file created by the first incarnation, which then crashes
    after_s: float = 0.5


class CrashOnce(Finisher):
    """The first incarnation dies hard (os._exit); the restarted one completes."""

    Config = CrashOnceConfig

    async def run(self) -> None:
        await asyncio.sleep(self.config.after_s)
        marker = Path(self.config.marker)
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(7)


class RaisesConfig(msgspec.Struct, forbid_unknown_fields=True):
    after_s: float = 0.3


class Raises(Actor):
    """Fails with an exception in its main task: a DEAD report, exit code 1."""

    Config = RaisesConfig

    async def run(self) -> None:
        await asyncio.sleep(self.config.after_s)
        raise RuntimeError("boom: deliberate failure in run()")


class Blocks(Actor):
    """Blocks its event loop forever after start: heartbeats stop."""

    async def run(self) -> None:
        await asyncio.sleep(0.2)
        time.sleep(3600)


class GivesUp(Actor):
    """Tells the console what is wrong, then ends the run (restarting would not help)."""

    async def run(self) -> None:
        self.notify("the data source is empty")
        await asyncio.sleep(0.2)  # the notice reaches the launcher first
        raise EndRun("nothing to train on: the data source is empty")


class ManagerConfig(msgspec.Struct, forbid_unknown_fields=True):
    pid_file: str  # where the Manager server's pid is written


class HardExitWithManager(Finisher):
    """Leaves with os._exit (`exit_hard`, as a trainer's rank) after starting a multiprocessing
    Manager server, as megatron-core's checkpoint writer does on its first save."""

    Config = ManagerConfig
    exit_hard = True

    async def on_start(self) -> None:
        import multiprocessing

        self.manager = multiprocessing.get_context("spawn").Manager()
        Path(self.config.pid_file).write_text(str(self.manager._process.pid))

    async def run(self) -> None:
        await asyncio.sleep(0.1)
