"""Building the trainer's state from its config: the policy (through its training backend,
training/backends.py), its optimizer, the reference and critic, colocated teachers, and the
latest checkpoint on resume.

Role: the one place every trainer rank (the actor's rank 0 and the rank processes,
training/ranks.py) loads its state, so all ranks start from identical weights (a whole model
per rank) or from the shards of one model (each rank its shard, cut from the same HF weights;
a backend's own checkpoint format may resume at any layout).
Invariant: a backend with `joins_group_first` finds torch.distributed and its model-parallel
state already initialised by training/ranks.py (its model is built on those groups); alone, it
initialises a one-rank group itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.utils.checkpoint

from memory.layout import FlatLayout
from memory.store import WeightStore, weight_tensors
from models.load import load_model
from training.aux_models import (
    AdaptersOffReference,
    AuxModel,
    CriticModel,
    OldActors,
    new_store,
)
from training.backends import TrainingBackend, backend_for
from training.checkpoints import resumable_checkpoint
from training.colocated_teachers import ColocatedTeachers, RowShard
from training.config import TrainConfig, distributed_optimizer
from training.distributed_optimizer import DistributedOptimizer, DistributedOptimizers
from training.master_weights import TrainOptimizer, make_optimizer
from training.moe import attach as attach_routing
from training.packing import use_packed_attention
from training.state import TrainState
from transport.dtypes import model_dtype

log = logging.getLogger(__name__)


def build_aux_models(cfg: TrainConfig, policy: torch.nn.Module | None):
    """(reference, critic) weight sets the configured algorithm needs, or None each; both in one
    `WeightStore` (pinned host copies; memory/store.py)."""
    def source(path: str) -> torch.nn.Module:
        if not path and policy is not None:
            return policy
        if not path:  # a policy that is not a transformers model: built from the checkpoint
            path = cfg.model
        model = load_model(path, cfg.device, model_dtype(cfg.dtype), cfg.seed)[0]
        if cfg.micro_batches.pack:  # its passes run packed rows too
            use_packed_attention(model, cfg.device)
        return model

    store = new_store(cfg.device)
    if cfg.lora is not None and not cfg.kl.ref_model:  # the base: the policy, adapters off
        ref = None  # load_train_state gives it the adapters-off reference once they are on
    else:
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
                     store: WeightStore) -> OldActors:
    """The proximal policies' sets (decoupled PPO, proximal = "rollout_version"), restored into
    the reference's resident module when the layouts match (one module for all of them)."""
    resident = None
    if ref is not None and FlatLayout.from_state_dict(weight_tensors(policy)).fingerprint() \
            == store.layout(ref.tag).fingerprint():
        resident = ref.resident_module
    return OldActors(cfg.mismatch.proximal_versions, cfg.device, cfg.offload_aux_models, store,
                     resident)


def load_train_state(cfg: TrainConfig, run_dir: str, resume: bool,
                     backend: TrainingBackend | None = None) -> TrainState:
    """The policy (through `backend`, default the configured one), optimizer, aux models;
    resumed when asked."""
    backend = backend if backend is not None else backend_for(cfg)
    torch.manual_seed(cfg.seed)
    dtype = model_dtype(cfg.dtype)
    model, tokenizer = backend.load_policy(cfg, dtype)
    model.train()
    hf_policy = backend.transformers_policy(model)
    if cfg.micro_batches.pack and hf_policy is not None:  # an attention without a dense mask
        log.info("packed micro-batches: attention %s",
                 use_packed_attention(hf_policy, cfg.device))
    if cfg.activation_checkpointing and hf_policy is not None:
        checkpoint_activations(hf_policy)
    elif cfg.activation_checkpointing:  # a model-parallel backend's layers (megatron's)
        log.info("activation checkpointing: %d decoder layers",
                 checkpoint_layers(decoder_layers(model)))
    ref, critic = build_aux_models(cfg, hf_policy)  # before resuming: from the initial weights
    if cfg.compile_layers:
        log.info("torch.compile: %d decoder layers", compile_layers(model))
    if cfg.lora is not None:  # after the copies above: they hold the base, never adapters
        backend.attach_lora(model, cfg.lora)
        if cfg.kl.coef > 0 and ref is None:
            ref = AdaptersOffReference(model, backend.adapters_off)
        log.info("LoRA student: %d trainable tensors, %d parameters (%.3f%% of the model)",
                 *lora_share(model))
    opt = build_optimizer(cfg, backend, model, dtype)
    state = TrainState(model, tokenizer, opt, ref, critic, backend)
    state.lora, state.base_model = cfg.lora, cfg.model
    if cfg.mismatch.proximal == "rollout_version" and hf_policy is not None:
        store = ref.store if ref is not None else critic.store if critic is not None \
            else new_store(cfg.device)
        state.old_actors = build_old_actors(cfg, hf_policy, ref, store)
    # a MoE policy's routing hooks, after every copy above (those route themselves)
    routing = backend.routing(model) if hasattr(backend, "routing") else None
    if routing is not None and cfg.true_on_policy:
        raise ValueError(f"true_on_policy and the mixture-of-experts model {cfg.model!r} "
                         f"conflict: the batch-invariant forward has no expert layers; set "
                         f"true_on_policy = false (moe.routing_replay = 'rollout' aligns the "
                         f"experts instead)")
    attach_routing(model, routing)
    if cfg.teachers:
        state.teachers = ColocatedTeachers.load(cfg.teachers, cfg.device, dtype,
                                                cfg.teacher_memory, run_dir, cfg.seed,
                                                teacher_shard(cfg, backend), tokenizer)
    if resume:
        latest, state.skipped_checkpoints = resumable_checkpoint(Path(run_dir) / "checkpoints")
        if latest is not None:
            resume_from(state, latest, cfg)
            log.info("resumed from %s (step %d)", latest, state.step)
    return state


