"""Environments: the task/episode API (`envs.base`), the built-in environments (`envs.builtin`),
loading user environments by dotted path (`envs.loader`) and checking them (`envs.contract`).

Invariant: importing this package imports nothing heavy (no torch, no sockets); environments work
on text only (see `envs.base`).
"""

from envs.base import Environment, Session, SingleTurnEnv, Task
from envs.loader import EnvMix, load_env, load_envs

__all__ = ["Environment", "EnvMix", "Session", "SingleTurnEnv", "Task", "load_env", "load_envs"]
