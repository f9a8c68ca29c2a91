"""The OPD loss terms from the student's and teachers' heads: no logits held.

Role: `training.step.opd_term_loss` computes the distribution terms of on-policy distillation
(top-k, top-p, full vocabulary: algos/opd.py) from the response logits [B, R, V] of the student
and of each colocated teacher. When the runner gives the student's head instead
(training/heads.py `ResponseHead`: hidden states and output weight) and the teachers theirs,
`opd_head_loss` computes the same terms with algos/loss_head.py, at the policy tokens only
(those with a teacher signal), chunk by chunk: nothing of size [B, R, V] is ever made.

The terms are those of `opd_term_loss`, term for term: for each distinct loss-term OPD config
of the micro-batch's samples, and each colocated teacher's rows (or the server replies' top-k),
the token sets are
- `top_k`: the k most likely ids of the student's or the teacher's distribution
  (`top_k_from`), the teacher read at them from its head; or a teacher's own top-k ids and
  log-probs (a server's reply, or a teacher of another vocabulary's, mapped to student ids);
- `top_p`: the nucleus the rollout recorded, where a token has one; the rest rebuilt from the
  student's detached logits (`top_p` < 1) or the whole vocabulary (`full`);
and each set's loss is sum_t w_t KL_t with `algos.opd.opd_weights` (kl_coef x the teacher's
coefficient over the sample's policy tokens and the step's samples), its gradient made in the
same pass (`head_weighted_set_kl`). Each teacher's KL per token is added to `sums` for the
per-teacher metrics. A config with `uld_coef` adds the sorted-probability term at the positions
a teacher of another vocabulary gave it (`sorted_term_loss`, shared with opd_term_loss).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from algos.cross_tokenizer import sorted_prob_distance
from algos.loss_head import head_top_k_ids, head_weighted_set_kl, same_rows, vocab_logits
from algos.opd import is_loss_term, opd_weights, teacher_kl_sums
from training.batching import MicroBatch
from training.colocated_teachers import OpdInputs, rows_with
from training.heads import ResponseHead

# a token set of one term: (its [B, R] mask, the keyword arguments of head_weighted_set_kl at
# the set's positions (rows b, columns j) as a function of them)
TermSet = tuple[torch.Tensor, Any]


def opd_head_loss(temperature: float, mb: MicroBatch, inp: OpdInputs, head: ResponseHead,
                  num_samples: int, sums: dict[str, list[float]] | None,
                  counts: dict[str, int] | None = None) -> torch.Tensor:
    """The OPD loss terms of one micro-batch (module docstring), a differentiable scalar in the
    student's head."""
    total = head.hidden.new_zeros((), dtype=torch.float32)
    teachers = [s.teacher for s in mb.samples]
    for config in {id(c): c for c in inp.configs if is_loss_term(c.mode)}.values():
        mask = inp.mask * rows_with(inp, config)[:, None]
        if not mask.any():
            continue
        sample_tokens = mask.sum(dim=1)  # a sample's mean spans all its tokens, whatever the set
        uld = sorted_term_loss(lambda b, j: vocab_logits(head.hidden[b, j], head.weight,
                                                         head.group),
                               config, mask, inp, num_samples, sample_tokens, temperature,
                               counts)
        if uld is not None:
            total = total + uld
        for part, args in _sets(config, mask, inp, head, counts):
            b, j = part.nonzero(as_tuple=True)
            if not len(b):
                continue
            w = opd_weights(part, inp.coef, num_samples, config.kl_coef, sample_tokens)[b, j]
            loss, kl = head_weighted_set_kl(head.hidden[b, j], head.weight, w,
                                            temperature=temperature, group=head.group,
                                            **args(b, j))
            total = total + loss
            if sums is not None:
                per_token = part.new_zeros(part.shape, dtype=kl.dtype)
                per_token[b, j] = kl
                teacher_kl_sums(per_token, part, teachers, sums)
    return total


