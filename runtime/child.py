"""Entry point of every actor process: `python -m runtime.child SPEC.json`.

Invariant: a child never outlives its launcher. It asks the kernel for SIGTERM when its parent
dies (PR_SET_PDEATHSIG) and also watches its parent pid, hard-exiting if an orderly stop does not
finish in time. SIGTERM/SIGINT become an orderly `stop()`; the exit code is the actor's. An actor
class with `exit_hard = True` (the trainer's ranks: C++ teardown of torch.distributed, threads
blocked in a collective) leaves with os._exit after its stop, logs flushed.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys

import msgspec

from runtime.actor import Actor, ActorContext
from runtime.loading import actor_config, import_actor

PR_SET_PDEATHSIG = 1


class ChildSpec(msgspec.Struct, forbid_unknown_fields=True):
    cls: str
    context: ActorContext
    config: dict = {}


def die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the pid watch below still applies
        pass


# after the launcher dies: the orderly stop may take this long before the process hard-exits
LAUNCHER_GONE_GRACE_S = 4.0


async def watch_parent(actor: Actor, parent_pid: int, grace_s: float) -> None:
    """Stop the actor within 0.2 s of the launcher's death; hard-exit `grace_s` later."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(0.2)
    actor.stop("launcher died")
    await asyncio.sleep(grace_s)
    os._exit(3)


async def main(spec: ChildSpec) -> int:
    cls = import_actor(spec.cls)
    config = actor_config(cls, spec.config, f"[actors.{spec.context.name}.config]")
    actor = cls(spec.context, config)
    parent = os.getppid()
    actor.supervisor_alive = lambda: os.getppid() == parent
    watcher = asyncio.ensure_future(watch_parent(
        actor, parent, min(spec.context.stop_timeout_s, LAUNCHER_GONE_GRACE_S)))
    try:
        return await actor.serve(handle_signals=True)
    finally:
        watcher.cancel()


def run(argv: list[str]) -> int:
    die_with_parent()
    if len(argv) != 1:
        print("usage: python -m runtime.child SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        spec = msgspec.json.decode(f.read(), type=ChildSpec)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {spec.context.name} %(levelname)s %(message)s")
    try:
        import uvloop
    except ImportError:
        code = asyncio.run(main(spec))
    else:
        code = uvloop.run(main(spec))
    if import_actor(spec.cls).exit_hard:
        end_multiprocessing()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def end_multiprocessing() -> None:
    """What multiprocessing's exit handler would do, which an os._exit skips: shut down the
    managers this process started (megatron-core's checkpoint writer starts a Manager server
    process on its first save, and it would outlive the process) and end its other children
    (waits bounded)."""
    if "multiprocessing" not in sys.modules:
        return
    from multiprocessing import active_children, util

    util._run_finalizers(0)  # managers: shutdown, join 1 s, terminate
    for child in active_children():
        child.terminate()
        child.join(1.0)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
