"""The model runner of pipeline-parallel megatron: the train step's passes through megatron's
schedule.

Role: with PP > 1 no rank holds a whole forward, so `MegatronCausalLM.forward` is unavailable.
`PipelineRunner` gives the train step (`training.step.train_on_batch`, through its
`ModelRunner` interface, training/runner.py) its two model passes, run by megatron's 1F1B
schedule (`get_forward_backward_func`), which moves activations and gradients between stages:
- `logprobs`: a no-grad pass; the last stage returns the response-aligned log-probs per
  micro-batch (`algos.logprobs.response_logprobs`, the project's one definition), other
  stages None;
- `forward_backward`: forward and backward of every micro-batch; on the last stage the step's
  loss callback gets each micro-batch's log-probs, entropies and, when asked, response logits,
  and returns the loss the schedule backpropagates; afterwards tied embedding gradients are
  summed between the first and last stage.
`share` broadcasts the last stage's statistics to every stage, so global rank 0 reports them.
Micro-batches are taken duck-typed (`input_ids`, `attention_mask`, `prompt_lens`,
`num_response_cols`, `samples`): planning and the algorithm stay in training/.
Invariant: on the same weights and samples the step through this runner equals the step on a
single-stage model (up to float summation order). Every rank of the job passes the same samples;
each stage reads only what it needs.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from algos.logprobs import response_logprobs
from backends.megatron.mcore import get_forward_backward_func, parallel_state
from backends.megatron.model import MegatronCausalLM, blocked_attention
from backends.megatron.parallel import allreduce_tied_embedding_grads


def _response(logits: torch.Tensor, mb: Any, temperature: float):
    """Response-aligned (log-probs, entropies, logits) from a stage's full logits [B, L, V]."""
    return response_logprobs(logits[:, :-1], mb.input_ids, mb.prompt_lens, mb.num_response_cols,
                             temperature)


def _forward_step(data_iterator, model, loss_for=None):
    """megatron's forward_step_func: one micro-batch through this stage."""
    i, mb = next(data_iterator)
    positions = torch.arange(mb.input_ids.shape[1], device=mb.input_ids.device)
    out = model(mb.input_ids, positions.expand_as(mb.input_ids),
                blocked_attention(mb.attention_mask), runtime_gather_output=True)
    return out, (partial(loss_for, i, mb) if loss_for is not None else None)


class PipelineRunner:
    """The train step's model passes over megatron's pipeline schedule (any PP, TP)."""

    whole_model = False
    gives_heads = False  # its loss callback gets the gathered logits

    def __init__(self, model: MegatronCausalLM):
        self.model = model
        self.device = next(model.parameters()).device
        self.is_last_stage = parallel_state.is_pipeline_last_stage()

    def _run(self, mbs: Sequence[Any], loss_for: Callable | None, forward_only: bool) -> list:
        """The schedule over `mbs`; what the last stage collected per micro-batch (else [])."""
        self.model.core.config.variable_seq_lengths = True  # micro-batches differ in length
        return get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss_for=loss_for),
            data_iterator=iter(list(enumerate(mbs))), model=[self.model.module],
            num_microbatches=len(mbs), seq_length=max(mb.input_ids.shape[1] for mb in mbs),
            micro_batch_size=max(len(mb.samples) for mb in mbs), forward_only=forward_only)

    def logprobs(self, mbs: Sequence[Any], temperature: float, by_length: bool = False
                 ) -> list[torch.Tensor] | None:
        """Response-aligned log-probs per micro-batch on the last stage, None on other stages.
        (`by_length` is not used: megatron forwards padded micro-batches.)"""
        with torch.no_grad():
            outputs = self._run(mbs, None, forward_only=True)
        if not self.is_last_stage:
            return None
        return [_response(out, mb, temperature)[0] for out, mb in zip(outputs, mbs)]

    def forward_backward(self, mbs: Sequence[Any], temperature: float, loss_fn: Callable,
                         with_logits: bool = False, by_length: bool = False,
                         heads: bool = False) -> None:
        """Forward and backward of every micro-batch; `loss_fn(i, logp, ent, logits or None)`
        on the last stage gives micro-batch i's loss. Tied embedding gradients summed after."""
        num_mbs = len(mbs)

        def loss_for(i: int, mb: Any, logits: torch.Tensor):
            logp, ent, resp_logits = _response(logits, mb, temperature)
            loss = loss_fn(i, logp, ent, resp_logits if with_logits else None)
            # the schedule divides each micro-batch's loss by their number: undone here, the
            # step's losses are already normalised over the whole step
            return loss * num_mbs, {"loss": loss.detach()}

        self._run(mbs, loss_for, forward_only=False)
        allreduce_tied_embedding_grads(self.model)

    def share(self, stats: dict[str, float]) -> dict[str, float]:
        """The last stage's statistics on every stage of this pipeline."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return stats
        box = [stats]
        dist.broadcast_object_list(box, parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        return box[0]
