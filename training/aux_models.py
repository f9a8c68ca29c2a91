"""Weight sets the trainer keeps besides the policy: the frozen reference and the critic.

Role: a small interface over a second (or third) set of weights so that the memory manager can
later hold them as flat weight sets: `state()` returns the tensors by name, `load_state(tensors)`
copies tensors in (same names and shapes), `forward` runs on the compute device. Until then, an
`AuxModel` keeps its module on the CPU and moves it to the compute device only for the duration
of a forward (`offload=True`), or leaves it on the device.
- `AuxModel.logprobs`: the reference policy's response-aligned log-probs of a micro-batch,
  computed with `algos.logprobs` exactly as the policy's (same temperature, positions, padding).
- `CriticModel`: a value model (a causal-LM backbone with a scalar head `Linear(hidden, 1)`) with
  its own AdamW optimizer. The value of response token j is read at position P - 1 + j (the state
  before the token is generated), the same column the token's log-prob comes from.
- `OldActors`: the policy's weights by version, for the proximal policy of decoupled PPO.
Invariant: the reference never changes after construction; the critic changes only in `step`;
an old-actor set holds exactly the policy's weights of its version.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from algos.logprobs import position_ids_from_mask, response_slice, token_logprobs_and_entropy
from models.invariant import decoder_for, is_enabled
from training.batching import MicroBatch
from training.config import CriticConfig
from training.master_weights import make_optimizer, move_optimizer


def micro_batch_logprobs(model: Any, mb: MicroBatch, temperature: float, by_length: bool = False,
                         with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response-aligned [B, R] (log-probs, entropies) of a micro-batch under `model`.

    by_length: one unpadded forward per distinct sequence length instead of one padded forward
    (see training.step: padding changes the fp32 reduction order of attention).
    A model marked by `models.invariant.enable` (true on-policy mode) runs the batch-invariant
    forward instead: one padded forward whose values do not depend on the padding, the batch
    or the micro-batch size (so `by_length` changes nothing there).
    """
    if is_enabled(model):
        logp, ent = decoder_for(model).token_logprobs(mb.input_ids, mb.attention_mask,
                                                      temperature, with_entropy)
    elif not by_length:
        logp, ent = token_logprobs_and_entropy(model, mb.input_ids, mb.attention_mask,
                                               temperature, with_entropy)
    else:
        lengths = mb.attention_mask.sum(dim=1)
        shape = (mb.input_ids.shape[0], mb.input_ids.shape[1] - 1)
        logp = ent = None
        for length in sorted(set(lengths.tolist())):
            rows = torch.nonzero(lengths == length).squeeze(1)
            ids = mb.input_ids[rows, :length]
            lp, en = token_logprobs_and_entropy(model, ids, torch.ones_like(ids), temperature,
                                                with_entropy)
            if logp is None:
                logp = lp.new_zeros(shape)
                ent = lp.new_zeros(shape) if with_entropy else None
            logp[rows, :length - 1] = lp
            if with_entropy:
                ent[rows, :length - 1] = en
    cols = mb.num_response_cols
    return (response_slice(logp, mb.prompt_lens, cols),
            response_slice(ent, mb.prompt_lens, cols) if with_entropy else None)


