"""Checkpoints of the megatron backend: distributed (resumable, reshardable) and HF (weight sync).

Role: `save_distributed` / `load_distributed` write and read the model and its optimizer state
through megatron.core.dist_checkpointing: every rank writes its own shards, and a checkpoint
saved at one TP/PP/DP layout loads at another. The optimizer's per-parameter tensors (AdamW's
moments, fp32 master weights) are sharded like the parameter they belong to (megatron's
`make_sharded_optimizer_tensor`), so they reshard with it; per-parameter scalars (AdamW's step
count) are equal for every parameter and kept once in `trainer_state.json`. `save_hf` writes the
whole model as a Hugging Face directory (streamed from the shards, one safetensors shard file
at a time, with an index when there are several) that transformers, the embedded worker and SGLang's
/update_weights_from_disk load. `save_trainer_checkpoint` / `load_trainer_checkpoint` are the
trainer's checkpoint (HF export, `megatron/` shards, critic, step and version).
Invariant: every function here is collective (call it on every rank of the job); files are
written only by the ranks that own them. A distributed directory is complete once
`save_distributed` returned on every rank (its state file is written last, after a barrier); an
HF directory once `save_hf` returned on global rank 0.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from backends.megatron.mcore import dist_checkpointing, parallel_state
from backends.megatron.parallel import iter_hf_tensors
from memory.safetensors_io import DEFAULT_SHARD_BYTES, write_safetensors_shards

if TYPE_CHECKING:  # annotations only: model.py imports this module
    from backends.megatron.model import MegatronCausalLM


STATE_FILE = "trainer_state.json"
MEGATRON_DIR = "megatron"  # a trainer checkpoint's distributed part
CRITIC_FILE = "critic.pt"
# torch.distributed.checkpoint APIs megatron-core 0.16 still uses; nothing a user can change
_TORCH_DEPRECATIONS = ("Please use DTensor instead", "`load_state_dict` is deprecated",
                       "`save_state_dict` is deprecated")


@contextlib.contextmanager
def _quiet_torch_deprecations():
    with warnings.catch_warnings():
        for message in _TORCH_DEPRECATIONS:
            warnings.filterwarnings("ignore", re.escape(message), FutureWarning)
        yield


def save_hf(model: MegatronCausalLM, directory: str | Path,
            shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Whole model as safetensors + config.json, written by global rank 0 as the pieces arrive
    (shards of at most `shard_bytes`: one shard in host memory, never the whole model)."""
    tensors = iter_hf_tensors(model)
    try:
        if dist.get_rank() == 0:
            write_safetensors_shards(tensors, directory, shard_bytes)
            model.config.save_pretrained(directory)
    finally:  # this rank's part of the gather, or (a failed write) the rest of it: the other
        for _ in tensors:  # ranks are in it, and stay in step for the next command
            pass


def _optimizer_parts(optimizer: Any) -> tuple[Any, list, list]:
    """(the torch optimizer, the model parameters it updates, the tensors it steps: fp32
    masters or the parameters themselves) of a per-parameter optimizer (the training library's
    TrainOptimizer protocol, duck-typed: `has_masters`, `optimizer`, `params`, `master`); the
    distributed optimizer through its per-parameter view (`_per_parameter`)."""
    return (optimizer.optimizer, optimizer.params,
            optimizer.master if optimizer.has_masters else optimizer.params)


def _sharded_params(model: MegatronCausalLM) -> dict[int, Any]:
    """id(parameter) -> its megatron sharded tensor (or factory)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded, _ = extract_sharded_tensors_and_factories(model.core.sharded_state_dict())
    return {id(t.data): t for t in nested_values(sharded)}


def _optimizer_sharded(model: MegatronCausalLM, optimizer: Any, keys: list[str],
                       masters: bool, template: bool) -> dict[str, Any]:
    """The optimizer's per-parameter tensors `keys` (and masters) as sharded tensors; with
    `template`, freshly allocated ones to load into."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    inner, params, owners = _optimizer_parts(optimizer)
    by_param = _sharded_params(model)
    out: dict[str, Any] = {}
    for i, (param, owner) in enumerate(zip(params, owners)):
        sharded = by_param.get(id(param))
        if sharded is None:
            raise ValueError(f"optimizer parameter {i} {tuple(param.shape)} is not a parameter "
                             f"of the megatron model")
        state = inner.state.get(owner, {})
        for key in keys:
            tensor = torch.zeros_like(owner) if template else state[key]
            out[f"optimizer/{key}.{i}"] = make_sharded_optimizer_tensor(sharded, tensor,
                                                              f"optimizer.{key}")
        if masters:
            tensor = torch.empty_like(owner) if template else owner.detach()
            out[f"optimizer/master.{i}"] = make_sharded_optimizer_tensor(sharded, tensor,
                                                                         "optimizer.master")
    return out


