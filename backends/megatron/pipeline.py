"""Pipeline-parallel log-probs and training step through megatron's forward_backward schedule.

Role: with PP > 1 no rank holds a whole forward, so `MegatronCausalLM.forward` is unavailable;
`pipeline_logprobs` and `pipeline_train_step` run the project's log-prob definition
(algos.logprobs) and GRPO/PPO-clip loss (algos) on the last stage, inside megatron's 1F1B
schedule (`get_forward_backward_func`), which moves activations and gradients between stages.
Invariant: on the same weights and samples the loss, gradient norm and updated weights equal
`training.step.train_on_batch` on a single-stage model (up to float summation order). Every
rank of the job passes the same samples; each stage reads only what it needs.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from algos.advantages import WHITENED, sample_scores, token_advantages, whiten_sums, whiten_with
from algos.logprobs import response_logprobs
from algos.mismatch import correction_weights
from algos.policy_loss import masked_sample_sum, ppo_clip_loss
from backends.megatron.mcore import get_forward_backward_func, parallel_state
from backends.megatron.model import MegatronCausalLM, blocked_attention
from backends.megatron.parallel import allreduce_tied_embedding_grads, clip_grad_norm
from training.batching import MicroBatch, make_micro_batch
from training.data_parallel import plan_micro_batches


def _response_logprobs(logits: torch.Tensor, mb, temperature: float):
    """Response-aligned (log-probs, entropies) from full logits [B, L, V]."""
    return response_logprobs(logits[:, :-1], mb.input_ids, mb.prompt_lens, mb.num_response_cols,
                             temperature)[:2]


def _forward_step(data_iterator, model, loss_for=None):
    """megatron's forward_step_func: one micro-batch through this stage."""
    mb, extra = next(data_iterator)
    positions = torch.arange(mb.input_ids.shape[1], device=mb.input_ids.device)
    out = model(mb.input_ids, positions.expand_as(mb.input_ids),
                blocked_attention(mb.attention_mask), runtime_gather_output=True)
    return out, (partial(loss_for, mb, extra) if loss_for is not None else None)


def _run(model: MegatronCausalLM, mbs: list[MicroBatch], extras: list, loss_for,
         forward_only: bool) -> list:
    """The schedule over `mbs`; what the last stage collected per micro-batch (else [])."""
    model.core.config.variable_seq_lengths = True  # micro-batches differ in length
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, loss_for=loss_for),
        data_iterator=iter(list(zip(mbs, extras))), model=[model.module],
        num_microbatches=len(mbs), seq_length=max(mb.input_ids.shape[1] for mb in mbs),
        micro_batch_size=max(len(mb.samples) for mb in mbs), forward_only=forward_only)


def pipeline_logprobs(model: MegatronCausalLM, mbs: list[MicroBatch], temperature: float
                      ) -> list[torch.Tensor] | None:
    """Response-aligned log-probs per micro-batch on the last stage, None on other stages."""
    with torch.no_grad():
        outputs = _run(model, mbs, [None] * len(mbs), None, forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return [_response_logprobs(out, mb, temperature)[0] for out, mb in zip(outputs, mbs)]


def _loss(cfg, num_samples: int, num_mbs: int, mb: MicroBatch, extra, logits: torch.Tensor):
    """The trainer's per-micro-batch loss (PPO-clip + entropy bonus), times the number of
    micro-batches because the schedule divides by it."""
    old_lp, adv = extra
    logp, ent = _response_logprobs(logits, mb, cfg.temperature)
    weights, keep = correction_weights(old_lp, mb.rollout_logp, mb.mask, cfg.mismatch)
    terms = ppo_clip_loss(logp, old_lp, adv, keep, num_samples, cfg.eps_clip, cfg.eps_clip_high,
                          cfg.dual_clip_c, weights)
    loss = terms.loss - cfg.entropy_coef * masked_sample_sum(ent, keep) / num_samples
    return loss * num_mbs, {"loss": terms.loss.detach()}


def _check_supported(cfg) -> None:
    """ValueError for options that need a second model (critic, reference) in the pipeline."""
    if cfg.estimator == "ppo" or cfg.use_kl_loss or cfg.kl_in_reward:
        raise ValueError("the pipeline-parallel step has no critic or reference model: use a "
                         "critic-free advantage_estimator and kl_coef only with the torch backend "
                         "or pipeline_model_parallel_size = 1")


def _advantages(samples, plan: list[list[int]], mbs: list[MicroBatch], cfg) -> list:
    """Token advantages per micro-batch, as training.step.prepare computes them."""
    est = cfg.estimator
    scores = sample_scores(est, [s.reward for s in samples], [s.group_id for s in samples])
    adv = [token_advantages(est, scores[idx].to(mb.mask.device), mb.mask, None, cfg.kl_coef,
                            None, cfg.gamma, cfg.gae_lambda)[0] for idx, mb in zip(plan, mbs)]
    if est in WHITENED:
        sums = sum(whiten_sums(a, mb.mask) for a, mb in zip(adv, mbs)).cpu()
        adv = [whiten_with(a, mb.mask, sums) for a, mb in zip(adv, mbs)]
    return adv


def pipeline_train_step(model: MegatronCausalLM, optimizer: torch.optim.Optimizer, samples,
                        cfg, pad_id: int) -> dict[str, float]:
    """One policy step over the pipeline: recompute old log-probs, 1F1B forward/backward, tied
    embedding gradient sync, global clipping, optimizer step. Returns loss and grad norm."""
    _check_supported(cfg)
    device = next(model.parameters()).device
    model.eval()
    plan = plan_micro_batches(samples, cfg.micro_batch_size, cfg.max_tokens_per_mb).micro_batches
    mbs = [make_micro_batch([samples[i] for i in idx], pad_id).to(device) for idx in plan]
    if cfg.mismatch.bypass:
        old = [mb.rollout_logp for mb in mbs]
    else:
        old = pipeline_logprobs(model, mbs, cfg.temperature) or [None] * len(mbs)
    extras = list(zip(old, _advantages(samples, plan, mbs, cfg)))
    optimizer.zero_grad(set_to_none=True)
    collected = _run(model, mbs, extras, partial(_loss, cfg, len(samples), len(mbs)),
                     forward_only=False)
    allreduce_tied_embedding_grads(model)
    grad_norm = clip_grad_norm(model, cfg.grad_clip)
    optimizer.step()
    loss = torch.tensor([sum(float(c["loss"]) for c in collected)], device=device)
    dist.broadcast(loss, parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return {"train/loss": float(loss), "train/grad_norm": grad_norm}
