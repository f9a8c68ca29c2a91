"""Data-parallel ranks of the trainer actor: rank 0 is the actor, ranks 1..N-1 processes it starts.

Role: with `parallel.dp = N > 1` the trainer actor starts N-1 rank processes
(`python -m actors.trainer_rank`) on its host. All N join one torch.distributed group (NCCL when
the trainer's device is CUDA, rank r on the r-th device from the trainer's; gloo on CPU) for the
step's reductions, plus a gloo group that carries rank 0's commands. Every step rank 0 broadcasts
the batch (msgpack) and every rank runs `training.step.train_on_batch` with
`training.data_parallel.DataParallel`: the DP schedule gives each rank its micro-batches, gradients are
summed, every rank takes the same optimizer step. The weights therefore stay identical: only rank
0 pushes weights and writes checkpoints (every rank resumes from the same checkpoint).

Invariants: every rank loads its state exactly as rank 0 does (`load_train_state`); right after
joining, the ranks compare a float64 digest of their weights and refuse to start if they differ;
commands reach every rank in one order. Colocated teachers: every rank loads its own (its own
device slots, pinned arena and NVMe directory), scoring only its micro-batches.
Faults: a rank process that exits (while loading or later) is reported by rank 0 at once or at
its next command, with the exit code and the rank's log; a collective stuck on a dead rank fails
after `parallel.timeout_s`; a rank whose parent dies gets SIGTERM.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from runtime.child import die_with_parent
from runtime.procs import log_tail, terminate_sync
from training.config import TrainConfig
from training.data_parallel import DataParallel
from training.step import train_on_batch
from transport import records
from transport.schema import Sample
from transport.sockets import free_port

log = logging.getLogger(__name__)


class RankCommand(msgspec.Struct, forbid_unknown_fields=True):
    op: str  # "step" | "device" | "digest" | "stop"
    samples: list[Sample] = []
    next_teachers: list[str] = []  # the buffer's hint (colocated teachers)
    device: str = ""


_COMMAND_ENCODER, _COMMAND_DECODER = records.encoder(), records.decoder(RankCommand)


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the r-th CUDA device counted from the trainer's (cuda:1 -> cuda:1+r)."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def weight_digest(model: torch.nn.Module) -> float:
    """A float64 sum of every parameter with a position weight (equal weights, equal digest)."""
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(model.parameters()):
        total += (i + 1) * p.detach().double().sum().cpu()
    return float(total)


class Ranks:
    """What every rank holds: the group, its command channel, the DP reductions."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, store: Any):
        cuda = cfg.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(torch.device(rank_device(cfg.device, 0)))  # an index
        timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout) if cuda else None
        self.dp = DataParallel()
        self.rank, self.world_size = rank, world_size

    def broadcast(self, cmd: RankCommand | None) -> RankCommand:
        """Rank 0 sends `cmd`; the others receive it."""
        if self.rank == 0:
            data = _COMMAND_ENCODER.encode(cmd)  # a sample's top-k arrays go inline
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.ctrl)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
               else torch.empty(int(size), dtype=torch.uint8))
        dist.broadcast(buf, src=0, group=self.ctrl)
        return cmd if self.rank == 0 else _COMMAND_DECODER.decode(buf.numpy())

    def digests(self, model: torch.nn.Module) -> list[float]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, weight_digest(model), group=self.ctrl)
        return out

    def check_same_weights(self, model: torch.nn.Module) -> None:
        got = self.digests(model)
        if len(set(got)) != 1:
            raise RuntimeError(f"the trainer's data-parallel ranks loaded different weights "
                               f"(digests {got}); every rank must load the same checkpoint")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankGroup(Ranks):
    """Rank 0's side, inside the trainer actor: starts the other ranks and drives them."""

    def __init__(self, cfg: TrainConfig, run_dir: str, resume: bool, log_dir: Path):
        self.procs: list[subprocess.Popen] = []
        size = cfg.parallel.dp
        self.logs = [log_dir / f"trainer.rank{r}.log" for r in range(1, size)]
        log_dir.mkdir(parents=True, exist_ok=True)
        config_path = Path(run_dir) / "trainer_ranks.json"
        config_path.write_bytes(msgspec.json.encode(cfg))
        port = free_port("127.0.0.1")
        store = dist.TCPStore("127.0.0.1", port, size, is_master=True,
                              timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s),
                              wait_for_workers=False)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for r, path in zip(range(1, size), self.logs):
            cmd = [sys.executable, "-m", "actors.trainer_rank", "--rank", str(r), "--world-size",
                   str(size), "--port", str(port), "--config", str(config_path),
                   "--run-dir", run_dir] + (["--resume"] if resume else [])
            with open(path, "ab") as f:
                self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=f, env=env,
                                                   stdin=subprocess.DEVNULL,
                                                   preexec_fn=die_with_parent))
        log.info("trainer: started data-parallel ranks 1..%d (logs %s)", size - 1, log_dir)
        try:
            self._wait_loaded(store, cfg.parallel.timeout_s)
            super().__init__(cfg, 0, size, store)
        except Exception as e:
            dead = self.dead_rank()  # before the kill: the rank that failed on its own
            self.kill()
            message = str(e) if not dead or dead in str(e) else f"{e}; {dead}"
            raise RuntimeError(f"the trainer's data-parallel group did not form: {message}") \
                from e

    def _wait_loaded(self, store: Any, timeout_s: float) -> None:
        """Until every rank has loaded its state (as long as it takes while they live): a rank
        that exits first is reported at once, not after a rendezvous timeout."""
        deadline = time.monotonic() + timeout_s
        for r in range(1, len(self.procs) + 1):
            while not store.check([f"loaded{r}"]):
                dead = self.dead_rank()
                if dead:
                    raise RuntimeError(dead)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"trainer rank {r} did not load its state within "
                                       f"parallel.timeout_s = {timeout_s:g}; "
                                       f"log {self.logs[r - 1]}")
                time.sleep(0.05)

    def dead_rank(self) -> str:
        """What a rank process that has exited left behind ("" while all live)."""
        for r, (p, path) in enumerate(zip(self.procs, self.logs), start=1):
            if p.poll() is not None:
                return (f"trainer rank {r} exited with code {p.returncode}, log {path}, last "
                        f"lines:\n{log_tail(path, 20)}")
        return ""

    def send(self, cmd: RankCommand) -> None:
        dead = self.dead_rank()
        if dead:
            raise RuntimeError(dead)
        try:
            self.broadcast(cmd)
        except Exception as e:
            dead = self.dead_rank()
            raise RuntimeError(f"{cmd.op} command to the data-parallel ranks failed: {e}"
                               f"{'; ' + dead if dead else ''}") from e

    def train(self, state: Any, samples: list[Sample], cfg: TrainConfig,
              next_teachers: list[str] = ()) -> dict[str, float]:
        self.send(RankCommand("step", samples=samples, next_teachers=list(next_teachers)))
        stats = train_on_batch(state, samples, cfg, self.dp)
        stats["train/dp_size"] = float(self.world_size)
        return stats

    def all_digests(self, model: torch.nn.Module) -> list[float]:
        """Every rank's weight digest, in rank order (equal while the ranks agree)."""
        self.send(RankCommand("digest"))
        return self.digests(model)

    def to_device(self, state: Any, device: str) -> None:
        self.send(RankCommand("device", device=device))
        state.to_device(rank_device(device, 0))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Tell the ranks to exit and wait for them (killed past the timeout)."""
        try:
            if not self.dead_rank():
                self.broadcast(RankCommand("stop"))
        except Exception as e:  # noqa: BLE001 - they are killed below
            log.warning("trainer ranks did not take the stop command: %s", e)
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                terminate_sync(p, 0)
        self.close()

    def kill(self) -> None:
        for p in self.procs:
            terminate_sync(p, 0)


def rank_config(cfg: TrainConfig, rank: int, run_dir: str) -> TrainConfig:
    """Rank r's trainer config: its device, and its own NVMe directory for colocated teachers
    (reads go through its own process; the prefetcher actor serves rank 0)."""
    nvme = cfg.teacher_memory.nvme_dir or str(Path(run_dir) / "teachers-nvme")
    memory = msgspec.structs.replace(cfg.teacher_memory, nvme_dir=f"{nvme}-rank{rank}")
    return msgspec.structs.replace(cfg, device=rank_device(cfg.device, rank),
                                   teacher_memory=memory)
