"""The trainer's state: the policy, its optimizer and counters, plus the auxiliary weight sets.

Role: everything a checkpoint holds. `ref` (the reference policy), `critic` (the value model
with its optimizer) and `old_actors` are `training.aux_models` weight sets (host copies in the
weight store, memory/store.py), present only when the configured algorithm needs them. Invariant: a
checkpoint directory is complete or absent (written under a temporary name with a manifest of
checksums, then renamed: training/checkpoints.py); the critic's weights and optimizer go in
`critic.pt`. A frozen reference is never saved: it is rebuilt from its source (`ref_model`, or
the initial checkpoint), so a resumed run keeps the same reference. A reference that follows the
actor (`kl.ref_update_interval`) is saved as `ref/model.safetensors` (caught up first), so a
resumed run continues with the copy it had.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from memory.safetensors_io import (
    DEFAULT_SHARD_BYTES,
    load_safetensors,
    write_safetensors_shards,
)
from models.load import save_checkpoint
from models.lora import read_adapter, write_adapter
from training.backends import TrainingBackend, get_backend
from training.checkpoints import write_checkpoint
from training.master_weights import TrainOptimizer, as_train_optimizer
from training.sleep import SleepReport, TrainerSleep

log = logging.getLogger(__name__)

REF_DIR = "ref"  # a following reference's copy in a checkpoint (not a *.safetensors of the
                 # checkpoint's own directory: those are the policy's weights)


class TrainState:
    """Model, tokenizer, optimizer and counters: everything a checkpoint holds."""

    def __init__(self, model: Any, tokenizer: Any, optimizer: Any, ref: Any = None,
                 critic: Any = None, backend: TrainingBackend | None = None):
        """`optimizer`: a training.master_weights.TrainOptimizer (a torch optimizer is wrapped
        in PlainOptimizer); `backend`: the training backend of `model` (default torch)."""
        self.backend = backend if backend is not None else get_backend("torch")
        self.model, self.tokenizer = model, tokenizer
        self.optimizer: TrainOptimizer = as_train_optimizer(optimizer)
        if self.optimizer is not None and self.optimizer.clip is None:
            self.optimizer.clip = self.backend.grad_clip(model)
        self.ref, self.critic = ref, critic  # training.aux_models.AuxModel / CriticModel or None
        if ref is not None and getattr(ref, "update_interval", 0):
            ref.follow(model, optimizer)  # kl.ref_update_interval: copies of the actor
        self.old_actors: Any = None  # training.aux_models.OldActors, made on first use
        # training.colocated_teachers.ColocatedTeachers (colocated distillation)
        self.teachers: Any = None
        self.next_teachers: list[str] = []  # the buffer's hint: teachers of the next batch
        # the run's sampling temperature (RunFacts): every log-prob of the step is computed at it
        self.temperature = 1.0
        self.step = 0
        self.version = 0
        self.skipped_checkpoints: list[str] = []  # newer checkpoints a resume found damaged
        self._sleeper: TrainerSleep | None = None  # colocated mode's sleep (made on first use)
        # a LoRA student (training/config.py LoraConfig, None = full weights) and the base
        # checkpoint its adapter applies to (written into adapter_config.json)
        self.lora: Any = None
        self.base_model = ""

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    def save_weights(self, path: Path, shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        """The HF export a disk push loads, written under a temporary name, then renamed; a
        sharded model streams it from its shards in files of at most `shard_bytes`."""
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # a sharded model: collective, every rank runs it (or the hf command)
        self.backend.save_hf(self.model, self.tokenizer, str(tmp), shard_bytes)
        shutil.rmtree(path, ignore_errors=True)  # a resumed run rewrites its current version
        tmp.replace(path)

    def save(self, path: Path) -> None:
        """Model as an HF directory plus optimizer/step/version, written atomically with a
        manifest of checksums (training/checkpoints.py): a checkpoint is complete or absent."""
        write_checkpoint(path, self.write_files)

    @property
    def follows_actor(self) -> bool:
        """The reference is a copy of the actor renewed every kl.ref_update_interval steps."""
        return self.ref is not None and bool(getattr(self.ref, "update_interval", 0))

    def host_weight_sets_bytes(self) -> int:
        """Host bytes of the reference, critic and old-actor weight sets (each store once)."""
        stores = {id(s): s for s in (getattr(self.ref, "store", None),
                                     getattr(self.critic, "store", None),
                                     getattr(self.old_actors, "store", None)) if s is not None}
        return sum(s.nbytes for s in stores.values())

    def write_files(self, path: Path) -> None:
        """The checkpoint's files into the directory `path` (TrainState.save makes it atomic):
        the HF directory of the model, or a LoRA student's PEFT adapter directory."""
        if self.lora is not None:
            self.save_adapter(path)
        else:
            save_checkpoint(self.model, self.tokenizer, path)
        if self.critic is not None:
            torch.save(self.critic.checkpoint(), path / "critic.pt")
        if self.follows_actor:
            self.ref.catch_up()  # a copy due at this step is taken before it is saved
            (path / REF_DIR).mkdir()
            save_file({n: t.clone() for n, t in self.ref.state().items()},  # views of one arena
                      str(path / REF_DIR / "model.safetensors"))
        torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step,
                    "version": self.version, "rng": torch.get_rng_state()},
                   path / "trainer_state.pt")

    # ---- a LoRA student (models/lora.py): the adapter is what is pushed and saved ----------
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The whole adapter under PEFT's names (on rank 0; collective on a sharded model)."""
        return self.backend.adapter_tensors(self.model)

    def save_adapter(self, directory: Path, tensors: dict[str, torch.Tensor] | None = None
                     ) -> int:
        """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors, which
        `peft.PeftModel.from_pretrained` loads as it is) plus the tokenizer; its bytes."""
        nbytes = write_adapter(directory, self.lora, tensors if tensors is not None
                               else self.adapter_tensors(), self.base_model)
        self.tokenizer.save_pretrained(str(directory))
        return nbytes

    def save_merged(self, directory: Path, shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        """An HF directory of the base with the adapter merged in (lora.merge_export)."""
        write_safetensors_shards(self.backend.merged_tensors(self.model), directory, shard_bytes)
        hf = self.backend.transformers_policy(self.model)  # megatron: None, its model has one
        config = getattr(hf if hf is not None else self.model, "config", None)
        if config is not None:
            config.save_pretrained(str(directory))
        self.tokenizer.save_pretrained(str(directory))

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """HF-named full weights (what the workers load) as one list (tests, small models)."""
        return list(self.iter_named_weights())

    def iter_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full weights as a push sends them: views of a whole local model, or (a
        sharded model: tp/pp, fsdp2) the tensors as each is gathered, on rank 0 (collective
        there: every rank runs it to its end; nothing on the others)."""
        return self.backend.iter_hf_tensors(self.model)

    @property
    def streams_weights(self) -> bool:
        """`iter_named_weights` gathers new host copies (a sharded model), not views."""
        return self.backend.streams_weights

    def load(self, path: Path, device: str) -> None:
        if self.lora is not None:
            self._load_adapter(path)
        else:
            weights = load_safetensors(path, device=device)
            missing, unexpected = self.backend.load_hf(self.model, weights)
            if unexpected or [m for m in missing if "lm_head" not in m]:
                raise ValueError(f"checkpoint {path} does not match the model: missing "
                                 f"{missing}, unexpected {unexpected}")
        if self.critic is not None:
            if not (path / "critic.pt").exists():
                raise ValueError(f"checkpoint {path} has no critic.pt but the trainer uses a "
                                 "critic; resume with the estimator it was written with")
            self.critic.restore(torch.load(path / "critic.pt", map_location="cpu",
                                           weights_only=True))
        state = torch.load(path / "trainer_state.pt", map_location=device, weights_only=True)
        if "master" in state["optimizer"] and not self.optimizer.has_masters:
            raise ValueError(f"checkpoint {path} holds fp32 master weights but this trainer has "
                             "none; resume it with master_weights = true (or unset)")
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.version = state["step"], state["version"]
        torch.set_rng_state(state["rng"].cpu())
        if self.follows_actor:
            self._load_ref(path)

    def _load_adapter(self, path: Path) -> None:
        if not (path / "adapter_config.json").is_file():
            raise ValueError(f"checkpoint {path} holds full weights, not a LoRA adapter, but "
                             f"this trainer trains one (lora is set): resume it without lora, "
                             f"or start a new run")
        _, tensors = read_adapter(path)
        self.backend.load_adapter(self.model, tensors)

    def _load_ref(self, path: Path) -> None:
        """The copy of the actor the reference was at `path`'s step; without one (written with
        ref_update_interval = 0) the next due copy is taken from the resumed actor."""
        saved = path / REF_DIR
        if saved.is_dir():
            self.ref.load_state(load_safetensors(saved))
        else:
            log.warning("checkpoint %s has no reference copy (%s/); the reference becomes a copy "
                        "of the resumed actor", path, REF_DIR)
        self.ref.follow(self.model, self.optimizer)
        if not saved.is_dir():
            self.ref.synced_updates = -1  # copy at the next use

    def sleep(self, keep_weights: bool = False) -> SleepReport:
        """Colocated mode: the model's parameters, gradients and buffers and the optimizer's
        state leave the device for pinned host memory, in place (training/sleep.py);
        `keep_weights` keeps the parameters there (a push reads them; a later `sleep()` parks
        them too). The freed memory goes back to the driver."""
        if self._sleeper is None:
            self._sleeper = TrainerSleep(self.backend.sleep_tensors(self.model), self.optimizer)
        return self._sleeper.sleep(keep_weights)

    def wake(self) -> SleepReport:
        """Everything `sleep` parked back on the device, same tensors, same bytes."""
        if self._sleeper is None:
            raise RuntimeError("the trainer is awake: wake() follows sleep()")
        return self._sleeper.wake()

    @property
    def asleep(self) -> bool:
        return self._sleeper is not None and self._sleeper.asleep

    def device_bytes(self) -> int:
        """What the step's tensors hold on their device now: the bytes of every storage of the
        model and optimizer there (0 for each parked one), each storage once."""
        sleeper = self._sleeper or TrainerSleep(self.backend.sleep_tensors(self.model),
                                                self.optimizer)
        seen: dict[int, int] = {}
        for t in sleeper.tensors():
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
        return sum(seen.values())
