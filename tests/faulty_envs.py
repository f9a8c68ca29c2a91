"""Environments whose verifier raises: on some tasks, or on every task."""

from __future__ import annotations

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
