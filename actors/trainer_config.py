"""The trainer as the launcher sees it (actors/trainer.py is the actor): its settings and the
checks the launcher runs on a plan (runtime/loading.py `import_actor`, plan side)."""

from __future__ import annotations

from typing import Literal

from algos.opd_config import check_cross_vocab
from engine.weight_sync_config import WeightSyncConfig
from engine.weight_sync_plan import check_sync_device
from logic.teachers import cross_vocab, tokenizer_source
from models.names import check_model_path
from models.tokenizer_load import load_tokenizer
from runtime.actor import Actor
from runtime.devices import gpu_ids
from training.backend_checks import check_backend
from training.config import CheckpointConfig, TrainConfig


class TrainerConfig(TrainConfig, kw_only=True):
    """Settings of the trainer actor: the training library's (`training.config.TrainConfig`,
    one table per component) plus its peers, its loop, checkpoints and weight sync."""

    workers: list[str]  # peer names of the inference workers that receive every version
    buffer: str = "buffer"  # peer that hands out batches
    rollout: str = ""  # peer asked for a final evaluation after the last step ("" = none)
    num_steps: int = 20  # optimizer steps; the run completes after the last one
    mode: Literal["decoupled", "colocated"] = "decoupled"  # colocated needs max_staleness = 0
    # a wait on the buffer longer than this ends the run with a message (while it lasts, the
    # console reports it every [run] stall_report_s), seconds
    batch_timeout_s: float = 3600.0
    prefetcher: str = ""  # peer (actors.prefetcher) doing the teachers' NVMe reads ("" = here)
    checkpoint: CheckpointConfig = CheckpointConfig()  # when checkpoints are written
    weight_sync: WeightSyncConfig = WeightSyncConfig()  # how versions reach the workers


class TrainerActorPlan(Actor):
    """What the launcher checks of a trainer: its model, teachers, backend and weight sync, its
    GPU, its ranks and peers (the checks across actors: launch/plan.py)."""

    Config = TrainerConfig
    role = "trainer"

    @classmethod
    def check_config(cls, config: TrainerConfig) -> None:
        check_model_path(config.model)
        for path in (config.kl.ref_model, config.critic.model if config.critic else ""):
            if path:
                check_model_path(path)
        if not config.workers:
            raise ValueError("`workers` must name the inference worker actors")
        if config.teachers:
            student = load_tokenizer(config.model)
            for t in config.teachers:
                check_model_path(t.model)
                if cross_vocab(student, load_tokenizer(tokenizer_source(t)), t) is not None:
                    check_cross_vocab(t.opd or config.opd, f"teacher {t.name!r}")
        check_backend(config, colocated=config.mode == "colocated")
        check_sync_device(config.weight_sync.path, config.device)
        if config.lora is not None and config.weight_sync.path == "distributed":
            raise ValueError("lora pushes the adapter only, through SGLang's LoRA endpoints: "
                             "weight_sync.path = 'distributed' carries full weights; use "
                             "'tensor' (the adapter in the request body), 'cuda_ipc' / 'auto' "
                             "(CUDA IPC to workers on the trainer's GPU) or 'disk' (a PEFT "
                             "directory every worker reads)")

    @classmethod
    def gpus(cls, config: TrainerConfig, env: dict[str, str], host: str) -> list[str]:
        return gpu_ids([config.device], env, host)  # the GPU weights are sent from (rank 0)

    # ranks 1..N-1 of `parallel` (N = tp * pp * dp > 1): processes of this class, started by
    # the launcher with this actor and restarted with it (launch/config.py rank_entries); the
    # launcher writes their store into parallel.store
    rank_cls = "actors.trainer_rank:TrainerRank"
    store_path = "parallel.store"

    @classmethod
    def ranks(cls, config: TrainerConfig) -> list[str]:
        """The [[hosts]] name of each of ranks 1..N-1 ("" = this actor's host)."""
        hosts = [config.parallel.rank_host(r) for r in range(1, config.parallel.world_size)]
        return [h.name if h is not None else "" for h in hosts]

    @classmethod
    def peers(cls, config: TrainerConfig) -> dict[str, str]:
        return {**{f"workers[{i}]": w for i, w in enumerate(config.workers)},
                "buffer": config.buffer, "rollout": config.rollout,
                "prefetcher": config.prefetcher}
