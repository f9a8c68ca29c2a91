"""The trainer's ranks: global rank 0 is the trainer actor, ranks 1..N-1 rank processes.

Role: with `parallel` asking for N = tp * pp * dp > 1 ranks, the launcher starts ranks 1..N-1
as processes of the run (actors/trainer_rank.py, on the hosts of `parallel.placement`), in one
restart group with the trainer actor. All N join one torch.distributed group through rank 0's
TCP store, at the address and port the launcher chose (never a path, so a rank need not share
rank 0's filesystem): NCCL when the trainer's device is CUDA (rank r on `parallel.devices[r]`,
or the r-th device counted from the trainer's), gloo on CPU, plus a gloo group that carries
rank 0's commands. Everything backend-specific goes through the training backend
(training/backends.py `TrainingBackend`): a model-parallel backend (`joins_group_first`) has
every rank join the group first, build its model-parallel groups (`init_model_parallel`: tp x
pp x dp) and load its own TP/PP shard; the torch backend is data-parallel only, each rank
holding the whole model (or, with parallel.shard = "fsdp2", its FSDP shards after the weight
check). Every step rank 0 broadcasts the batch and every rank runs
`training.step.train_on_batch` with `training.data_parallel.DataParallel` over the
data-parallel group and the backend's model runner (`model_runner`: its pipeline schedule when
pp > 1): the DP schedule gives each replica its micro-batches, gradients are summed over that
group only, every replica takes the same optimizer step. Only global rank 0 pushes weights and
writes the HF export; with a sharded model (`shards_model`, or fsdp2) the tensors come to it
piece by piece from the other shards (`hf` commands) and every rank takes part in a checkpoint
(`save`: the backend's own format, `save_checkpoint`, each rank writing its shards, which
reloads at another layout; else the one-process checkpoint rank 0 writes from the gathers).
One rank (N = 1) is `SingleRank`: the same methods, acting on the local state.

This module holds the collective protocol only: rank 0's side (`RankGroup`), the other ranks'
side (`join_group`, `serve_commands`), the commands and their digests. It starts no process:
the launcher's supervisor starts, watches, restarts and stops every rank
(launch/supervisor.py).

Invariants: every rank loads its state as rank 0 does (training/setup.py); right after loading,
ranks holding the same shard (all of them with the torch backend, the data-parallel replicas of
one TP/PP position with a model-parallel backend) compare a float64 digest of their weights and
refuse to start if they differ; commands reach every rank in one order, and each command is a
collective every rank takes part in.
Faults: a rank process that exits is reported by the launcher with its exit code and log tail,
and the trainer and its ranks restart together; a collective stuck on a rank that no longer
answers fails after `parallel.timeout_s`, naming every rank that had not finished the command
(each rank records its progress in the store); ranks that do not reach the store, load or join
within `parallel.start_timeout_s` are named the same way.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import msgspec
import psutil
import torch
import torch.distributed as dist

from memory.safetensors_io import DEFAULT_SHARD_BYTES
from training.backends import TrainingBackend, backend_for, model_runner
from training.checkpoints import write_checkpoint
from training.config import TrainConfig
from training.data_parallel import DataParallel
from training.fsdp import full
from training.setup import load_train_state
from training.state import TrainState
from training.step import train_on_batch
from transport import records
from transport.dtypes import model_dtype
from transport.schema import Sample

log = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"  # rank 0's TCP store when every rank runs on the trainer's host
# the trainer's store, "host:port", in the environment of the trainer actor the launcher starts
# with ranks (chosen by the launcher at each start of the group)
STORE_ENV = "RLX_TRAINER_STORE"


class RankCommand(msgspec.Struct, forbid_unknown_fields=True):
    op: str  # "step" | "sleep" | "wake" | "digest" | "hf" | "adapter" | "merged" | "save" | "stop"
    samples: list[Sample] = []
    next_teachers: list[str] = []  # the buffer's hint (colocated teachers)
    temperature: float = 1.0  # "step": the run's sampling temperature (TrainState.temperature)
    keep_weights: bool = False  # "sleep": park all but the parameters (TrainState.sleep)
    path: str = ""  # "save": the checkpoint directory being written


_COMMAND_ENCODER, _COMMAND_DECODER = records.encoder(), records.decoder(RankCommand)


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the r-th CUDA device counted from the trainer's (cuda:1 -> cuda:1+r)."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def weight_digest(model: torch.nn.Module) -> float:
    """A float64 sum of every parameter with a position weight (equal weights, equal digest);
    of the whole parameters for a sharded (FSDP) model, so every rank calls it."""
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(model.parameters()):
        total += (i + 1) * full(p.detach()).double().sum().cpu()
    return float(total)


class Ranks:
    """What every rank holds: the group, its command channel, the data-parallel reductions,
    and the training backend that built its model-parallel groups (the one its state is loaded
    with: `load_train_state(..., backend=ranks.backend)`)."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, store: Any,
                 backend: TrainingBackend):
        self.rank, self.world_size, self.store = rank, world_size, store
        self.backend = backend
        self.fsdp = cfg.parallel.shard == "fsdp2"
        self.seq = 0  # commands taken (the same count on every rank)
        cuda = cfg.device.startswith("cuda")
        if cuda:  # this rank's own device ("cuda" alone is the first)
            torch.cuda.set_device(torch.device(cfg.device if ":" in cfg.device
                                               else f"{cfg.device}:0"))
        timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout) if cuda else None
        # the backend's model-parallel groups; their data-parallel group (None: the world), or
        # the backend's own reductions with DataParallel's interface (megatron: experts summed
        # over their expert data-parallel group only)
        group = backend.init_model_parallel(cfg)
        self.dp = group if hasattr(group, "sum_grads") else DataParallel(group)

    @property
    def sharded(self) -> bool:
        """Rank 0 gathers to push and export; every rank takes part in a checkpoint."""
        return self.backend.shards_model or self.fsdp

    def broadcast(self, cmd: RankCommand | None) -> RankCommand:
        """Rank 0 sends `cmd`; the others receive it."""
        self.seq += 1
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

    def record(self, what: str) -> None:
        """This rank's progress in the store (read by rank 0 when a collective fails)."""
        self.store.set(f"at{self.rank}", f"command {self.seq} {what}")

    def position(self) -> tuple[int, int]:
        """Which shard this rank holds: (tensor rank, pipeline stage); (0, 0) for the torch
        backend (every rank the whole model)."""
        return self.backend.position()

    def _gather_digests(self, model: torch.nn.Module) -> list[tuple[tuple[int, int], float]]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, (self.position(), weight_digest(model)), group=self.ctrl)
        return out

    def digests(self, model: torch.nn.Module) -> list[float]:
        """Every rank's weight digest, in rank order."""
        return [d for _, d in self._gather_digests(model)]

    def check_same_weights(self, model: torch.nn.Module) -> None:
        """Ranks holding the same shard hold the same weights, else RuntimeError."""
        by_shard: dict[tuple[int, int], set[float]] = {}
        got = self._gather_digests(model)
        for position, digest in got:
            by_shard.setdefault(position, set()).add(digest)
        if any(len(d) != 1 for d in by_shard.values()):
            raise RuntimeError(f"the trainer's data-parallel ranks loaded different weights "
                               f"(rank: (tensor rank, stage), digest: {got}); every rank must "
                               f"load the same checkpoint")

    def check_and_shard(self, state: TrainState, cfg: TrainConfig) -> None:
        """Right after loading: the weight check, then (fsdp2) the policy sharded over the
        ranks (the torch backend's `shard`, training/fsdp.py; the config allows fsdp2 with that
        backend only)."""
        self.check_same_weights(state.model)
        if self.fsdp:
            state.backend.shard(state, model_dtype(cfg.dtype), cfg.optimizer.lr,
                                cfg.optimizer.weight_decay)

    def step(self, state: TrainState, samples: list[Sample], cfg: TrainConfig
             ) -> dict[str, float]:
        """This rank's part of one optimizer step (every rank of the job calls it)."""
        b = state.backend
        stats = train_on_batch(state, samples, cfg, self.dp, model_runner(b, cfg, state.model))
        stats["train/dp_size"] = float(self.dp.world_size)
        return stats | b.step_stats(cfg)

    def save_shards(self, state: TrainState, directory: Path) -> None:
        """Every rank's part of a checkpoint written into `directory`: a backend with its own
        format has every rank write its shards (`save_checkpoint`); otherwise (fsdp2) every
        rank takes part in the gathers and rank 0 writes the one-process checkpoint (the torch
        backend unsharded: rank 0 alone, not here)."""
        if state.backend.save_checkpoint(state, directory):
            return
        if self.rank == 0:
            state.write_files(directory)
        else:  # the gathers of write_files, in its order
            drain(state.iter_named_weights())
            state.optimizer.state_dict()

    def close(self) -> None:
        self.backend.close()  # its model-parallel groups, before the process group
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None  # rank 0's store server ends with its last reference


