"""Environments whose verifier raises (on some tasks, or on every task), hangs, or is slow."""

from __future__ import annotations

import threading
import time
import zlib

from envs.base import Task
from envs.builtin.arith import ArithEnv


class SometimesBroken(ArithEnv):
    """Addition whose reward() raises on about one task in four (by task id)."""

    def reward(self, task: Task, response: str) -> float:
        if zlib.crc32(task.id.encode()) % 4 == 0:
            raise ZeroDivisionError(f"verifier bug on task {task.id}")
        return super().reward(task, response)


class AlwaysBroken(ArithEnv):
    def reward(self, task: Task, response: str) -> float:
        raise RuntimeError("the verifier's service is down")


class HangingVerifier(ArithEnv):
    """Addition whose reward() blocks until `release` is set (a verifier that hangs)."""

    release = threading.Event()

    def reward(self, task: Task, response: str) -> float:
        self.release.wait()
        return 0.0


class SlowVerifier(ArithEnv):
    """Addition whose reward() takes `delay_s` (a slow verifier that does return)."""

    delay_s = 0.1

    def reward(self, task: Task, response: str) -> float:
        time.sleep(self.delay_s)
        return super().reward(task, response)
