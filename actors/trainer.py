"""The trainer actor (torch backend): PPO-clip policy training on a transformers model.

One optimizer step per batch from the buffer (training.step):
1. recompute the old-policy log-probs on the *same* micro-batches that training uses (no grad),
   and measure them against the rollout's log-probs (train-rollout mismatch);
2. advantages by `advantage_estimator` (GRPO, Dr.GRPO, REINFORCE++(-baseline), PPO with GAE and
   a critic), optionally a KL to a frozen reference (loss term or reward shaping); for each
   micro-batch the PPO-clip loss with the configured mismatch correction, backward (gradient
   accumulation with sample-mean normalisation over the whole step), clip, AdamW;
3. push the new weights to every inference worker (safetensors written once per version;
   pause -> /update_weights_from_disk -> continue on each worker), tell the buffer the version.
Checkpoints (model, optimizer, step, version) every `save_every` steps; with the run's `--resume`
it continues from the latest. In `colocated` mode the workers release their memory while the
trainer trains, and the trainer moves its weights and optimizer state off the device while the
workers generate. Compute runs in a dedicated thread so the actor stays responsive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from actors.prefetcher import RemoteReader
from algos.advantages import TOKEN_REWARDS, check_estimator
from algos.kl import ESTIMATORS as KL_ESTIMATORS
from algos.mismatch import MismatchConfig
from algos.opd import OpdConfig, check_placement
from engine.client import SglangClient
from engine.weight_sync import make_weight_sync
from logic.teachers import TeacherSpec, check_vocab, route_table
from models.load import check_model_path, load_tokenizer
from runtime.actor import Actor
from training.aux_models import CriticConfig
from training.colocated_teachers import TeacherMemoryConfig
from training.ranks import RankGroup
from training.setup import load_train_state
from training.step import train_on_batch
from transport.schema import EvalRequest, GetBatch, TrainBatch, VersionUpdate

log = logging.getLogger(__name__)


class TrainerConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of the torch trainer (incompatible options fail at load, naming both)."""

    model: str  # initial checkpoint: an HF directory or a built-in tiny model name
    workers: list[str]  # peer names of the inference workers that receive every version
    buffer: str = "buffer"  # peer that hands out batches
    rollout: str = ""  # peer asked for a final evaluation after the last step ("" = none)
    num_steps: int = 20  # optimizer steps; the run completes after the last one
    mode: Literal["decoupled", "colocated"] = "decoupled"  # colocated needs max_staleness = 0
    lr: float = 1e-4  # policy AdamW learning rate
    weight_decay: float = 0.0  # policy AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm (0 = no clipping)
    micro_batch_size: int = 16  # samples per forward/backward (when max_tokens_per_mb = 0)
    max_tokens_per_mb: int = 0  # token cap per micro-batch, first-fit-decreasing packing (0 = off)
    forward_by_length: bool | None = None  # unpadded forward per length; None = fp32 on CPU only
    temperature: float = 1.0  # must equal the rollout's sampling temperature
    # grpo | dr_grpo | reinforce_plus_plus | reinforce_plus_plus_baseline | ppo (GAE + critic)
    # | none (A = 0: pure distillation, needs opd)
    advantage_estimator: str = "grpo"
    std_normalization: bool = True  # grpo only: false = Dr.GRPO (same as estimator "dr_grpo")
    gamma: float = 1.0  # per-token discount (reinforce_plus_plus, ppo)
    gae_lambda: float = 0.95  # GAE lambda (ppo)
    critic: CriticConfig | None = None  # the value model; required by (only by) "ppo"
    kl_coef: float = 0.0  # weight of KL(policy || reference); 0 = no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3 (algos.kl)
    use_kl_loss: bool = False  # the KL as a loss term: + kl_coef * sample-mean KL
    kl_in_reward: bool = False  # the KL as reward shaping: token reward -kl_coef * KL_t
    ref_model: str = ""  # reference checkpoint ("" = a frozen copy of `model`'s initial weights)
    offload_aux_models: bool = True  # reference/critic weights on the CPU between uses (on GPU)
    eps_clip: float = 0.2  # PPO clip: ratio bounded below by 1 - eps_clip
    eps_clip_high: float | None = None  # upper bound 1 + eps_clip_high (None = eps_clip)
    dual_clip_c: float | None = None  # > 1: cap the loss of negative-advantage tokens at -c*A
    entropy_coef: float = 0.0  # entropy bonus weight
    mismatch: MismatchConfig = MismatchConfig()  # TIS / rejection / decoupled PPO / bypass
    device: str = "cpu"  # torch device of the policy (and of the reference/critic while in use)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights and activations
    # fp32 master weights and optimizer state behind 16-bit parameters (training/master_weights.py);
    # None = on for bfloat16/float16, false = pure 16-bit updates
    master_weights: bool | None = None
    save_every: int = 0  # checkpoint every this many steps (0 = only at the end)
    keep_versions: int = 2  # pushed weight versions kept on disk
    seed: int = 0  # torch seed (and the initialisation of built-in tiny models)
    batch_timeout_s: float = 3600.0  # how long to wait for the buffer
    backend: Literal["torch", "megatron"] = "torch"  # megatron: megatron-core GPTModel (GPU)
    megatron: dict[str, Any] = {}  # megatron TransformerConfig/GPTModel options, passed through
    # how each version reaches the workers: disk (safetensors + /update_weights_from_disk),
    # distributed (a torch.distributed group with every worker: NCCL on GPU, gloo on CPU),
    # tensor (weights in the request body; colocated workers on the same host)
    weight_sync: Literal["disk", "distributed", "tensor"] = "disk"
    weight_sync_bucket_mib: int = 512  # bucket size of the distributed and tensor paths
    # on-policy distillation (algos/opd.py): None = off. With `teachers` the teachers run here,
    # colocated on weight memory; without, their signal comes from the teacher pool's servers
    opd: OpdConfig | None = None
    teachers: list[TeacherSpec] = []  # colocated teachers (the same list as the teacher pool's)
    teacher_memory: TeacherMemoryConfig = TeacherMemoryConfig()  # their tiers and budgets
    prefetcher: str = ""  # peer (actors.prefetcher) doing the teachers' NVMe reads ("" = here)
    # data-parallel ranks on this host (training/ranks.py): the actor is rank 0 and starts
    # the others; on CUDA rank r uses the r-th device from `device`, on CPU gloo processes.
    # Colocated teachers: every rank holds its own (own slots, arena, NVMe dir <dir>-rank<r>)
    dp_size: int = 1
    dp_timeout_s: float = 600.0  # a collective waiting longer than this fails (a dead rank)

    def __post_init__(self) -> None:
        check_algorithm(self)

    @property
    def estimator(self) -> str:
        """The advantage estimator in effect (grpo with std_normalization = false is dr_grpo)."""
        if self.advantage_estimator == "grpo" and not self.std_normalization:
            return "dr_grpo"
        return self.advantage_estimator


