"""Checkpoints of the megatron backend: distributed (resumable, reshardable) and HF (weight sync).

Role: `save_distributed` / `load_distributed` write and read the model through
megatron.core.dist_checkpointing (every rank writes its own shards; a checkpoint saved at one
TP/PP layout loads at another), plus each rank's torch optimizer state, step and version;
`save_hf` writes the whole model as a Hugging Face directory that transformers, the embedded
worker and SGLang's /update_weights_from_disk load.
Invariant: every function here is collective (call it on every rank of the job); files are
written only by the ranks that own them, and a directory is complete only once `save_*` returned
on every rank (they end with a barrier). Optimizer state is per rank and only loads back at the
layout it was saved at (it is refused otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from backends.megatron.mcore import dist_checkpointing, parallel_state

if TYPE_CHECKING:  # annotations only: model.py imports this module
    from backends.megatron.model import MegatronCausalLM



STATE_FILE = "trainer_state.json"
# torch.distributed.checkpoint APIs megatron-core 0.16 still uses; nothing a user can change
_TORCH_DEPRECATIONS = ("Please use DTensor instead", "`load_state_dict` is deprecated",
                       "`save_state_dict` is deprecated")


@contextlib.contextmanager
def _quiet_torch_deprecations():
    with warnings.catch_warnings():
        for message in _TORCH_DEPRECATIONS:
            warnings.filterwarnings("ignore", re.escape(message), FutureWarning)
        yield


def _layout_tag() -> str:
    """This rank's place in the parallel layout, naming its optimizer file."""
    return (f"tp{parallel_state.get_tensor_model_parallel_rank()}of"
            f"{parallel_state.get_tensor_model_parallel_world_size()}_"
            f"pp{parallel_state.get_pipeline_model_parallel_rank()}of"
            f"{parallel_state.get_pipeline_model_parallel_world_size()}_"
            f"dp{parallel_state.get_data_parallel_rank()}")


def save_hf(model: MegatronCausalLM, directory: str | Path) -> None:
    """Whole model as safetensors + config.json, written by global rank 0."""
    tensors = model.hf_state_dict()
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(directory)
    dist.barrier()


def save_distributed(model: MegatronCausalLM, directory: str | Path,
                     optimizer: torch.optim.Optimizer | None = None, step: int = 0,
                     version: int = 0) -> None:
    """Sharded model weights, this rank's optimizer state, and (rank 0) step and version."""
    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with _quiet_torch_deprecations():
        dist_checkpointing.save(model.core.sharded_state_dict(), str(directory))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), directory / f"optimizer_{_layout_tag()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:  # written last: its presence marks a complete checkpoint
        (directory / STATE_FILE).write_text(json.dumps({"step": step, "version": version}))
    dist.barrier()


def load_distributed(model: MegatronCausalLM, directory: str | Path,
                     optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Load weights saved by `save_distributed` (any layout) and, when given, the optimizer
    state of this rank (same layout only); returns {"step", "version"}."""
    directory = Path(directory)
    if not (directory / STATE_FILE).is_file():
        raise ValueError(f"{directory} is not a complete megatron checkpoint (no {STATE_FILE})")
    with _quiet_torch_deprecations():
        loaded = dist_checkpointing.load(model.core.sharded_state_dict(), str(directory))
    missing, unexpected = model.core.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {directory} does not match the model: missing {missing}, "
                         f"unexpected {unexpected}")
    if optimizer is not None:
        path = directory / f"optimizer_{_layout_tag()}.pt"
        if not path.is_file():
            raise ValueError(f"no optimizer state {path.name} in {directory}: optimizer state "
                             f"loads only at the TP/PP/DP layout it was saved at")
        optimizer.load_state_dict(torch.load(path, weights_only=True))
    return json.loads((directory / STATE_FILE).read_text())
