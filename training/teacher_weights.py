"""Colocated teachers' weights at start-up: within the host budget, from their checkpoints.

Role: `load_teachers` turns the run's teacher specs into a `memory.manager.WeightMemory` (built by
`memory.config.TeacherMemoryConfig.build`: its host tier the weight store, memory/store.py; its
NVMe reads into device slots through cuFile where `gds` allows) holding one set per teacher
(`teacher:<name>`) and a meta-device skeleton per architecture. A teacher given as a
safetensors checkpoint directory is never built as a model: its skeleton comes from its config
on the meta device (non-persistent buffers such as rotary tables computed for real), its flat
layout from the skeleton's tensors in the checkpoint's data order, and its bytes are read from
the checkpoint tensor by tensor (memory/sources.py). The teachers' sizes are summed against
`teacher_memory.host_budget_bytes` first: when all fit they all go to the pinned host tier;
otherwise the first ones (in the run's order) stay on the host as long as room for the largest
teacher remains (the staging region every other teacher passes through on its way to a device
slot), and the others are streamed from their checkpoints straight to the NVMe tier. Every such
set is registered with its checkpoint as its source, so a chunk that later fails its checksum is
read again from there. Built-in tiny models, checkpoints without safetensors and checkpoints
whose tensor names transformers converts on load (fused experts, say) are built in memory as
before, without a source (the last with a warning).

Sharded over tensor-parallel ranks (`shard`, a tensor-parallel trainer at tp > 1: every tensor rank
of a replica runs the same micro-batches): each rank keeps 1/tp of every linear layer of the
teacher (its block of output rows: the q/k/v/o and MLP projections, an untied output head),
read straight from the checkpoint (one contiguous byte range per tensor: the set's source is
the checkpoint with its rows, memory/sources.py `sharded_source`), and the embeddings and norms
whole; a forward hook on each such layer all-gathers its output over the tensor group, so every
rank computes the teacher's exact outputs (each output element is the same dot product) with
about 1/tp of its layers in its weight memory. A layer whose rows do not divide by tp is refused
naming the teacher, the tensor and the size.

Invariant: host memory during the load is the arena (the budget) plus, per teacher, one skeleton
on the meta device and the streaming buffers (about three chunks of `WeightMemory.chunk_bytes`,
48 MiB at the default), never a whole teacher outside the arena for a safetensors teacher (the
teachers built in memory are whole, all at once, as before). A teacher whose checkpoint is
missing or unreadable (no such directory, a corrupt header, a truncated file) raises ValueError
naming the teacher and the path, and nothing stays allocated.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from logic.teachers import TeacherSpec
from memory.config import TeacherMemoryConfig
from memory.layout import FlatLayout, module_tensors
from memory.manager import WeightMemory
from memory.safetensors_io import INDEX_FILE, tensor_extents
from memory.sources import sharded_source
from models.load import is_checkpoint_dir, load_model
from transport.errors import RlxError

log = logging.getLogger(__name__)


@dataclass
class TeacherWeights:
    """One teacher before placement: its skeleton, its layout, where its bytes come from."""

    name: str
    skeleton: torch.nn.Module
    layout: FlatLayout
    source: str = ""  # safetensors checkpoint ("" = built in memory: `tensors`)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class RowShard:
    """This rank's part of every teacher: block `rank` of `world` of each linear layer's rows,
    outputs all-gathered over `group` (a torch.distributed group; None = the world)."""

    rank: int
    world: int
    group: Any = None


def load_teachers(specs: Sequence[TeacherSpec], device: str, dtype: torch.dtype,
                  cfg: TeacherMemoryConfig, run_dir: str, seed: int = 0,
                  chunk_bytes: int = 16 << 20, shard: RowShard | None = None
                  ) -> tuple[WeightMemory, dict[str, torch.nn.Module]]:
    """(the weight memory holding every teacher, name -> skeleton); see the module docstring.
    `chunk_bytes`: the NVMe tier's chunk (checksum unit, streaming buffer); `shard`: this
    rank's rows of every linear layer (tensor-parallel ranks), else whole teachers."""
    by_arch: dict[str, torch.nn.Module] = {}
    teachers = [_resolve(t, device, dtype, seed, by_arch) for t in specs]
    if shard is not None and shard.world > 1:
        teachers = [_row_sharded(t, shard) for t in teachers]
    sizes = {t.name: t.layout.total_bytes for t in teachers}
    budget = cfg.host_budget(sizes)
    on_host = set(host_placement(sizes, budget))
    nvme_dir = cfg.nvme_path(run_dir)
    memory = cfg.build(device, sizes, run_dir, chunk_bytes)
    streamed = [t.name for t in teachers if t.name not in on_host]
    if streamed:
        log.info("teachers: %.2f GiB in all, host budget %.2f GiB: %s on the host, %s streamed "
                 "to NVMe (%s)", sum(sizes.values()) / 2**30, budget / 2**30,
                 sorted(on_host) or "none", streamed, nvme_dir)
    try:
        for t in teachers:
            _place(memory, t, t.name in on_host)
    except BaseException:
        memory.close()
        raise
    return memory, {t.name: t.skeleton for t in teachers}