def check_algorithm(cfg: TrainerConfig) -> None:
    """ValueError naming both options of any incompatible pair."""
    check_estimator(cfg.advantage_estimator)
    est = cfg.advantage_estimator
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator = {cfg.kl_estimator!r}; use one of {KL_ESTIMATORS}")
    if cfg.micro_batch_size < 1 or cfg.max_tokens_per_mb < 0:
        raise ValueError("micro_batch_size must be >= 1 and max_tokens_per_mb >= 0 (0 = no cap)")
    if not cfg.std_normalization and est not in ("grpo", "dr_grpo"):
        raise ValueError(f"std_normalization = false and advantage_estimator = {est!r} conflict: "
                         "std_normalization only applies to grpo; remove it")
    if est == "ppo" and cfg.critic is None:
        raise ValueError("advantage_estimator = 'ppo' needs a critic: add critic = {} (a value "
                         "model from the policy's checkpoint) or critic = { model = ..., "
                         "lr = ... }")
    if est != "ppo" and cfg.critic is not None:
        raise ValueError(f"critic is set but advantage_estimator = {est!r} uses no value model; "
                         "use advantage_estimator = 'ppo' or remove critic")
    if not (0 < cfg.gamma <= 1 and 0 <= cfg.gae_lambda <= 1):
        raise ValueError(f"need 0 < gamma <= 1 and 0 <= gae_lambda <= 1, got gamma = {cfg.gamma},"
                         f" gae_lambda = {cfg.gae_lambda}")
    _check_kl(cfg, est)
    _check_opd(cfg)
    _check_dp(cfg)


