"""LoRA adapters: the `lora` table, peft's layers on a transformers model, PEFT's format.

Role: `attach(model, cfg)` puts LoRA adapters (peft's `inject_adapter_in_model`) on the
configured linear layers of a transformers model in place: the model keeps its class and its
forward, so every pass of the train step (the chunked loss head, packed rows, sleep) runs as
for full fine-tuning; only the adapters' tensors require gradients. The reference of a KL term
is the same model with the adapters off (`adapters_off`), never a second copy of the weights.

The adapter travels and rests in PEFT's own layout, so `peft.PeftModel.from_pretrained(base,
directory)` loads any directory written here as it is:
- tensor names `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` (`adapter_tensors`,
  `load_adapter_tensors`), the adapter's name ("default") left out, as `save_pretrained` does;
- `adapter_config.json` (peft's `LoraConfig.to_dict()`, `peft_config`) and
  `adapter_model.safetensors` (`save_adapter`, `read_adapter`).
`merged_tensors(model)` gives the HF-named full weights with the adapters merged in (W + B A
alpha / r), for an export that loads without LoRA support.

Used by the trainer (a LoRA student on the torch backend; the megatron backend keeps PEFT's
names) and by the embedded engine (the adapters it serves). peft and torch are imported only
when an adapter is used (peft takes seconds to import; the launcher reads `LoraConfig`).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import msgspec

if TYPE_CHECKING:
    import torch

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A LoRA student (this module): low-rank adapters on the policy's linear layers are
    trained, the base weights stay frozen; pushes and checkpoints carry the adapter only (PEFT
    format). Absent (`lora` unset) = full fine-tuning."""

    rank: int = 32  # r: the adapters' inner dimension
    alpha: float = 64.0  # scaling: the adapter's output is multiplied by alpha / rank
    # the linear layers that get adapters, by their HF module names (Qwen/Llama: these seven)
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(LORA_TARGETS))
    dropout: float = 0.0  # dropout on the adapters' input while training (0: none)
    # the last checkpoint also holds `merged/`: an HF directory of the base with the adapter
    # merged in (what a plain transformers or SGLang load serves without LoRA support)
    merge_export: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank = {self.rank}: use 1 or more (8-64 is usual)")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha = {self.alpha}: use a positive scale (often 2 x rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout = {self.dropout}: use 0 <= dropout < 1")
        if not self.target_modules or not all(isinstance(m, str) and m
                                              for m in self.target_modules):
            raise ValueError("lora.target_modules is empty: name the linear layers to adapt, "
                             f"e.g. {LORA_TARGETS}")


PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before module names
ADAPTER = "default"  # the adapter's name inside the layers (left out of saved names)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_config(cfg: LoraConfig | dict, base_model: str = "") -> Any:
    """peft's LoraConfig for `cfg` (a LoraConfig, or an adapter_config.json's dict)."""
    from peft import LoraConfig as PeftLoraConfig

    if isinstance(cfg, dict):
        known = {k: v for k, v in cfg.items() if k in PeftLoraConfig.__dataclass_fields__}
        return PeftLoraConfig(**known)
    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha,
                          target_modules=list(cfg.target_modules), lora_dropout=cfg.dropout,
                          bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=base_model or None)


def config_dict(cfg: LoraConfig | dict, base_model: str = "") -> dict[str, Any]:
    """adapter_config.json's content (JSON-safe: peft keeps target_modules as a set)."""
    out = peft_config(cfg, base_model).to_dict()
    return json.loads(json.dumps(out, default=lambda v: sorted(v) if isinstance(v, set)
                                 else str(v)))


