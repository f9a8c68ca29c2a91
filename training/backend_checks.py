"""The training backends by name and the checks of a trainer's config against its backend, read
without importing a backend (no torch for the torch backend's).

Role: `REGISTRY` names where each backend lives (training/backends.py `get_backend` imports it
when asked for); `check_backend(cfg, colocated)` is what the configured backend needs of the
install, the checkpoint and the device, at load (ValueError naming what to change). The torch
backend's check is `check_torch_config` here (training/backends.py `TorchBackend.check_config`
is it), so the launcher checks a torch plan without torch (tests/test_import_cost.py); the
megatron backend's check (`CHECKS`: its install, the checkpoint's config.json) is imported
without megatron-core itself (backends/megatron/checks.py); any other backend is imported and
asked.
"""

from __future__ import annotations

import importlib

from training.config import MP, TrainConfig

MEGATRON = MP
# name -> module:class, imported when first asked for (optional dependencies stay unimported)
REGISTRY: dict[str, str] = {"torch": "training.backends:TorchBackend",
                            MEGATRON: "backends.megatron.backend:MegatronBackend"}
# name -> module:function of a backend's config check that needs less than the backend
CHECKS: dict[str, str] = {MEGATRON: "backends.megatron.checks:check_config"}


def backend_class(name: str) -> type:
    """The backend class named `name`, imported (ValueError naming the choices otherwise)."""
    if name not in REGISTRY:
        raise ValueError(f"backend = {name!r}; use one of {', '.join(REGISTRY)}")
    module, _, cls = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def check_torch_config(cfg: TrainConfig, colocated: bool = False) -> None:
    """The torch backend's check (`TorchBackend.check_config`)."""
    if cfg.megatron:
        raise ValueError(f"`{MEGATRON}` options are set but backend = 'torch'; set "
                         f"backend = '{MEGATRON}' or remove them")
    if cfg.parallel.shard == "fsdp2" and colocated:
        raise ValueError("parallel.shard = 'fsdp2' and mode = 'colocated' conflict: sleeping "
                         "moves the trainer's tensors off the GPU, and FSDP's sharded storage "
                         "is not moved yet; use mode = 'decoupled' or shard = 'none'")


def check_backend(cfg: TrainConfig, colocated: bool = False) -> None:
    """What the configured backend needs of the install, the checkpoint and the device, at load
    (ValueError naming what to change)."""
    if cfg.backend == "torch":
        check_torch_config(cfg, colocated)
    elif cfg.backend in CHECKS:
        module, _, name = CHECKS[cfg.backend].partition(":")
        getattr(importlib.import_module(module), name)(cfg, colocated)
    else:
        backend_class(cfg.backend)().check_config(cfg, colocated)
