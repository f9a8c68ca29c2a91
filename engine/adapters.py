"""LoRA adapters in the embedded engine: SGLang's adapter endpoints, one base model, many adapters.

Role: a LoRA student's trainer pushes only its adapter; the worker keeps its base weights
untouched and serves each request with the adapter it names (`lora_path` of /generate, as in
SGLang). `AdapterRegistry` holds the loaded adapters by name (their tensors on the model's
device, in its dtype); the first load puts LoRA layers on the model (peft, models/lora.py: the
same layers the trainer computes with) and every later adapter must have that shape (rank,
alpha, target modules: one shape per worker, as SGLang's `--max-lora-rank` /
`--lora-target-modules` fix its pool). A wave of the scheduler runs one adapter (or none: the
base); `use(adapter)` copies that adapter's tensors into the layers before the wave (nothing when
they already hold it), so the base weights never move.

HTTP (SGLang's `http_server.py` / `io_struct.py`, the v0.5.x line read for
tests/fixtures/sglang/; no SGLang server was run):
- `POST /load_lora_adapter` `{lora_name, lora_path, pinned}`: a PEFT adapter directory;
- `POST /load_lora_adapter_from_tensors` `{lora_name, config_dict, serialized_tensors,
  load_format, pinned}`: the adapter in the body, as base64 safetensors (load_format null), or
  on a CUDA worker as SGLang's CUDA IPC payload (load_format "flattened_bucket", read through
  engine/cuda_ipc.py's allowlist as /update_weights_from_tensor reads it);
- `POST /unload_lora_adapter` `{lora_name}`;
each answered with SGLang's `LoRAUpdateOutput` `{success, error_message, loaded_adapters: {name:
{lora_id, lora_name, lora_path, pinned}}}`, 200 or 400. A request naming an adapter that is not
loaded is refused with 400 before it is queued. Unloading drops the name at once; requests
already queued with that adapter finish with it (they hold it), as SGLang waits for in-flight
requests of an adapter it unloads.
Invariants: the base model's tensors are bit-identical whatever adapters are loaded, used or
unloaded; a failed load changes nothing (names, shapes and the adapter's shape are checked
first).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import torch

from engine.errors import BadRequest
from models import lora

TENSOR_PATH = "__tensor__"  # SGLang's lora_path of an adapter loaded from tensors


@dataclasses.dataclass(eq=False)
class Adapter:
    """One loaded adapter: its tensors by the model's parameter names, on the model's device."""

    name: str
    path: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    pinned: bool = False
    lora_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)

    def ref(self) -> dict[str, Any]:
        return {"lora_id": self.lora_id, "lora_name": self.name, "lora_path": self.path,
                "pinned": self.pinned}


def _shape_of(config: dict[str, Any]) -> tuple[int, float, tuple[str, ...]]:
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    return int(config.get("r", 0)), float(config.get("lora_alpha", 0)), tuple(sorted(targets))


class AdapterRegistry:
    """The adapters one engine holds (see the module docstring); called from the engine thread
    (`load`, `use`) and the event loop (`get`, `unload`, `loaded`)."""

    def __init__(self, model: torch.nn.Module, refuse: str = ""):
        self.model = model
        self.refuse = refuse  # why this engine takes no adapters ("" = it does)
        self.adapters: dict[str, Adapter] = {}
        self.shape: tuple[int, float, tuple[str, ...]] | None = None  # of the first adapter
        self._params: dict[str, torch.nn.Parameter] = {}  # the LoRA layers' tensors
        self.installed: Adapter | None = None  # the adapter the layers hold now
        self.loads = 0

    # ---- event loop ------------------------------------------------------------------------
    def get(self, name: str | None) -> Adapter | None:
        """The adapter a request names (None: the base); BadRequest naming the loaded ones."""
        if name is None:
            return None
        if name not in self.adapters:
            loaded = sorted(self.adapters) or "none"
            raise BadRequest(f"The following requested LoRA adapters are not loaded: {name} "
                             f"(loaded: {loaded}); load it with /load_lora_adapter first")
        return self.adapters[name]

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise BadRequest(f"LoRA adapter {name!r} is not loaded (loaded: "
                             f"{sorted(self.adapters) or 'none'})")
        del self.adapters[name]

    def loaded(self) -> dict[str, dict[str, Any]]:
        return {name: a.ref() for name, a in self.adapters.items()}

    # ---- engine thread -----------------------------------------------------------------------
    def load(self, name: str, path: str, config: dict[str, Any],
             tensors: dict[str, torch.Tensor], pinned: bool = False) -> Adapter:
        """Check and hold an adapter (PEFT-named tensors); the first one puts the LoRA layers on
        the model (with the adapters off: running waves compute the base as before)."""
        if self.refuse:
            raise BadRequest(self.refuse)
        if not isinstance(name, str) or not name:
            raise BadRequest("lora_name must be a non-empty string")
        if name in self.adapters:
            raise BadRequest(f"LoRA adapter {name!r} is already loaded; unload it first or "
                             f"load under another name")
        if config.get("peft_type", "LORA") != "LORA":
            raise BadRequest(f"adapter {name!r} is a {config.get('peft_type')} adapter; only "
                             f"LoRA adapters are served")
        shape = _shape_of(config)
        if shape[0] < 1 or shape[1] <= 0 or not shape[2]:
            raise BadRequest(f"adapter {name!r}: its config needs r >= 1, lora_alpha > 0 and "
                             f"target_modules (got r={shape[0]}, lora_alpha={shape[1]}, "
                             f"target_modules={list(shape[2])})")
        if self.shape is not None and shape != self.shape:
            raise BadRequest(f"adapter {name!r} has rank {shape[0]}, alpha {shape[1]}, targets "
                             f"{list(shape[2])}; this worker's adapters have rank "
                             f"{self.shape[0]}, alpha {self.shape[1]}, targets "
                             f"{list(self.shape[2])} (one adapter shape per worker)")
        if self.shape is None:
            self._attach(config)
        own = {lora.PEFT_PREFIX + n.replace(f".{lora.ADAPTER}.", "."): n for n in self._params}
        missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise BadRequest(f"adapter {name!r} does not fit this model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        held = {}
        for saved, t in tensors.items():
            p = self._params[own[saved]]
            if tuple(t.shape) != tuple(p.shape):
                raise BadRequest(f"adapter {name!r}: {saved} has shape {tuple(t.shape)}, this "
                                 f"model's {tuple(p.shape)}")
            held[own[saved]] = t.detach().to(device=p.device, dtype=p.dtype).clone()
        for device in {t.device for t in held.values() if t.is_cuda}:
            torch.cuda.synchronize(device)  # copied out of a sender's IPC buffer: it may reuse it
        adapter = Adapter(name, path, dict(config), held, pinned)
        self.adapters[name] = adapter
        self.loads += 1
        return adapter

    def _attach(self, config: dict[str, Any]) -> None:
        try:
            lora.attach(self.model, {**config, "lora_dropout": 0.0})
        except ValueError as e:
            raise BadRequest(str(e)) from None
        self.model.requires_grad_(False)
        self._params = {n: p for n, p in self.model.named_parameters() if lora.is_adapter_name(n)}
        self.shape = _shape_of(config)
        self._enable(False)

    def _enable(self, on: bool) -> None:
        for layer in lora._tuner_layers(self.model):
            layer.enable_adapters(on)

    def use(self, adapter: Adapter | None) -> None:
        """The layers compute with `adapter` (None: the base) from the next forward on."""
        if self.shape is None:
            return  # no adapter was ever loaded: the model has no LoRA layers
        if adapter is None:
            self._enable(False)
            return
        if self.installed is not adapter:
            with torch.no_grad():
                for n, t in adapter.tensors.items():
                    self._params[n].copy_(t)
            self.installed = adapter
        self._enable(True)

    def forget_installed(self) -> None:
        """The layers' tensors were parked or replaced (memory release): copy in again."""
        self.installed = None


def base_named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by their HF names (LoRA layers' base weights under the names they had
    before the layers were added; the adapters' own tensors left out): what a full-weight update
    names."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        out[name.replace(".base_layer.", ".")] = t
    return out


__all__ = ["Adapter", "AdapterRegistry", "TENSOR_PATH", "base_named_tensors"]