def attach(model: torch.nn.Module, cfg: LoraConfig | dict) -> torch.nn.Module:
    """Adapters on `model`'s target layers, in place (B = 0: the model computes as before);
    every other tensor frozen. ValueError naming the layers when no target matches."""
    import torch
    from peft import inject_adapter_in_model

    config = peft_config(cfg)
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"lora.target_modules = {sorted(config.target_modules)} match no "
                         f"layer of this model ({e}); its linear layers are {linear}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    return model


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def has_adapters(model: Any) -> bool:
    import torch

    return isinstance(model, torch.nn.Module) and any(
        is_adapter_name(n) for n, _ in model.named_parameters())


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps (the adapters' with LoRA, else all)."""
    return [p for p in model.parameters() if p.requires_grad]


def _saved_name(name: str) -> str:
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (views of the live parameters)."""
    return {_saved_name(n): p.detach() for n, p in model.named_parameters()
            if is_adapter_name(n)}


def load_adapter_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy an adapter (PEFT names) into the model's adapters; every name and shape is checked
    before anything changes (ValueError naming the first differences)."""
    own = {_saved_name(n): p for n, p in model.named_parameters() if is_adapter_name(n)}
    check_fits({n: tuple(p.shape) for n, p in own.items()}, tensors)
    import torch

    with torch.no_grad():
        for name, t in tensors.items():
            own[name].copy_(t.to(dtype=own[name].dtype, device=own[name].device))


def check_fits(want: dict[str, tuple[int, ...]], tensors: dict[str, torch.Tensor]) -> None:
    """ValueError naming the first differences unless `tensors` has exactly the adapter names
    of `want` (PEFT names -> whole shapes), each of its shape."""
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ValueError(f"the adapter does not fit this model's adapters: missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]} (rank, target_modules "
                         f"and the base model must be the ones it was trained with)")
    for name, shape in want.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"adapter tensor {name} has shape {tuple(tensors[name].shape)}, "
                             f"this model's {tuple(shape)}: lora.rank or the base model differ")


def _tuner_layers(model: torch.nn.Module) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """The base model for the block (the reference of a LoRA student): every adapter skipped."""
    layers = _tuner_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merged_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full weights with each adapter merged in (W + B A alpha / r, computed in fp32,
    in the weight's dtype), the model left as it is; tied weights once."""
    import torch
    from peft.tuners.lora import LoraLayer

    merged: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            base = module.get_base_layer().weight
            with torch.no_grad():
                delta = module.get_delta_weight(ADAPTER).float()
                merged[f"{name}.weight"] = (base.float() + delta).to(base.dtype)
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if is_adapter_name(name) or id(t) in seen:
            continue
        seen.add(id(t))
        hf = name.replace(".base_layer.", ".")
        yield hf, merged.get(hf, t.detach())


def save_adapter(model: torch.nn.Module, cfg: LoraConfig | dict, directory: str | Path,
                 base_model: str = "") -> int:
    """`model`'s adapter as a PEFT directory (`write_adapter`); the tensors' bytes."""
    return write_adapter(directory, cfg, adapter_tensors(model), base_model)


def write_adapter(directory: str | Path, cfg: LoraConfig | dict,
                  tensors: dict[str, torch.Tensor], base_model: str = "") -> int:
    """adapter_config.json + adapter_model.safetensors (PEFT-named `tensors`) into `directory`;
    the tensors' bytes."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    host = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}
    (directory / CONFIG_FILE).write_text(json.dumps(config_dict(cfg, base_model), indent=1))
    save_file(host, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in host.values())


def read_adapter(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json's dict, the tensors) of a PEFT adapter directory; ValueError naming
    what is missing or unreadable."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise ValueError(f"{directory} is not a PEFT adapter directory: no {name}")
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except ValueError as e:
        raise ValueError(f"{directory / CONFIG_FILE} is not JSON: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{directory} holds a {config.get('peft_type')} adapter; only LoRA "
                         f"adapters are served")
    return config, load_file(str(directory / WEIGHTS_FILE))


__all__ = ["ADAPTER", "CONFIG_FILE", "PEFT_PREFIX", "WEIGHTS_FILE", "adapter_tensors",
           "adapters_off", "attach", "config_dict", "has_adapters", "load_adapter_tensors",
           "merged_tensors", "peft_config", "read_adapter", "save_adapter", "trainable"]
