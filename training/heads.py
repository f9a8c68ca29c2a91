"""A model's output head as hidden states and weight, so the trainer never holds the logits.

Role: at a vocabulary of 150k, one micro-batch's logits [B, R, V] and their float32 copies are
most of a step's memory. A causal LM's logits are z = h W^T, h its final hidden states and W its
output layer's weight, so every quantity the step needs (the response tokens' log-probs and
entropies, every OPD set KL) is computed by `algos/loss_head.py` from (h, W), chunk by chunk.

- `response_head(model, mb)`: one forward of the model in which the output layer sees only the
  response positions' hidden states and computes nothing (a pre-hook on
  `get_output_embeddings()` records them and hands the layer an empty tensor): the hidden
  states [B, R, H] (column j of row b: the position predicting response token j, as
  `algos.logprobs.response_slice`) and W [V, H]. Gradients flow to both when called with grad.
  Works on a skeleton with `params` (a colocated teacher's weight set) as well. A micro-batch
  with packed rows (`mb.packed`, `micro_batches.pack`) and no `params` runs one packed forward
  (training/packing.py) instead, and the response positions' hidden states are gathered from
  the rows: the same [B, R, H], so the head functions are the same and no logits are made.
- `plain_head(model)`: the output layer when it is a bias-free `nn.Linear` whose output is the
  model's logits as they are (no soft-capping or logit scaling in its config): the models this
  project trains (Qwen2/Qwen3/Llama and the tiny test models). Other models keep the logits
  path: `response_logits`, the same forward with the output layer applied to the response
  positions only.
- `head_response_logprobs(head, mb, T)`: the response tokens' log-probs and entropies [B, R],
  the values `algos.logprobs.response_logprobs` gives, float32.
Invariant: for the same weights, the values equal the logits path's up to float summation order
(the product h W^T is the output layer's, in the model's dtype).
"""

from __future__ import annotations

from typing import Any

import torch

from algos.logprobs import position_ids_from_mask, response_slice, response_tokens
from algos.loss_head import ResponseHead, response_head_logprobs
from training.batching import MicroBatch
from training.packing import (
    PackedBatch,
    attention_mechanism,
    packed_forward,
    packed_response_logits,
    response_positions,
)

# config attributes that rescale a model's logits after its output layer (their neutral value)
LOGIT_RESCALES = {"final_logit_softcapping": None, "logit_scale": None, "logits_scaling": 1.0,
                  "output_multiplier_scale": None}


def plain_head(model: Any) -> torch.nn.Module | None:
    """The model's output layer if z = h W^T is its logits as they are, else None: a bias-free
    `nn.Linear`, or a vocabulary-parallel head (`vocab_parallel`: `weight` this rank's rows,
    `group` their process group; the megatron backend's VocabParallelHead)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    linear = isinstance(head, torch.nn.Linear) and head.bias is None
    if not (linear or getattr(head, "vocab_parallel", False)):
        return None
    config = getattr(model, "config", None)
    for name, neutral in LOGIT_RESCALES.items():
        if getattr(config, name, neutral) not in (neutral, None):
            return None
    return head


def response_head(model: Any, mb: MicroBatch, params: dict | None = None) -> ResponseHead | None:
    """(hidden [B, R, H], W [V, H]) of one forward of `model` (on `params`, a skeleton's
    weights, if given) over the micro-batch, the output layer computing nothing; None for a
    model without a plain head (`plain_head`)."""
    head = plain_head(model)
    if head is None:
        return None
    seen: list[ResponseHead] = []

    def record(module, hidden):
        # under functional_call: the set's weight
        seen.append(ResponseHead(hidden, module.weight, getattr(module, "group", None)))
        return hidden[:, :0]  # the layer makes [B, 0, V]: nothing

    if mb.packed is not None and params is None:
        return packed_response_head(model, head, mb.packed, record, seen)
    _through_head(model, head, mb, params, record)
    return seen[0]


def packed_response_head(model: Any, head: torch.nn.Module, packed: PackedBatch, record: Any,
                         seen: list[ResponseHead]) -> ResponseHead:
    """`response_head` on the packed rows of a micro-batch (training/packing.py): one packed
    forward, the output layer's input cut to the response positions' hidden states [B, R, H]
    (gathered from the rows, in the samples' order) before `record` takes them."""
    mechanism = attention_mechanism(model)
    flat = mechanism == "varlen"

    def select(module, args):
        hidden = args[0]
        width = packed.num_tokens if flat else packed.input_ids.shape[1]
        if hidden.dim() != 3 or hidden.shape[1] != width:
            raise RuntimeError(f"the output head saw hidden states {tuple(hidden.shape)}, not "
                               f"one per packed position (width {width})")
        return (record(module, response_positions(hidden, packed, flat)),) + tuple(args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        packed_forward(model, packed, mechanism)
    finally:
        handle.remove()
    return seen[0]


def response_logits(model: Any, mb: MicroBatch, params: dict | None = None) -> torch.Tensor:
    """Response-aligned logits [B, R, V] (row b, column j: the logits predicting response token
    j), in the model's dtype. The output head is applied to the response positions' hidden
    states only, so no [B, L, V] tensor is made; a model without that module gives
    `response_slice(forward_logits(...))`. Packed rows (`mb.packed`, no `params`): from one
    packed forward (training/packing.py `packed_response_logits`)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if mb.packed is not None and params is None:
        return packed_response_logits(model, mb.packed)
    if not isinstance(head, torch.nn.Module):
        return response_slice(forward_logits(model, mb, params), mb.prompt_lens,
                              mb.num_response_cols)
    return _through_head(model, head, mb, params, lambda _module, hidden: hidden).logits


def forward_logits(model: Any, mb: MicroBatch, params: dict | None = None) -> torch.Tensor:
    """Next-token logits [B, L-1, V] of a micro-batch (optionally on `params` of a skeleton)."""
    return _call(model, mb, params).logits[:, :-1]


def _through_head(model: Any, head: torch.nn.Module, mb: MicroBatch, params: dict | None,
                  on_hidden: Any) -> Any:
    """The model's output for the micro-batch, its output layer (`head`) fed
    `on_hidden(head, response hidden states [B, R, H])` instead of every position's (a
    forward pre-hook)."""
    def select(module, args):
        hidden = args[0]
        if hidden.dim() != 3 or hidden.shape[1] != mb.input_ids.shape[1]:
            raise RuntimeError(f"the output head saw hidden states {tuple(hidden.shape)}, not "
                               f"one per input position {tuple(mb.input_ids.shape)}")
        response = response_slice(hidden[:, :-1], mb.prompt_lens, mb.num_response_cols)
        return (on_hidden(module, response),) + tuple(args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        return _call(model, mb, params)
    finally:
        handle.remove()


def _call(model: Any, mb: MicroBatch, params: dict | None) -> Any:
    kwargs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask,
              "position_ids": position_ids_from_mask(mb.attention_mask), "use_cache": False}
    if params is None:
        return model(**kwargs)
    return torch.func.functional_call(model, params, args=(), kwargs=kwargs)


def head_response_logprobs(head: ResponseHead, mb: MicroBatch, temperature: float,
                           with_entropy: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response-aligned [B, R] (log-probs, entropies or None) of the response tokens, float32,
    differentiable in the head (algos/loss_head.py `response_head_logprobs`)."""
    return response_head_logprobs(head, response_tokens(mb), temperature, with_entropy,
                                  token_bounds=mb.token_bounds)
