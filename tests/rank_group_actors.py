"""Stand-ins for a trainer and its ranks (a restart group of the launcher, launch/supervisor.py)
without torch: every start is appended to <run_dir>/starts.txt with the store it was given (and
each member's run, once the launcher has its READY), and members fail on cue (the `config`
table the launcher copies from the leader to its ranks). What the tests wait for are conditions
(files), never times: a machine under load may take seconds for any step."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import msgspec

from runtime.actor import Actor


class LeaderConfig(msgspec.Struct, forbid_unknown_fields=True):
    ranks: int = 2  # the group's size (this actor and ranks - 1 members)
    # "start": rank 1 exits (code 3) before READY on every start; "once": rank 1 exits (code 5)
    # after READY on the first start only; "early": the leader completes at once, and the
    # members report READY only once its process has exited (a leader quicker than its group's
    # start: not a failure)
    fail: str = ""
    store: str = ""  # the group's store (the launcher writes it at each start)


def record(run_dir: str, line: str) -> None:
    with open(Path(run_dir) / "starts.txt", "a") as f:
        f.write(line + "\n")


class Leader(Actor):
    Config = LeaderConfig
    rank_cls = "tests.rank_group_actors:Member"
    store_path = "store"

    @classmethod
    def ranks(cls, config: LeaderConfig) -> list[str]:
        return [""] * (config.ranks - 1)

    async def on_start(self) -> None:
        record(self.ctx.run_dir, f"leader {self.config.store}")

    async def run(self) -> None:
        starts = (Path(self.ctx.run_dir) / "starts.txt").read_text().splitlines()
        if self.config.fail == "once" and sum(s.startswith("leader") for s in starts) == 1:
            await asyncio.Event().wait()  # its rank 1 fails: the launcher restarts both
        if self.config.fail == "early":
            record(self.ctx.run_dir, f"leader pid {os.getpid()}")
            return
        # like a trainer, whose work needs its ranks: it completes only once every member of
        # this start runs (the launcher has their READY), never while the group still starts
        await group_running(Path(self.ctx.run_dir), self.config.store, self.config.ranks)
        await asyncio.sleep(0.5)


class MemberConfig(msgspec.Struct, forbid_unknown_fields=True):
    trainer: str
    rank: int
    world_size: int
    config: dict[str, Any]
    store: str = ""
    address: str = ""


async def group_running(run_dir: Path, store: str, ranks: int) -> None:
    """Until every member of the start given `store` runs (its READY acknowledged by the
    launcher: an actor runs only after that)."""
    want = {f"running {r}/{ranks} {store}" for r in range(1, ranks)}
    while not want <= set((run_dir / "starts.txt").read_text().splitlines()):
        await asyncio.sleep(0.05)


async def group_started(run_dir: Path) -> None:
    """Until the launcher lists the run's actors in endpoints.json: every start is over (it
    writes the file whole, once start_all has seen every READY)."""
    path = run_dir / "endpoints.json"
    while True:
        try:
            if "actors" in json.loads(path.read_text()):
                return
        except (OSError, ValueError):
            pass
        await asyncio.sleep(0.05)


async def leader_gone(run_dir: Path) -> None:
    """Until the leader's process has completed and the launcher has reaped it (a zombie still
    answers signal 0)."""
    while True:
        pids = [int(line.split()[-1]) for line in (run_dir / "starts.txt").read_text()
                .splitlines() if line.startswith("leader pid ")]
        if pids:
            try:
                os.kill(pids[-1], 0)
            except ProcessLookupError:
                return
        await asyncio.sleep(0.05)


class Member(Actor):
    Config = MemberConfig

    async def on_start(self) -> None:
        cfg = self.config
        record(self.ctx.run_dir, f"member {cfg.rank}/{cfg.world_size} of {cfg.trainer} "
                                 f"{cfg.store}")
        if cfg.config.get("fail") == "start" and cfg.rank == 1:
            print("rank 1: no such checkpoint", flush=True)
            os._exit(3)
        if cfg.config.get("fail") == "early":
            await leader_gone(Path(self.ctx.run_dir))

    async def run(self) -> None:
        cfg = self.config
        record(self.ctx.run_dir, f"running {cfg.rank}/{cfg.world_size} {cfg.store}")
        died = Path(self.ctx.run_dir) / "died"
        if cfg.config.get("fail") == "once" and cfg.rank == 1 and not died.exists():
            died.write_text("")
            await group_started(Path(self.ctx.run_dir))  # dies after READY, not during start
            print("rank 1: lost", flush=True)
            os._exit(5)
        await asyncio.Event().wait()
