"""The megatron backend's checks of a trainer config, without importing megatron-core.

Role: `check_config` is `MegatronBackend.check_config` (backend.py): what backend = "megatron"
needs of the install, the checkpoint's config.json, the device and the options, ValueError
naming what to change. It lives here, apart from the backend, so the launcher checks a megatron
plan (training/backend_checks.py) without importing megatron-core (about 4 s of CPU: its module
imports compile dozens of functions through torch.compile); torch and the HF config classes are
all it imports. The LoRA target names the backend adapts (`TARGETS`) are here for the same
reason (lora.py uses them).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

from backends.megatron.convert import check_parallel_layout, is_moe

if TYPE_CHECKING:  # annotations only: the training library is a layer above
    from training.config import TrainConfig

# HF module -> (its path in an HF decoder layer, the megatron layer, what part of it); in the
# order of an HF layer's modules (the order peft registers its adapters in)
TARGETS: dict[str, tuple[str, str, str]] = {
    "q_proj": ("self_attn.q_proj", "self_attention.linear_qkv", "q"),
    "k_proj": ("self_attn.k_proj", "self_attention.linear_qkv", "k"),
    "v_proj": ("self_attn.v_proj", "self_attention.linear_qkv", "v"),
    "o_proj": ("self_attn.o_proj", "self_attention.linear_proj", "row"),
    "gate_proj": ("mlp.gate_proj", "mlp.linear_fc1", "gate"),
    "up_proj": ("mlp.up_proj", "mlp.linear_fc1", "up"),
    "down_proj": ("mlp.down_proj", "mlp.linear_fc2", "row"),
}
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def check_targets(target_modules: list[str]) -> None:
    """ValueError naming the allowed modules when a target is not one of this backend's."""
    unknown = [t for t in target_modules if t not in TARGETS]
    if unknown:
        raise ValueError(f"lora.target_modules {unknown} are not linear layers the megatron "
                         f"backend adapts; allowed: {list(TARGETS)}")


def check_moe_targets(moe: bool, target_modules: list[str]) -> None:
    """ValueError for MLP targets on a mixture-of-experts model (its MLPs are experts, which
    take no adapters here)."""
    mlp = [t for t in target_modules if t in MLP_TARGETS]
    if moe and mlp:
        raise ValueError(f"lora.target_modules {mlp} are expert MLPs of a mixture-of-experts "
                         f"model, which the megatron backend does not adapt; target the "
                         f"attention projections (q_proj, k_proj, v_proj, o_proj)")


def on_cpu_shim() -> bool:
    """This process runs megatron-core on the CPU through the test-only torch.cuda stand-ins
    (cpu_shim.py, armed by the tests' sitecustomize); looked up, never imported, so production
    code does not depend on it."""
    shim = sys.modules.get("backends.megatron.cpu_shim")
    return shim is not None and shim.armed()


def check_config(cfg: TrainConfig, colocated: bool = False) -> None:
    """What backend = "megatron" needs (ValueError naming what to change): megatron-core
    installed, the model splitting over the parallel layout, a CUDA device, no sequence
    parallelism, a mixture-of-experts or LoRA combination the backend runs."""
    if importlib.util.find_spec("megatron.core") is None:
        raise ValueError("backend = 'megatron' needs megatron-core: pip install "
                         "'rlx[megatron]' (megatron-core 0.16.1)")
    check_parallel_layout(cfg.model, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep)
    if not cfg.device.startswith("cuda") and not on_cpu_shim():
        raise ValueError("backend = 'megatron' runs on CUDA devices (megatron-core has no "
                         "CPU path); use backend = 'torch' with device = 'cpu'")
    if str(cfg.megatron.get("sequence_parallel", False)).lower() == "true":
        raise ValueError("megatron's sequence_parallel needs Transformer Engine's norm "
                         "layers; this backend builds megatron-core's local layers, whose "
                         "torch norms refuse it (megatron-core 0.16.1): unset "
                         "sequence_parallel (tensor parallelism runs without it)")
    if is_moe(cfg.model):
        _check_moe(cfg)
        if cfg.activation_checkpointing:
            raise ValueError("activation_checkpointing with a mixture-of-experts model is "
                             "not supported on the megatron backend (the routers' recorded "
                             "routes and load-balancing loss would run again in the "
                             "recompute); use micro_batches.pack = true or a smaller "
                             "micro_batches.max_tokens")
    if cfg.lora is not None:
        _check_lora(cfg)


def _check_moe(cfg: TrainConfig) -> None:
    """ValueError for a mixture-of-experts layout this backend cannot run (the expert count
    against ep is checked with the model's other sizes, check_parallel_layout)."""
    par, options = cfg.parallel, cfg.megatron
    if (par.tp > 1 or par.ep > 1) and cfg.lora is not None:
        raise ValueError(f"lora on a mixture-of-experts model runs at parallel.tp = ep = 1 "
                         f"on the megatron backend (got tp = {par.tp}, ep = {par.ep})")
    if cfg.lora is not None:
        check_moe_targets(True, list(cfg.lora.target_modules))
    if par.pp > 1 and cfg.moe.routing_replay != "off" and any(
            options.get(key) for key in ("recompute_granularity", "recompute_method")):
        raise ValueError("moe.routing_replay with megatron recomputation at parallel.pp > 1 "
                         "is not supported (a recomputed layer's routes are not kept across "
                         "the pipeline schedule); remove the recompute options or set "
                         "routing_replay = 'off'")


def _check_lora(cfg: TrainConfig) -> None:
    """ValueError for a LoRA student this backend cannot train (lora.py)."""
    check_targets(list(cfg.lora.target_modules))
    if cfg.parallel.pp > 1 and cfg.kl.coef > 0 and not cfg.kl.ref_model:
        # the step asks the last stage alone for the reference's log-probs; through the
        # pipeline every stage must run that pass (AdaptersOffReference.runner_logprobs)
        raise ValueError("a LoRA student's KL reference (the policy, adapters off) runs "
                         "only at parallel.pp = 1 on the megatron backend (the step asks "
                         "the last stage alone for it); use pp = 1 or set kl.ref_model")


__all__ = ["MLP_TARGETS", "TARGETS", "check_config", "check_moe_targets", "check_targets",
           "on_cpu_shim"]
