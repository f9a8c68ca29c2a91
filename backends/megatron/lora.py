"""LoRA students on the megatron backend: tensor-parallel adapters on megatron's linear layers,
saved and loaded under PEFT's names.

Role: `attach(model, cfg)` puts one adapter (A [r, in], B [out, r], output scaled by alpha / r)
per HF module of `cfg.target_modules` on each transformer layer of a `MegatronCausalLM` stage and
freezes every other parameter. The adapters live in `model.lora` (a `LoraAdapters`, outside the
GPTModel, so the model's state dicts, HF conversion and distributed checkpoints are unchanged)
and act through forward hooks on the fused megatron layers they belong to:
- column-parallel layers (linear_qkv for q/k/v, linear_fc1 for gate/up): A is replicated, B is
  split over output rows as megatron splits the layer (each rank's query groups of q/k/v, its
  chunk of gate and of up); each rank adds its rows of B A x at the right places of its fused
  output shard (q/k/v interleaved per query group, [gate; up]). The r-dim activation A x passes
  `copy_to_tensor_model_parallel_region` (backward: all-reduce), so A's gradient and the
  input's gradient through the adapter are the whole sums, equal on every tensor rank;
- row-parallel layers (linear_proj = o_proj, linear_fc2 = down_proj): A is split along the
  input like the layer, the r-dim A x is all-reduced (`reduce_from_tensor_model_parallel_
  region`, backward identity), B is replicated and its gradient equal on every tensor rank.
Split tensors carry megatron's `tensor_model_parallel` attributes, so the gradient norm and the
optimizers count each replicated tensor once (`param_is_not_tensor_parallel_duplicate`).
Dropout (`cfg.dropout`, training only) draws on the default generator, equal on every tensor
rank, for a replicated input, and on megatron's model-parallel generator for a split one.

The whole adapter travels under PEFT's names (`base_model.model.model.layers.{i}.self_attn.
q_proj.lora_A.weight` ...): `adapter_tensors` gathers it to global rank 0 (collective),
`load_adapter` gives each rank its part, `merged_tensors` streams the HF weights with B A
alpha / r added, and `save_checkpoint` / `load_checkpoint` write and read a trainer checkpoint
whose top is a PEFT adapter directory, with the optimizer state as whole tensors under the
same names (resumable at any tp x pp x dp layout).
Invariant: the adapters of a layout are the same function as those of tp = pp = 1 loaded with
the same PEFT tensors (up to float summation order), and the gather of `load_adapter`'s input
gives it back bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import zlib
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from backends.megatron.checks import TARGETS, check_moe_targets, check_targets
from backends.megatron.mcore import parallel_state, tensor_parallel
from backends.megatron.parallel import (
    _gather_to_first_tensor_rank,
    _recv_piece,
    _send_piece,
    iter_hf_tensors,
)
from models.lora import PEFT_PREFIX, check_fits, read_adapter

CHECKPOINT_FILE = "megatron_lora.json"  # marks a megatron LoRA checkpoint (written last)
STATE_FILE = "trainer_state.pt"  # the optimizer state (whole tensors), step, version, RNG


def peft_name(layer: int, target: str, matrix: str) -> str:
    """PEFT's saved name of global layer `layer`'s `target` adapter matrix ("A" or "B")."""
    return f"{PEFT_PREFIX}model.layers.{layer}.{TARGETS[target][0]}.lora_{matrix}.weight"


class Adapter(torch.nn.Module):
    """One HF module's adapter on this rank: A [r, in or in / tp], B [out or out / tp, r]."""

    def __init__(self, layer: int, target: str, in_size: int, out_size: int, rank: int,
                 tp: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layer, self.target = layer, target
        self.row = TARGETS[target][2] == "row"
        # the split dim of each matrix over tensor ranks (None: replicated)
        self.dims = {"A": 1 if self.row else None, "B": None if self.row else 0}
        a_in = in_size // tp if self.row else in_size
        b_out = out_size if self.row else out_size // tp
        self.A = torch.nn.Parameter(torch.empty(rank, a_in, dtype=dtype, device=device))
        self.B = torch.nn.Parameter(torch.zeros(b_out, rank, dtype=dtype, device=device))
        for matrix, dim in self.dims.items():
            if dim is not None:
                tensor_parallel.set_tensor_model_parallel_attributes(
                    getattr(self, matrix), True, dim, 1)
        with torch.no_grad():  # kaiming-uniform (a = sqrt 5) as peft, from the whole tensor:
            self.A.copy_(local_part(self._initial_a(rank, in_size), self.dims["A"]))

    def _initial_a(self, rank: int, in_size: int) -> torch.Tensor:
        """The whole initial A, seeded by its name: the same on every rank and layout."""
        gen = torch.Generator().manual_seed(zlib.crc32(self.name("A").encode()))
        bound = 1.0 / math.sqrt(in_size)
        return (torch.rand(rank, in_size, generator=gen, dtype=torch.float64) * 2 - 1) * bound

    def name(self, matrix: str) -> str:
        return peft_name(self.layer, self.target, matrix)


def local_part(whole: torch.Tensor, dim: int | None) -> torch.Tensor:
    """This tensor rank's part of a whole adapter tensor split along `dim` (None: all of it)."""
    if dim is None:
        return whole
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return whole.chunk(tp, dim=dim)[parallel_state.get_tensor_model_parallel_rank()]


class LoraAdapters(torch.nn.Module):
    """A stage's adapters (`model.lora`), their scale, dropout and on/off switch, and the hooks
    that add them to megatron's linear layers."""

    def __init__(self, cfg: Any):
        super().__init__()
        self.rank, self.scale, self.dropout = cfg.rank, cfg.alpha / cfg.rank, cfg.dropout
        self.targets = [t for t in TARGETS if t in cfg.target_modules]
        self.adapters = torch.nn.ModuleDict()  # f"{layer}_{target}" -> Adapter
        self.enabled = True
        self._hooks: list[Any] = []

    def by_name(self) -> dict[str, tuple[Adapter, str]]:
        """PEFT name -> (its adapter, "A" or "B"), in registration order."""
        return {a.name(m): (a, m) for a in self.adapters.values() for m in ("A", "B")}

    def _drop(self, x: torch.Tensor, split: bool) -> torch.Tensor:
        if not (self.training and self.dropout > 0):
            return x
        if not split:
            return F.dropout(x, self.dropout, True)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return F.dropout(x, self.dropout, True)

    def column_delta(self, x: torch.Tensor, parts: list[tuple[str, Adapter | None, int]],
                     groups: int) -> torch.Tensor:
        """The adapters' addition to a column-parallel layer's output shard: each part's rows
        (`width` per group; None = no adapter: zeros), interleaved over `groups` row groups."""
        x = self._drop(x, split=False)
        pieces = []
        for _, adapter, width in parts:
            if adapter is None:
                pieces.append(x.new_zeros(*x.shape[:-1], groups, width))
                continue
            h = tensor_parallel.copy_to_tensor_model_parallel_region(
                F.linear(x, adapter.A.to(x.dtype)))
            out = F.linear(h, adapter.B.to(x.dtype)) * self.scale
            pieces.append(out.view(*x.shape[:-1], groups, width))
        return torch.cat(pieces, dim=-1).flatten(-2)

    def row_delta(self, x: torch.Tensor, adapter: Adapter) -> torch.Tensor:
        """The adapter's addition to a row-parallel layer's (whole) output, x split along its
        last dim as the layer's input."""
        h = F.linear(self._drop(x, split=True), adapter.A.to(x.dtype))
        h = tensor_parallel.reduce_from_tensor_model_parallel_region(h)
        return F.linear(h, adapter.B.to(x.dtype)) * self.scale


def _layer_parts(model: Any, adapters: LoraAdapters, layer: int
                 ) -> dict[str, tuple[list[tuple[str, Adapter | None, int]], int]]:
    """megatron layer path -> (its column parts (part, adapter, width per group), groups) of
    this rank, for the fused column-parallel layers with at least one adapter."""
    lay, tp = model.layout, parallel_state.get_tensor_model_parallel_world_size()
    d, groups = lay.head_dim, lay.num_query_groups // tp
    ffn = lay.ffn_hidden_size // tp

    def get(target: str) -> Adapter | None:
        return adapters.adapters[f"{layer}_{target}"] if target in adapters.targets else None

    out = {}
    qkv = [("q", get("q_proj"), lay.num_heads // lay.num_query_groups * d),
           ("k", get("k_proj"), d), ("v", get("v_proj"), d)]
    if any(a is not None for _, a, _ in qkv):
        out["self_attention.linear_qkv"] = (qkv, groups)
    fc1 = [("gate", get("gate_proj"), ffn), ("up", get("up_proj"), ffn)]
    if any(a is not None for _, a, _ in fc1):
        out["mlp.linear_fc1"] = (fc1, 1)
    return out


def _sizes(model: Any, target: str) -> tuple[int, int]:
    """(in, out) of the whole HF module `target`."""
    lay = model.layout
    q_out, kv_out = lay.num_heads * lay.head_dim, lay.num_query_groups * lay.head_dim
    return {"q_proj": (lay.hidden_size, q_out), "k_proj": (lay.hidden_size, kv_out),
            "v_proj": (lay.hidden_size, kv_out), "o_proj": (q_out, lay.hidden_size),
            "gate_proj": (lay.hidden_size, lay.ffn_hidden_size),
            "up_proj": (lay.hidden_size, lay.ffn_hidden_size),
            "down_proj": (lay.ffn_hidden_size, lay.hidden_size)}[target]


def attach(model: Any, cfg: Any) -> None:
    """Adapters (B = 0: the model computes as before) on this stage's layers for the targets of
    `cfg` (a training.config.LoraConfig); every other parameter frozen."""
    check_targets(list(cfg.target_modules))
    if getattr(model, "lora", None) is not None:
        raise ValueError("the megatron model already has LoRA adapters")
    if model.core.config.sequence_parallel:
        raise ValueError("lora with megatron's sequence_parallel is not supported: the "
                         "adapters take whole-sequence inputs")
    check_moe_targets(model.layout.moe, list(cfg.target_modules))
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = LoraAdapters(cfg)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    weight = next(model.core.parameters())
    for layer in model.layers:
        for target in adapters.targets:
            adapters.adapters[f"{layer}_{target}"] = Adapter(
                layer, target, *_sizes(model, target), cfg.rank, tp, weight.dtype, weight.device)
    model.lora = adapters  # registered: its parameters are the model's trainable ones
    for local, layer in enumerate(model.layers):
        block = model.core.decoder.layers[local]
        for path, (parts, groups) in _layer_parts(model, adapters, layer).items():
            adapters._hooks.append(_module(block, path).register_forward_hook(
                _column_hook(adapters, parts, groups)))
        for target in ("o_proj", "down_proj"):
            if target in adapters.targets:
                adapter = adapters.adapters[f"{layer}_{target}"]
                adapters._hooks.append(_module(block, TARGETS[target][1]).register_forward_hook(
                    _row_hook(adapters, adapter)))


def _module(block: torch.nn.Module, path: str) -> torch.nn.Module:
    for part in path.split("."):
        block = getattr(block, part)
    return block


def _column_hook(adapters: LoraAdapters, parts: list, groups: int):
    def hook(module, args, output):
        if not adapters.enabled:
            return None
        out, bias = output
        return out + adapters.column_delta(args[0], parts, groups).to(out.dtype), bias
    return hook


def _row_hook(adapters: LoraAdapters, adapter: Adapter):
    def hook(module, args, output):
        if not adapters.enabled:
            return None
        out, bias = output
        return out + adapters.row_delta(args[0], adapter).to(out.dtype), bias
    return hook


def _adapters(model: Any) -> LoraAdapters:
    adapters = getattr(model, "lora", None)
    if adapters is None:
        raise ValueError("the megatron model has no LoRA adapters (attach_lora first)")
    return adapters


@contextlib.contextmanager
def adapters_off(model: Any):
    """The base model for the block (a LoRA student's reference): every adapter skipped."""
    adapters = _adapters(model)
    before, adapters.enabled = adapters.enabled, False
    try:
        yield model
    finally:
        adapters.enabled = before


def expected_names(model: Any, adapters: LoraAdapters) -> dict[str, tuple[int, ...]]:
    """Every PEFT name of the whole model's adapter (all layers) -> its whole shape."""
    out = {}
    for layer in range(model.layout.num_layers):
        for target in adapters.targets:
            size_in, size_out = _sizes(model, target)
            out[peft_name(layer, target, "A")] = (adapters.rank, size_in)
            out[peft_name(layer, target, "B")] = (size_out, adapters.rank)
    return out


def check_adapter(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError naming the first differences unless `tensors` is a whole adapter (PEFT
    names, whole shapes) of this model's targets and rank."""
    check_fits(expected_names(model, _adapters(model)), tensors)


def load_adapter(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Copy this rank's part of a whole PEFT-named adapter into the model's adapters; every
    name and shape is checked before anything changes."""
    check_adapter(model, tensors)
    with torch.no_grad():
        for name, (adapter, matrix) in _adapters(model).by_name().items():
            own = getattr(adapter, matrix)
            own.copy_(local_part(tensors[name], adapter.dims[matrix]).to(own.dtype))


def whole_on_rank0(model: Any, local: dict[str, tuple[torch.Tensor, int | None]]
                   ) -> dict[str, torch.Tensor]:
    """Whole tensors on global rank 0 (CPU), {} elsewhere, from every rank's parts (`local`:
    name -> (this rank's part, its split dim over tensor ranks or None)); names are global, so
    stages need no renaming. Collective: every rank of the job calls it; only data-parallel
    replica 0 (its first context-parallel rank) moves data."""
    if parallel_state.get_data_parallel_rank() != 0 \
            or parallel_state.get_context_parallel_rank() != 0:
        return {}
    shards = _gather_to_first_tensor_rank({k: t for k, (t, _) in local.items()})
    whole: dict[str, torch.Tensor] | None = None
    if shards is not None:
        whole = {k: (shards[0][k] if dim is None else torch.cat([s[k] for s in shards], dim))
                 .detach().cpu().clone() for k, (_, dim) in local.items()}
    if parallel_state.get_pipeline_model_parallel_rank() > 0:
        if whole is not None:
            _send_piece(whole, dst=0)
        return {}
    if whole is None:
        return {}
    stages = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    for src in stages[1:]:
        whole.update(_recv_piece(src) or {})
    return whole


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The whole adapter under PEFT's names on global rank 0 ({} elsewhere). Collective."""
    return whole_on_rank0(model, {name: (getattr(a, m).detach(), a.dims[m])
                                  for name, (a, m) in _adapters(model).by_name().items()})


def merged_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named whole weights with the adapter merged in (W + B A alpha / r, computed in
    fp32 as models/lora.py does, in the weight's dtype) on global rank 0, as
    `iter_hf_tensors` streams them. Collective: every rank runs it to its end."""
    adapters = _adapters(model)
    whole = adapter_tensors(model)
    deltas = {}
    for layer in range(model.layout.num_layers):
        for target in adapters.targets:
            if peft_name(layer, target, "A") in whole:
                deltas[f"model.layers.{layer}.{TARGETS[target][0]}.weight"] = (layer, target)
    for name, tensor in iter_hf_tensors(model):
        if name in deltas:
            layer, target = deltas[name]
            a, b = (whole[peft_name(layer, target, m)].float() for m in "AB")
            delta = (b @ a * adapters.scale).to(device=tensor.device)
            tensor = (tensor.float() + delta).to(tensor.dtype)
        yield name, tensor


# ---- checkpoints ---------------------------------------------------------------------------
def _optimizer_entries(model: Any, optimizer: Any) -> list[tuple[str, int | None, Any, Any]]:
    """(PEFT name, split dim, parameter, stepped tensor) per optimizer parameter."""
    from backends.megatron.checkpoint import _optimizer_parts

    _, params, owners = _optimizer_parts(optimizer)
    by_id = {id(getattr(a, m)): (name, a.dims[m])
             for name, (a, m) in _adapters(model).by_name().items()}
    out = []
    for i, (param, owner) in enumerate(zip(params, owners)):
        if id(param) not in by_id:
            raise ValueError(f"optimizer parameter {i} {tuple(param.shape)} is not an adapter "
                             f"tensor of the LoRA student")
        out.append((*by_id[id(param)], param, owner))
    return out


def is_checkpoint(directory: str | Path) -> bool:
    """`directory` is a megatron LoRA checkpoint (`save_checkpoint`'s)."""
    return (Path(directory) / CHECKPOINT_FILE).is_file()


def save_checkpoint(state: Any, directory: str | Path) -> None:
    """A LoRA student's checkpoint into the existing `directory`: the PEFT adapter directory
    (adapter_config.json, adapter_model.safetensors, the tokenizer) at its top, the optimizer
    state as whole tensors under the adapter's names with step, version and RNG in
    trainer_state.pt, the critic; the marker file last. Collective."""
    from backends.megatron.checkpoint import (
        CRITIC_FILE,
        _optimizer_layout,
        _per_parameter,
        _writes_critic,
    )

    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model = state.model
    tensors = adapter_tensors(model)
    optimizer = _per_parameter(state.optimizer)  # collective for the distributed optimizer
    layout = _optimizer_layout(optimizer)
    inner = optimizer.optimizer
    local = {}
    for name, dim, _, owner in _optimizer_entries(model, optimizer):
        for key in layout["tensor_keys"]:
            local[f"{key}/{name}"] = (inner.state[owner][key].detach(), dim)
        if layout["masters"]:
            local[f"master/{name}"] = (owner.detach(), dim)
    opt_tensors = whole_on_rank0(model, local)
    if state.critic is not None and _writes_critic():
        torch.save(state.critic.checkpoint(), directory / CRITIC_FILE)
    if dist.get_rank() == 0:
        state.save_adapter(directory, tensors)
        torch.save({"optimizer": opt_tensors, "step": state.step, "version": state.version,
                    "rng": torch.get_rng_state()}, directory / STATE_FILE)
    dist.barrier()
    if dist.get_rank() == 0:  # last: its presence marks a complete checkpoint
        meta = {"step": state.step, "version": state.version, "optimizer": layout,
                "tp": parallel_state.get_tensor_model_parallel_world_size(),
                "pp": parallel_state.get_pipeline_model_parallel_world_size()}
        (directory / CHECKPOINT_FILE).write_text(json.dumps(meta))
    dist.barrier()


def load_checkpoint(state: Any, directory: str | Path) -> None:
    """Resume a LoRA student from `save_checkpoint`'s directory, at any layout: each rank
    reads the whole tensors and keeps its parts. Collective (every rank reads the files)."""
    from backends.megatron.checkpoint import restore_critic

    directory = Path(directory)
    meta = json.loads((directory / CHECKPOINT_FILE).read_text())
    _, tensors = read_adapter(directory)
    load_adapter(state.model, tensors)
    saved = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
    layout = meta["optimizer"]
    target = state.optimizer
    optimizer = target.empty_view() if target.holds_ranges else target
    if layout["masters"] and not optimizer.has_masters:
        raise ValueError(f"checkpoint {directory} holds fp32 master weights but this trainer "
                         f"has none; resume it with master_weights = true (or unset)")
    inner = optimizer.optimizer
    whole = saved["optimizer"]
    with torch.no_grad():
        for name, dim, param, owner in _optimizer_entries(state.model, optimizer):
            if owner is not param:
                source = whole[f"master/{name}"] if layout["masters"] else None
                owner.copy_(local_part(source, dim) if source is not None else param)
                param.copy_(owner)
            st = inner.state[owner]
            for key in layout["tensor_keys"]:
                st[key] = local_part(whole[f"{key}/{name}"], dim).to(
                    owner.device, owner.dtype).clone()
            for key, value in layout["scalars"].items():
                st[key] = torch.tensor(value, dtype=torch.float32)
    if target is not optimizer:
        target.load_view(optimizer)
    restore_critic(state, directory)
    torch.set_rng_state(saved["rng"])
    state.step, state.version = meta["step"], meta["version"]


__all__ = ["Adapter", "LoraAdapters", "TARGETS", "adapter_tensors", "adapters_off", "attach",
           "check_adapter", "check_targets", "is_checkpoint", "load_adapter", "load_checkpoint",
           "merged_tensors", "save_checkpoint", "whole_on_rank0"]