def _check_dp(cfg: TrainerConfig) -> None:
    if cfg.dp_size < 1 or cfg.dp_timeout_s <= 0:
        raise ValueError(f"need dp_size >= 1 and dp_timeout_s > 0, got dp_size = {cfg.dp_size}, "
                         f"dp_timeout_s = {cfg.dp_timeout_s}")
    if cfg.dp_size == 1:
        return
    if cfg.backend == "megatron":
        raise ValueError(f"dp_size = {cfg.dp_size} and backend = 'megatron' conflict: the actor "
                         "runs megatron as one rank; run multi-rank megatron under torchrun "
                         "(backends.megatron) or use backend = 'torch'")


def _check_opd(cfg: TrainerConfig) -> None:
    if cfg.teachers and cfg.opd is None:
        raise ValueError("teachers are set but opd is not: add opd = { mode = ..., kl_coef = ... }"
                         " or remove teachers")
    if cfg.opd is None:
        if cfg.advantage_estimator == "none":
            raise ValueError("advantage_estimator = 'none' (A = 0) trains nothing without opd; "
                             "set opd = { ... } or choose an estimator")
        return
    route_table(cfg.teachers)
    if not cfg.teachers:  # the signal comes from teacher servers through the teacher pool
        check_placement(cfg.opd, "server")


def _check_kl(cfg: TrainerConfig, est: str) -> None:
    if cfg.use_kl_loss and cfg.kl_in_reward:
        raise ValueError("use_kl_loss = true and kl_in_reward = true conflict: the KL is either a "
                         "loss term or reward shaping; set one of them false")
    if cfg.kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {cfg.kl_coef}")
    if cfg.kl_coef > 0 and not (cfg.use_kl_loss or cfg.kl_in_reward):
        raise ValueError(f"kl_coef = {cfg.kl_coef} needs use_kl_loss = true or kl_in_reward = "
                         "true (how the KL enters the update)")
    if (cfg.use_kl_loss or cfg.kl_in_reward) and cfg.kl_coef == 0:
        which = "use_kl_loss" if cfg.use_kl_loss else "kl_in_reward"
        raise ValueError(f"{which} = true and kl_coef = 0 conflict: set kl_coef > 0 or {which} "
                         "= false")
    if cfg.kl_in_reward and est not in TOKEN_REWARDS:
        raise ValueError(f"kl_in_reward = true and advantage_estimator = {est!r} conflict: "
                         f"{est} ignores token rewards; use use_kl_loss = true or one of "
                         f"{TOKEN_REWARDS}")
    if cfg.ref_model and cfg.kl_coef == 0:
        raise ValueError(f"ref_model = {cfg.ref_model!r} is unused with kl_coef = 0; set kl_coef "
                         "(and use_kl_loss or kl_in_reward) or remove ref_model")