def build_optimizer(cfg: TrainConfig, backend: TrainingBackend, model: torch.nn.Module,
                    dtype: torch.dtype) -> TrainOptimizer:
    """The policy's optimizer: AdamW's state and fp32 main weights sharded over the
    data-parallel replicas (`parallel.distributed_optimizer`: the backend's groups exist, the
    ranks joined them), else AdamW (through fp32 masters for 16-bit weights), clipping by the
    backend's global norm."""
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    if distributed_optimizer(cfg):
        parts = [DistributedOptimizer(part, group, cfg.optimizer.lr, cfg.optimizer.weight_decay,
                                      counted=counted, norm_group=norm_group)
                 for part, group, counted, norm_group in backend.optimizer_shards(params)]
        opt = parts[0] if len(parts) == 1 else DistributedOptimizers(parts)
        opt.prepare = backend.prepare_grads(model)
        return opt
    return make_optimizer(params, dtype, cfg.optimizer.master_weights,
                          cfg.optimizer.lr, cfg.optimizer.weight_decay, backend.grad_clip(model))


def checkpoint_activations(model: torch.nn.Module) -> None:
    """transformers' per-layer activation checkpointing, non-reentrant (gradients reach the
    adapters of a LoRA student, whose layer inputs need none)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# torch.compile's backend for `compile_layers` (tests trace with "aot_eager": inductor's code
# generation takes minutes on a CPU)
COMPILE_BACKEND = "inductor"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the first module list named `layers` (transformers'
    `model.layers`, megatron's `decoder.layers`); [] for a model without one."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return list(module)
    return []


def compile_layers(model: torch.nn.Module) -> int:
    """torch.compile every decoder layer in place (`nn.Module.compile`, dynamic shapes: the
    micro-batches' widths differ); the count. Values equal the eager layers' to float
    rounding; the first forwards and backwards of each shape compile."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError("compile_layers = true: the policy has no decoder layer list "
                         "(a module list named 'layers') to compile")
    for layer in layers:
        layer.compile(dynamic=True, backend=COMPILE_BACKEND)
    return len(layers)


def checkpoint_layers(layers: list[torch.nn.Module]) -> int:
    """Activation checkpointing of `layers` (a policy that is not a transformers model: the
    megatron backend's TransformerLayers, whose own recompute acts in training mode only and
    the step runs eval mode): each layer's forward with grad runs under
    torch.utils.checkpoint (non-reentrant), its activations made again in the backward; a
    no-grad forward runs as it is. The count of layers."""
    for layer in layers:
        def forward(*args, _forward=layer.forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False,
                                                     **kwargs)
        layer.forward = forward
    return len(layers)


def lora_share(model: torch.nn.Module) -> tuple[int, int, float]:
    """(trainable tensors, their parameters, their percent of all parameters)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    n, total = sum(p.numel() for p in trained), sum(p.numel() for p in model.parameters())
    return len(trained), n, 100.0 * n / max(total, 1)


def teacher_shard(cfg: TrainConfig, backend: TrainingBackend | None = None) -> RowShard | None:
    """A tensor-parallel backend: each tensor rank keeps its rows of every teacher's linear
    layers (training/teacher_weights.py); else whole teachers on every rank."""
    shard = (backend if backend is not None else backend_for(cfg)).tensor_shard(cfg)
    return RowShard(*shard) if shard is not None else None


def resume_from(state: TrainState, path: Path, cfg: TrainConfig) -> None:
    """Load the checkpoint at `path` into `state`: the backend's own format when it is one (a
    distributed checkpoint: any layout; collective), else the HF directory."""
    if not state.backend.load_checkpoint(state, path):
        state.load(path, cfg.device)
