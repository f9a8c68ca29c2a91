"""The trainer's ranks: global rank 0 is the trainer actor, ranks 1..N-1 processes it starts.

Role: with `parallel` asking for N = tp * pp * dp > 1 ranks, the trainer actor starts N-1 rank
processes (`python -m actors.trainer_rank`). All N join one torch.distributed group through
rank 0's TCP store (an address and a port, never a path, so a rank need not share rank 0's
filesystem): NCCL when the trainer's device is CUDA (rank r on `parallel.devices[r]`, or the
r-th device counted from the trainer's), gloo on CPU, plus a gloo group that carries rank 0's
commands. With the megatron backend every rank then builds megatron-core's parallel state
(tp x pp x dp groups, megatron's rank order) and loads its own TP/PP shard; the torch backend
is data-parallel only, each rank holding the whole model. Every step rank 0 broadcasts the batch
and every rank runs `training.step.train_on_batch` with `training.data_parallel.DataParallel`
over the data-parallel group: the DP schedule gives each replica its micro-batches, gradients
are summed over that group only, megatron's pipeline schedule runs the passes when pp > 1
(`backends.megatron.pipeline.PipelineRunner`), every replica takes the same optimizer step.
Only global rank 0 pushes weights and writes the HF export; with megatron the tensors come to it
piece by piece from the other shards (`hf` commands, backends/megatron/parallel.py) and every
rank writes its shards of a checkpoint (`save`; it reloads at another layout).

Invariants: every rank loads its state as rank 0 does (training/setup.py); right after loading,
ranks holding the same shard (all of them with the torch backend, the data-parallel replicas of
one TP/PP position with megatron) compare a float64 digest of their weights and refuse to start
if they differ; commands reach every rank in one order, and each command is a collective every
rank takes part in.
Faults: a rank process that exits (while loading or later) is reported by rank 0 at once or at
its next command, with the exit code and the rank's log tail; a collective stuck on a rank that
no longer answers fails after `parallel.timeout_s`, naming every rank that had not finished the
command (each rank records its progress in the store); a rank whose parent dies gets SIGTERM.
"""

from __future__ import annotations

import datetime
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import msgspec
import psutil
import torch
import torch.distributed as dist

from memory.safetensors_io import DEFAULT_SHARD_BYTES
from runtime.child import die_with_parent
from runtime.procs import log_tail, terminate_sync
from training.checkpoints import write_checkpoint
from training.config import TrainConfig
from training.data_parallel import DataParallel
from training.fsdp import full, shard_state
from training.setup import load_train_state
from training.state import TrainState
from training.step import train_on_batch
from transport import records
from transport.dtypes import model_dtype
from transport.schema import Sample

log = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"  # rank 0's TCP store when every rank runs on the trainer's host
CONFIG_KEY = "trainer_config"  # the trainer's config in the store (msgspec JSON)


class RankCommand(msgspec.Struct, forbid_unknown_fields=True):
    op: str  # "step" | "sleep" | "wake" | "digest" | "hf" | "save" | "stop"
    samples: list[Sample] = []
    next_teachers: list[str] = []  # the buffer's hint (colocated teachers)
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


def is_megatron(model: Any) -> bool:
    return hasattr(model, "load_hf_state_dict")  # backends.megatron.model.MegatronCausalLM


class Ranks:
    """What every rank holds: the group, its command channel, the data-parallel reductions,
    and (megatron) the model-parallel layout."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, store: Any):
        self.rank, self.world_size, self.store = rank, world_size, store
        self.megatron = cfg.backend == "megatron"
        self.fsdp = cfg.parallel.shard == "fsdp2"
        self.sharded = self.megatron or self.fsdp  # rank 0 gathers to push and export
        self.pipeline = cfg.parallel.pp > 1
        self.seq = 0  # commands taken (the same count on every rank)
        cuda = cfg.device.startswith("cuda")
        if cuda:  # this rank's own device ("cuda" alone is the first)
            torch.cuda.set_device(torch.device(cfg.device if ":" in cfg.device
                                               else f"{cfg.device}:0"))
        timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout) if cuda else None
        group = None
        if self.megatron:
            from backends.megatron.model import initialize_parallel, parallel_state

            initialize_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed,
                                cfg.parallel.timeout_s)
            group = parallel_state.get_data_parallel_group()
        self.dp = DataParallel(group)

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
        if not self.megatron:
            return (0, 0)
        from backends.megatron.model import parallel_state

        return (parallel_state.get_tensor_model_parallel_rank(),
                parallel_state.get_pipeline_model_parallel_rank())

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
        ranks (training/fsdp.py)."""
        self.check_same_weights(state.model)
        if self.fsdp:
            shard_state(state, model_dtype(cfg.dtype), cfg.optimizer.lr,
                        cfg.optimizer.weight_decay)

    def step(self, state: TrainState, samples: list[Sample], cfg: TrainConfig
             ) -> dict[str, float]:
        """This rank's part of one optimizer step (every rank of the job calls it)."""
        runner = None
        if self.pipeline:
            from backends.megatron.pipeline import PipelineRunner

            runner = PipelineRunner(state.model)
        stats = train_on_batch(state, samples, cfg, self.dp, runner)
        stats["train/dp_size"] = float(self.dp.world_size)
        if self.megatron:
            stats["train/tp_size"], stats["train/pp_size"] = (float(cfg.parallel.tp),
                                                              float(cfg.parallel.pp))
        return stats

    def save_shards(self, state: TrainState, directory: Path) -> None:
        """Every rank's part of a checkpoint written into `directory`: megatron's ranks write
        their shards; with fsdp2 every rank takes part in the gathers and rank 0 writes the
        one-process checkpoint (the torch backend unsharded: rank 0 alone, not here)."""
        if self.fsdp:
            if self.rank == 0:
                state.write_files(directory)
            else:  # the gathers of write_files, in its order
                drain(state.iter_named_weights())
                state.optimizer.state_dict()
            return
        from backends.megatron.checkpoint import save_trainer_checkpoint

        save_trainer_checkpoint(state, directory)

    def close(self) -> None:
        if self.megatron:
            from backends.megatron.model import parallel_state

            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None  # rank 0's store server ends with its last reference


