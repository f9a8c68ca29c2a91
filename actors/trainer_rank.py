"""A rank process of the trainer actor: `python -m actors.trainer_rank ...`, started by the
trainer (training/ranks.py `RankGroup`), never by hand.

Role: reaches rank 0's TCP store at the address it was given, loads its state as rank 0 does
(training/setup.py) and joins rank 0's group (megatron: joins first, its model is built on the
groups), then runs rank 0's commands (step, sleep, wake, digest, hf, save, stop) until told to stop,
recording its progress in the store. Dies with its parent.
The heavy imports are inside the functions: multiprocessing's spawn (megatron's checkpoint
writer starts a helper that way) imports this main module again, and that should cost nothing.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from pathlib import Path
from typing import Any


def run_command(cmd: Any, state: Any, cfg: Any, ranks: Any) -> None:
    """This rank's part of one of rank 0's commands (training.ranks.RankCommand)."""
    from training.ranks import drain

    if cmd.op == "step":
        state.next_teachers = cmd.next_teachers
        ranks.step(state, cmd.samples, cfg)
    elif cmd.op == "sleep":
        state.sleep(cmd.keep_weights)
    elif cmd.op == "wake":
        state.wake()
    elif cmd.op == "digest":
        ranks.digests(state.model)
    elif cmd.op == "hf":  # one gather of the HF tensors to rank 0, streamed there
        drain(state.iter_named_weights())
    elif cmd.op == "save":
        ranks.save_shards(state, Path(cmd.path))
    else:
        raise ValueError(f"unknown command {cmd.op!r} from trainer rank 0")


def serve(state: Any, cfg: Any, ranks: Any) -> None:
    """Ranks 1..N-1: run rank 0's commands until it says stop."""
    while True:
        cmd = ranks.broadcast(None)
        if cmd.op == "stop":
            return
        ranks.record(f"{cmd.op} started")
        run_command(cmd, state, cfg, ranks)
        ranks.record("done")


def main(argv: list[str] | None = None) -> int:
    import msgspec
    import torch.distributed as dist

    from actors.trainer import TrainerConfig
    from runtime.child import die_with_parent
    from training.ranks import CONFIG_KEY, Ranks, rank_config, use_interface_of
    from training.setup import load_train_state

    die_with_parent()
    ap = argparse.ArgumentParser(description="a rank of the trainer actor (started by it, not "
                                             "by hand)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--store", required=True, help="rank 0's TCP store, host:port")
    ap.add_argument("--store-timeout", type=float, default=600.0,
                    help="seconds to reach the store (the trainer's parallel.timeout_s)")
    ap.add_argument("--address", default="",
                    help="this host's address in [[hosts]] (ranks on several hosts)")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(message)s")
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), args.world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=args.store_timeout))
    cfg = msgspec.json.decode(store.get(CONFIG_KEY), type=TrainerConfig)  # rank 0's config
    cfg = msgspec.structs.replace(rank_config(cfg, args.rank, args.run_dir), prefetcher="")
    store.set_timeout(datetime.timedelta(seconds=cfg.parallel.timeout_s))
    if args.address:
        use_interface_of(cfg, args.address)
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    logging.info("trainer rank %d of %d on %s (store %s)%s", args.rank, args.world_size,
                 args.address or "the trainer's host", args.store,
                 f" over interface {interface}" if interface else "")
    ranks = None
    if cfg.backend == "megatron":  # the model is built on megatron's groups: join first
        import backends.megatron.model  # noqa: F401 - the slow import, before rank 0 waits on us

        store.set(f"started{args.rank}", "1")
        ranks = Ranks(cfg, args.rank, args.world_size, store)
    state = load_train_state(cfg, args.run_dir, args.resume)
    store.set(f"loaded{args.rank}", "1")
    ranks = ranks or Ranks(cfg, args.rank, args.world_size, store)
    try:
        ranks.check_and_shard(state, cfg)
        ranks.record("ready")
        serve(state, cfg, ranks)
        logging.info("trainer rank %d: told to stop; leaving the group", args.rank)
    finally:
        ranks.close()
        if state.teachers is not None:
            state.teachers.close()
    logging.info("trainer rank %d: stopped", args.rank)
    return 0


if __name__ == "__main__":
    code = main()  # an exception ends the process as any (traceback, exit code 1)
    # done, and the group destroyed: leave without C++ static destructors, which now and then
    # meet a gloo thread still being torn down ("terminate called without an active
    # exception", SIGABRT after a clean stop)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
