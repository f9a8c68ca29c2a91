"""Actor lifecycle in-process: start/stop idempotence, deadlines, fatal errors, terminal states."""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime.actor import Actor, Status
from tests.helpers import context, running
from tests.misbehaving import FailsOnStart, Finisher, Idle, SlowStart, SlowStartConfig


async def test_start_and_stop_are_idempotent(ipc):
    actor = Idle(context("idle", ipc))
    task = asyncio.ensure_future(actor.serve())
    await actor.wait_running()
    await actor.start()
    await actor.start()  # already started: returns at once
    assert actor.status == Status.RUNNING
    actor.stop("first")
    actor.stop("second")  # ignored
    assert await asyncio.wait_for(task, 10) == 0
    assert actor.status == Status.STOPPED
    assert actor._stop_reason == "first"
    actor.stop("after the end")  # still harmless
    assert actor.status == Status.STOPPED


async def test_completed_run_stops_cleanly(ipc):
    actor = Finisher(context("fin", ipc), Finisher.Config(after_s=0.2, steps=2))
    assert await asyncio.wait_for(actor.serve(), 10) == 0
    assert actor.status == Status.STOPPED and actor._completed


async def test_failure_in_on_start_is_terminal_failed(ipc):
    actor = FailsOnStart(context("fails", ipc))
    assert await asyncio.wait_for(actor.serve(), 10) == 1
    assert actor.status == Status.FAILED
    assert "deliberate start failure" in actor._stop_reason


async def test_start_deadline(ipc):
    actor = SlowStart(context("slow", ipc, start_timeout_s=0.3), SlowStartConfig(delay_s=5))
    t0 = time.monotonic()
    assert await asyncio.wait_for(actor.serve(), 10) == 1
    assert time.monotonic() - t0 < 3
    assert actor.status == Status.FAILED
    assert "start_timeout_s" in actor._stop_reason


async def test_stop_during_slow_start_reaches_stopped(ipc):
    actor = SlowStart(context("slow", ipc), SlowStartConfig(delay_s=30))
    task = asyncio.ensure_future(actor.serve())
    await asyncio.sleep(0.3)
    assert actor.status == Status.STARTING
    actor.stop("impatient")
    assert await asyncio.wait_for(task, 5) == 0
    assert actor.status == Status.STOPPED


class TaskFails(Idle):
    async def on_start(self):
        self.sibling_cancelled = asyncio.Event()
        self.spawn(self._sibling(), "sibling")
        self.spawn(self._bad(), "bad")

    async def _sibling(self):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.sibling_cancelled.set()
            raise

    async def _bad(self):
        await asyncio.sleep(0.1)
        raise ValueError("task failure")


async def test_failing_task_fails_actor_and_cancels_the_rest(ipc):
    actor = TaskFails(context("tf", ipc))
    assert await asyncio.wait_for(actor.serve(), 10) == 1
    assert actor.status == Status.FAILED
    assert "ValueError: task failure" == actor._stop_reason
    assert actor.sibling_cancelled.is_set()


class HangsInStop(Idle):
    async def on_stop(self, reason):
        await asyncio.sleep(3600)


async def test_hanging_on_stop_is_bounded(ipc):
    actor = HangsInStop(context("hang", ipc, stop_timeout_s=0.3))
    async with running(actor):
        pass
    assert actor.status == Status.FAILED  # on_stop overran its deadline: reported, still terminal


async def test_serve_cancelled_from_outside_is_terminal(ipc):
    actor = Idle(context("idle", ipc))
    task = asyncio.ensure_future(actor.serve())
    await actor.wait_running()
    task.cancel()
    assert await asyncio.wait_for(task, 10) == 0
    assert actor.status == Status.STOPPED


def test_spawn_needs_serve(ipc):
    actor = Actor(context("a", ipc))
    coro = asyncio.sleep(0)
    with pytest.raises(AssertionError):
        actor.spawn(coro)
    coro.close()
    actor.factory.close()
