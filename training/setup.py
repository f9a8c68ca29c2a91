"""Building the trainer's state from its config: the policy (torch or megatron backend), its
optimizer, the reference and critic, colocated teachers, and the latest checkpoint on resume.

Role: the one place every trainer rank (the actor's rank 0 and the rank processes,
training/ranks.py) loads its state, so all ranks start from identical weights (the torch
backend) or from the shards of one model (megatron: each rank its TP/PP shard, cut from the
same HF weights; a megatron checkpoint is read through megatron's distributed checkpointing, so
it resumes at any layout).
Invariant: with more than one rank, the megatron backend finds torch.distributed and megatron's
parallel state already initialised by training/ranks.py (its model is built on those groups);
alone, it initialises a one-rank group itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from memory.layout import FlatLayout
from models.load import load_model
from training.aux_models import AuxModel, CriticModel, OldActors, new_store
from training.checkpoints import resumable_checkpoint
from training.colocated_teachers import ColocatedTeachers, RowShard
from training.config import TrainConfig, distributed_optimizer
from training.distributed_optimizer import DistributedOptimizer
from training.master_weights import make_optimizer
from training.state import TrainState
from training.weight_sets import WeightSets, weight_tensors
from transport.dtypes import model_dtype

log = logging.getLogger(__name__)


def build_aux_models(cfg: TrainConfig, policy: torch.nn.Module | None):
    """(reference, critic) weight sets the configured algorithm needs, or None each; both in one
    `WeightSets` (pinned host copies; training/weight_sets.py)."""
    def source(path: str) -> torch.nn.Module:
        if not path and policy is not None:
            return policy
        if not path:  # a megatron policy: the reference/critic are transformers models
            path = cfg.model
        return load_model(path, cfg.device, model_dtype(cfg.dtype), cfg.seed)[0]

    store = new_store(cfg.device)
    ref = (AuxModel.frozen_copy(source(cfg.kl.ref_model), cfg.device, cfg.offload_aux_models,
                                store=store, update_interval=cfg.kl.ref_update_interval)
           if cfg.kl.coef > 0 else None)
    if ref is not None and ref.update_interval and policy is not None:
        own = FlatLayout.from_state_dict(weight_tensors(policy))
        if own.fingerprint() != store.layout(ref.tag).fingerprint():
            raise ValueError(f"kl.ref_update_interval = {ref.update_interval} copies the actor "
                             f"into the reference, but kl.ref_model = {cfg.kl.ref_model!r} has "
                             f"other tensors than the policy {cfg.model!r}; use a reference of "
                             f"the policy's architecture or ref_update_interval = 0")
    critic = (CriticModel(source(cfg.critic.model), cfg.device, cfg.critic, cfg.offload_aux_models,
                          store=store)
              if cfg.critic is not None else None)
    return ref, critic


def build_old_actors(cfg: TrainConfig, policy: torch.nn.Module, ref: AuxModel | None,
                     store: WeightSets) -> OldActors:
    """The proximal policies' sets (decoupled PPO, proximal = "rollout_version"), restored into
    the reference's resident module when the layouts match (one module for all of them)."""
    resident = None
    if ref is not None and FlatLayout.from_state_dict(weight_tensors(policy)).fingerprint() \
            == store.layout(ref.tag).fingerprint():
        resident = ref.resident_module
    return OldActors(cfg.mismatch.proximal_versions, cfg.device, cfg.offload_aux_models, store,
                     resident)


def load_train_state(cfg: TrainConfig, run_dir: str, resume: bool) -> TrainState:
    """The policy (torch or megatron backend), optimizer, aux models; resumed when asked."""
    torch.manual_seed(cfg.seed)
    dtype = model_dtype(cfg.dtype)
    if cfg.backend == "megatron":
        model, tokenizer = load_megatron(cfg, dtype)
    else:
        model, tokenizer = load_model(cfg.model, cfg.device, dtype, cfg.seed)
    model.train()
    if distributed_optimizer(cfg):  # megatron: the dp group exists (training.ranks joined it)
        from backends.megatron.mcore import param_is_not_shared, \
            param_is_not_tensor_parallel_duplicate
        from backends.megatron.model import parallel_state

        opt = DistributedOptimizer(
            model.parameters(), parallel_state.get_data_parallel_group(), cfg.optimizer.lr,
            cfg.optimizer.weight_decay, counted=lambda p: bool(
                param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)),
            norm_group=parallel_state.get_model_parallel_group())
    else:
        opt = make_optimizer(model.parameters(), dtype, cfg.optimizer.master_weights,
                             cfg.optimizer.lr, cfg.optimizer.weight_decay)
    hf_policy = model if cfg.backend == "torch" else None
    ref, critic = build_aux_models(cfg, hf_policy)  # before resuming: from the initial weights
    state = TrainState(model, tokenizer, opt, ref, critic)
    if cfg.mismatch.proximal == "rollout_version" and hf_policy is not None:
        store = ref.store if ref is not None else critic.store if critic is not None \
            else new_store(cfg.device)
        state.old_actors = build_old_actors(cfg, hf_policy, ref, store)
    if cfg.teachers:
        state.teachers = ColocatedTeachers.load(cfg.teachers, cfg.device, dtype,
                                                cfg.teacher_memory, run_dir, cfg.seed,
                                                teacher_shard(cfg))
    if resume:
        latest, state.skipped_checkpoints = resumable_checkpoint(Path(run_dir) / "checkpoints")
        if latest is not None:
            resume_from(state, latest, cfg)
            log.info("resumed from %s (step %d)", latest, state.step)
    return state


def teacher_shard(cfg: TrainConfig) -> RowShard | None:
    """Megatron at tp > 1: each tensor rank keeps its rows of every teacher's linear layers
    (training/teacher_weights.py); else whole teachers on every rank."""
    if cfg.backend != "megatron" or cfg.parallel.tp == 1:
        return None
    from backends.megatron.model import parallel_state

    return RowShard(parallel_state.get_tensor_model_parallel_rank(), cfg.parallel.tp,
                    parallel_state.get_tensor_model_parallel_group())


def load_megatron(cfg: TrainConfig, dtype: torch.dtype):
    """This rank's megatron-core model (its TP/PP shard) and the tokenizer."""
    # megatron-core is an optional dependency: imported only when the megatron backend is used
    from backends.megatron.model import initialize_parallel, load_model, parallel_state

    if not dist.is_initialized():
        assert cfg.parallel.world_size == 1, "training.ranks joins a multi-rank group first"
        dist.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        initialize_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.timeout_s)
    return load_model(cfg.model, cfg.megatron, cfg.device, dtype, cfg.seed)


def resume_from(state: TrainState, path: Path, cfg: TrainConfig) -> None:
    """Load the checkpoint at `path` into `state`: a megatron checkpoint through megatron's
    distributed checkpointing (any TP/PP/DP layout; collective), else the HF directory."""
    if cfg.backend == "megatron":
        from backends.megatron.checkpoint import is_trainer_checkpoint, load_trainer_checkpoint

        if is_trainer_checkpoint(path):
            load_trainer_checkpoint(state, path)
            return
    state.load(path, cfg.device)
