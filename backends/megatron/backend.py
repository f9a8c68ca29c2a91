"""The megatron-core backend behind the training library's backend protocol (training/backends.py
`TrainingBackend`, which imports this module when backend = "megatron" is asked for).

Role: each rank holds its TP/PP shard of a GPTModel built on megatron's parallel state, so the
ranks join the process group and build that state before loading (`joins_group_first`,
`init_model_parallel`); the policy is loaded from HF weights (`load_policy`), its gradient norm
is taken over the model-parallel groups (`grad_clip`), pipeline stages run through megatron's
schedule (`runner`), HF-named tensors are gathered to global rank 0 (`iter_hf_tensors`), and
checkpoints use megatron's distributed format, resumable at any layout. A LoRA student (`lora`)
gets tensor-parallel adapters under PEFT's names (lora.py: `attach_lora`, `adapter_tensors`,
`load_adapter`, `adapters_off`, `merged_tensors`), and its checkpoint is a PEFT adapter
directory with the optimizer state, no base weights. A mixture-of-experts policy (Qwen3-MoE)
splits its experts over parallel.ep data-parallel ranks (`init_model_parallel`), its placement
checked at load (`check_config`), and gets `routing(model)` (model.py MegatronRouting: routing
replay, route metrics, the load-balancing loss). Context parallelism (parallel.cp): the
model's forward splits each sequence over the CP ranks of a replica (model.py, through
context_parallel.py); the CP ranks share the replica's micro-batches (the step's data-parallel
reductions exclude them) and sum their gradients (`init_model_parallel`'s reductions,
`prepare_grads`), with tp, pp, ep (MoE) and the distributed optimizer. Megatron's
sequence_parallel is refused at load: megatron-core's local layers (no Transformer Engine here)
refuse it in their norms.
The option table
(`TrainConfig.megatron`) is checked here. Invariant: importing this module imports megatron-core
only through the submodules it names at the top (all of them from `mcore.py`); the config
checks need only `convert.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist

from backends.megatron import lora
from backends.megatron.checkpoint import (
    is_trainer_checkpoint,
    load_trainer_checkpoint,
    save_trainer_checkpoint,
)
from backends.megatron.checks import check_config
from backends.megatron.mcore import param_is_not_shared, param_is_not_tensor_parallel_duplicate
from backends.megatron.model import (
    MegatronCausalLM,
    MegatronRouting,
    initialize_parallel,
    load_model,
    parallel_state,
)
from backends.megatron.parallel import (
    ExpertDataParallel,
    is_expert_parallel,
    sum_context_parallel_grads,
    sum_tensor_partial_grads,
)
from backends.megatron.pipeline import PipelineRunner

if TYPE_CHECKING:  # annotations only: the training library is a layer above
    from models.lora import LoraConfig
    from training.config import TrainConfig


def distributed_optimizer(cfg: TrainConfig) -> bool:
    """training/config.py's `distributed_optimizer` (the flag, or megatron's option name)."""
    return bool(cfg.parallel.distributed_optimizer
                or cfg.megatron.get("use_distributed_optimizer", False))


class MegatronBackend:
    """megatron-core GPTModel shards (tp x pp), data-parallel replicas of them."""

    name = "megatron"
    joins_group_first = True  # the model is built on the model-parallel groups
    shards_model = True
    streams_weights = True

    def __init__(self) -> None:
        self._parallel = False  # this backend initialised megatron's parallel state

    def check_config(self, cfg: TrainConfig, colocated: bool = False) -> None:
        check_config(cfg, colocated)  # checks.py: the launcher runs it without megatron-core

    def init_model_parallel(self, cfg: TrainConfig) -> Any:
        """megatron's tp x pp x dp (x ep) groups over the joined world; the step's data-parallel
        reductions over them."""
        initialize_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.seed, cfg.parallel.timeout_s,
                            cfg.parallel.ep, cfg.parallel.cp)
        self._parallel = True
        # the step's data-parallel sums: dense gradients over the data-parallel group, each
        # expert's over its expert data-parallel group (the others hold other experts); the
        # CP ranks of a replica share its micro-batches, their gradients summed with it
        return ExpertDataParallel()

    def position(self) -> tuple[int, ...]:
        """(tensor rank, stage); with expert parallelism (tensor rank, stage, expert-parallel
        rank): data-parallel ranks of one expert-parallel group hold different experts."""
        here = (parallel_state.get_tensor_model_parallel_rank(),
                parallel_state.get_pipeline_model_parallel_rank())
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            return here + (parallel_state.get_expert_model_parallel_rank(),)
        return here

    def shard(self, state: Any, dtype: torch.dtype, lr: float, weight_decay: float) -> None:
        raise ValueError("the megatron backend shards the model itself (tp x pp); "
                         "parallel.shard = 'fsdp2' is the torch backend's")

    def close(self) -> None:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()

    def load_policy(self, cfg: TrainConfig, dtype: torch.dtype) -> tuple[Any, Any]:
        """This rank's model shard and the tokenizer; alone, a one-rank group first."""
        if not dist.is_initialized():
            assert cfg.parallel.world_size == 1, "the ranks join a multi-rank group first"
            dist.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo",
                                    store=dist.HashStore(), rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            self.init_model_parallel(cfg)
        return load_model(cfg.model, cfg.megatron, cfg.device, dtype, cfg.seed)

    def grad_clip(self, model: Any) -> Callable[[float], float] | None:
        return model.clip_grad_norm  # over the TP/PP groups, each element once

    def prepare_grads(self, model: Any) -> Callable[[], None]:
        """What the distributed optimizer runs before its reduce-scatter (over the
        data-parallel group without the context-parallel ranks): the tensor ranks' partial
        gradients (q/k norms) summed, as the replicated step's norm does, and the
        context-parallel ranks' parts of every gradient summed."""
        def prepare() -> None:
            sum_tensor_partial_grads(model)
            sum_context_parallel_grads([p for p in model.parameters() if p.requires_grad])
        return prepare

    def optimizer_shards(self, params: list[torch.nn.Parameter]
                         ) -> list[tuple[list[torch.nn.Parameter], Any, Callable, Any]]:
        """The distributed optimizer's parts: (parameters, the group their optimizer state is
        sharded over, whether a parameter counts in the norm, the group the norm is summed over
        beyond it). Dense parameters: the data-parallel and model-parallel groups; with expert
        parallelism the experts apart: the expert data-parallel group (where each expert is
        replicated) and the expert tensor x expert x pipeline group."""
        def counted(p: torch.Tensor) -> bool:
            return bool(param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p))

        experts = [p for p in params if is_expert_parallel(p)] \
            if parallel_state.get_expert_model_parallel_world_size() > 1 else []
        chosen = {id(p) for p in experts}
        dense = [p for p in params if id(p) not in chosen]
        parts = [(dense, parallel_state.get_data_parallel_group(), counted,
                  parallel_state.get_model_parallel_group())] if dense else []
        if experts:
            parts.append((experts, parallel_state.get_expert_data_parallel_group(), counted,
                          parallel_state.get_expert_tensor_model_pipeline_parallel_group()))
        return parts

    def transformers_policy(self, model: Any) -> torch.nn.Module | None:
        return None  # the reference / critic are transformers models from the checkpoint

    def tensor_shard(self, cfg: TrainConfig) -> tuple[int, int, Any] | None:
        if cfg.parallel.tp == 1:
            return None
        return (parallel_state.get_tensor_model_parallel_rank(), cfg.parallel.tp,
                parallel_state.get_tensor_model_parallel_group())

    def runner(self, cfg: TrainConfig, model: Any) -> PipelineRunner | None:
        """megatron's pipeline schedule at pp > 1; None (a whole forward per micro-batch, the
        training library's default runner) at pp = 1."""
        return PipelineRunner(model) if cfg.parallel.pp > 1 else None

    def step_stats(self, cfg: TrainConfig) -> dict[str, float]:
        stats = {"train/tp_size": float(cfg.parallel.tp), "train/pp_size": float(cfg.parallel.pp)}
        if cfg.parallel.ep > 1:
            stats["train/ep_size"] = float(cfg.parallel.ep)
        if cfg.parallel.cp > 1:
            stats["train/cp_size"] = float(cfg.parallel.cp)
        return stats

    def routing(self, model: MegatronCausalLM) -> MegatronRouting | None:
        """The routing object of a MoE policy (model.py MegatronRouting), None for a dense one."""
        return MegatronRouting(model) if model.layout.moe else None

    def iter_hf_tensors(self, model: MegatronCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
        return model.iter_hf_tensors()

    def save_hf(self, model: MegatronCausalLM, tokenizer: Any, directory: str,
                shard_bytes: int) -> None:
        model.save_pretrained(directory, shard_bytes=shard_bytes)  # collective
        tokenizer.save_pretrained(directory)

    def load_hf(self, model: MegatronCausalLM, weights: dict[str, torch.Tensor]
                ) -> tuple[list, list]:
        model.load_hf_state_dict(weights)  # HF names converted; refuses what it does not use
        return [], []

    def save_checkpoint(self, state: Any, directory: Any) -> bool:
        """The distributed checkpoint; a LoRA student's: the PEFT adapter directory at its top
        with the optimizer state (lora.save_checkpoint), no base weights."""
        if getattr(state, "lora", None) is not None:
            lora.save_checkpoint(state, directory)
        else:
            save_trainer_checkpoint(state, directory)
        return True

    def load_checkpoint(self, state: Any, path: Any) -> bool:
        """True when `path` is this backend's checkpoint (loaded); False leaves it to the
        one-process reader (an HF directory, or a torch backend's LoRA checkpoint, which only
        tp = pp = 1 reads: its optimizer state is per whole tensor)."""
        path = Path(path)
        if getattr(state, "lora", None) is not None:
            if lora.is_checkpoint(path):
                lora.load_checkpoint(state, path)
                return True
            if is_trainer_checkpoint(path):
                raise ValueError(f"checkpoint {path} holds full weights, not a LoRA adapter, "
                                 f"but this trainer trains one (lora is set): resume it "
                                 f"without lora, or start a new run")
            sharded = (parallel_state.get_tensor_model_parallel_world_size() > 1
                       or parallel_state.get_pipeline_model_parallel_world_size() > 1)
            if sharded and (path / "adapter_config.json").is_file():
                raise ValueError(f"checkpoint {path} is a torch backend's LoRA checkpoint: "
                                 f"resume it at parallel.tp = pp = 1 (its optimizer state is "
                                 f"per whole tensor)")
            if sharded:
                raise ValueError(f"checkpoint {path} holds no LoRA adapter, but this trainer "
                                 f"trains one (lora is set): resume it without lora, or start "
                                 f"a new run")
            return False  # TrainState.load reads it (or says what it holds instead)
        if lora.is_checkpoint(path):
            raise ValueError(f"checkpoint {path} holds a LoRA adapter, not full weights: resume "
                             f"it with the lora table it was trained with")
        if not is_trainer_checkpoint(path):
            return False
        load_trainer_checkpoint(state, path)
        return True

    def sleep_tensors(self, model: Any) -> list[torch.nn.Module]:
        return [model]

    # ---- LoRA students (backends/megatron/lora.py) ------------------------------------------
    def attach_lora(self, model: MegatronCausalLM, cfg: LoraConfig) -> None:
        lora.attach(model, cfg)

    def adapter_tensors(self, model: MegatronCausalLM) -> dict[str, torch.Tensor]:
        return lora.adapter_tensors(model)  # collective: whole tensors on global rank 0

    def load_adapter(self, model: MegatronCausalLM, tensors: dict[str, torch.Tensor]) -> None:
        lora.load_adapter(model, tensors)

    def adapters_off(self, model: MegatronCausalLM) -> ContextManager[Any]:
        return lora.adapters_off(model)

    def merged_tensors(self, model: MegatronCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
        return lora.merged_tensors(model)  # collective like iter_hf_tensors