def _optimizer_layout(optimizer: Any) -> dict[str, Any]:
    """What the optimizer state holds: per-parameter tensor keys, scalars (equal for every
    parameter), whether there are fp32 masters."""
    inner, params, owners = _optimizer_parts(optimizer)
    keys: set[str] = set()
    scalars: dict[str, float] = {}
    for param, owner in zip(params, owners):
        for key, value in inner.state.get(owner, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == owner.shape and value.dim():
                keys.add(key)
                continue
            number = float(value)
            if scalars.setdefault(key, number) != number:
                raise ValueError(f"optimizer state {key!r} differs between parameters "
                                 f"({scalars[key]} and {number}); it cannot be resharded")
    return {"tensor_keys": sorted(keys), "scalars": scalars,
            "masters": bool(optimizer.has_masters)}


def _per_parameter(optimizer: Any) -> Any:
    """The optimizer as the checkpoint sees it: per parameter. One that `holds_ranges` (the
    distributed optimizer) gathers its ranges into that view (collective)."""
    return optimizer.full_view() if optimizer.holds_ranges else optimizer


def save_distributed(model: MegatronCausalLM, directory: str | Path,
                     optimizer: Any = None, step: int = 0, version: int = 0) -> None:
    """Sharded model weights and optimizer state, and (rank 0, last) the state file."""
    directory = Path(directory)
    if optimizer is not None:
        optimizer = _per_parameter(optimizer)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sharded = model.core.sharded_state_dict()
    meta: dict[str, Any] = {"step": step, "version": version}
    if optimizer is not None:
        layout = _optimizer_layout(optimizer)
        sharded |= _optimizer_sharded(model, optimizer, layout["tensor_keys"], layout["masters"],
                                      template=False)
        meta["optimizer"] = layout
    with _quiet_torch_deprecations():
        dist_checkpointing.save(sharded, str(directory))
    dist.barrier()
    if dist.get_rank() == 0:  # written last: its presence marks a complete checkpoint
        (directory / STATE_FILE).write_text(json.dumps(meta))
    dist.barrier()


def load_distributed(model: MegatronCausalLM, directory: str | Path,
                     optimizer: Any = None) -> dict[str, Any]:
    """Load weights saved by `save_distributed` (any layout) and, when given, the optimizer
    state (any layout); returns the state file ({"step", "version", ...})."""
    directory = Path(directory)
    if not (directory / STATE_FILE).is_file():
        raise ValueError(f"{directory} is not a complete megatron checkpoint (no {STATE_FILE})")
    meta = json.loads((directory / STATE_FILE).read_text())
    sharded = model.core.sharded_state_dict()
    saved = meta.get("optimizer")
    target = optimizer
    if optimizer is not None and optimizer.holds_ranges:
        optimizer = optimizer.empty_view()  # per parameter; its ranges taken out below
    if optimizer is not None and saved is not None:
        if saved["masters"] and not optimizer.has_masters:
            raise ValueError(f"checkpoint {directory} holds fp32 master weights but this "
                             f"trainer has none; resume it with master_weights = true (or unset)")
        sharded |= _optimizer_sharded(model, optimizer, saved["tensor_keys"], saved["masters"],
                                      template=True)
    with _quiet_torch_deprecations():
        loaded = dist_checkpointing.load(sharded, str(directory))
    weights = {k: v for k, v in loaded.items() if not k.startswith("optimizer/")}
    missing, unexpected = model.core.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {directory} does not match the model: missing {missing}, "
                         f"unexpected {unexpected}")
    if optimizer is not None:
        _restore_optimizer(optimizer, loaded, saved)
        if target is not optimizer:
            target.load_view(optimizer)
    return meta


def _restore_optimizer(optimizer: Any, loaded: dict[str, Any], saved: dict | None) -> None:
    """Per-parameter state from `loaded`, scalars from the state file; fp32 masters from the
    checkpoint, or (none saved) from the weights just loaded."""
    inner, params, owners = _optimizer_parts(optimizer)
    with_masters = bool(saved and saved["masters"])
    with torch.no_grad():
        for i, (param, owner) in enumerate(zip(params, owners)):
            if owner is not param:
                owner.copy_(loaded[f"optimizer/master.{i}"] if with_masters else param)
                param.copy_(owner)
            if not saved:
                continue
            state = inner.state[owner]
            for key in saved["tensor_keys"]:
                state[key] = loaded[f"optimizer/{key}.{i}"].to(owner.device)
            for key, value in saved["scalars"].items():
                state[key] = torch.tensor(value, dtype=torch.float32)


def _writes_critic() -> bool:
    """The rank that writes the critic: the last stage's first tensor rank of replica 0 (only
    the last stage trains it), its first context-parallel rank."""
    return (parallel_state.is_pipeline_last_stage()
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0)


def save_trainer_checkpoint(state: Any, directory: str | Path) -> None:
    """The trainer's checkpoint into the existing `directory`: the HF export with the tokenizer
    (rank 0), the model and optimizer shards under `megatron/` (every rank), the critic, step
    and version. Collective."""
    directory = Path(directory)
    save_hf(state.model, directory)
    if dist.get_rank() == 0:
        state.tokenizer.save_pretrained(str(directory))
    save_distributed(state.model, directory / MEGATRON_DIR, state.optimizer, state.step,
                     state.version)
    if state.critic is not None and _writes_critic():
        torch.save(state.critic.checkpoint(), directory / CRITIC_FILE)
    dist.barrier()


def is_trainer_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / MEGATRON_DIR / STATE_FILE).is_file()


def restore_critic(state: Any, directory: Path) -> None:
    """The critic's weights and optimizer from `directory` (when the trainer has a critic)."""
    if state.critic is None:
        return
    if not (directory / CRITIC_FILE).is_file():
        raise ValueError(f"checkpoint {directory} has no {CRITIC_FILE} but the trainer uses "
                         f"a critic; resume with the estimator it was written with")
    state.critic.restore(torch.load(directory / CRITIC_FILE, map_location="cpu",
                                    weights_only=True))


def load_trainer_checkpoint(state: Any, directory: str | Path) -> None:
    """Resume `state` from `save_trainer_checkpoint`'s directory, at any layout. Collective."""
    directory = Path(directory)
    meta = load_distributed(state.model, directory / MEGATRON_DIR, state.optimizer)
    restore_critic(state, directory)
    state.step, state.version = meta["step"], meta["version"]