def store_address(cfg: TrainConfig) -> str:
    """The host rank 0's TCP store listens on, as the other ranks reach it: the trainer host's
    address with `parallel.placement`, else loopback."""
    here = cfg.parallel.rank_host(0)
    return here.address if here is not None else STORE_HOST


def split_store(store: str) -> tuple[str, int]:
    """"host:port" -> (host, port); ValueError for anything else."""
    host, sep, port = store.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"the trainer's store must be host:port, got {store!r}")
    return host, int(port)


class RankGroup(Ranks):
    """Rank 0's side, inside the trainer actor: opens the store at `store` (host:port, chosen by
    whoever started the other ranks: the launcher), loads its own state (`self.state`), waits
    for the other ranks to join, and drives them."""

    def __init__(self, cfg: TrainConfig, run_dir: str, resume: bool, store: str):
        size = cfg.parallel.world_size
        timeout_s = cfg.parallel.start_timeout_s
        host, port = split_store(store)
        use_interface_of(cfg, host)
        # the store listens on every interface; the ranks reach it at this host's address
        tcp = dist.TCPStore(host, port, size, is_master=True,
                            timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s),
                            wait_for_workers=False)
        self.store = tcp
        log.info("trainer: rank 0 of tp %d x pp %d x dp %d, store %s:%d", cfg.parallel.tp,
                 cfg.parallel.pp, cfg.parallel.dp, host, tcp.port)
        try:
            backend = backend_for(cfg)
            if backend.joins_group_first:  # the model is built on the groups: join first
                self._wait_for(tcp, size, "started", timeout_s)
                super().__init__(cfg, 0, size, tcp, backend)
                self.state = load_train_state(cfg, run_dir, resume, backend=backend)
                self._wait_for(tcp, size, "loaded", timeout_s)
            else:  # each rank loads alone (all at once), then they join
                self.state = load_train_state(cfg, run_dir, resume, backend=backend)
                self._wait_for(tcp, size, "loaded", timeout_s)
                super().__init__(cfg, 0, size, tcp, backend)
            self.check_and_shard(self.state, cfg)
        except Exception as e:
            if dist.is_initialized():
                self.close()
            raise RuntimeError(f"the trainer's ranks did not form a group: {e}") from e

    @staticmethod
    def _wait_for(store: Any, size: int, what: str, timeout_s: float) -> None:
        """Until every rank has set `<what><rank>`, up to the start timeout (a rank process
        that exits first is the launcher's to report: it stops the whole group)."""
        deadline = time.monotonic() + timeout_s
        for r in range(1, size):
            while not store.check([f"{what}{r}"]):
                if time.monotonic() > deadline:
                    missing = [q for q in range(r, size) if not store.check([f"{what}{q}"])]
                    raise TimeoutError(f"trainer rank(s) {', '.join(map(str, missing))} not "
                                       f"{what} within parallel.start_timeout_s = "
                                       f"{timeout_s:g}; see their logs (trainer.rank<r>.log)")
                time.sleep(0.05)

    def lagging(self) -> str:
        """The ranks that had not finished the latest command, with where each was."""
        behind = []
        for r in range(1, self.world_size):
            at = (self.store.get(f"at{r}").decode() if self.store.check([f"at{r}"])
                  else "nothing yet")
            if at != f"command {self.seq} done":
                behind.append(f"trainer rank {r} (at: {at})")
        return ("ranks not done with command " + str(self.seq) + ": " + "; ".join(behind)
                if behind else "")

    broken = False  # a command's collective failed: the group carries no more commands

    def _failed(self, op: str, e: Exception) -> RuntimeError:
        self.broken = True
        try:
            why = self.lagging()
        except Exception as s:  # noqa: BLE001 - the store itself failed: say the command's error
            why = f"(the store did not answer: {s})"
        return RuntimeError(f"{op} command to the trainer's ranks failed: {e}"
                            f"{'; ' + why if why else ''}")

    def run(self, cmd: RankCommand, fn: Any = None, *args: Any) -> Any:
        """Send `cmd`, then take rank 0's part (`fn(*args)`); a failure names the ranks."""
        try:
            self.broadcast(cmd)
            return fn(*args) if fn is not None else None
        except RuntimeError as e:  # collectives (gloo/NCCL errors and timeouts) raise these
            raise self._failed(cmd.op, e) from e

    def send(self, cmd: RankCommand) -> None:
        self.run(cmd)

    def train(self, state: TrainState, samples: list[Sample], cfg: TrainConfig,
              next_teachers: list[str] = ()) -> dict[str, float]:
        return self.run(RankCommand("step", samples=samples, next_teachers=list(next_teachers),
                                    temperature=state.temperature),
                        self.step, state, samples, cfg)

    def all_digests(self, model: torch.nn.Module) -> list[float]:
        """Every rank's weight digest, in rank order."""
        return self.run(RankCommand("digest"), self.digests, model)

    def sleep(self, state: TrainState, keep_weights: bool = False) -> Any:
        """Colocated mode: every rank parks its step's tensors in host memory (TrainState.sleep);
        rank 0's report is returned."""
        return self.run(RankCommand("sleep", keep_weights=keep_weights), state.sleep, keep_weights)

    def wake(self, state: TrainState) -> Any:
        return self.run(RankCommand("wake"), state.wake)

    def named_weights(self, state: TrainState) -> list[tuple[str, torch.Tensor]]:
        """The whole model's HF-named weights on rank 0 as one list (tests, small models)."""
        return list(self.stream_weights(state))

    def stream_weights(self, state: TrainState) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model's HF-named weights on rank 0 as a push reads them; sharded: the
        `hf` command, then each tensor as the gather brings it (one piece in host memory at a
        time). Closed early (a failed push), it still runs the rest of the gather, which the
        other ranks are running; a collective that fails names the ranks."""
        if not self.sharded:
            yield from state.iter_named_weights()
            return
        self.run(RankCommand("hf"))
        gather = state.iter_named_weights()
        try:
            while True:
                try:
                    item = next(gather)
                except StopIteration:
                    return
                except RuntimeError as e:
                    raise self._failed("hf", e) from e
                yield item
                del item
        finally:
            try:
                for _ in gather:  # nothing left after a normal end or a failed collective
                    pass
            except RuntimeError as e:
                raise self._failed("hf", e) from e

    def save_weights(self, state: TrainState, path: Path,
                     shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        """The HF export rank 0 pushes through disk (sharded: streamed from the shards)."""
        if not self.sharded:
            return state.save_weights(path, shard_bytes)
        return self.run(RankCommand("hf"), state.save_weights, path, shard_bytes)

    def adapter_tensors(self, state: TrainState) -> dict[str, torch.Tensor]:
        """A LoRA student's whole adapter on rank 0 (sharded: the `adapter` gather)."""
        if not self.sharded:
            return state.adapter_tensors()
        return self.run(RankCommand("adapter"), state.adapter_tensors)

    def save_merged(self, state: TrainState, path: Path) -> None:
        """The HF export with the adapter merged in (sharded: the `merged` gather)."""
        if not self.sharded:
            return state.save_merged(path)
        return self.run(RankCommand("merged"), state.save_merged, path)

    def save_checkpoint(self, state: TrainState, path: Path) -> None:
        """A checkpoint at `path`, complete or absent (training/checkpoints.py); a sharded
        model's ranks all take part (`save_shards`)."""
        if not self.sharded:
            return state.save(path)
        write_checkpoint(path, lambda tmp: self.run(RankCommand("save", path=str(tmp)),
                                                    self.save_shards, state, tmp))

    def stop(self) -> None:
        """Tell the ranks to leave (each then ends its process) and leave the group."""
        try:
            if not self.broken:
                self.broadcast(RankCommand("stop"))
        except Exception as e:  # noqa: BLE001 - the launcher stops them with the group
            log.warning("trainer ranks did not take the stop command: %s", e)
        self.close()

    def kill(self) -> None:
        """Leave without the stop command (a compute thread is stuck in a collective): the
        store goes with this process, the launcher stops the ranks with the group."""
        self.store = None