class RankGroup(Ranks):
    """Rank 0's side, inside the trainer actor: starts the other ranks, loads its own state
    (`self.state`) and drives them."""

    def __init__(self, cfg: TrainConfig, run_dir: str, resume: bool, log_dir: Path):
        self.procs: list[subprocess.Popen] = []
        size = cfg.parallel.world_size
        self.logs = [log_dir / f"trainer.rank{r}.log" for r in range(1, size)]
        log_dir.mkdir(parents=True, exist_ok=True)
        timeout_s = cfg.parallel.start_timeout_s
        here = cfg.parallel.rank_host(0)
        store_host = here.address if here is not None else STORE_HOST
        use_interface_of(cfg, store_host)
        # the store listens on every interface; the ranks reach it at this host's address
        store = dist.TCPStore(store_host, 0, size, is_master=True,
                              timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s),
                              wait_for_workers=False)
        store.set(CONFIG_KEY, msgspec.json.encode(cfg))  # no shared path needed
        for r, path in zip(range(1, size), self.logs):
            cmd = rank_command(cfg, r, size, f"{store_host}:{store.port}", run_dir, resume)
            with open(path, "ab") as f:
                self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=f, env=rank_env(cfg, r),
                                                   stdin=subprocess.DEVNULL,
                                                   preexec_fn=die_with_parent))
        log.info("trainer: started ranks 1..%d of tp %d x pp %d x dp %d (logs %s)", size - 1,
                 cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, log_dir)
        try:
            if cfg.backend == "megatron":  # megatron builds its model on the groups: join first
                self._wait_for(store, "started", timeout_s)
                super().__init__(cfg, 0, size, store)
                self.state = load_train_state(cfg, run_dir, resume)
                self._wait_for(store, "loaded", timeout_s)
            else:  # each rank loads alone (all at once), then they join
                self.state = load_train_state(cfg, run_dir, resume)
                self._wait_for(store, "loaded", timeout_s)
                super().__init__(cfg, 0, size, store)
            self.check_and_shard(self.state, cfg)
        except Exception as e:
            dead = self.dead_rank()  # before the kill: the rank that failed on its own
            self.kill()
            if dist.is_initialized():
                self.close()
            message = str(e) if not dead or dead in str(e) else f"{e}; {dead}"
            raise RuntimeError(f"the trainer's ranks did not form a group: {message}") from e

    def _wait_for(self, store: Any, what: str, timeout_s: float) -> None:
        """Until every rank has set `<what><rank>` (while they live, up to the start timeout): a
        rank that exits first is reported at once, not after a rendezvous timeout."""
        deadline = time.monotonic() + timeout_s
        for r in range(1, len(self.procs) + 1):
            while not store.check([f"{what}{r}"]):
                dead = self.dead_rank()
                if dead:
                    raise RuntimeError(dead)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"trainer rank {r} was not {what} within "
                                       f"parallel.start_timeout_s = {timeout_s:g}; "
                                       f"log {self.logs[r - 1]}")
                time.sleep(0.05)

    def dead_rank(self) -> str:
        """What a rank process that has exited left behind ("" while all live)."""
        for r, (p, path) in enumerate(zip(self.procs, self.logs), start=1):
            if p.poll() is not None:
                return (f"trainer rank {r} exited with code {p.returncode}, log {path}, last "
                        f"lines:\n{log_tail(path, 20)}")
        return ""

    def lagging(self) -> str:
        """The ranks that had not finished the latest command, with where each was."""
        behind = []
        for r in range(1, self.world_size):
            at = (self.store.get(f"at{r}").decode() if self.store.check([f"at{r}"])
                  else "nothing yet")
            if at != f"command {self.seq} done":
                behind.append(f"trainer rank {r} (at: {at}, log {self.logs[r - 1]})")
        return ("ranks not done with command " + str(self.seq) + ": " + "; ".join(behind)
                if behind else "")

    def _failed(self, op: str, e: Exception) -> RuntimeError:
        why = self.dead_rank() or self.lagging()
        return RuntimeError(f"{op} command to the trainer's ranks failed: {e}"
                            f"{'; ' + why if why else ''}")

    def run(self, cmd: RankCommand, fn: Any = None, *args: Any) -> Any:
        """Send `cmd`, then take rank 0's part (`fn(*args)`); a failure names the ranks."""
        dead = self.dead_rank()
        if dead:
            raise RuntimeError(dead)
        try:
            self.broadcast(cmd)
            return fn(*args) if fn is not None else None
        except RuntimeError as e:  # collectives (gloo/NCCL errors and timeouts) raise these
            raise self._failed(cmd.op, e) from e

    def send(self, cmd: RankCommand) -> None:
        self.run(cmd)

    def train(self, state: TrainState, samples: list[Sample], cfg: TrainConfig,
              next_teachers: list[str] = ()) -> dict[str, float]:
        return self.run(RankCommand("step", samples=samples, next_teachers=list(next_teachers)),
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

    def save_checkpoint(self, state: TrainState, path: Path) -> None:
        """A checkpoint at `path`, complete or absent (training/checkpoints.py); with megatron
        every rank writes its shards into it, with fsdp2 every rank gathers."""
        if not self.sharded:
            return state.save(path)
        write_checkpoint(path, lambda tmp: self.run(RankCommand("save", path=str(tmp)),
                                                    self.save_shards, state, tmp))

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


_DERIVED_ENV: set[str] = set()  # interface variables use_interface_of set for this host only


def rank_env(cfg: TrainConfig, rank: int) -> dict[str, str]:
    """Rank r's environment: this process's, less the interface this host's ranks use when r
    runs elsewhere (its own is found there from its address)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    host, here = cfg.parallel.rank_host(rank), cfg.parallel.rank_host(0)
    if host is not None and here is not None and host.address != here.address:
        for key in _DERIVED_ENV:
            env.pop(key, None)
    return env


def rank_command(cfg: TrainConfig, rank: int, world_size: int, store: str, run_dir: str,
                 resume: bool) -> list[str]:
    """The command that starts rank r: on this machine, or through its host's `exec` prefix
    (parallel.placement: ssh, srun, ip netns exec), in the host's workdir with its python and
    this process's PYTHONPATH. It reaches rank 0's store at `store` (host:port)."""
    host = cfg.parallel.rank_host(rank)
    args = ["-m", "actors.trainer_rank", "--rank", str(rank), "--world-size", str(world_size),
            "--store", store, "--store-timeout", f"{cfg.parallel.timeout_s:g}",
            "--run-dir", run_dir] + (["--resume"] if resume else [])
    if host is not None:
        args += ["--address", host.address]
    if host is None or not host.exec:
        return [sys.executable, *args]
    env = [f"{k}={os.environ[k]}" for k in ("PYTHONPATH", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
                                              "NCCL_SOCKET_IFNAME")
           if os.environ.get(k) and k not in _DERIVED_ENV]
    words = ["sh", "-c", 'cd "$0" && exec env "$@"', host.workdir or os.getcwd(),
             "PYTHONUNBUFFERED=1", *env, host.python or sys.executable, *args]
    shell = host.shell
    if shell is None:
        shell = os.path.basename(host.exec[0]) == "ssh"
    return [*host.exec, shlex.join(words)] if shell else [*host.exec, *words]


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
        if key not in os.environ:
            os.environ[key] = name
            _DERIVED_ENV.add(key)


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


def load_trainer(cfg: TrainConfig, run_dir: str, resume: bool, log_dir: Path
                 ) -> tuple[TrainState, RankGroup | None]:
    """The trainer's state on rank 0, and the group of the other ranks when there are any."""
    if cfg.parallel.world_size == 1:
        return load_train_state(cfg, run_dir, resume), None
    ranks = RankGroup(cfg, run_dir, resume, log_dir)
    return ranks.state, ranks


def stream_weights(state: TrainState, ranks: RankGroup | None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """What a push sends, tensor by tensor, on rank 0: views of a local model, or a sharded
    model's tensors as they are gathered (run in the trainer's compute thread)."""
    return ranks.stream_weights(state) if ranks is not None else state.iter_named_weights()


def save_weights(state: TrainState, path: Path, ranks: RankGroup | None,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """The HF export a disk push writes (rank 0; a sharded model in files of at most
    `shard_bytes`, streamed from its shards)."""
    if ranks is not None:
        ranks.save_weights(state, path, shard_bytes)
    else:
        state.save_weights(path, shard_bytes)


def save_checkpoint(state: TrainState, path: Path, ranks: RankGroup | None) -> None:
    """The trainer's checkpoint at `path` (megatron: its distributed format, at any rank
    count, so it resumes at another layout)."""
    if ranks is not None:
        ranks.save_checkpoint(state, path)
    elif is_megatron(state.model):
        from backends.megatron.checkpoint import save_trainer_checkpoint

        write_checkpoint(path, lambda tmp: save_trainer_checkpoint(state, tmp))
    else:
        state.save(path)
