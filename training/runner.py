"""How the train step runs a model over micro-batches: the one thing that differs per backend.

Role: `training.step.train_on_batch` is the whole algorithm (advantages, KL, critic, OPD,
mismatch corrections, clipping, master weights) and calls a `ModelRunner` for the two model
passes it needs:
- `logprobs(mbs, temperature, by_length)`: a no-grad pass, response-aligned [B, R] log-probs per
  micro-batch (None on a pipeline stage without logits);
- `forward_backward(mbs, temperature, loss_fn, with_logits, by_length)`: forward with grad and
  backward of every micro-batch, where `loss_fn(i, logp, ent, logits)` turns micro-batch i's
  response-aligned log-probs and entropies [B, R] (and, when `with_logits`, the response
  logits [B, R, V], or with `heads` a training.heads.ResponseHead where the runner can give
  one, else None) into the loss to backpropagate. Only stages with logits call it.
plus `is_last_stage` (this rank computes losses and statistics) and `share(stats)` (the last
stage's statistics on every rank of the model, so global rank 0 reports them).

`TorchRunner` serves any model with a whole forward (transformers, or a model-parallel backend's
model at pipeline size 1): it loops the micro-batches. With `micro_batches.pack` a micro-batch
carries its samples packed in rows (`mb.packed`, training/packing.py) and each of its passes is
one packed forward (`packs`); loss_fn gets the same response-aligned [B, R] values either way.
A runner without `packs` gets padded micro-batches only (training/step.py `packing_allowed`).
A pipeline-parallel backend gives its own runner (training/backends.py `model_runner`) over its
schedule. Invariant: on the same weights both give the same log-probs, gradients and losses (up
to float summation order); a runner never changes what is computed, only where.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch
from torch.profiler import record_function

from training.aux_models import micro_batch_logprobs
from training.colocated_teachers import student_pass
from training.heads import plain_head
from training.moe import routed, with_aux_loss

# (micro-batch index, log-probs [B, R], entropies [B, R], response logits [B, R, V] or None)
# -> the loss tensor to backpropagate
LossFn = Callable[[int, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class ModelRunner(Protocol):
    is_last_stage: bool  # this rank has the logits: it computes losses and statistics
    whole_model: bool  # this rank can run the model's whole forward by itself
    gives_heads: bool  # forward_backward(heads=True) gives loss_fn a ResponseHead, not logits
    packs: bool  # its passes run a micro-batch's packed rows (`mb.packed`) where it has them
    device: torch.device

    def logprobs(self, mbs: Sequence[Any], temperature: float, by_length: bool = False
                 ) -> list[torch.Tensor] | None: ...

    def forward_backward(self, mbs: Sequence[Any], temperature: float, loss_fn: LossFn,
                         with_logits: bool = False, by_length: bool = False,
                         heads: bool = False) -> None: ...

    def share(self, stats: dict[str, float]) -> dict[str, float]: ...


class TorchRunner:
    """A model with a whole forward (`model(input_ids=..., attention_mask=...).logits`), one
    micro-batch at a time."""

    is_last_stage = True
    whole_model = True
    packs = True  # micro_batch_logprobs / response_head run `mb.packed` where it is set

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device
        self.gives_heads = plain_head(model) is not None

    def logprobs(self, mbs: Sequence[Any], temperature: float, by_length: bool = False
                 ) -> list[torch.Tensor]:
        out = []
        with torch.no_grad(), record_function("rlx.recompute"):
            for mb in mbs:
                with routed(self.model, mb):  # a MoE policy: the micro-batch's routes
                    out.append(micro_batch_logprobs(self.model, mb, temperature, by_length,
                                                    False)[0])
        return out

    def forward_backward(self, mbs: Sequence[Any], temperature: float, loss_fn: LossFn,
                         with_logits: bool = False, by_length: bool = False,
                         heads: bool = False) -> None:
        for i, mb in enumerate(mbs):
            with routed(self.model, mb) as routing:  # a MoE policy: the micro-batch's routes
                with record_function("rlx.forward"):
                    if with_logits:  # the distribution terms need the logits (or the head)
                        logp, ent, logits = student_pass(self.model, mb, temperature, heads)
                    else:
                        (logp, ent), logits = micro_batch_logprobs(self.model, mb, temperature,
                                                                   by_length), None
                with record_function("rlx.loss"):
                    loss = with_aux_loss(loss_fn(i, logp, ent, logits), routing, mb)
                del logits  # what the loss terms' backward needs they keep: free [B, R, V] now
                with record_function("rlx.backward"):
                    loss.backward()

    def share(self, stats: dict[str, float]) -> dict[str, float]:
        return stats