def host_placement(sizes: dict[str, int], budget_bytes: int) -> list[str]:
    """The teachers kept on the host tier, in order: all of them when their sum fits the
    budget; otherwise the first ones that fit in it less the largest teacher (the staging
    region the others pass through)."""
    if sum(sizes.values()) <= budget_bytes:
        return list(sizes)
    room = budget_bytes - max(sizes.values())
    kept, used = [], 0
    for name, n in sizes.items():
        if used + n <= room:
            kept.append(name)
            used += n
    return kept


def _place(memory: WeightMemory, t: TeacherWeights, on_host: bool) -> None:
    tag = f"teacher:{t.name}"
    if not t.source:  # built in memory: staged on the host, spilled when it does not stay
        memory.load_tensors(tag, t.tensors)
        t.tensors = {}
        if not on_host:
            memory.evict(tag, "host")
        return
    tier = "host" if on_host else "nvme"
    progress = LogProgress(f"teacher {t.name!r} -> {tier}", t.layout.total_bytes)
    try:
        memory.load_source(tag, t.layout, t.source, tier, progress)
    except (ValueError, OSError) as e:  # a bad checkpoint, a full NVMe tier: say which
        raise ValueError(f"teacher {t.name!r}: loading its checkpoint {t.source} to the {tier} "
                         f"tier failed: {e}") from e
    progress.finish()


def _resolve(spec: TeacherSpec, device: str, dtype: torch.dtype, seed: int,
             by_arch: dict[str, torch.nn.Module]) -> TeacherWeights:
    try:
        if _has_safetensors(spec.model):
            try:
                return _from_checkpoint(spec, device, dtype, by_arch)
            except _NamesDiffer as e:  # transformers converts this checkpoint's names on load
                log.warning("teacher %r: %s; loading it whole on the CPU (no source, no "
                            "streaming)", spec.name, e)
        model, _ = load_model(spec.model, "cpu", dtype, seed)
    except (ValueError, OSError) as e:
        raise ValueError(f"teacher {spec.name!r}: cannot load its checkpoint {spec.model}: "
                         f"{e}") from e
    tensors = module_tensors(model)
    skeleton = _shared(by_arch, model.config.to_json_string(), lambda: meta_skeleton(model,
                                                                                     device))
    missing = set(dict(skeleton.named_parameters())) - set(tensors)
    if missing:  # a parameter left on the meta device would compute garbage
        raise ValueError(f"teacher {spec.name!r}: weights missing for {sorted(missing)[:3]}")
    return TeacherWeights(spec.name, skeleton, FlatLayout.from_state_dict(tensors),
                          tensors=tensors)


def _from_checkpoint(spec: TeacherSpec, device: str, dtype: torch.dtype,
                     by_arch: dict[str, torch.nn.Module]) -> TeacherWeights:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec.model)
    skeleton = _shared(by_arch, f"{config.to_json_string()}{dtype}",
                       lambda: skeleton_from_config(config, dtype, device))
    tensors = skeleton_tensors(skeleton)
    extents = tensor_extents(spec.model)
    missing = sorted(set(tensors) - set(extents))
    if missing:
        raise _NamesDiffer(f"{spec.model} has no tensor named {missing[:3]}"
                           f"{' ...' if len(missing) > 3 else ''} as the model does")
    files = {f: i for i, f in enumerate(dict.fromkeys(e.file for e in extents.values()))}
    order = sorted(tensors, key=lambda n: (files[extents[n].file], extents[n].offset))
    layout = FlatLayout.from_shapes((n, tensors[n].dtype, tuple(tensors[n].shape))
                                    for n in order)  # the checkpoint's order: sequential reads
    return TeacherWeights(spec.name, skeleton, layout, source=spec.model)


