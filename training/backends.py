"""Training backends by name: the one place the training library reaches a backend.

Role: `TrainConfig.backend` names how the policy is built, stepped, streamed and saved.
`get_backend(name)` gives a fresh `TrainingBackend` for one trainer state: "torch" (a
transformers model on every rank, optionally FSDP2-sharded: `TorchBackend` below) or "megatron"
(`backends/megatron/backend.py`, imported only when asked for: megatron-core is optional). The
rest of training/ and the actors call the protocol, never a backend's modules.

A backend answers:
- at load, in the actor: `check_config(cfg, colocated)` (ValueError naming what to change);
- forming the ranks: `joins_group_first` (the ranks join the process group before loading:
  the model is built on the model-parallel groups), `init_model_parallel(cfg)` right after
  `init_process_group` (returns the data-parallel group, None = the world, or an object with
  training/data_parallel.py DataParallel's reductions), `position()` (which
  shard this rank holds), `shards_model` (rank 0 gathers to push and export; every rank writes
  its part of a checkpoint), `shard(state, dtype, lr, weight_decay)` (parallel.shard = "fsdp2":
  the loaded policy sharded over the data-parallel ranks after their weight check; the config
  allows it with the torch backend only), `close()` (its model-parallel groups, before the
  process group goes);
- building the state (training/setup.py): `load_policy(cfg, dtype)`, `grad_clip(model)` (the
  global norm of a sharded model, for the optimizer), `optimizer_shards(params)` (the
  distributed optimizer's parts: parameters, shard group, norm filter and group) and
  `prepare_grads(model)` (what it runs before reducing: partial gradients completed, or None),
  `transformers_policy(model)` (the policy as a transformers model the reference/critic copy,
  or None), `tensor_shard(cfg)` (colocated teachers' row shard);
- training: `runner(cfg, model)` (the model passes, training/runner.py; None = `TorchRunner`, a
  whole forward per micro-batch: use `model_runner`), `step_stats(cfg)`;
- weights and checkpoints: `iter_hf_tensors(model)` / `streams_weights` / `save_hf(...)` /
  `load_hf(model, weights)` (HF-named tensors), `save_checkpoint(state, directory)` (every
  rank's part; False: the one-process HF checkpoint applies) and `load_checkpoint(state, path)`
  (True when `path` is in its own format and was loaded);
- sleep: `sleep_tensors(model)`, the modules whose tensors colocated mode parks;
- LoRA students (`lora`, models/lora.py): `attach_lora(model, cfg)` (adapters on the target
  layers, everything else frozen), `adapter_tensors(model)` (the whole adapter under PEFT's
  saved names, on rank 0; collective on every rank of a sharded model), `load_adapter(model,
  tensors)` (each rank its part), `adapters_off(model)` (a context: the base model, the
  reference of a KL term) and `merged_tensors(model)` (HF-named weights with the adapter merged
  in, on rank 0; collective like `iter_hf_tensors`);
- mixture-of-experts policies: `routing(model)` (the routing object the train step replays and
  measures routes with, models/moe.py `Routing`'s protocol; None for a dense model).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch

from memory.layout import module_tensors
from models import lora
from models.load import load_model, save_checkpoint
from models.moe import Routing, checkpoint_tensors, fuse_experts, moe_shape
from training.backend_checks import (  # noqa: F401 - also read from here
    MEGATRON,
    REGISTRY,
    check_backend,
    check_torch_config,
)
from training.config import LoraConfig, TrainConfig, distributed_optimizer
from training.fsdp import iter_full_state, save_pretrained, shard_state
from training.master_weights import ClipFn
from training.runner import ModelRunner, TorchRunner


class TrainingBackend(Protocol):
    name: str
    joins_group_first: bool
    shards_model: bool

    def check_config(self, cfg: TrainConfig, colocated: bool = False) -> None: ...

    def init_model_parallel(self, cfg: TrainConfig) -> Any: ...

    def position(self) -> tuple[int, int]: ...

    def shard(self, state: Any, dtype: torch.dtype, lr: float, weight_decay: float) -> None: ...

    def close(self) -> None: ...

    def load_policy(self, cfg: TrainConfig, dtype: torch.dtype) -> tuple[Any, Any]: ...

    def grad_clip(self, model: Any) -> ClipFn | None: ...

    def optimizer_shards(self, params: list[torch.nn.Parameter]
                         ) -> list[tuple[list[torch.nn.Parameter], Any,
                                         Callable[[torch.Tensor], bool] | None, Any]]: ...

    def prepare_grads(self, model: Any) -> Callable[[], None] | None: ...

    def transformers_policy(self, model: Any) -> torch.nn.Module | None: ...

    def tensor_shard(self, cfg: TrainConfig) -> tuple[int, int, Any] | None: ...

    def runner(self, cfg: TrainConfig, model: Any) -> ModelRunner | None: ...

    def step_stats(self, cfg: TrainConfig) -> dict[str, float]: ...

    @property
    def streams_weights(self) -> bool: ...

    def iter_hf_tensors(self, model: Any) -> Iterator[tuple[str, torch.Tensor]]: ...

    def save_hf(self, model: Any, tokenizer: Any, directory: str, shard_bytes: int) -> None: ...

    def load_hf(self, model: Any, weights: dict[str, torch.Tensor]) -> tuple[list, list]: ...

    def save_checkpoint(self, state: Any, directory: Any) -> bool: ...

    def load_checkpoint(self, state: Any, path: Any) -> bool: ...

    def sleep_tensors(self, model: Any) -> list[torch.nn.Module]: ...

    def attach_lora(self, model: Any, cfg: LoraConfig) -> None: ...

    def adapter_tensors(self, model: Any) -> dict[str, torch.Tensor]: ...

    def load_adapter(self, model: Any, tensors: dict[str, torch.Tensor]) -> None: ...

    def adapters_off(self, model: Any) -> ContextManager[Any]: ...

    def merged_tensors(self, model: Any) -> Iterator[tuple[str, torch.Tensor]]: ...

    def routing(self, model: Any) -> Any: ...


class TorchBackend:
    """transformers models, the whole model on every rank, or FSDP2 shards of it after
    `shard(state, dtype, lr, weight_decay)` (parallel.shard = "fsdp2", training/fsdp.py)."""

    name = "torch"
    joins_group_first = False

    def __init__(self) -> None:
        self.sharded_dtype: torch.dtype | None = None  # set once the policy is FSDP-sharded

    @property
    def shards_model(self) -> bool:
        return self.sharded_dtype is not None

    streams_weights = shards_model

    def check_config(self, cfg: TrainConfig, colocated: bool = False) -> None:
        check_torch_config(cfg, colocated)  # training/backend_checks.py: read without torch

    def init_model_parallel(self, cfg: TrainConfig) -> Any:
        return None  # data-parallel only: the world

    def position(self) -> tuple[int, int]:
        return (0, 0)

    def close(self) -> None:
        return None

    def load_policy(self, cfg: TrainConfig, dtype: torch.dtype) -> tuple[Any, Any]:
        return load_model(cfg.model, cfg.device, dtype, cfg.seed)

    def grad_clip(self, model: Any) -> ClipFn | None:
        return None  # whole parameters: torch's clip (a sharded optimizer clips its shards)

    def prepare_grads(self, model: Any) -> Callable[[], None] | None:
        return None

    def optimizer_shards(self, params: list[torch.nn.Parameter]) -> list[Any]:
        raise ValueError("parallel.distributed_optimizer needs a model-parallel backend; the "
                         "torch backend shards its optimizer state with shard = 'fsdp2'")

    def transformers_policy(self, model: Any) -> torch.nn.Module | None:
        return model

    def tensor_shard(self, cfg: TrainConfig) -> tuple[int, int, Any] | None:
        return None

    def runner(self, cfg: TrainConfig, model: Any) -> ModelRunner:
        return TorchRunner(model)

    def step_stats(self, cfg: TrainConfig) -> dict[str, float]:
        return {}

    def shard(self, state: Any, dtype: torch.dtype, lr: float, weight_decay: float) -> None:
        """The policy of `state` sharded over the world (every rank, after the weight check)."""
        shard_state(state, dtype, lr, weight_decay)  # sets state.backend.sharded_dtype

    def iter_hf_tensors(self, model: Any) -> Iterator[tuple[str, torch.Tensor]]:
        # fused MoE experts go out under their checkpoint names (models/moe.py)
        if self.sharded_dtype is not None:  # gathered one tensor at a time, on rank 0
            return checkpoint_tensors(iter_full_state(model, self.sharded_dtype))
        return checkpoint_tensors([(n, t.detach()) for n, t in module_tensors(model).items()])

    def save_hf(self, model: Any, tokenizer: Any, directory: str, shard_bytes: int) -> None:
        if self.sharded_dtype is not None:  # collective: every rank runs it
            save_pretrained(model, self.sharded_dtype, directory, shard_bytes)
            tokenizer.save_pretrained(directory)
        else:
            save_checkpoint(model, tokenizer, directory)

    def load_hf(self, model: Any, weights: dict[str, torch.Tensor]) -> tuple[list, list]:
        missing, unexpected = model.load_state_dict(fuse_experts(weights), strict=False)
        return list(missing), list(unexpected)

    def save_checkpoint(self, state: Any, directory: Any) -> bool:
        return False  # the one-process HF checkpoint (sharded: rank 0 writes it, all gather)

    def load_checkpoint(self, state: Any, path: Any) -> bool:
        return False

    def sleep_tensors(self, model: Any) -> list[torch.nn.Module]:
        return [model]

    def attach_lora(self, model: Any, cfg: LoraConfig) -> None:
        lora.attach(model, cfg)

    def adapter_tensors(self, model: Any) -> dict[str, torch.Tensor]:
        return lora.adapter_tensors(model)

    def load_adapter(self, model: Any, tensors: dict[str, torch.Tensor]) -> None:
        lora.load_adapter_tensors(model, tensors)

    def adapters_off(self, model: Any) -> ContextManager[Any]:
        return lora.adapters_off(model)

    def merged_tensors(self, model: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return lora.merged_tensors(model)

    def routing(self, model: Any) -> Routing | None:
        return Routing(model) if moe_shape(model.config) is not None else None


def get_backend(name: str) -> TrainingBackend:
    """A fresh backend named `name` (one per trainer state)."""
    if name not in REGISTRY:
        raise ValueError(f"backend = {name!r}; use one of {', '.join(REGISTRY)}")
    module, _, cls = REGISTRY[name].partition(":")
    return getattr(sys.modules[module] if module == __name__ else importlib.import_module(module),
                   cls)()


def model_runner(backend: TrainingBackend, cfg: TrainConfig, model: Any) -> ModelRunner:
    """The runner of the train step's model passes on this rank."""
    return backend.runner(cfg, model) or TorchRunner(model)


def backend_for(cfg: TrainConfig) -> TrainingBackend:
    return get_backend(cfg.backend)


__all__ = ["REGISTRY", "TorchBackend", "TrainingBackend", "backend_for", "check_backend",
           "distributed_optimizer", "get_backend", "model_runner"]
