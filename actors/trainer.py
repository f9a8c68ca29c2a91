"""The trainer actor: PPO-clip policy training (any training backend, training/backends.py).

Settings: `TrainerConfig` (actors/trainer_config.py, with the launcher's checks), the training
library's `training.config.TrainConfig` (one table per component: optimizer, micro_batches,
loss, kl, critic, mismatch, opd, parallel, ...) plus the actor's peers, loop, checkpoints and
weight sync.

One optimizer step per batch from the buffer (training.step):
1. recompute the old-policy log-probs on the *same* micro-batches that training uses (no grad),
   and measure them against the rollout's log-probs (train-rollout mismatch);
2. advantages by `loss.advantage_estimator` (GRPO, Dr.GRPO, REINFORCE++(-baseline), PPO with
   GAE and a critic), optionally a KL to a frozen reference (loss term or reward shaping); for
   each micro-batch the PPO-clip loss with the configured mismatch correction, backward
   (gradient accumulation with sample-mean normalisation over the whole step), clip, AdamW;
3. push the new weights to every inference worker (`weight_sync`, engine/weight_sync_config.py:
   one `push(version)` whatever the path; on disk the safetensors are written once per version,
   then pause -> /update_weights_from_disk -> continue on each worker; `weight_sync.pause_mode`,
   "in_place" by default: requests in flight are held, not aborted, and finish with the new
   weights), tell the buffer the version; its time per GB is a metric per path.
Checkpoints (model, optimizer, step, version) every `checkpoint.save_every` steps; with the
run's `--resume` it continues from the latest. In `colocated` mode the workers release their
memory while the trainer trains, and the trainer parks its parameters, gradients and optimizer
state in pinned host memory while the workers generate (training/sleep.py: in place, the
allocator's cache given back; engine/weight_push.py gives the order around each push). Compute
runs in
a dedicated thread so the actor stays responsive. Checks across actors: launch/plan.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from actors.prefetcher import RemoteReader
from actors.trainer_config import (  # noqa: F401 - TrainerConfig: also read from here
    TrainerActorPlan,
    TrainerConfig,
)
from engine.client import SglangClient
from engine.weight_push import AdapterPush, adapter_paths, release_to_train, wake_to_generate
from engine.weight_sync import WeightStream
from memory.device_usage import process_device_bytes
from models.lora import config_dict
from runtime.devices import gpu_ids
from training.ranks import load_trainer
from training.sleep import SleepReport
from transport.schema import EvalRequest, GetBatch, TrainBatch, VersionUpdate

log = logging.getLogger(__name__)


def distill_kl(stats: dict[str, float]) -> dict[str, float]:
    """`opd/reverse_kl`: the distillation signal of the whole step, every teacher's
    `opd/<teacher>/reverse_kl` weighted by its `opd/<teacher>/tokens` (the console's and
    plots' distillation line; a pure distillation run's `train/loss` is the policy-gradient
    part, 0); none without per-teacher KL."""
    total = tokens = 0.0
    for key, kl in stats.items():
        if key.startswith("opd/") and key.endswith("/reverse_kl") and key.count("/") == 2:
            n = stats.get(f"{key[:-len('reverse_kl')]}tokens", 0.0)
            total, tokens = total + kl * n, tokens + n
    return {"opd/reverse_kl": total / tokens} if tokens else {}


MERGED_DIR = "merged"  # lora.merge_export: the run's final HF export with the adapter merged in


class TrainerActor(TrainerActorPlan):
    """The trainer itself: its settings and launcher checks are `TrainerActorPlan`'s
    (actors/trainer_config.py)."""

    async def on_start(self) -> None:
        cfg = self.config
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self._closers.append(lambda: self.pool.shutdown(wait=True))
        run_dir = self.ctx.run_dir or "."
        # rank 0 here; with parallel.tp * pp * dp > 1 the launcher starts the other ranks
        # (actors/trainer_rank.py) with this actor and gives it their store (training.ranks)
        self.ranks = await self._in_thread(load_trainer, cfg, run_dir, self.ctx.resume,
                                           cfg.parallel.store)
        self.state = self.ranks.state
        self.state.temperature = self.facts.temperature  # ranks get it with each step
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
        self.run_dir = Path(run_dir)
        if cfg.lora is not None:  # the adapter only, loaded under each version's name
            self.sync = self._adapter_push()
        else:  # one push(version) whatever the path; disk when it fails (weight_sync.fallback)
            self.sync = await cfg.weight_sync.build(
                self.clients, names=list(cfg.workers),
                worker_devices=[self.peer(w).devices for w in cfg.workers],
                own_devices=gpu_ids([cfg.device]), device=cfg.device, run_dir=self.run_dir,
                write=lambda path, shard: self._in_thread(self.ranks.save_weights, self.state,
                                                          path, shard),
                stream=self.weight_stream)
        self._closers.append(self.sync.close)
        self.push_stats: dict[str, float] = {}  # the latest push's time per GB (metrics)
        self.buffer = await self.connect(cfg.buffer)
        self.epoch = uuid.uuid4().hex  # a restarted trainer is a new epoch for the buffer
        self.rollout = await self.connect(cfg.rollout) if cfg.rollout else None
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
            stats.update(distill_kl(stats))
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
        which lets the rollout generate with it. A failed distributed/tensor push that went
        through disk instead (`weight_sync.fallback = "disk"`) is said on the console with the
        failing worker and the cause."""
        report = await self.sync.push(self.state.version)
        if report.fell_back:
            self.counters["weight_sync.fallbacks"] += 1
            self.notify(report.notice)
        self.push_stats = report.metrics()
        if announce:
            await self._announce()

    def _adapter_push(self) -> AdapterPush:
        """A LoRA student's push: its adapter under each version's name (engine/weight_push.py);
        the newest max_staleness + 2 versions stay loaded (a request in flight keeps its own),
        at least weight_sync.keep_versions."""
        cfg, state = self.config, self.state

        def write(directory: Path) -> int:
            tmp = directory.with_name(directory.name + ".tmp")  # whole or absent
            shutil.rmtree(tmp, ignore_errors=True)
            nbytes = state.save_adapter(tmp, self.ranks.adapter_tensors(state))
            shutil.rmtree(directory, ignore_errors=True)
            tmp.replace(directory)
            return nbytes

        keep = max(cfg.weight_sync.keep_versions, self.facts.max_staleness + 2)
        paths = adapter_paths(cfg.weight_sync.path, [self.peer(w).devices for w in cfg.workers],
                              gpu_ids([cfg.device]), cfg.device, len(cfg.workers))
        return AdapterPush(self.clients, list(cfg.workers), paths, self.run_dir,
                           config_dict(cfg.lora, cfg.model),
                           lambda d: self._in_thread(write, d),
                           lambda: self._in_thread(self.ranks.adapter_tensors, state), keep,
                           cfg.weight_sync.timeout_s, cfg.device)

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

    async def _set_phase(self, phase: str) -> None:
        """Push the new version when the workers generate next. Colocated mode: one side's
        memory leaves the device while the other side works, in the order of
        engine/weight_push.py (`release_to_train`, `wake_to_generate`); then the buffer hears
        of the version (a worker still holding a released tag refuses requests)."""
        if self.config.mode != "colocated":
            if phase == "generate":
                await self.push_weights()
            return
        if phase == "train":
            report = await release_to_train(self.clients, lambda: self._in_thread(self.wake))
            self._publish_memory("train", report)
            return
        await wake_to_generate(self.clients, lambda: self.push_weights(announce=False),
                               lambda: self._in_thread(self.sleep, True),
                               lambda: self._sleep(keep_weights=False))
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
        lora = self.config.lora
        if lora is not None and lora.merge_export and self.state.step >= self.config.num_steps:
            self.save_merged()
        return path

    def save_merged(self) -> Path:
        """lora.merge_export: `<run_dir>/merged`, an HF directory of the base with the final
        adapter merged in (written under a temporary name, then renamed)."""
        path = self.run_dir / MERGED_DIR
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.ranks.save_merged(self.state, tmp)
        shutil.rmtree(path, ignore_errors=True)
        tmp.replace(path)
        return path

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
