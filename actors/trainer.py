"""The trainer actor: PPO-clip policy training (torch or megatron backend).

Settings: `TrainerConfig` below, the training library's `training.config.TrainConfig` (one
table per component: optimizer, micro_batches, loss, kl, critic, mismatch, opd, parallel, ...)
plus the actor's peers, loop, checkpoints and weight sync.

One optimizer step per batch from the buffer (training.step):
1. recompute the old-policy log-probs on the *same* micro-batches that training uses (no grad),
   and measure them against the rollout's log-probs (train-rollout mismatch);
2. advantages by `loss.advantage_estimator` (GRPO, Dr.GRPO, REINFORCE++(-baseline), PPO with
   GAE and a critic), optionally a KL to a frozen reference (loss term or reward shaping); for
   each micro-batch the PPO-clip loss with the configured mismatch correction, backward
   (gradient accumulation with sample-mean normalisation over the whole step), clip, AdamW;
3. push the new weights to every inference worker (safetensors written once per version;
   pause -> /update_weights_from_disk -> continue on each worker; `weight_sync.pause_mode`,
   "in_place" by default: requests in flight are held, not aborted, and finish with the new
   weights), tell the buffer the version; its time per GB is a metric per path.
Checkpoints (model, optimizer, step, version) every `checkpoint.save_every` steps; with the
run's `--resume` it continues from the latest. In `colocated` mode the workers release their
memory while the trainer trains, and the trainer parks its parameters, gradients and optimizer
state in pinned host memory while the workers generate (training/sleep.py: in place, the
allocator's cache given back; `_set_phase` gives the order around each push). Compute runs in
a dedicated thread so the actor stays responsive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Literal

from actors.prefetcher import RemoteReader
from engine.client import SglangClient
from engine.weight_sync_config import WeightSyncConfig
from engine.weight_sync import (DiskSync, SyncError, WeightStream, make_weight_sync,
                                plan_groups, plan_paths)
from logic.teachers import check_vocab
from memory.device_usage import process_device_bytes
from models.load import check_model_path, load_tokenizer
from runtime.actor import Actor, ActorView, check_named_peers
from runtime.devices import gpu_ids
from training.config import CheckpointConfig, TrainConfig
from training.ranks import STORE_ENV, load_trainer
from training.sleep import SleepReport
from transport.schema import EvalRequest, GetBatch, TrainBatch, VersionUpdate

log = logging.getLogger(__name__)


class TrainerConfig(TrainConfig, kw_only=True):
    """Settings of the trainer actor: the training library's (`training.config.TrainConfig`,
    one table per component) plus its peers, its loop, checkpoints and weight sync."""

    workers: list[str]  # peer names of the inference workers that receive every version
    buffer: str = "buffer"  # peer that hands out batches
    rollout: str = ""  # peer asked for a final evaluation after the last step ("" = none)
    num_steps: int = 20  # optimizer steps; the run completes after the last one
    mode: Literal["decoupled", "colocated"] = "decoupled"  # colocated needs max_staleness = 0
    # a wait on the buffer longer than this ends the run with a message (while it lasts, the
    # console reports it every [run] stall_report_s), seconds
    batch_timeout_s: float = 3600.0
    prefetcher: str = ""  # peer (actors.prefetcher) doing the teachers' NVMe reads ("" = here)
    checkpoint: CheckpointConfig = CheckpointConfig()  # when checkpoints are written
    weight_sync: WeightSyncConfig = WeightSyncConfig()  # how versions reach the workers


def _megatron_on_cpu() -> bool:
    """This process runs megatron-core on the CPU through the test-only torch.cuda stand-ins
    (backends/megatron/cpu_shim.py, armed by the tests' sitecustomize); looked up, never
    imported, so production code does not depend on it."""
    shim = sys.modules.get("backends.megatron.cpu_shim")
    return shim is not None and shim.armed()


class TrainerActor(Actor):
    Config = TrainerConfig
    role = "trainer"
    fact_fields = {"loss.temperature": "temperature"}

    @classmethod
    def check_config(cls, config: TrainerConfig) -> None:
        check_model_path(config.model)
        for path in (config.kl.ref_model, config.critic.model if config.critic else ""):
            if path:
                check_model_path(path)
        if not config.workers:
            raise ValueError("`workers` must name the inference worker actors")
        if config.teachers:
            student = load_tokenizer(config.model)
            for t in config.teachers:
                check_model_path(t.model)
                check_vocab(student, load_tokenizer(t.model), t.name)
        if config.backend == "megatron":
            if importlib.util.find_spec("megatron.core") is None:
                raise ValueError("backend = 'megatron' needs megatron-core: pip install "
                                 "'rlx[megatron]' (megatron-core 0.16.1)")
            from backends.megatron.convert import check_parallel_layout  # no megatron import

            check_parallel_layout(config.model, config.parallel.tp, config.parallel.pp)
            if not config.device.startswith("cuda") and not _megatron_on_cpu():
                raise ValueError("backend = 'megatron' runs on CUDA devices (megatron-core has no "
                                 "CPU path); use backend = 'torch' with device = 'cpu'")
        elif config.megatron:
            raise ValueError("`megatron` options are set but backend = 'torch'; set "
                             "backend = 'megatron' or remove them")
        if config.parallel.shard == "fsdp2" and config.mode == "colocated":
            raise ValueError("parallel.shard = 'fsdp2' and mode = 'colocated' conflict: sleeping "
                             "moves the trainer's tensors off the GPU, and FSDP's sharded storage "
                             "is not moved yet; use mode = 'decoupled' or shard = 'none'")
        if config.weight_sync.path == "cuda_ipc" and not config.device.startswith("cuda"):
            raise ValueError(f"weight_sync.path = 'cuda_ipc' sends CUDA IPC handles of the "
                             f"trainer's GPU memory, but device = {config.device!r}: use "
                             f"'tensor' (weights in the request body) or 'disk' on the CPU")

    @classmethod
    def gpus(cls, config: TrainerConfig, env: dict[str, str], host: str) -> list[str]:
        return gpu_ids([config.device], env, host)  # the GPU weights are sent from (rank 0)

    # ranks 1..N-1 of `parallel` (N = tp * pp * dp > 1): processes of this class, started by
    # the launcher with this actor and restarted with it (launch/config.py rank_entries)
    rank_cls = "actors.trainer_rank:TrainerRank"

    @classmethod
    def ranks(cls, config: TrainerConfig) -> list[str]:
        """The [[hosts]] name of each of ranks 1..N-1 ("" = this actor's host)."""
        hosts = [config.parallel.rank_host(r) for r in range(1, config.parallel.world_size)]
        return [h.name if h is not None else "" for h in hosts]

    @classmethod
    def peers(cls, config: TrainerConfig) -> dict[str, str]:
        return {**{f"workers[{i}]": w for i, w in enumerate(config.workers)},
                "buffer": config.buffer, "rollout": config.rollout,
                "prefetcher": config.prefetcher}

    @classmethod
    def check_peers(cls, name: str, config: TrainerConfig, actors: dict[str, ActorView]) -> None:
        """Every worker is an actor of the run; a distributed weight sync's placement can be
        served (engine.weight_sync.plan_groups: no worker on the trainer's GPU, no CPU worker
        under NCCL); cuda_ipc reaches only workers on the trainer's GPU ("auto" picks
        engine.weight_sync.plan_paths per worker and checks each part)."""
        check_named_peers(name, actors, {
            **{f"workers[{i}]": w for i, w in enumerate(config.workers)},
            "buffer": config.buffer, "rollout": config.rollout, "prefetcher": config.prefetcher})
        cls._check_buffer_side(name, config, actors)
        cls._check_true_on_policy(name, config, actors)
        path, workers = config.weight_sync.path, config.workers
        if path not in ("distributed", "cuda_ipc", "auto"):
            return
        mine, gpus = actors[name].gpus, [actors[w].gpus for w in workers]
        paths = (plan_paths(gpus, mine, config.device, len(workers)) if path == "auto"
                 else [path] * len(workers))
        for w, p, theirs in zip(workers, paths, gpus):
            if p == "cuda_ipc" and not set(theirs) & set(mine):
                raise ValueError(
                    f"weight_sync.path = 'cuda_ipc' hands [actors.{w}] CUDA IPC handles of the "
                    f"trainer's GPU ({', '.join(mine)}), but it runs on "
                    f"{', '.join(theirs) or 'the CPU'}: put it on the trainer's GPU, or set "
                    f"weight_sync.path = 'auto' (CUDA IPC on the shared GPU, NCCL to the "
                    f"others), 'distributed' or 'disk'")
        nccl = [i for i, p in enumerate(paths) if p == "distributed"]
        try:
            plan_groups([gpus[i] for i in nccl], mine, [f"[actors.{workers[i]}]" for i in nccl],
                        nccl=config.device.startswith("cuda"))
        except SyncError as e:
            raise ValueError(str(e)) from None

    @classmethod
    def _check_true_on_policy(cls, name: str, config: TrainerConfig,
                              actors: dict[str, ActorView]) -> None:
        """`true_on_policy` holds only when every worker computes with the same kernels, dtype
        and device kind as the trainer (models/invariant): embedded workers that set it too."""
        for w in config.workers:
            there = actors[w].config
            flag = getattr(there, "true_on_policy", None)
            if flag is None:  # not an embedded worker (SGLang runs its own kernels)
                if config.true_on_policy:
                    raise ValueError(f"true_on_policy = true here, but [actors.{w}] is not an "
                                     f"embedded inference worker: SGLang's kernels are not this "
                                     f"trainer's, so log-probs cannot be bitwise equal; use "
                                     f"embedded workers, or leave true_on_policy off (SGLang's "
                                     f"deterministic inference: docs/training.md)")
                continue
            if flag != config.true_on_policy:
                raise ValueError(f"true_on_policy = {str(config.true_on_policy).lower()} here but "
                                 f"{str(flag).lower()} in [actors.{w}.config]: the worker and the "
                                 f"trainer must both use the invariant kernels (or neither); set "
                                 f"the same value in both (or `true_on_policy` in [rl])")
            if not config.true_on_policy:
                continue
            kinds = there.device.split(":")[0], config.device.split(":")[0]
            if there.dtype != config.dtype or kinds[0] != kinds[1]:
                raise ValueError(f"true_on_policy: dtype {config.dtype!r} on {config.device!r} "
                                 f"here but dtype {there.dtype!r} on {there.device!r} in "
                                 f"[actors.{w}.config]; bitwise equality needs the same dtype "
                                 f"and device kind on both sides")

    @classmethod
    def _check_buffer_side(cls, name: str, config: TrainerConfig,
                           actors: dict[str, ActorView]) -> None:
        """Against the actors around its buffer: colocated mode needs the buffer's
        max_staleness = 0; the rollouts feeding that buffer sample at loss.temperature; the
        teacher pools feeding it agree with the trainer's opd / teachers."""
        buf = f"[actors.{config.buffer}.config]"
        buffer = actors[config.buffer]
        staleness = getattr(buffer.config, "max_staleness", 0) if buffer.cls.role == "buffer" \
            else 0
        if config.mode == "colocated" and staleness != 0:
            raise ValueError(f"mode = 'colocated' here needs max_staleness = 0 in {buf} (it is "
                             f"{staleness}): the workers are paused while the trainer trains, so "
                             f"no batch can be generated ahead; set max_staleness = 0 there, or "
                             f"mode = 'decoupled' here")
        feeding = {n: v for n, v in actors.items() if n != name
                   and getattr(v.config, "buffer", None) == config.buffer}
        for other, view in feeding.items():
            if view.cls.role == "rollout" and view.config.temperature != config.loss.temperature:
                raise ValueError(f"loss.temperature = {config.loss.temperature} here but "
                                 f"temperature = {view.config.temperature} in "
                                 f"[actors.{other}.config], the rollout feeding {buf}: the "
                                 f"trainer's log-probs must be at the sampling temperature; set "
                                 f"loss = {{ temperature = {view.config.temperature} }} here or "
                                 f"change the rollout's temperature")
        pools = {n: v for n, v in feeding.items() if v.cls.role == "teacher_pool"}
        if config.opd is None:
            if pools:
                pool = next(iter(pools))
                raise ValueError(f"[actors.{pool}] (a teacher pool) routes samples into {buf}, "
                                 f"which this trainer trains on, but opd is not set here: add "
                                 f"opd = {{ mode = ..., kl_coef = ... }} here (and `teachers` "
                                 f"for colocated teachers), or remove the teacher pool")
            return
        if not pools:
            raise ValueError(f"opd is set here, but no teacher pool (actors.teacher_pool:"
                             f"TeacherPool) sends its groups to {buf}, so no sample gets a "
                             f"teacher: add one with buffer = {config.buffer!r} and make it the "
                             f"rollout's `sink`, or remove opd")
        mine = sorted((t.name, t.model, tuple(sorted(t.domains))) for t in config.teachers)
        for pool, view in pools.items():
            there = f"[actors.{pool}.config]"
            pc = view.config
            if config.teachers:
                if pc.mode != "colocated":
                    raise ValueError(f"`teachers` here run colocated in the trainer, but {there} "
                                     f"has mode = {pc.mode!r}: set mode = 'colocated' there, or "
                                     f"remove `teachers` here to use its teacher servers")
                theirs = sorted((t.name, t.model, tuple(sorted(t.domains))) for t in pc.teachers)
                if mine != theirs:
                    raise ValueError(f"`teachers` here and in {there} differ (name, model, "
                                     f"domains): here {mine}, there {theirs}; the pool routes "
                                     f"samples by name to the trainer's teachers: give both the "
                                     f"same list")
            else:
                if pc.mode != "server":
                    raise ValueError(f"opd without `teachers` here takes the teacher signal from "
                                     f"teacher servers, but {there} has mode = 'colocated' (only "
                                     f"routing): set mode = 'server' there (with each teacher's "
                                     f"`worker` or `url`), or list the same `teachers` here to "
                                     f"run them in the trainer")
                if (pc.opd.mode, pc.opd.top_k) != (config.opd.mode, config.opd.top_k):
                    raise ValueError(f"opd here (mode = {config.opd.mode!r}, top_k = "
                                     f"{config.opd.top_k}) and in {there} (mode = "
                                     f"{pc.opd.mode!r}, top_k = {pc.opd.top_k}) differ: the "
                                     f"servers return what the pool's opd asks for and the "
                                     f"trainer trains on its own; set the same opd mode and "
                                     f"top_k in both")

    async def on_start(self) -> None:
        cfg = self.config
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self._closers.append(lambda: self.pool.shutdown(wait=True))
        run_dir = self.ctx.run_dir or "."
        # rank 0 here; with parallel.tp * pp * dp > 1 the launcher starts the other ranks
        # (actors/trainer_rank.py) with this actor and gives it their store (training.ranks)
        self.ranks = await self._in_thread(load_trainer, cfg, run_dir, self.ctx.resume,
                                           os.environ.get(STORE_ENV, ""))
        self.state = self.ranks.state
        self._closers.append(self._stop_ranks)
        for skipped in self.state.skipped_checkpoints:
            self.notify(f"resume skipped a damaged checkpoint: {skipped}")
        if self.ctx.resume:
            self.notify(f"resumed from the checkpoint of step {self.state.step} (weight version "
                        f"{self.state.version}); {max(0, cfg.num_steps - self.state.step)} of "
                        f"{cfg.num_steps} steps to go" if self.state.step else
                        "resume: no checkpoint in the run directory yet; starting at step 0")
        self.clients = [SglangClient(self.peer(w).http) for w in cfg.workers]
        for c in self.clients:
            self._closers.append(c.close)
        if self.state.teachers is not None:
            self._closers.append(self.state.teachers.close)
            if cfg.prefetcher:  # NVMe -> pinned arena reads in the prefetcher's process
                mem = self.state.teachers.memory
                mem.remote_read = RemoteReader(await self.connect(cfg.prefetcher),
                                               asyncio.get_running_loop(), mem.arena,
                                               str(mem.store.root))
        ws = cfg.weight_sync
        self.sync = await make_weight_sync(
            ws.path, self.clients, cfg.device, ws.bucket_bytes, names=list(cfg.workers),
            devices=[self.peer(w).devices for w in cfg.workers],
            own_devices=gpu_ids([cfg.device]), timeout_s=ws.timeout_s, retries=ws.retries,
            master_address=ws.master_address, pause_mode=ws.pause_mode)
        if hasattr(self.sync, "close"):
            self._closers.append(self.sync.close)
        # versions go through disk when the configured path fails (weight_sync.fallback)
        self.disk_sync = self.sync if ws.path == "disk" else DiskSync(self.clients,
                                                                      ws.pause_mode)
        self.push_stats: dict[str, float] = {}  # the latest push's time per GB (metrics)
        self._weight_bytes = 0  # bytes of one version (what each push moves per worker)
        self._held_bytes = 0  # the latest gathered push's most bytes held at once
        self.buffer = await self.connect(cfg.buffer)
        self.epoch = uuid.uuid4().hex  # a restarted trainer is a new epoch for the buffer
        self.rollout = await self.connect(cfg.rollout) if cfg.rollout else None
        self.run_dir = Path(self.ctx.run_dir or ".")
        self._warned_stale = False
        self._unequal_notice_at = -1e9  # last true_on_policy inequality said on the console
        self._saved_step = -1  # the step of the latest checkpoint this process wrote

    async def run(self) -> None:
        cfg = self.config
        await self.push_weights()  # workers serve exactly the trainer's weights from the start
        if self.config.mode == "colocated":  # the workers generate first: the trainer sleeps
            await self._sleep(keep_weights=False)
        while self.state.step < cfg.num_steps:
            t0 = time.monotonic()
            async with self.waiting_for(f"{cfg.buffer}'s batch for step {self.state.step}",
                                        cfg.batch_timeout_s, "batch_timeout_s"):
                batch: TrainBatch = await self.call_retrying(self.buffer, GetBatch(
                    step=self.state.step, trainer_version=self.state.version,
                    trainer_epoch=self.epoch), cfg.batch_timeout_s)
            t_wait = time.monotonic() - t0
            self.state.next_teachers = batch.next_teachers
            await self._set_phase("train")
            stats = await self._in_thread(self.train_step, batch.samples)
            t_train = time.monotonic() - t0 - t_wait
            self.state.step += 1
            self.state.version += 1
            every = cfg.checkpoint.save_every
            save = self.state.step >= cfg.num_steps or bool(every and self.state.step % every == 0)
            # colocated: written while awake (asleep, the trainer holds no weights to write);
            # the buffer hears of it after the push either way (its version comes first)
            written = save and cfg.mode == "colocated"
            if written:
                await self._in_thread(self.save_checkpoint)
            await self._set_phase("generate")  # with the push of the new version
            t_sync = time.monotonic() - t0 - t_wait - t_train
            if save:
                await self.checkpoint(written=written)
            stats.update({"time/wait_batch_s": t_wait, "time/train_s": t_train,
                          "time/weight_sync_s": t_sync, "time/step_s": time.monotonic() - t0,
                          "version": self.state.version,
                          "weight_sync/fallbacks": self.counters["weight_sync.fallbacks"],
                          **self.push_stats})
            host_sets = self.state.host_weight_sets_bytes()  # reference, critic, old actors
            if host_sets:
                stats["memory/host_weight_sets_bytes"] = host_sets
            self._warn_stale_sampled_opd(stats)
            self._warn_unequal(stats)
            if self.metrics:
                self.metrics.publish(stats, step=self.state.step, total_steps=cfg.num_steps)
        if self._saved_step != self.state.step:  # no step ran (resumed at num_steps)
            await self.checkpoint()
        if self.rollout is not None:
            await self.final_eval()

    def _warn_unequal(self, stats: dict[str, float]) -> None:
        """true_on_policy: a step where a current-weight token's log-probs differ reaches the
        console at once (then at most once a minute; every such step is in the trainer's log)."""
        if not self.config.true_on_policy or stats.get(
                "train/engine_logprob_bitwise_equal_frac", 1.0) >= 1.0:
            return
        now = time.monotonic()
        if now - self._unequal_notice_at < 60.0:
            return
        self._unequal_notice_at = now
        self.notify(f"true_on_policy: at step {self.state.step} only "
                    f"{stats['train/engine_logprob_bitwise_equal_frac']:.4%} of the tokens "
                    f"sampled with the current weights have bitwise-equal trainer and rollout "
                    f"log-probs (mean |delta| {stats['train/engine_logprob_abs_diff']:.3g}); "
                    f"check the workers' true_on_policy, device kind and dtype")

    def _warn_stale_sampled_opd(self, stats: dict[str, float]) -> None:
        """Sampled-token OPD on stale samples without TIS diverged in our runs (docs/mopd.md):
        said once, when it first happens."""
        cfg = self.config
        modes = {t.opd.mode for t in cfg.teachers if t.opd} | ({cfg.opd.mode} if cfg.opd else set())
        if ("sampled" in modes and cfg.mismatch.correction != "tis" and not self._warned_stale
                and stats.get("train/staleness_max", 0) >= 1):
            self._warned_stale = True
            log.warning("%s: sampled-token OPD on samples %d version(s) stale with mismatch "
                        "correction %r: this diverged in our runs; use mismatch = { correction = "
                        "'tis' }, opd mode 'full', or max_staleness = 0", self.name,
                        int(stats["train/staleness_max"]), cfg.mismatch.correction)

    async def _stop_ranks(self) -> None:
        """After the step in progress (commands go out from the compute thread only): the
        other ranks are told to leave; past 60 s this process leaves them (the launcher stops
        them with it)."""
        try:
            await asyncio.wait_for(self._in_thread(self.ranks.stop), 60)
        except TimeoutError:
            log.warning("%s: the trainer's ranks did not stop in 60 s; leaving them", self.name)
            self.ranks.kill()

    def train_step(self, samples: list) -> dict[str, float]:
        """Every rank takes its share of the same optimizer step (one rank: this process)."""
        return self.ranks.train(self.state, samples, self.config, self.state.next_teachers)

    def sleep(self, keep_weights: bool = False) -> SleepReport:
        return self.ranks.sleep(self.state, keep_weights)

    def wake(self) -> SleepReport:
        return self.ranks.wake(self.state)

    async def final_eval(self) -> None:
        """Ask the rollout to score the eval tasks with the final weights; record the result."""
        reply = await self.rollout.call(EvalRequest(step=self.state.step),
                                        self.config.batch_timeout_s)
        path = self.run_dir / "final_eval.json"
        tmp = path.with_name(path.name + ".tmp")  # whole or not at all (a full disk)
        try:
            tmp.write_text(json.dumps({"step": self.state.step, "version": self.state.version,
                                       "scores": reply.scores, "num_tasks": reply.num_tasks},
                                      indent=2))
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.notify(f"final eval {reply.scores} (not written to {path.name}: {e})")
        log.info("%s: final eval %s", self.name, reply.scores)
        if self.metrics:
            self.metrics.publish({f"final_eval/{d}": v for d, v in reply.scores.items()},
                                 step=self.state.step, total_steps=self.config.num_steps)

    async def push_weights(self, announce: bool = True) -> None:
        """Send this version to every worker (`weight_sync`), then (`announce`) tell the buffer,
        which lets the rollout generate with it. A failed
        distributed/tensor push goes through disk instead when `weight_sync.fallback = "disk"`,
        said on the console with the failing worker and the cause."""
        version, ws = self.state.version, self.config.weight_sync
        t0, path = time.monotonic(), ws.path
        if ws.path == "disk":
            await self._push_disk(version)
        else:
            stream = self.weight_stream()
            try:
                await self.sync.push(stream, str(version))
                self._weight_bytes = stream.bytes_read or self._weight_bytes
                self._held_bytes = stream.peak_held_bytes
            except SyncError as e:
                if ws.fallback != "disk":
                    raise
                self.counters["weight_sync.fallbacks"] += 1
                self.notify(f"weight version {version} over {ws.path} failed ({e}); sent "
                            f"through disk instead (the next version tries {ws.path} again)")
                path = "disk"
                await self._push_disk(version)
        self._record_push(path, time.monotonic() - t0)
        if announce:
            await self._announce()

    def weight_stream(self) -> WeightStream:
        """One version's weights as the in-memory paths read them: produced bucket by bucket
        in the compute thread (a sharded trainer gathers each piece from its ranks as it is
        sent, never the whole model at once)."""
        gathered = self.state.streams_weights
        return WeightStream(lambda: self.ranks.stream_weights(self.state), self.pool,
                            copies=gathered, shared=not gathered)

    async def _announce(self) -> None:
        await self.call_retrying(self.buffer, VersionUpdate(
            version=self.state.version, step=self.state.step, trainer_epoch=self.epoch),
            self.config.batch_timeout_s)

    def _record_push(self, path: str, seconds: float) -> None:
        """The push's time per GB of weights (one version's bytes; the disk path counts the
        write and every worker's load, the others every bucket to every worker)."""
        per_gb = seconds / (max(self._weight_bytes, 1) / 1e9)
        self.push_stats = {"weight_sync/push_s": seconds, "weight_sync/push_s_per_gb": per_gb,
                           f"weight_sync/{path}/push_s_per_gb": per_gb,
                           "weight_sync/weight_bytes": float(self._weight_bytes)}
        if self._held_bytes:  # a gathered (sharded) push: the most of it held at once
            self.push_stats["weight_sync/push_held_bytes"] = float(self._held_bytes)

    async def _push_disk(self, version: int) -> None:
        """Write the version once under <run_dir>/weights/v<N>; every worker loads it."""
        path = self.run_dir / "weights" / f"v{version}"
        await self._in_thread(self.ranks.save_weights, self.state, path,
                              self.config.weight_sync.bucket_bytes)
        self._weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        self._held_bytes = 0
        await self.disk_sync.push(str(path), str(version))
        versions = [p for p in (self.run_dir / "weights").glob("v*") if p.name[1:].isdigit()]
        for old in sorted(versions, key=lambda p: int(p.name[1:]))[
                :-self.config.weight_sync.keep_versions]:
            shutil.rmtree(old, ignore_errors=True)

    async def _set_phase(self, phase: str) -> None:
        """Push the new version when the workers generate next. Colocated mode: one side's
        memory leaves the device while the other side works. To train: the workers release
        theirs (weights, KV cache, CUDA graphs), then the trainer wakes. To generate: the
        trainer parks its gradients and optimizer state, the workers take their weights back,
        the push fills them (CUDA IPC reads the trainer's parameters where they are), the
        trainer parks its parameters too, and the workers take their KV cache back; then the
        buffer hears of the version."""
        if self.config.mode != "colocated":
            if phase == "generate":
                await self.push_weights()
            return
        if phase == "train":
            await asyncio.gather(*(c.release_memory_occupation() for c in self.clients))
            report = await self._in_thread(self.wake)
            self._publish_memory("train", report)
            return
        await self._in_thread(self.sleep, True)
        await asyncio.gather(*(c.resume_memory_occupation(["weights"]) for c in self.clients))
        await self.push_weights(announce=False)
        await self._sleep(keep_weights=False)
        await asyncio.gather(*(c.resume_memory_occupation(["kv_cache", "cuda_graph"])
                               for c in self.clients))
        # only now may the rollout generate: a worker still holding a released tag refuses
        # requests (503), which the router counts against it (its circuit breaker opens)
        await self._announce()

    async def _sleep(self, keep_weights: bool) -> None:
        report = await self._in_thread(self.sleep, keep_weights)
        if not keep_weights:
            self._publish_memory("generate", report)

    def _publish_memory(self, phase: str, report: SleepReport) -> None:
        """The trainer's device memory after a sleep or wake: the bytes its step's tensors hold
        there, what NVML shows for the process (CUDA; allocator cache and context included),
        and the bytes moved and the time the move took (rank 0's)."""
        if not self.metrics:
            return
        values = {f"memory/{phase}/trainer_device_bytes": float(self.state.device_bytes()),
                  **report.metrics(f"memory/{phase}/trainer_move")}
        nvml = process_device_bytes() if self.config.device.startswith("cuda") else None
        if nvml is not None:
            values[f"memory/{phase}/trainer_nvml_bytes"] = float(nvml)
        self.metrics.publish(values, step=self.state.step)

    async def checkpoint(self, written: bool = False) -> None:
        """Save (unless `written` already), then tell the buffer: batches of earlier steps are
        never needed again."""
        if not written:
            await self._in_thread(self.save_checkpoint)
        await self.call_retrying(self.buffer, VersionUpdate(
            version=self.state.version, step=self.state.step, trainer_epoch=self.epoch,
            checkpointed=True), self.config.batch_timeout_s)

    def save_checkpoint(self) -> Path:
        path = self.run_dir / "checkpoints" / f"step_{self.state.step:06d}"
        self._saved_step = self.state.step
        self.ranks.save_checkpoint(self.state, path)
        return path

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