class TrainerActor(Actor):
    Config = TrainerConfig
    role = "trainer"

    @classmethod
    def check_config(cls, config: TrainerConfig) -> None:
        check_model_path(config.model)
        for path in (config.ref_model, config.critic.model if config.critic else ""):
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
            if not config.device.startswith("cuda"):
                raise ValueError("backend = 'megatron' runs on CUDA devices (megatron-core has no "
                                 "CPU path); use backend = 'torch' with device = 'cpu'")
        elif config.megatron:
            raise ValueError("`megatron` options are set but backend = 'torch'; set "
                             "backend = 'megatron' or remove them")

    async def on_start(self) -> None:
        cfg = self.config
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self._closers.append(lambda: self.pool.shutdown(wait=True))
        self.state = await self._in_thread(load_train_state, cfg, self.ctx.run_dir or ".",
                                           self.ctx.resume)
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
        self.sync = await make_weight_sync(cfg.weight_sync, self.clients, cfg.device,
                                           cfg.weight_sync_bucket_mib << 20)
        if hasattr(self.sync, "close"):
            self._closers.append(self.sync.close)
        self.buffer = await self.connect(cfg.buffer)
        self.rollout = await self.connect(cfg.rollout) if cfg.rollout else None
        self.run_dir = Path(self.ctx.run_dir or ".")
        self.ranks, self._warned_stale = None, False
        if cfg.dp_size > 1:
            self.ranks = await self._in_thread(RankGroup, cfg, str(self.run_dir), self.ctx.resume,
                                               self.run_dir / "logs")
            self._closers.append(self._stop_ranks)
            await self._in_thread(self.ranks.check_same_weights, self.state.model)

    async def run(self) -> None:
        cfg = self.config
        await self.push_weights()  # workers serve exactly the trainer's weights from the start
        while self.state.step < cfg.num_steps:
            t0 = time.monotonic()
            batch: TrainBatch = await self.buffer.call(
                GetBatch(step=self.state.step, trainer_version=self.state.version),
                cfg.batch_timeout_s)
            t_wait = time.monotonic() - t0
            self.state.next_teachers = batch.next_teachers
            await self._set_phase("train")
            stats = await self._in_thread(self.train_step, batch.samples)
            t_train = time.monotonic() - t0 - t_wait
            self.state.step += 1
            self.state.version += 1
            await self._set_phase("generate")
            await self.push_weights()
            t_sync = time.monotonic() - t0 - t_wait - t_train
            if cfg.save_every and self.state.step % cfg.save_every == 0:
                await self._in_thread(self.save_checkpoint)
            stats.update({"time/wait_batch_s": t_wait, "time/train_s": t_train,
                          "time/weight_sync_s": t_sync, "time/step_s": time.monotonic() - t0,
                          "version": self.state.version})
            self._warn_stale_sampled_opd(stats)
            if self.metrics:
                self.metrics.publish(stats, step=self.state.step, total_steps=cfg.num_steps)
        await self._in_thread(self.save_checkpoint)
        if self.rollout is not None:
            await self.final_eval()

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
        """After the step in progress (commands go out from the compute thread only); ranks
        that do not stop in time are killed."""
        try:
            await asyncio.wait_for(self._in_thread(self.ranks.stop), 60)
        except TimeoutError:
            log.warning("%s: data-parallel ranks did not stop in 60 s; killing them", self.name)
            self.ranks.kill()

    def train_step(self, samples: list) -> dict[str, float]:
        if self.ranks is not None:  # every rank takes its share of the same optimizer step
            return self.ranks.train(self.state, samples, self.config, self.state.next_teachers)
        return train_on_batch(self.state, samples, self.config)

    def to_device(self, device: str) -> None:
        if self.ranks is not None:
            self.ranks.to_device(self.state, device)
        else:
            self.state.to_device(device)

    async def final_eval(self) -> None:
        """Ask the rollout to score the eval tasks with the final weights; record the result."""
        reply = await self.rollout.call(EvalRequest(step=self.state.step),
                                        self.config.batch_timeout_s)
        (self.run_dir / "final_eval.json").write_text(json.dumps(
            {"step": self.state.step, "version": self.state.version, "scores": reply.scores,
             "num_tasks": reply.num_tasks}, indent=2))
        log.info("%s: final eval %s", self.name, reply.scores)
        if self.metrics:
            self.metrics.publish({f"final_eval/{d}": v for d, v in reply.scores.items()},
                                 step=self.state.step, total_steps=self.config.num_steps)

    async def push_weights(self) -> None:
        """Send this version to every worker (`weight_sync`), then tell the buffer."""
        version = self.state.version
        if self.config.weight_sync == "disk":  # written once, loaded by every worker
            path = self.run_dir / "weights" / f"v{version}"
            await self._in_thread(self.state.save_weights, path)
            await self.sync.push(str(path), str(version))
            versions = [p for p in (self.run_dir / "weights").glob("v*") if p.name[1:].isdigit()]
            for old in sorted(versions, key=lambda p: int(p.name[1:]))[
                    :-self.config.keep_versions]:
                shutil.rmtree(old, ignore_errors=True)
        else:
            named = await self._in_thread(self.state.named_weights)
            await self.sync.push(named, str(version))
        await self.buffer.call(VersionUpdate(version=version, step=self.state.step))

    async def _set_phase(self, phase: str) -> None:
        """Colocated mode: one side's memory leaves the device while the other side works."""
        if self.config.mode != "colocated":
            return
        if phase == "train":
            await asyncio.gather(*(c.release_memory_occupation() for c in self.clients))
            await self._in_thread(self.to_device, self.config.device)
        else:
            await self._in_thread(self.to_device, "cpu")
            await asyncio.gather(*(c.resume_memory_occupation() for c in self.clients))
        if self.metrics:
            self.metrics.publish({f"memory/{phase}/trainer_device_bytes":
                                  self.state.device_bytes(self.config.device)},
                                 step=self.state.step)

    def save_checkpoint(self) -> Path:
        path = self.run_dir / "checkpoints" / f"step_{self.state.step:06d}"
        self.state.save(path)
        return path

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