class SingleRank:
    """One rank (parallel.world_size = 1): `RankGroup`'s methods, acting on the local state."""

    world_size = 1

    def __init__(self, state: TrainState):
        self.state = state

    def train(self, state: TrainState, samples: list[Sample], cfg: TrainConfig,
              next_teachers: list[str] = ()) -> dict[str, float]:
        return train_on_batch(state, samples, cfg)

    def all_digests(self, model: torch.nn.Module) -> list[float]:
        return [weight_digest(model)]

    def sleep(self, state: TrainState, keep_weights: bool = False) -> Any:
        return state.sleep(keep_weights)

    def wake(self, state: TrainState) -> Any:
        return state.wake()

    def named_weights(self, state: TrainState) -> list[tuple[str, torch.Tensor]]:
        return list(self.stream_weights(state))

    def stream_weights(self, state: TrainState) -> Iterator[tuple[str, torch.Tensor]]:
        """Views of the local model's tensors as a push reads them."""
        return state.iter_named_weights()

    def save_weights(self, state: TrainState, path: Path,
                     shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        state.save_weights(path, shard_bytes)

    def adapter_tensors(self, state: TrainState) -> dict[str, torch.Tensor]:
        return state.adapter_tensors()

    def save_merged(self, state: TrainState, path: Path) -> None:
        state.save_merged(path)

    def save_checkpoint(self, state: TrainState, path: Path) -> None:
        """The trainer's checkpoint at `path`, complete or absent: the backend's own format
        when it has one (resumable at another layout), else the one-process checkpoint."""

        def write(tmp: Path) -> None:
            if not state.backend.save_checkpoint(state, tmp):
                state.write_files(tmp)

        write_checkpoint(path, write)

    def stop(self) -> None:
        pass

    def kill(self) -> None:
        pass


def load_trainer(cfg: TrainConfig, run_dir: str, resume: bool, store: str = ""
                 ) -> SingleRank | RankGroup:
    """The trainer's rank 0 with its state (`.state`): one process, or the group of N =
    parallel.world_size ranks whose store rank 0 opens at `store` (host:port; the other ranks
    are started by the launcher, or by `actors.trainer_rank.start_standalone`)."""
    if cfg.parallel.world_size == 1:
        return SingleRank(load_train_state(cfg, run_dir, resume))
    if not store:
        raise RuntimeError(f"parallel asks for {cfg.parallel.world_size} ranks, but no store "
                           f"address was given for them: the launcher starts ranks 1..N-1 with "
                           f"the trainer (python -m launch.cluster HOSTS.toml)")
    return RankGroup(cfg, run_dir, resume, store)


# ----------------------------------------------------------------------------- ranks 1..N-1
def join_group(cfg: TrainConfig, rank: int, world_size: int, store: str, run_dir: str,
               resume: bool, address: str = "") -> tuple[Ranks, TrainState]:
    """Rank r's start: reach rank 0's store at `store` (host:port; retried until
    parallel.start_timeout_s), load the state as rank 0 does and join its group (a backend
    that `joins_group_first`: join first, its model is built on the groups), then the weight
    check. `cfg` is rank r's (`rank_config`); `address` is its host's address in [[hosts]]
    (ranks on several hosts)."""
    host, port = split_store(store)
    tcp = dist.TCPStore(host, port, world_size, is_master=False,
                        timeout=datetime.timedelta(seconds=cfg.parallel.start_timeout_s))
    tcp.set_timeout(datetime.timedelta(seconds=cfg.parallel.timeout_s))
    if address:
        use_interface_of(cfg, address)
    backend = backend_for(cfg)  # imports the backend's modules (slow) before rank 0 waits
    ranks = None
    if backend.joins_group_first:  # the model is built on the backend's groups: join first
        tcp.set(f"started{rank}", "1")
        ranks = Ranks(cfg, rank, world_size, tcp, backend)
    state = load_train_state(cfg, run_dir, resume, backend=backend)
    tcp.set(f"loaded{rank}", "1")
    ranks = ranks or Ranks(cfg, rank, world_size, tcp, backend)
    try:
        ranks.check_and_shard(state, cfg)
    except BaseException:
        ranks.close()
        raise
    ranks.record("ready")
    return ranks, state


def run_command(cmd: RankCommand, state: TrainState, cfg: TrainConfig, ranks: Ranks) -> None:
    """This rank's part of one of rank 0's commands."""
    if cmd.op == "step":
        state.next_teachers, state.temperature = cmd.next_teachers, cmd.temperature
        ranks.step(state, cmd.samples, cfg)
    elif cmd.op == "sleep":
        state.sleep(cmd.keep_weights)
    elif cmd.op == "wake":
        state.wake()
    elif cmd.op == "digest":
        ranks.digests(state.model)
    elif cmd.op == "hf":  # one gather of the HF tensors to rank 0, streamed there
        drain(state.iter_named_weights())
    elif cmd.op == "adapter":  # a LoRA student's adapter, gathered to rank 0
        state.adapter_tensors()
    elif cmd.op == "merged":  # the merged export's tensors, gathered to rank 0
        drain(state.backend.merged_tensors(state.model))
    elif cmd.op == "save":
        ranks.save_shards(state, Path(cmd.path))
    else:
        raise ValueError(f"unknown command {cmd.op!r} from trainer rank 0")


def serve_commands(state: TrainState, cfg: TrainConfig, ranks: Ranks) -> None:
    """Ranks 1..N-1: run rank 0's commands until it says stop (blocking: a thread's work)."""
    while True:
        cmd = ranks.broadcast(None)
        if cmd.op == "stop":
            return
        ranks.record(f"{cmd.op} started")
        run_command(cmd, state, cfg, ranks)
        ranks.record("done")


def interface_of(address: str) -> str | None:
    """The network interface holding `address` on this machine (None: none does)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def use_interface_of(cfg: TrainConfig, address: str) -> None:
    """Ranks on several hosts: gloo and NCCL talk over the interface of this host's address
    (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless set), not whatever the hostname resolves
    to. Before the process group forms."""
    if len({h.address for h in cfg.parallel.placement}) < 2:
        return
    name = interface_of(address)
    if name is None:
        raise RuntimeError(f"this host has no interface with address {address!r} (its address "
                           f"in [[hosts]], where the trainer's other ranks reach it): fix the "
                           f"address or set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME")
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(key, name)


def drain(gather: Iterator[Any]) -> None:
    """A rank's part of a gather whose results go to rank 0."""
    for _ in gather:
        pass


def rank_config(cfg: TrainConfig, rank: int, run_dir: str) -> TrainConfig:
    """Rank r's trainer config: its device, and its own NVMe directory for colocated teachers
    (reads go through its own process; the prefetcher actor serves rank 0)."""
    nvme = cfg.teacher_memory.nvme_dir or str(Path(run_dir) / "teachers-nvme")
    memory = msgspec.structs.replace(cfg.teacher_memory, nvme_dir=f"{nvme}-rank{rank}")
    return msgspec.structs.replace(cfg, device=cfg.parallel.device(cfg.device, rank),
                                   teacher_memory=memory)
