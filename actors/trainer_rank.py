"""A rank 1..N-1 of the trainer actor: a process of the run like any actor, started by the
launcher (launch/supervisor.py) with the trainer, in one restart group with it.

Role: `python -m runtime.child SPEC.json` with this class. Its config carries the trainer's
own table, its rank, the group's size, its host's address and rank 0's TCP store (host:port,
chosen by the launcher at each start of the group). On start it reaches the store, loads its
state as rank 0 does (training/setup.py) and joins rank 0's group (training/ranks.py
`join_group`; with a model-parallel backend it joins first, its model is built on the groups);
READY then means it is in the group. Its run is rank 0's commands (step, sleep, wake, digest,
hf, save, stop) in a thread of its own, while the actor's loop keeps sending heartbeats; rank
0's stop command completes it. Its process leaves with os._exit (`exit_hard`): a gloo thread
still being torn down by C++ static destructors aborts a clean exit now and then, and a
collective a stop interrupted cannot be joined.
The launcher names these processes `<trainer>.rank<r>` (logs/<trainer>.rank<r>.log).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec

from actors.trainer import TrainerConfig
from actors.trainer_rank_config import TrainerRankConfig, TrainerRankPlan  # noqa: F401
from runtime.actor import ActorContext
from runtime.child import ChildSpec
from training.ranks import join_group, rank_config, serve_commands, use_interface_of
from transport.schema import Endpoints

log = logging.getLogger(__name__)


def _rank_trainer_config(cfg: TrainerRankConfig, run_dir: str) -> TrainerConfig:
    """Rank r's trainer config: the trainer's, on rank r's device and NVMe directory, without
    the prefetcher (it serves rank 0)."""
    trainer = msgspec.convert(cfg.config, TrainerConfig)
    return msgspec.structs.replace(rank_config(trainer, cfg.rank, run_dir), prefetcher="")


class TrainerRank(TrainerRankPlan):
    exit_hard = True  # runtime.child leaves with os._exit (see the module's text)

    async def on_start(self) -> None:
        cfg = self.config
        if not cfg.store:
            raise ValueError(f"{self.name}: no store address (the launcher gives one at start)")
        run_dir = self.ctx.run_dir or "."
        self.trainer_cfg = _rank_trainer_config(cfg, run_dir)
        if cfg.address:  # gloo / NCCL over this host's interface (before the group forms)
            use_interface_of(self.trainer_cfg, cfg.address)
        interface = os.environ.get("GLOO_SOCKET_IFNAME")
        log.info("trainer rank %d of %d on %s (store %s)%s", cfg.rank, cfg.world_size,
                 cfg.address or "the trainer's host", cfg.store,
                 f" over interface {interface}" if interface else "")
        self.ranks, self.state = await self._in_thread(
            join_group, self.trainer_cfg, cfg.rank, cfg.world_size, cfg.store, run_dir,
            self.ctx.resume, cfg.address)
        self._closers.append(self._close_group)

    async def run(self) -> None:
        await self._in_thread(serve_commands, self.state, self.trainer_cfg, self.ranks)
        log.info("trainer rank %d: told to stop; leaving the group", self.config.rank)

    def _close_group(self) -> None:
        if self._busy:  # stopped inside a collective: the process leaves without closing
            return
        self.ranks.close()
        if self.state.teachers is not None:
            self.state.teachers.close()

    _busy = False

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in a daemon thread (a collective blocked on a dead rank 0 must not keep
        the process from exiting); the actor's loop keeps beating meanwhile."""
        loop = asyncio.get_running_loop()
        done: concurrent.futures.Future = concurrent.futures.Future()

        def work() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the loop
                done.set_exception(e)

        self._busy = True
        threading.Thread(target=work, name=f"{self.name}-compute", daemon=True).start()
        result = await asyncio.wrap_future(done, loop=loop)
        self._busy = False
        return result


def start_standalone(cfg: TrainerConfig, run_dir: str, resume: bool, log_dir: Path,
                     store: str, name: str = "trainer") -> list[subprocess.Popen]:
    """Ranks 1..N-1 for a caller that plays rank 0 itself without the launcher (benches,
    tests): the launcher's recipe (`python -m runtime.child SPEC.json` with this class, no
    supervisor), one process each, output in `<log_dir>/<name>.rank<r>.log`. The caller
    watches and stops them; rank 0 opens `store` (training.ranks.load_trainer)."""
    size = cfg.parallel.world_size
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(1, size):
        host = cfg.parallel.rank_host(r)
        config = TrainerRankConfig(trainer=name, rank=r, world_size=size,
                                   config=msgspec.to_builtins(cfg), store=store,
                                   address=host.address if host is not None else "")
        ctx = ActorContext(name=f"{name}.rank{r}",
                           endpoints=Endpoints(control="tcp://127.0.0.1:0"), run_dir=run_dir,
                           resume=resume, start_timeout_s=cfg.parallel.start_timeout_s)
        spec = log_dir / f"{name}.rank{r}.spec.json"
        spec.write_bytes(msgspec.json.encode(ChildSpec(
            cls=f"{__name__}:TrainerRank", context=ctx, config=msgspec.to_builtins(config))))
        with open(log_dir / f"{name}.rank{r}.log", "ab") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "runtime.child", str(spec)], stdout=f, stderr=f,
                stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    return procs
