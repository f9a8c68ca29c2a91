"""On-policy distillation (OPD) signals at four granularities, as pure tensor functions.

Notation: the student pi_theta samples response tokens x_t at the rollout temperature T; every
log-prob below, student's and teacher's, is `log_softmax(logits / T)` (`algos.logprobs`, T = 0
counts as 1); m_t is the response mask (1 = policy token); beta = `kl_coef`.

Modes (`OPD_MODES`):
- `sampled` (a reward): `r_t = log pi_theta(x_t) - log pi_T(x_t)` on the student's own sampled
  token (the one-sample estimate of KL(pi_theta || pi_T) at position t), detached, and folded
  into the advantage: `A'_t = (A_t - beta * r_t) * m_t` (A = 0 for pure distillation). The
  gradient then comes from the policy loss, as for any advantage.
- `top_p`, `top_k`, `full` (differentiable loss terms): an exact reverse KL over a token set S_t
  of both distributions renormalised over S_t,
      `p_S(v) = p(v) / sum_{u in S_t} p(u)`, `q_S(v) = q(v) / sum_{u in S_t} q(u)` (v in S_t),
      `KL_t = sum_{v in S_t} p_S(v) * (log p_S(v) - log q_S(v))`,
  with p = pi_theta (gradient flows to the student logits), q = pi_T (detached). The loss adds
  `beta * sum_i (sum_t KL_t m_t / sum_t m_t) / num_samples_in_step` (the sample mean of
  `algos.policy_loss`, so micro-batches and DP ranks add up to the one-batch gradient).
  They are loss terms, not rewards, because the KL over a set is computed exactly: its gradient
  needs no sampling (no variance) and no advantage whitening may rescale it. The three are one
  loss at three set choices, so top_p = 1 and top_k = V are exactly `full`:
  * `full`: S_t = the whole vocabulary;
  * `top_p`: S_t = the nucleus the rollout sampled x_t from: with the sampling distribution at
    temperature T sorted descending, p_(1) >= p_(2) >= ..., the first n tokens for the smallest
    n with p_(1) + ... + p_(n) >= top_p. The rollout records it per token (`Sample.rollout_
    nucleus_*`: the worker's top log-probs up to that mass, engine/sampling.py `nucleus`), so
    S_t is the set the token really came from, whatever the staleness (`ids_reverse_kl` on the
    recorded ids). Tokens without a recorded nucleus (a sample without a record, or a token
    whose nucleus held more tokens than the rollout's top log-probs) fall back to the set
    rebuilt from `nucleus_logits` (by default the student's current logits, detached; every
    token tied with p_(n) is kept too), which is the rollout's only for samples of the current
    weights; each sample's KL mean still divides by all its policy tokens;
  * `top_k`: S_t = k token ids per position, chosen by `top_k_from`:
    - "student" (default, the source's definition): the k most likely tokens of the student's
      sampling distribution at t (its current logits, detached); the teacher is read at those
      ids from its logits, so this needs a colocated teacher (a teacher server returns log-probs
      only for its own top-k or for the sequence's tokens, not for per-position id lists);
    - "teacher": the teacher's k most likely tokens, as a teacher server returns them with
      `top_logprobs_num = k` (ids and teacher log-probs), or from a colocated teacher's logits.
    The teacher side is renormalised from its k values alone, the student side from its logits
    gathered at those ids. Server log-probs computed at another temperature T' are rescaled
    exactly (`teacher_temperature`): `log_softmax(lp' * T' / T)` over S_t, since the
    renormalisation cancels the server's normaliser.
  The two top-k objectives differ: the teacher's top-k may hold tokens the student gives almost
  no mass, the student's top-k holds exactly the tokens it would sample.
Top-p replay (`top_p_replay`, the source's top-p sampling replay): the log-probs of the policy
gradient (training, proximal and rollout) are those of the distribution the token was sampled
from, renormalised over the recorded nucleus N_t: `log p(x_t) - log sum_{v in N_t} p(v)`
(`nucleus_logprobs`); the rollout's from the mass of its top log-probs (`Sample.rollout_nucleus_
logmass`). In `sampled` mode the teacher's log-prob of r_t is renormalised over N_t too (a
colocated teacher: `z_x / T - logsumexp_{v in N_t} z_v / T` from its logits), so that r_t
compares the two distributions the token could have been sampled from, as the source's teacher
forward does under replay; a teacher server returns only the sampled token's log-prob, so
with one r_t stays the whole-vocabulary gap on both sides (the source pairs its sglang
teachers' whole-vocabulary log-prob with the replayed student's, which adds -log p(N_t) to r_t).
A token without a nucleus (rollout top_p = 1, or the fallback above) keeps its plain log-probs.
Arithmetic is float32 (float64 when the student logits are float64).
Gradient of the set KL (z = student logits):
`dKL_t / dz_v = p_S(v) * (log p_S(v) - log q_S(v) - KL_t) / T` for v in S_t, 0 outside.

Which modes need teacher logits: `top_p` and `full` always (a colocated teacher forward);
`top_k` with `top_k_from = "student"`; `sampled` and teacher-chosen `top_k` work from teacher
server replies (input log-probs, top log-probs).

Memory: `full` and the fallback `top_p` never build a [B, T, V] temporary: they walk the masked
positions in chunks of about `CHUNK_ELEMENTS` logits (a whole row when the vocabulary is smaller,
else slices of the vocabulary with a streamed log-sum-exp), forward and backward. The trainer's
form (`weighted_set_kl`) takes the term's per-position weights, computes the gradient during the
forward, chunk by chunk, and keeps only that gradient (one [B, T, V] tensor in the student's
dtype): the teacher's logits are free as soon as the term is built, before the backward. The
set forms (`ids_reverse_kl`: top-k, recorded nuclei) gather [B, T, k] values and keep nothing
larger.
Invariant: no function changes its inputs; teacher values never receive gradient; every
per-position result is 0 off the mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from algos.logprobs import effective_temperature
from algos.opd_config import (  # noqa: F401 - the settings: also read from here
    OPD_MODES,
    SERVER_MODES,
    TEACHER_LOGIT_MODES,
    TOP_K_FROM,
    OpdConfig,
    check_placement,
    is_loss_term,
    needs_teacher_logits,
)
from algos.policy_loss import masked_sample_sum

CHUNK_ELEMENTS = 1 << 22  # logits per chunk in the full / top_p KL (16 MiB per fp32 temporary)


def chunk_size(numel: int, vocab: int, requested: int | None = None) -> int:
    """Logits per chunk: `requested`, else CHUNK_ELEMENTS, but no more than 1/16 of the
    tensor (so that small tensors are chunked too) and no less than one row (up to
    CHUNK_ELEMENTS)."""
    if requested is not None:
        return max(1, int(requested))
    return max(min(vocab, CHUNK_ELEMENTS), min(CHUNK_ELEMENTS, numel // 16))


# --- sampled token: a reward -------------------------------------------------------------------

def sampled_log_ratio(student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """r_t = log pi_theta(x_t) - log pi_T(x_t) on sampled tokens, [B, T], detached, 0 off-mask."""
    with torch.no_grad():
        dtype = torch.promote_types(student_logp.dtype, torch.float32)
        r = student_logp.to(dtype) - teacher_logp.to(dtype)
        return torch.where(mask.bool(), r, torch.zeros_like(r))


def token_logprobs_chunked(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                           chunk_elements: int | None = None) -> torch.Tensor:
    """log_softmax(logits / T)[targets], [B, T] float32 (float64 for float64 logits), no grad,
    computed over chunks of rows: no float32 copy of the whole [B, T, V] logits."""
    t = effective_temperature(temperature)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    out = torch.empty(tgt.shape, dtype=dtype, device=logits.device)
    V = max(1, logits.shape[-1])
    step = max(1, chunk_size(logits.numel(), V, chunk_elements) // V)
    with torch.no_grad():
        for s in range(0, flat.shape[0], step):
            z = flat[s:s + step].to(dtype) / t
            out[s:s + step] = z.gather(-1, tgt[s:s + step, None])[:, 0] - z.logsumexp(-1)
    return out.view(targets.shape)


# --- set reverse KL over logits: full vocabulary and top-p (chunked) -----------------------------

def _scaled(logits: torch.Tensor, keep: torch.Tensor | None, temperature: float,
            dtype: torch.dtype) -> torch.Tensor:
    """logits / T in `dtype` (a fresh tensor), -inf outside `keep`."""
    z = logits.to(dtype) / temperature
    return z if keep is None else z.masked_fill_(~keep, float("-inf"))


def _nucleus_threshold(logits: torch.Tensor, top_p: float, temperature: float,
                       dtype: torch.dtype) -> torch.Tensor:
    """[N, 1]: the smallest probability kept in each row's top-p nucleus."""
    probs = torch.softmax(logits.to(dtype) / temperature, dim=-1)
    ordered = probs.sort(dim=-1, descending=True).values
    needed = (ordered.cumsum(dim=-1) < top_p).sum(dim=-1, keepdim=True) + 1
    return ordered.gather(-1, needed.clamp(max=ordered.shape[-1]) - 1)


