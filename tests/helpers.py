"""Helpers for in-process actor tests."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from runtime.actor import Actor, ActorContext
from transport.schema import Endpoints


def context(name: str, ipc, **kw) -> ActorContext:
    """An ActorContext binding fresh ipc:// endpoints (no supervisor, no metrics)."""
    eps = Endpoints(control=ipc(f"{name}.ctl"), rpc=ipc(f"{name}.rpc"), inbox=ipc(f"{name}.in"))
    return ActorContext(name=name, endpoints=eps, **kw)


@asynccontextmanager
async def running(actor: Actor, timeout_s: float = 10.0):
    """Serve `actor` in a task; yields once RUNNING; stops it and checks the exit code after."""
    task = asyncio.ensure_future(actor.serve())
    try:
        async with asyncio.timeout(timeout_s):
            waiter = asyncio.ensure_future(actor.wait_running())
            await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        if task.done():
            task.result()
            raise AssertionError(f"{actor.name} stopped during start: {actor.status}")
        yield actor
    finally:
        actor.stop("test over")
        await asyncio.wait_for(task, timeout_s)
