"""A data-parallel rank process of the trainer actor: `python -m actors.trainer_rank ...`, started
by the trainer (training/ranks.py `RankGroup`), never by hand.

Role: loads its state exactly as rank 0 does (training/setup.py), joins rank 0's group, then runs
rank 0's commands (step, device, digest, stop) until told to stop. Dies with its parent.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
from pathlib import Path

import msgspec
import torch.distributed as dist

from actors.trainer import TrainerConfig
from runtime.child import die_with_parent
from training.config import TrainConfig
from training.ranks import Ranks, rank_config, rank_device
from training.setup import load_train_state
from training.state import TrainState
from training.step import train_on_batch


def serve(state: TrainState, cfg: TrainConfig, ranks: Ranks) -> None:
    """Ranks 1..N-1: run rank 0's commands until it says stop."""
    while True:
        cmd = ranks.broadcast(None)
        if cmd.op == "stop":
            return
        if cmd.op == "step":
            state.next_teachers = cmd.next_teachers
            train_on_batch(state, cmd.samples, cfg, ranks.dp)
        elif cmd.op == "device":
            state.to_device(rank_device(cmd.device, ranks.rank))
        elif cmd.op == "digest":
            ranks.digests(state.model)
        else:
            raise ValueError(f"unknown command {cmd.op!r} from trainer rank 0")


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    ap = argparse.ArgumentParser(description="a data-parallel rank of the trainer actor "
                                             "(started by it, not by hand)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(message)s")
    cfg = msgspec.json.decode(Path(args.config).read_bytes(), type=TrainerConfig)
    cfg = msgspec.structs.replace(rank_config(cfg, args.rank, args.run_dir), prefetcher="")
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    store = dist.TCPStore("127.0.0.1", args.port, args.world_size, is_master=False,
                          timeout=timeout)
    state = load_train_state(cfg, args.run_dir, args.resume)
    store.set(f"loaded{args.rank}", "1")
    ranks = Ranks(cfg, args.rank, args.world_size, store)
    try:
        ranks.check_same_weights(state.model)
        serve(state, cfg, ranks)
    finally:
        ranks.close()
        if state.teachers is not None:
            state.teachers.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