def _nucleus_keep(logits: torch.Tensor, top_p: float, temperature: float,
                  dtype: torch.dtype) -> torch.Tensor:
    threshold = _nucleus_threshold(logits, top_p, temperature, dtype)
    return torch.softmax(logits.to(dtype) / temperature, dim=-1) >= threshold


def _rows_kl(student: torch.Tensor, teacher: torch.Tensor, keep: torch.Tensor | None,
             temperature: float, dtype: torch.dtype, width: int,
             scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KL_t of N rows [N, V] over `keep` (None: all), and with `scale` [N] the gradient
    scale * dKL/dz [N, V] in the student's dtype. `width` < V: vocabulary slices of that width
    (log-sum-exp of both sides first, then the KL, then the gradient: three reads of the rows,
    temporaries of [N, width])."""
    V = student.shape[-1]
    if width >= V:
        ls = torch.log_softmax(_scaled(student, keep, temperature, dtype), dim=-1)
        p = ls.exp()
        diff = ls.sub_(torch.log_softmax(_scaled(teacher, keep, temperature, dtype), dim=-1))
        diff.masked_fill_(p == 0, 0.0)  # outside the set: -inf - -inf
        kl = torch.linalg.vecdot(p, diff)
        if scale is None:
            return kl, None
        grad = diff.sub_(kl[:, None]).mul_(p).mul_(scale.to(dtype)[:, None] / temperature)
        return kl, grad.to(student.dtype)
    slices = [slice(v, min(v + width, V)) for v in range(0, V, width)]

    def parts(sl):
        k = None if keep is None else keep[:, sl]
        return _scaled(student[:, sl], k, temperature, dtype), \
            _scaled(teacher[:, sl], k, temperature, dtype)

    lse_s = torch.full((student.shape[0],), float("-inf"), dtype=dtype, device=student.device)
    lse_t = lse_s.clone()
    for sl in slices:
        zs, zt = parts(sl)
        lse_s, lse_t = torch.logaddexp(lse_s, zs.logsumexp(-1)), \
            torch.logaddexp(lse_t, zt.logsumexp(-1))

    def terms(sl):
        zs, zt = parts(sl)
        ls = zs.sub_(lse_s[:, None])
        p = ls.exp()
        diff = ls.sub_(zt.sub_(lse_t[:, None])).masked_fill_(p == 0, 0.0)
        return p, diff

    kl = torch.zeros_like(lse_s)
    for sl in slices:
        kl += torch.linalg.vecdot(*terms(sl))
    if scale is None:
        return kl, None
    grad = torch.empty_like(student)
    factor = scale.to(dtype)[:, None] / temperature
    for sl in slices:
        p, diff = terms(sl)
        grad[:, sl] = diff.sub_(kl[:, None]).mul_(p).mul_(factor).to(student.dtype)
    return kl, grad


def _set_kl(student: torch.Tensor, teacher: torch.Tensor, nucleus: torch.Tensor | None,
            rows: torch.Tensor, temperature: float, top_p: float, chunk_elements: int | None,
            scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(KL_t [B, T] at the masked positions `rows` [n, 2], zero elsewhere; with `scale` [n] the
    gradient sum_t scale_t * dKL_t/dz as a [B, T, V] tensor of the student's dtype), computed
    over chunks of about `chunk_elements` logits (`chunk_size`). The top-p nucleus (top_p < 1)
    is rebuilt from `nucleus` on whole rows (it needs a sort); the whole vocabulary is sliced
    when V is larger than a chunk."""
    dtype = torch.promote_types(student.dtype, torch.float32)
    V = student.shape[-1]
    chunk_elements = chunk_size(student.numel(), V, chunk_elements)
    width = V if top_p < 1 else min(V, chunk_elements)
    chunk_rows = max(1, chunk_elements // width)
    out = torch.zeros(student.shape[:-1], dtype=dtype, device=student.device)
    grad = None if scale is None else torch.zeros_like(student)
    for start in range(0, rows.shape[0], chunk_rows):
        idx = tuple(rows[start:start + chunk_rows].unbind(1))
        keep = None if top_p >= 1 else _nucleus_keep(nucleus[idx], top_p, temperature, dtype)
        part = None if scale is None else scale[start:start + chunk_rows]
        kl, g = _rows_kl(student[idx], teacher[idx], keep, temperature, dtype, width, part)
        out[idx] = kl
        if g is not None:
            grad[idx] = g
    return out, grad


class _SetReverseKL(torch.autograd.Function):
    """KL_t [B, T] over the whole vocabulary or the top-p nucleus; gradient in the backward
    (inputs saved by reference; the teacher's logits live until then)."""

    @staticmethod
    def forward(ctx, student, teacher, nucleus, rows, temperature, top_p, chunk_elements):
        ctx.save_for_backward(student, teacher, nucleus, rows)
        ctx.args = temperature, top_p, chunk_elements
        return _set_kl(student, teacher, nucleus, rows, temperature, top_p, chunk_elements)[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        student, teacher, nucleus, rows = ctx.saved_tensors
        scale = grad_out[tuple(rows.unbind(1))]
        grad = _set_kl(student, teacher, nucleus, rows, *ctx.args, scale=scale)[1]
        return grad, None, None, None, None, None, None


class _WeightedSetKL(torch.autograd.Function):
    """sum_t w_t KL_t (a scalar) and KL_t [B, T] (not differentiable); the gradient is computed
    in the forward, chunk by chunk, and kept (one [B, T, V] tensor of the student's dtype); the
    teacher's logits are not kept."""

    @staticmethod
    def forward(ctx, student, teacher, nucleus, rows, weights, temperature, top_p,
                chunk_elements):
        kl, grad = _set_kl(student, teacher, nucleus, rows, temperature, top_p, chunk_elements,
                           scale=weights)
        ctx.grad = grad
        ctx.mark_non_differentiable(kl)
        return (kl[tuple(rows.unbind(1))] * weights.to(kl.dtype)).sum(), kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_kl):
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError("the weighted OPD term's gradient was already used: backward it "
                               "once (it is precomputed and released)")
        if float(grad_loss) != 1.0:
            grad.mul_(grad_loss.to(grad.dtype))
        return grad, None, None, None, None, None, None, None


def _check_logits(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> None:
    if student.shape != teacher.shape:
        raise ValueError(f"student logits {tuple(student.shape)} and teacher logits "
                         f"{tuple(teacher.shape)} differ; slice both to the shared tokenizer "
                         "vocabulary (logits[..., :vocab_size]) and the same response positions")
    if student.shape[:-1] != mask.shape:
        raise ValueError(f"logits {tuple(student.shape)} do not match the mask "
                         f"{tuple(mask.shape)}: pass response-aligned [B, T, V] logits")


def _set_inputs(student_logits, teacher_logits, mask, top_p, nucleus_logits):
    _check_logits(student_logits, teacher_logits, mask)
    if not top_p > 0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    nucleus = (student_logits if nucleus_logits is None else nucleus_logits).detach()
    if top_p < 1:
        _check_logits(student_logits, nucleus, mask)
    return nucleus, mask.bool().nonzero(), min(float(top_p), 1.0)


def full_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    mask: torch.Tensor, temperature: float = 1.0,
                    chunk_elements: int | None = None) -> torch.Tensor:
    """KL(pi_theta || pi_T) over the whole vocabulary at each masked position, [B, T];
    logits [B, T, V]; differentiable in the student logits, the teacher's detached."""
    return top_p_reverse_kl(student_logits, teacher_logits, mask, 1.0, temperature,
                            chunk_elements=chunk_elements)


def top_p_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                     mask: torch.Tensor, top_p: float, temperature: float = 1.0,
                     nucleus_logits: torch.Tensor | None = None,
                     chunk_elements: int | None = None) -> torch.Tensor:
    """Reverse KL over the top-p nucleus rebuilt from `nucleus_logits` (default: the student
    logits, detached), both sides renormalised over it, [B, T]. top_p >= 1 is the full
    vocabulary. (A nucleus the rollout recorded: `ids_reverse_kl`.)"""
    nucleus, rows, top_p = _set_inputs(student_logits, teacher_logits, mask, top_p,
                                       nucleus_logits)
    return _SetReverseKL.apply(student_logits, teacher_logits.detach(), nucleus, rows,
                               effective_temperature(temperature), top_p, chunk_elements)


def weighted_set_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    mask: torch.Tensor, weights: torch.Tensor, temperature: float = 1.0,
                    top_p: float = 1.0, nucleus_logits: torch.Tensor | None = None,
                    chunk_elements: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_t weights_t * KL_t, a differentiable scalar; KL_t [B, T], detached) for the full
    vocabulary (top_p = 1) or the nucleus rebuilt from `nucleus_logits`; weights [B, T].
    The gradient is computed now and the teacher's logits are not kept: drop them after this
    call and the only [B, T, V] tensor the term holds until the backward is its gradient."""
    nucleus, rows, top_p = _set_inputs(student_logits, teacher_logits, mask, top_p,
                                       nucleus_logits)
    w = weights.detach()[tuple(rows.unbind(1))]
    loss, kl = _WeightedSetKL.apply(student_logits, teacher_logits.detach(), nucleus, rows, w,
                                    effective_temperature(temperature), top_p, chunk_elements)
    return loss, kl


# --- set reverse KL over given ids: top-k and recorded nuclei -----------------------------------

def ids_reverse_kl(student_logits: torch.Tensor, ids: torch.Tensor,
                   teacher_scores: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """Reverse KL over S_t = {ids[b, t, j] : valid[b, t, j]}, both sides renormalised over it,
    [B, T]. student_logits [B, T, V] (differentiable, gathered at the ids and divided by T);
    teacher_scores [B, T, k]: anything whose log_softmax over S_t is the teacher's log-probs
    renormalised there (log-probs at T, or logits / T: a per-position constant cancels);
    valid [B, T, k] (default: all) marks padding of ragged sets. Every masked position needs a
    non-empty set."""
    if ids.shape != teacher_scores.shape or ids.shape[:-1] != mask.shape:
        raise ValueError(f"token ids {tuple(ids.shape)} and teacher values "
                         f"{tuple(teacher_scores.shape)} must both be [B, T, k] over the mask "
                         f"{tuple(mask.shape)}")
    m = mask.bool()
    keep = m[..., None] if valid is None else valid.bool() & m[..., None]
    if bool((m & ~keep.any(-1)).any()):
        raise ValueError("a masked position has an empty token set")
    ids = ids.long().masked_fill(~keep, 0)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= student_logits.shape[-1]):
        raise ValueError(f"token ids outside the student vocabulary [0, "
                         f"{student_logits.shape[-1]}); the teacher's tokenizer must match")
    t = effective_temperature(temperature)
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    off = ~keep & m[..., None]  # padding inside a masked row: out of the set
    zs = (student_logits.gather(-1, ids).to(dtype) / t).masked_fill(off, float("-inf"))
    zt = teacher_scores.detach().to(dtype).masked_fill(~keep, 0.0).masked_fill(
        off, float("-inf"))
    ls, lt = torch.log_softmax(zs, dim=-1), torch.log_softmax(zt, dim=-1)
    p = ls.exp()
    kl = (p * torch.where(p > 0, ls - lt, torch.zeros_like(ls))).sum(dim=-1)
    return torch.where(m, kl, torch.zeros_like(kl))


def top_k_reverse_kl(student_logits: torch.Tensor, teacher_ids: torch.Tensor,
                     teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                     temperature: float = 1.0,
                     teacher_temperature: float | None = None) -> torch.Tensor:
    """Reverse KL over S = the teacher's top-k ids as a server returned them, [B, T].

    student_logits [B, T, V]; teacher_ids (long) and teacher_logprobs [B, T, k] (entries that
    are -inf, a server's padding, are out of the set). teacher_temperature: the temperature the
    server computed its log-probs at (default: the rollout's); they are rescaled to the rollout
    temperature, exactly, because a renormalisation over S cancels the server's normaliser."""
    if teacher_ids.shape != teacher_logprobs.shape or teacher_ids.shape[:-1] != mask.shape:
        raise ValueError(f"teacher top-k ids {tuple(teacher_ids.shape)} and log-probs "
                         f"{tuple(teacher_logprobs.shape)} must both be [B, T, k] over the mask "
                         f"{tuple(mask.shape)}")
    t_rollout = effective_temperature(temperature)
    scale = 1.0 if teacher_temperature is None else \
        effective_temperature(teacher_temperature) / t_rollout
    lps = teacher_logprobs.detach()
    return ids_reverse_kl(student_logits, teacher_ids, lps.to(torch.promote_types(
        lps.dtype, torch.float32)) * scale, mask, temperature, valid=torch.isfinite(lps))


def top_k_ids(logits: torch.Tensor, k: int, chunk_elements: int | None = None
              ) -> torch.Tensor:
    """[..., k] ids of the k largest logits per position (the k most likely tokens at any
    temperature > 0), detached, over chunks of rows."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    k = min(k, flat.shape[-1])
    out = torch.empty((flat.shape[0], k), dtype=torch.long, device=logits.device)
    V = max(1, flat.shape[-1])
    step = max(1, chunk_size(flat.numel(), V, chunk_elements) // V)
    for s in range(0, flat.shape[0], step):
        out[s:s + step] = flat[s:s + step].topk(k, dim=-1).indices
    return out.view(*logits.shape[:-1], k)


def gather_scores(teacher_logits: torch.Tensor, ids: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """teacher_logits [B, T, V] at ids [B, T, k], divided by T, float32 (the teacher values of
    `ids_reverse_kl`: its log-probs there up to a per-position constant)."""
    dtype = torch.promote_types(teacher_logits.dtype, torch.float32)
    return teacher_logits.detach().gather(-1, ids).to(dtype) / effective_temperature(temperature)


def nucleus_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ids: torch.Tensor,
                     valid: torch.Tensor, mask: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """Top-p replay: log of token x_t's probability renormalised over the recorded nucleus,
    `z_x / T - logsumexp_{v in N_t} z_v / T`, [B, T], differentiable in logits [B, T, V];
    tokens [B, T]; ids, valid [B, T, K] (N_t and its padding). 0 off the mask."""
    m = mask.bool()
    keep = valid.bool() & m[..., None]
    t = effective_temperature(temperature)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    zn = (logits.gather(-1, ids.long().masked_fill(~keep, 0)).to(dtype) / t).masked_fill(
        ~keep, float("-inf"))
    zn = zn.masked_fill(~m[..., None], 0.0)  # rows off the mask: finite, then dropped
    zx = logits.gather(-1, tokens.long()[..., None])[..., 0].to(dtype) / t
    out = zx - torch.logsumexp(zn, dim=-1)
    return torch.where(m, out, torch.zeros_like(out))


# --- dispatch, reduction, metrics ----------------------------------------------------------------

def distribution_reverse_kl(cfg: OpdConfig, student_logits: torch.Tensor, mask: torch.Tensor,
                            temperature: float, *, teacher_logits: torch.Tensor | None = None,
                            teacher_ids: torch.Tensor | None = None,
                            teacher_logprobs: torch.Tensor | None = None,
                            nucleus_logits: torch.Tensor | None = None,
                            nucleus_ids: torch.Tensor | None = None,
                            nucleus_valid: torch.Tensor | None = None,
                            teacher_temperature: float | None = None) -> torch.Tensor:
    """Per-position KL_t [B, T] of a loss-term mode (top_p, top_k, full) from what it needs:
    top_k: the teacher's logits (any top_k_from) or a server's top-k ids and log-probs (top_k_from
    = "teacher"); top_p: the teacher's logits and the recorded nucleus (nucleus_ids, _valid), or
    without it the nucleus rebuilt from nucleus_logits; full: the teacher's logits."""
    if cfg.mode == "top_k":
        if teacher_logits is not None:
            source = student_logits if cfg.top_k_from == "student" else teacher_logits
            ids = top_k_ids(source, cfg.top_k)
            return ids_reverse_kl(student_logits, ids,
                                  gather_scores(teacher_logits, ids, temperature), mask,
                                  temperature)
        if cfg.top_k_from == "student":
            raise ValueError("mode = 'top_k' with top_k_from = 'student' needs the teacher's "
                             "logits (a colocated teacher)")
        if teacher_ids is None or teacher_logprobs is None:
            raise ValueError("mode = 'top_k' needs the teacher's top-k ids and log-probs")
        return top_k_reverse_kl(student_logits, teacher_ids, teacher_logprobs, mask, temperature,
                                teacher_temperature)
    if cfg.mode not in TEACHER_LOGIT_MODES:
        raise ValueError(f"mode = {cfg.mode!r} is not a loss term: its signal is a reward "
                         f"(sampled_log_ratio), subtracted from the advantages by the step")
    if teacher_logits is None:
        raise ValueError(f"mode = {cfg.mode!r} needs the teacher's logits (a colocated teacher)")
    if cfg.mode == "top_p" and nucleus_ids is not None:
        valid = torch.ones_like(nucleus_ids, dtype=torch.bool) if nucleus_valid is None \
            else nucleus_valid
        ids = nucleus_ids.long().masked_fill(~valid, 0)
        return ids_reverse_kl(student_logits, ids, gather_scores(teacher_logits, ids,
                                                                 temperature),
                              mask, temperature, valid)
    top_p = cfg.top_p if cfg.mode == "top_p" else 1.0
    return top_p_reverse_kl(student_logits, teacher_logits, mask, top_p, temperature,
                            nucleus_logits)


def opd_loss(kl: torch.Tensor, mask: torch.Tensor, num_samples_in_step: int,
             kl_coef: float, sample_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """kl_coef * sum over samples of the masked token mean of KL_t / num_samples_in_step;
    `sample_tokens` [B]: each mean's denominator when `mask` is part of the sample's tokens."""
    return kl_coef * masked_sample_sum(kl, mask.to(kl.dtype), sample_tokens) / num_samples_in_step


def opd_weights(mask: torch.Tensor, coef: torch.Tensor, num_samples_in_step: int,
                kl_coef: float, sample_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] per-position weights w with sum_t w_t KL_t = opd_loss(KL * coef, mask, ...):
    kl_coef * coef_b * m_bt / (max(n_b, 1) * num_samples_in_step), n_b = `sample_tokens`
    (default: the mask's count)."""
    m = mask.to(torch.promote_types(torch.promote_types(mask.dtype, coef.dtype), torch.float32))
    n = m.sum(dim=1) if sample_tokens is None else sample_tokens.to(m.dtype)
    return kl_coef * coef.to(m.dtype)[:, None] * m / (n.clamp(min=1)[:, None]
                                                      * num_samples_in_step)


def teacher_kl_sums(kl: torch.Tensor, mask: torch.Tensor, teachers: Sequence[str],
                    into: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Add each teacher's (sum of KL_t or r_t, token count) over its samples' masked tokens;
    kl, mask: [B, T]; teachers: the teacher of each sample. Accumulates into `into`."""
    if len(teachers) != kl.shape[0]:
        raise ValueError(f"{len(teachers)} teacher names for {kl.shape[0]} samples")
    out = {} if into is None else into
    with torch.no_grad():
        m = mask.bool()
        per_sample = torch.where(m, kl.double(), torch.zeros((), dtype=torch.float64)).sum(1)
        counts = m.sum(dim=1)
        for name, total, count in zip(teachers, per_sample.tolist(), counts.tolist()):
            acc = out.setdefault(name, [0.0, 0.0])
            acc[0] += total
            acc[1] += count
    return out


def teacher_kl_metrics(sums: dict[str, list[float]]) -> dict[str, float]:
    """`opd/<teacher>/reverse_kl` (mean over its tokens) and `opd/<teacher>/tokens`."""
    out: dict[str, float] = {}
    for name, (total, count) in sorted(sums.items()):
        out[f"opd/{name}/reverse_kl"] = total / count if count else 0.0
        out[f"opd/{name}/tokens"] = float(count)
    return out
