"""The model runner of pipeline-parallel megatron: the train step's passes through megatron's
schedule.

Role: with PP > 1 no rank holds a whole forward, so `MegatronCausalLM.forward` is unavailable.
`PipelineRunner` gives the train step (`training.step.train_on_batch`, through its
`ModelRunner` interface, training/runner.py) its two model passes, run by megatron's 1F1B
schedule (`get_forward_backward_func`), which moves activations and gradients between stages:
- `logprobs`: a no-grad pass; the last stage returns the response-aligned log-probs per
  micro-batch, other stages None;
- `forward_backward`: forward and backward of every micro-batch; on the last stage the step's
  loss callback gets each micro-batch's log-probs, entropies and, when asked, the response
  positions' head (`heads`) or logits, and returns the loss the schedule backpropagates;
  afterwards tied embedding gradients are summed between the first and last stage.
At cp = 1 the last stage's output layer computes nothing: the final hidden states at the
response positions and its tensor rank's rows of the output weight (a ResponseHead) give every
value through algos/loss_head.py (`_head_step`), so neither pass makes the logits; with context
parallelism the last stage gathers its chunks' logits (`algos.logprobs.response_logprobs`).
`share` broadcasts the last stage's statistics to every stage, so global rank 0 reports them.
Micro-batches are taken duck-typed (`input_ids`, `attention_mask`, `prompt_lens`,
`num_response_cols`, `samples`): planning and the algorithm stay in training/.
A mixture-of-experts model's routing object (model.py MegatronRouting, `model.routing`) is
given each micro-batch's layout right before its forward on every stage (routing replay, route
metrics, the load-balancing loss of each stage's routers).
With context parallelism each CP rank's stages run its load-balanced chunks of every sequence
(context_parallel.py `split_batch`): the activations between stages are that share, and the
last stage gathers its logits into whole sequences (`gather_from_cp`) for the loss.
Invariant: on the same weights and samples the step through this runner equals the step on a
single-stage model (up to float summation order). Every rank of the job passes the same samples;
each stage reads only what it needs.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from algos.logprobs import response_logprobs, response_slice, response_tokens
from algos.loss_head import ResponseHead, response_head_logprobs
from backends.megatron.context_parallel import gather_from_cp, padded_length, split_batch
from backends.megatron.mcore import Float16Module, get_forward_backward_func, parallel_state
from backends.megatron.model import (
    MegatronCausalLM,
    blocked_attention,
    final_hidden,
    layer_mask,
    pad_to_split,
)
from backends.megatron.parallel import allreduce_tied_embedding_grads


def _response(logits: torch.Tensor, mb: Any, temperature: float):
    """Response-aligned (log-probs, entropies, logits) from a stage's full logits [B, L, V]."""
    return response_logprobs(logits[:, :-1], mb.input_ids, mb.prompt_lens, mb.num_response_cols,
                             temperature)


def _forward_step(data_iterator, model, loss_for=None, routing=None, head=None):
    """megatron's forward_step_func: one micro-batch through this stage (a MoE model's routing
    set to its layout first; rows padded to the sequence-parallel split, the logits cut).
    `head` (the last stage, cp = 1): its output layer computes nothing, and the loss callback
    (or, without one, `head` itself: the no-grad pass's per-token output) gets the response
    positions' ResponseHead instead of logits (`_head_step`)."""
    i, mb = next(data_iterator)
    if head is not None and parallel_state.is_pipeline_last_stage():
        return _head_step(i, mb, model, loss_for, routing, head)
    if routing is not None:
        routing.set_batch([(getattr(mb, "routes", None), mb.attention_mask.bool())])
    config = model.config if hasattr(model, "config") else model.module.config
    width = mb.input_ids.shape[1]
    if config.context_parallel_size > 1:  # this CP rank's chunks; whole sequences at the end
        batch = split_batch(mb.input_ids, mb.attention_mask)
        out = model(batch.input_ids, batch.position_ids, batch.attention_mask,
                    runtime_gather_output=True)
        if parallel_state.is_pipeline_last_stage():
            out = gather_from_cp(out, 1, batch.length)
        return out, (partial(loss_for, i, mb) if loss_for is not None else None)
    ids, mask = pad_to_split(config, mb.input_ids, mb.attention_mask)
    positions = torch.arange(ids.shape[1], device=ids.device)
    out = model(ids, positions.expand_as(ids), layer_mask(model, blocked_attention(mask), False),
                runtime_gather_output=True)
    if parallel_state.is_pipeline_last_stage() and out.shape[1] != width:
        out = out[:, :width]
    return out, (partial(loss_for, i, mb) if loss_for is not None else None)


def _head_step(i: int, mb: Any, model, loss_for, routing, head: "_Head"):
    """The last stage's forward of micro-batch i through its output head: the final hidden
    states at the response positions and this tensor rank's rows of the output weight
    (model.py VocabParallelHead) as a ResponseHead, no logits made. Returns (what the schedule
    keeps or backpropagates through the loss callback: the callback given the head, or without
    one `head.values`, the pass's per-token values)."""
    if routing is not None:
        routing.set_batch([(getattr(mb, "routes", None), mb.attention_mask.bool())])
    core = model.module if isinstance(model, Float16Module) else model
    ids, mask = pad_to_split(core.config, mb.input_ids, mb.attention_mask)
    positions = torch.arange(ids.shape[1], device=ids.device)
    out: list[torch.Tensor] = []
    hidden = final_hidden(core, lambda: out.append(model(
        ids, positions.expand_as(ids), layer_mask(core, blocked_attention(mask), False),
        runtime_gather_output=True)))
    hidden = hidden.transpose(0, 1)[:, :mb.input_ids.shape[1] - 1]
    empty = out[0]  # the output layer's [B, 0, V]: what the schedule passes the loss callback
    response = ResponseHead(response_slice(hidden, mb.prompt_lens, mb.num_response_cols),
                            head.weight, head.group)
    if loss_for is None:
        return head.values(mb, response), None
    return empty, partial(loss_for, i, mb, response)