def sorted_term_loss(rows_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     config: Any, mask: torch.Tensor, inp: OpdInputs, num_samples: int,
                     sample_tokens: torch.Tensor, temperature: float,
                     counts: dict[str, float] | None = None) -> torch.Tensor | None:
    """uld_coef x the sorted-probability distance (algos/cross_tokenizer.py
    `sorted_prob_distance`) between the student's distribution and a teacher of another
    vocabulary's top-k, at the positions of `mask` that have one (`inp.sorted_pos`), weighted
    as the OPD terms (over each sample's policy tokens and the step's samples);
    `rows_logits(b, j)`: the student's logits [m, V] at those positions, made only there.
    None when no position has one. Adds uld_tokens and uld_distance_sum to `counts`."""
    if not config.uld_coef or inp.sorted_pos is None:
        return None
    part = mask * inp.sorted_pos.to(mask.dtype)
    b, j = part.nonzero(as_tuple=True)
    if not len(b):
        return None
    d = sorted_prob_distance(rows_logits(b, j)[None], inp.sorted_logp[b, j][None],
                             torch.ones(1, len(b), device=part.device), temperature)[0]
    w = opd_weights(part, inp.coef, num_samples, config.uld_coef, sample_tokens)[b, j]
    if counts is not None:
        counts["uld_tokens"] += len(b)
        counts["uld_distance_sum"] += float(d.detach().sum())
    return (w.to(d.dtype) * d).sum()


def _sets(config: Any, mask: torch.Tensor, inp: OpdInputs, head: ResponseHead,
          counts: dict[str, int] | None) -> Iterator[TermSet]:
    """The token sets of one config's term (module docstring)."""
    if config.mode == "top_k" and inp.topk_rows is not None:
        # a teacher's own top-k: a server's reply, or mapped across vocabularies
        served = mask * inp.topk_rows.to(mask.dtype)[:, None]
        yield served, lambda b, j: {"mode": "top_k", "ids": inp.topk_ids[b, j],
                                    "teacher_logprobs": inp.topk_logp[b, j]}
        mask = mask - served
    if not inp.teacher_heads:
        if mask.any():
            raise ValueError(f"opd mode {config.mode!r} without colocated teachers of the "
                             f"student's vocabulary needs top-k replies (mode 'top_k', "
                             f"top_k_from 'teacher')")
        return
    for rows, teacher in inp.teacher_heads:
        part = mask * _row_mask(rows, mask)[:, None]
        local = torch.full((mask.shape[0],), -1, dtype=torch.long, device=mask.device)
        local[rows] = torch.arange(len(rows), device=mask.device)  # row in the teacher's batch
        yield from _teacher_sets(config, part, inp, head, teacher, local, counts)


def _teacher_sets(config: Any, part: torch.Tensor, inp: OpdInputs, head: ResponseHead,
                  teacher: ResponseHead, local: torch.Tensor,
                  counts: dict[str, int] | None) -> Iterator[TermSet]:
    # the teacher's output rows the student's rank holds (a whole teacher beside a student
    # whose vocabulary is split over tensor ranks: each rank reads its own rows of it)
    teacher_weight = same_rows(teacher.weight, head.weight, head.group)

    def side(b, j):  # the teacher's hidden states and weight at the positions
        return {"teacher_hidden": teacher.hidden[local[b], j], "teacher_weight": teacher_weight}

    if config.mode == "top_k":
        def top_k(b, j):
            h, w = ((head.hidden[b, j], head.weight) if config.top_k_from == "student"
                    else (teacher.hidden[local[b], j], teacher_weight))
            return {"mode": "top_k", "ids": head_top_k_ids(h.detach(), w, config.top_k,
                                                            group=head.group),
                    **side(b, j)}
        yield part, top_k
        return
    recorded = torch.zeros_like(part)
    if config.mode == "top_p" and inp.nucleus_rows is not None:
        recorded = part * inp.nucleus_tokens.to(part.dtype)
    if recorded.any():  # the nucleus each token was sampled from
        yield recorded, lambda b, j: {"mode": "top_p", "ids": inp.nucleus_ids[b, j],
                                      "valid": inp.nucleus_valid[b, j], **side(b, j)}
    rest = part - recorded
    top_p = config.top_p if config.mode == "top_p" else 1.0
    if top_p < 1 and counts is not None and rest.any():
        counts["student_nucleus_samples"] += int((rest.sum(1) > 0).sum())
    mode = "top_p" if top_p < 1 else "full"  # the nucleus rebuilt from the student's logits
    yield rest, lambda b, j: {"mode": mode, "top_p": top_p, **side(b, j)}


def _row_mask(rows: list[int], mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(mask.shape[0], dtype=mask.dtype, device=mask.device)
    out[rows] = 1
    return out
