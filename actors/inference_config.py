"""The inference worker as the launcher sees it (actors/inference.py is the actor): its
settings and the class-level facts the launcher checks a plan with, without torch.

The launcher reads `actors.inference:InferenceWorker` from `InferenceWorkerPlan` here
(runtime/loading.py `import_actor`, plan side); `InferenceWorker` subclasses it.
"""

from __future__ import annotations

import msgspec

from runtime.actor import Actor
from runtime.devices import gpu_ids


class InferenceWorkerConfig(msgspec.Struct, forbid_unknown_fields=True):
    model: str = "tiny-qwen2"  # built-in tiny model name (models.tiny.TINY) or HF checkpoint dir
    device: str = "cpu"  # torch device the model runs on
    dtype: str = "float32"  # parameter dtype: float32 | bfloat16 | float16
    host: str = "127.0.0.1"  # address the HTTP server binds
    port: int = 0  # HTTP port; 0 = a free port, kept across restarts (endpoints.http has it)
    max_batch_size: int = 64  # most requests decoded together in one wave
    batch_wait_ms: float = 5.0  # how long requests are collected before a wave starts
    seed: int = 0  # tiny-model init seed; also seeds requests that carry no sampling_seed
    weight_version: str = "0"  # weight version reported until the first weight update
    metrics_interval_s: float = 1.0  # how often device memory and engine counters are published
    # on (re)start, load the newest weight version the trainer wrote under <run_dir>/weights
    # (weight_sync = "disk") before serving, so a restarted worker serves current weights
    catch_up: bool = True
    max_body_bytes: int = 64 << 20  # larger HTTP request bodies get 413 (weight tensors: 256 MiB)
    # every forward and log-prob by the batch-invariant kernels (models/invariant): the log-probs
    # equal, bit for bit, those of a trainer with `true_on_policy = true` on the same kind of
    # device and the same weights (docs/training.md, True on-policy mode)
    true_on_policy: bool = False
    # /release_memory_occupation parks the weights in pinned host memory and resume copies them
    # back, so a resumed worker serves exactly the version it reports; false (SGLang's default)
    # drops them: resume reloads the last checkpoint loaded, or zeros when the last version came
    # as tensors, and the trainer's next push fills them (saves one copy and one host model)
    weights_cpu_backup: bool = True
    # a mixture-of-experts model: answer every /generate with its routed experts
    # (meta_info.routed_experts), asked for or not. sglang-router 0.3.2 drops the request's
    # `return_routed_experts` field on the way, so a rollout behind it relies on this (`[rl]`
    # with `moe` sets it)
    return_routed_experts: bool = False


class InferenceWorkerPlan(Actor):
    """What the launcher checks of an inference worker: its HTTP port and its GPU."""

    Config = InferenceWorkerConfig
    role = "inference"

    @classmethod
    def bound_ports(cls, config: InferenceWorkerConfig) -> list[tuple[str, str, str, int]]:
        return [("", "port", config.host, config.port)]  # its HTTP server

    @classmethod
    def gpus(cls, config: InferenceWorkerConfig, env: dict[str, str], host: str) -> list[str]:
        return gpu_ids([config.device], env, host)