class _Head:
    """The last stage's head (`_head_step`): the model's VocabParallelHead weight and group,
    and what a no-grad pass keeps per micro-batch (the response tokens' log-probs)."""

    def __init__(self, model: MegatronCausalLM, temperature: float = 1.0):
        self.weight, self.group = model.lm_head.weight, model.lm_head.group
        self.temperature = temperature

    def values(self, mb: Any, response: ResponseHead) -> torch.Tensor:
        return response_head_logprobs(response, response_tokens(mb), self.temperature,
                                      with_entropy=False, token_bounds=mb.token_bounds)[0]


class PipelineRunner:
    """The train step's model passes over megatron's pipeline schedule (any PP, TP)."""

    whole_model = False

    def __init__(self, model: MegatronCausalLM):
        self.model = model
        self.device = next(model.parameters()).device
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        # the last stage's passes through the loss head (no logits), except with context
        # parallelism, whose last stage gathers its chunks' logits
        self.gives_heads = model.core.config.context_parallel_size == 1

    def _head(self, temperature: float) -> "_Head | None":
        """The last stage's head (the other stages hold no output layer)."""
        return _Head(self.model, temperature) if self.is_last_stage else None

    def _run(self, mbs: Sequence[Any], loss_for: Callable | None, forward_only: bool,
             head: "_Head | None" = None) -> list:
        """The schedule over `mbs`; what the last stage collected per micro-batch (else [])."""
        self.model.core.config.variable_seq_lengths = True  # micro-batches differ in length
        routing = getattr(self.model, "routing", None)  # a MoE model's (MegatronRouting)
        config = self.model.core.config
        tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
        longest = max(mb.input_ids.shape[1] for mb in mbs)
        # what a stage sends: its tokens of the longest micro-batch (under context parallelism
        # its share of the sequence padded to 2 * cp chunks)
        seq = padded_length(longest, cp) // cp if cp > 1 else -(-longest // tp) * tp
        try:
            return get_forward_backward_func()(
                forward_step_func=partial(_forward_step, loss_for=loss_for, routing=routing,
                                          head=head),
                data_iterator=iter(list(enumerate(mbs))), model=[self.model.module],
                num_microbatches=len(mbs),
                seq_length=seq,
                micro_batch_size=max(len(mb.samples) for mb in mbs), forward_only=forward_only)
        finally:
            if routing is not None:
                routing.clear()

    def logprobs(self, mbs: Sequence[Any], temperature: float, by_length: bool = False
                 ) -> list[torch.Tensor] | None:
        """Response-aligned log-probs per micro-batch on the last stage, None on other stages.
        (`by_length` is not used: megatron forwards padded micro-batches.)"""
        head = self._head(temperature) if self.gives_heads else None
        with torch.no_grad():
            outputs = self._run(mbs, None, forward_only=True, head=head)
        if not self.is_last_stage:
            return None
        if head is not None:  # each micro-batch's log-probs, made on the last stage
            return list(outputs)
        return [_response(out, mb, temperature)[0] for out, mb in zip(outputs, mbs)]

    def forward_backward(self, mbs: Sequence[Any], temperature: float, loss_fn: Callable,
                         with_logits: bool = False, by_length: bool = False,
                         heads: bool = False) -> None:
        """Forward and backward of every micro-batch; `loss_fn(i, logp, ent, logits or None)`
        on the last stage gives micro-batch i's loss. Tied embedding gradients summed after."""
        num_mbs = len(mbs)
        cp = self.model.core.config.context_parallel_size

        use_head = heads and self.gives_heads

        def loss_for(i: int, mb: Any, logits: torch.Tensor | ResponseHead,
                     _output: torch.Tensor | None = None):
            if use_head:  # logits: the ResponseHead (`_head_step`), its loss terms from it
                logp, ent = response_head_logprobs(logits, response_tokens(mb), temperature,
                                                   token_bounds=mb.token_bounds)
                loss = loss_fn(i, logp, ent, logits if with_logits else None)
            else:
                logp, ent, resp_logits = _response(logits, mb, temperature)
                loss = loss_fn(i, logp, ent, resp_logits if with_logits else None)
            # the schedule divides each micro-batch's loss by their number and multiplies it
            # by the CP size (megatron's CP ranks each take the loss of their own tokens; here
            # each has the whole sequence's, from gathered logits): both undone, the step's
            # losses are already normalised over the whole step
            return loss * num_mbs / cp, {"loss": loss.detach()}

        self._run(mbs, loss_for, forward_only=False,
                  head=self._head(temperature) if use_head else None)
        allreduce_tied_embedding_grads(self.model)

    def share(self, stats: dict[str, float]) -> dict[str, float]:
        """The last stage's statistics on every stage of this pipeline."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return stats
        box = [stats]
        dist.broadcast_object_list(box, parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        return box[0]