def _row_sharded(t: TeacherWeights, shard: RowShard) -> TeacherWeights:
    """`t` with this rank's block of rows of every linear layer (see the module docstring),
    its skeleton's linear layers all-gathering their outputs."""
    linear = sharded_names(t.skeleton)
    specs = []
    for spec in t.layout.specs:
        shape = tuple(spec.shape)
        if spec.name in linear:
            if shape[0] % shard.world:
                raise ValueError(f"teacher {t.name!r}: {spec.name} has {shape[0]} rows, which "
                                 f"do not divide over tensor-parallel size {shard.world}; use "
                                 f"a tp that divides every layer of the teacher")
            shape = (shape[0] // shard.world, *shape[1:])
        specs.append((spec.name, spec.torch_dtype, shape))
    layout = FlatLayout.from_shapes(specs)
    tensors = {n: (v.chunk(shard.world)[shard.rank].clone() if n in linear else v)
               for n, v in t.tensors.items()}
    _gather_outputs(t.skeleton, linear, shard)
    source = sharded_source(t.source, shard.rank, shard.world) if t.source else ""
    return TeacherWeights(t.name, t.skeleton, layout, source=source, tensors=tensors)


def sharded_names(skeleton: torch.nn.Module) -> set[str]:
    """The tensors a row shard splits: weight and bias of every linear layer whose weight is
    its own (a tied output head shares the embedding, which stays whole)."""
    own = set(skeleton_tensors(skeleton))
    out = set()
    for name, mod in skeleton.named_modules():
        if isinstance(mod, torch.nn.Linear):
            for p in ("weight", "bias"):
                full = f"{name}.{p}" if name else p
                if getattr(mod, p, None) is not None and full in own:
                    out.add(full)
    return out


def _gather_outputs(skeleton: torch.nn.Module, linear: set[str], shard: RowShard) -> None:
    """Once per skeleton: each sharded linear layer's output all-gathered over the group."""
    if getattr(skeleton, "_row_shard", None) is not None:
        return
    skeleton._row_shard = shard

    def gather(_module: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(out) for _ in range(shard.world)]
        dist.all_gather(parts, out.contiguous(), group=shard.group)
        return torch.cat(parts, dim=-1)

    for name, mod in skeleton.named_modules():
        if isinstance(mod, torch.nn.Linear) and f"{name}.weight" in linear:
            mod.register_forward_hook(gather)


class _NamesDiffer(RlxError, ValueError):
    """The checkpoint's tensor names are not the model's (e.g. experts fused on load)."""


def _has_safetensors(ref: str) -> bool:
    path = Path(ref)
    return is_checkpoint_dir(ref) and ((path / INDEX_FILE).is_file() or
                                       any(path.glob("*.safetensors")))


def _shared(by_arch: dict[str, torch.nn.Module], key: str, build) -> torch.nn.Module:
    """Teachers of one architecture share one skeleton."""
    if key not in by_arch:
        by_arch[key] = build()
    return by_arch[key]


def skeleton_from_config(config, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A meta skeleton (`meta_skeleton`) of the architecture of `config`, built without
    materialising a weight: the model is made on the meta device, then its non-persistent
    floating-point buffers (rotary tables) are recomputed for real by the model's own
    initialisation (`_init_weights` of their module). An architecture where that leaves a
    buffer unset is built for real on the CPU instead (its random weights are dropped)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    persistent = set(model.state_dict())
    for mod_name, mod in model.named_modules():
        names = [b for b, buf in mod._buffers.items()
                 if buf is not None and f"{mod_name}.{b}".lstrip(".") not in persistent]
        if not names:
            continue
        if not all(mod._buffers[b].is_floating_point() for b in names) or \
                not hasattr(model, "_init_weights"):
            return _built_for_real(config, dtype, device)
        for b in names:
            mod._buffers[b] = torch.full_like(mod._buffers[b], math.nan, device="cpu")
        with torch.no_grad():
            model._init_weights(mod)
        if any(mod._buffers[b].isnan().any() for b in names):
            return _built_for_real(config, dtype, device)
    return meta_skeleton(model, device)


def _built_for_real(config, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    log.warning("the non-persistent buffers of %s cannot be computed on the meta device; "
                "building the model once on the CPU for them", type(config).__name__)
    return meta_skeleton(AutoModelForCausalLM.from_config(config, dtype=dtype), device)


def skeleton_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name, each object once (tied weights under their
    first name), on any device (meta included, where storage addresses mean nothing)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def meta_skeleton(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """The model with its parameters and persistent buffers on the meta device (they come from
    a weight slot at call time); non-persistent buffers (rotary tables) stay real, on device."""
    persistent = set(model.state_dict())
    metas: dict[int, torch.nn.Parameter] = {}  # tied weights stay tied (functional_call ties)
    for mod_name, mod in model.named_modules():
        for p_name, p in list(mod.named_parameters(recurse=False)):
            if id(p) not in metas:
                metas[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                  requires_grad=False)
            mod._parameters[p_name] = metas[id(p)]
        for b_name, buf in list(mod.named_buffers(recurse=False)):
            full = f"{mod_name}.{b_name}" if mod_name else b_name
            mod._buffers[b_name] = (torch.empty_like(buf, device="meta") if full in persistent
                                    else buf.to(device))
    return model.eval()


class LogProgress:
    """Progress of one teacher's load as log lines (every 25%), with its rate at the end."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.next_pct = label, total, 25
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct >= self.next_pct and pct < 100:
            log.info("%s: %d%% (%.2f of %.2f GiB)", self.label, pct, done / 2**30, total / 2**30)
            self.next_pct = pct // 25 * 25 + 25

    def finish(self) -> None:
        seconds = time.perf_counter() - self.t0
        log.info("%s: %.2f GiB in %.1f s (%.2f GB/s)", self.label, self.total / 2**30, seconds,
                 self.total / max(seconds, 1e-9) / 1e9)
