"""A trainer rank as the launcher sees it (actors/trainer_rank.py is the actor): its settings and
the check the launcher runs on them (runtime/loading.py `import_actor`, plan side), so that a
plan with ranks (parallel dp / tp / pp > 1) is checked without importing the training code."""

from __future__ import annotations

from typing import Any

import msgspec

from actors.trainer_config import TrainerConfig
from runtime.actor import Actor


class TrainerRankConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Written by the launcher from the trainer's table (launch/config.py `rank_entries`)."""

    trainer: str  # the trainer actor's name (rank 0)
    rank: int  # this process's global rank, 1..world_size-1
    world_size: int  # tp * pp * dp of the trainer's `parallel`
    config: dict[str, Any]  # the trainer's config table (as its own spec has it)
    store: str = ""  # rank 0's TCP store, host:port (filled by the launcher at each start)
    address: str = ""  # this host's address in [[hosts]] ("" = the trainer's host)


class TrainerRankPlan(Actor):
    """What the launcher checks of a trainer rank: its rank and the trainer's table."""

    Config = TrainerRankConfig
    role = "trainer_rank"

    @classmethod
    def check_config(cls, config: TrainerRankConfig) -> None:
        if not 0 < config.rank < config.world_size:
            raise ValueError(f"rank {config.rank} of {config.world_size}: ranks 1..N-1 run here "
                             f"(rank 0 is the trainer actor)")
        msgspec.convert(config.config, TrainerConfig)