class AuxModel:
    """A weight set with its own module, resident on `device` only while it computes."""

    def __init__(self, module: torch.nn.Module, device: str | torch.device, offload: bool = True):
        self.module, self.device = module, torch.device(device)
        self.offload = offload and self.device.type != "cpu"
        self.module.to("cpu" if self.offload else self.device)

    @classmethod
    def frozen_copy(cls, model: torch.nn.Module, device, offload: bool = True) -> "AuxModel":
        """A frozen deep copy of `model` (the reference = the policy's initial weights)."""
        module = copy.deepcopy(model).eval().requires_grad_(False)
        return cls(module, device, offload)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.module.state_dict().items()}

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy `tensors` in; names and shapes must match the module's."""
        own = self.module.state_dict()
        if set(own) != set(tensors):
            missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
            raise ValueError(f"weight set does not match: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, t in own.items():
                if t.shape != tensors[name].shape:
                    raise ValueError(f"shape of {name}: {tuple(t.shape)} vs "
                                     f"{tuple(tensors[name].shape)}")
                t.copy_(tensors[name])

    @contextlib.contextmanager
    def resident(self):
        """The module on the compute device for the duration of the block."""
        if self.offload:
            self.module.to(self.device)
        try:
            yield self.module
        finally:
            if self.offload:
                self.module.to("cpu")

    def logprobs(self, mb: MicroBatch, temperature: float, by_length: bool = False
                 ) -> torch.Tensor:
        """Response-aligned [B, R] log-probs of the micro-batch's tokens (no gradient)."""
        with torch.no_grad(), self.resident() as module:
            return micro_batch_logprobs(module, mb, temperature, by_length, False)[0]


class OldActors:
    """Snapshots of the policy by weight version: the proximal policies of decoupled PPO with
    `proximal = "rollout_version"`. At most `keep` sets; the oldest is recycled (`load_state`)."""

    def __init__(self, keep: int, device, offload: bool = True):
        self.keep, self.device, self.offload = keep, device, offload
        self.sets: dict[int, AuxModel] = {}

    def snapshot(self, model: torch.nn.Module, version: int) -> None:
        """Keep the live weights as `version` (no-op when already kept)."""
        if version in self.sets:
            return
        if len(self.sets) >= self.keep:
            aux = self.sets.pop(min(self.sets))
            aux.load_state({k: v.detach() for k, v in model.state_dict().items()})
        else:
            aux = AuxModel.frozen_copy(model, self.device, self.offload)
        self.sets[version] = aux

    def get(self, version: int) -> AuxModel | None:
        return self.sets.get(version)


class ValueModel(torch.nn.Module):
    """Causal-LM backbone (its decoder, without the LM head when it has one) + scalar head."""

    def __init__(self, causal_lm: torch.nn.Module):
        super().__init__()
        self.backbone = copy.deepcopy(getattr(causal_lm, "model", causal_lm))
        hidden = int(causal_lm.config.hidden_size)
        dtype = next(causal_lm.parameters()).dtype
        self.head = torch.nn.Linear(hidden, 1, dtype=dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same head on every rank and every run
            torch.nn.init.normal_(self.head.weight, std=1.0 / hidden ** 0.5)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return self.head(hidden).squeeze(-1).float()


class CriticModel(AuxModel):
    """The value model: an AuxModel that also trains (its own optimizer and gradient clip)."""

    def __init__(self, causal_lm: torch.nn.Module, device, cfg: CriticConfig,
                 offload: bool = True):
        super().__init__(ValueModel(causal_lm).train(False), device, offload)
        self.cfg = cfg

        dtype = next(self.module.parameters()).dtype
        self.optimizer = make_optimizer(self.module.parameters(), dtype, None, cfg.lr,
                                        cfg.weight_decay)  # fp32 masters for 16-bit weights

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """Response-aligned [B, R] values; call inside `resident()` when training."""
        v = self.module(mb.input_ids, mb.attention_mask)[:, :-1]
        return response_slice(v, mb.prompt_lens, mb.num_response_cols)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def step(self, all_reduce_grads: Any = None) -> float:
        """Clip (after summing gradients over ranks, when given) and apply; returns the norm."""
        to_master = getattr(self.optimizer, "prepare_grads", None)
        params = to_master() if to_master is not None else self.parameters()
        if all_reduce_grads is not None:
            all_reduce_grads(params)
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    @contextlib.contextmanager
    def resident(self):
        """Module and optimizer state on the compute device for the block."""
        with super().resident() as module:
            self._move_optimizer(self.device)
            try:
                yield module
            finally:
                if self.offload:
                    self._move_optimizer(torch.device("cpu"))

    def _move_optimizer(self, device: torch.device) -> None:
        move_optimizer(self.optimizer, device)

    def checkpoint(self) -> dict[str, Any]:
        return {"weights": self.state(), "optimizer": self.optimizer.state_dict()}

    def restore(self, saved: dict[str, Any]) -> None:
        self.load_state(saved["weights"])
        self.optimizer.load_state_dict(saved["optimizer"])
