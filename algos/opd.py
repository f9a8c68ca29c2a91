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
  * `top_p`: S_t = the rollout's nucleus at t: with the student probabilities at temperature T
    sorted descending, p_(1) >= p_(2) >= ..., S_t holds the first n tokens for the smallest n
    with p_(1) + ... + p_(n) >= top_p (every token tied with p_(n) is kept too); top_p >= 1 is
    the whole vocabulary. The probabilities come from `nucleus_logits` (the weights that sampled
    the rollout; by default the student logits themselves, detached), so S_t is a constant;
  * `top_k`: S_t = the teacher's k most likely tokens at t, as a teacher server returns them with
    `top_logprobs_num = k` (ids and teacher log-probs), so no teacher logits are needed; the
    teacher side is renormalised from those k log-probs alone, the student side from its logits
    gathered at those ids. Server log-probs computed at another temperature T' are rescaled
    exactly (`teacher_temperature`): `log_softmax(lp' * T' / T)` over S_t, since the
    renormalisation cancels the server's normaliser.
Arithmetic is float32 (float64 when the student logits are float64).
Gradient of the set KL (used by the chunked autograd function, z = student logits):
`dKL_t / dz_v = p_S(v) * (log p_S(v) - log q_S(v) - KL_t) / T` for v in S_t, 0 outside.

Which modes need teacher logits (a colocated teacher forward): `top_p` and `full`; `sampled` and
`top_k` work from teacher server replies (input log-probs, top log-probs).

Memory: `full` and `top_p` never build a [B, T, V] temporary: they walk the masked positions in
chunks of about `CHUNK_ELEMENTS` logits, keep nothing but per-row scalars for backward (the
inputs are saved by reference), and allocate one [B, T, V] tensor, the gradient.
Invariant: no function changes its inputs; teacher values never receive gradient; every
per-position result is 0 off the mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import torch

from algos.logprobs import effective_temperature
from algos.policy_loss import masked_sample_sum

OPD_MODES = ("sampled", "top_p", "top_k", "full")
TEACHER_LOGIT_MODES = ("top_p", "full")  # need teacher logits: colocated teachers only
SERVER_MODES = ("sampled", "top_k")  # work from teacher server replies (or colocated)
CHUNK_ELEMENTS = 1 << 22  # logits per chunk in the full / top_p KL (16 MiB per fp32 temporary)


class OpdConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How one teacher's signal reaches the student (see the module docstring)."""

    mode: str = "sampled"  # sampled | top_p | top_k | full
    kl_coef: float = 1.0  # beta: weight of the reverse KL (0: scored and logged, not trained on)
    top_p: float = 1.0  # top_p mode: nucleus mass, the rollout's sampling top_p, in (0, 1]
    top_k: int = 0  # top_k mode: teacher tokens per position (the server's top_logprobs_num)

    def __post_init__(self) -> None:
        if self.mode not in OPD_MODES:
            raise ValueError(f"opd mode = {self.mode!r}; use one of {OPD_MODES}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p != 1 and self.mode != "top_p":
            raise ValueError(f"top_p = {self.top_p} is only used by mode = 'top_p' (mode is "
                             f"{self.mode!r}); set mode = 'top_p' or remove top_p")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 1 (top_k mode) or absent, got {self.top_k}")
        if self.mode == "top_k" and self.top_k < 1:
            raise ValueError("mode = 'top_k' needs top_k >= 1 (the teacher tokens scored per "
                             "position); set top_k, e.g. top_k = 20")
        if self.top_k and self.mode != "top_k":
            raise ValueError(f"top_k = {self.top_k} is only used by mode = 'top_k' (mode is "
                             f"{self.mode!r}); set mode = 'top_k' or remove top_k")


def needs_teacher_logits(mode: str) -> bool:
    """True for modes that need the teacher's full logits (a colocated teacher forward)."""
    if mode not in OPD_MODES:
        raise ValueError(f"opd mode = {mode!r}; use one of {OPD_MODES}")
    return mode in TEACHER_LOGIT_MODES


def is_loss_term(mode: str) -> bool:
    """True for the differentiable KL loss modes; False for `sampled` (advantage shaping)."""
    needs_teacher_logits(mode)  # validates the name
    return mode != "sampled"


def check_placement(cfg: OpdConfig, placement: str, teacher: str = "teacher") -> None:
    """Refuse a server-mode teacher whose OPD mode needs logits a server does not return."""
    if placement == "server" and needs_teacher_logits(cfg.mode):
        raise ValueError(f"{teacher}: mode = {cfg.mode!r} needs the teacher's logits, which a "
                         f"teacher server does not return; use a colocated teacher or one of "
                         f"the server modes {SERVER_MODES}")


# --- sampled token: a reward -------------------------------------------------------------------

def sampled_log_ratio(student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """r_t = log pi_theta(x_t) - log pi_T(x_t) on sampled tokens, [B, T], detached, 0 off-mask."""
    with torch.no_grad():
        dtype = torch.promote_types(student_logp.dtype, torch.float32)
        r = student_logp.to(dtype) - teacher_logp.to(dtype)
        return torch.where(mask.bool(), r, torch.zeros_like(r))


def shaped_advantages(advantages: torch.Tensor, student_logp: torch.Tensor,
                      teacher_logp: torch.Tensor, mask: torch.Tensor,
                      kl_coef: float) -> torch.Tensor:
    """A_t - kl_coef * r_t, masked, [B, T]; advantages [B] (broadcast) or [B, T] (zeros: pure
    distillation). No gradient flows through r (it is a reward)."""
    r = sampled_log_ratio(student_logp, teacher_logp, mask)
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(r)
    return (adv.to(r.dtype) - kl_coef * r) * mask.to(r.dtype)


# --- set reverse KL over logits: full vocabulary and top-p ---------------------------------------

def _set_logprobs(logits: torch.Tensor, keep: torch.Tensor | None, temperature: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """log_softmax(logits / T) over the kept tokens (-inf elsewhere); `logits` is a chunk copy."""
    z = logits.to(dtype).div_(temperature)
    if keep is not None:
        z.masked_fill_(~keep, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def _nucleus_threshold(logits: torch.Tensor, top_p: float, temperature: float,
                       dtype: torch.dtype) -> torch.Tensor:
    """[N, 1]: the smallest probability kept in each row's top-p nucleus."""
    probs = torch.softmax(logits.to(dtype) / temperature, dim=-1)
    ordered = probs.sort(dim=-1, descending=True).values
    needed = (ordered.cumsum(dim=-1) < top_p).sum(dim=-1, keepdim=True) + 1
    return ordered.gather(-1, needed.clamp(max=ordered.shape[-1]) - 1)


def _nucleus_keep(logits: torch.Tensor, threshold: torch.Tensor, temperature: float,
                  dtype: torch.dtype) -> torch.Tensor:
    return torch.softmax(logits.to(dtype) / temperature, dim=-1) >= threshold


def _chunk_terms(student: torch.Tensor, teacher: torch.Tensor, keep: torch.Tensor | None,
                 temperature: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(p_S, log p_S - log q_S with 0 where p_S = 0, KL [N]) of one chunk of rows."""
    diff = _set_logprobs(student, keep, temperature, dtype)
    p = diff.exp()
    diff.sub_(_set_logprobs(teacher, keep, temperature, dtype)).masked_fill_(p == 0, 0.0)
    return p, diff, torch.linalg.vecdot(p, diff)


class _SetReverseKL(torch.autograd.Function):
    """KL_t over the whole vocabulary or the top-p nucleus at the masked positions, chunked."""

    @staticmethod
    def forward(ctx, student, teacher, nucleus, rows, temperature, top_p, chunk_rows):
        dtype = torch.promote_types(student.dtype, torch.float32)
        out = torch.zeros(student.shape[:-1], dtype=dtype, device=student.device)
        thresholds = []
        for idx in _chunks(rows, chunk_rows):
            keep = None
            if top_p < 1:
                thresholds.append(_nucleus_threshold(nucleus[idx], top_p, temperature, dtype))
                keep = _nucleus_keep(nucleus[idx], thresholds[-1], temperature, dtype)
            out[idx] = _chunk_terms(student[idx], teacher[idx], keep, temperature, dtype)[2]
        ctx.save_for_backward(student, teacher, nucleus, rows)
        ctx.thresholds, ctx.temperature, ctx.top_p = thresholds, temperature, top_p
        ctx.chunk_rows, ctx.dtype = chunk_rows, dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        student, teacher, nucleus, rows = ctx.saved_tensors
        grad = torch.zeros_like(student)
        temperature, dtype = ctx.temperature, ctx.dtype
        for i, idx in enumerate(_chunks(rows, ctx.chunk_rows)):
            keep = None
            if ctx.top_p < 1:
                keep = _nucleus_keep(nucleus[idx], ctx.thresholds[i], temperature, dtype)
            p, diff, kl = _chunk_terms(student[idx], teacher[idx], keep, temperature, dtype)
            scale = grad_out[idx].to(dtype)[:, None] / temperature
            grad[idx] = diff.sub_(kl[:, None]).mul_(p).mul_(scale).to(grad.dtype)
        return grad, None, None, None, None, None, None


def _chunks(rows: torch.Tensor, chunk_rows: int):
    """Index tuples (one tensor per leading dim) of the masked positions, chunk_rows at a time."""
    for start in range(0, rows.shape[0], chunk_rows):
        yield tuple(rows[start:start + chunk_rows].unbind(1))


def _check_logits(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> None:
    if student.shape != teacher.shape:
        raise ValueError(f"student logits {tuple(student.shape)} and teacher logits "
                         f"{tuple(teacher.shape)} differ; slice both to the shared tokenizer "
                         "vocabulary (logits[..., :vocab_size]) and the same response positions")
    if student.shape[:-1] != mask.shape:
        raise ValueError(f"logits {tuple(student.shape)} do not match the mask "
                         f"{tuple(mask.shape)}: pass response-aligned [B, T, V] logits")


def full_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    mask: torch.Tensor, temperature: float = 1.0,
                    chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """KL(pi_theta || pi_T) over the whole vocabulary at each masked position, [B, T];
    logits [B, T, V]; differentiable in the student logits, the teacher's detached."""
    return top_p_reverse_kl(student_logits, teacher_logits, mask, 1.0, temperature,
                            chunk_elements=chunk_elements)


def top_p_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                     mask: torch.Tensor, top_p: float, temperature: float = 1.0,
                     nucleus_logits: torch.Tensor | None = None,
                     chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Reverse KL over the rollout's top-p nucleus, both sides renormalised over it, [B, T].

    nucleus_logits [B, T, V]: the logits of the weights that sampled the rollout (default: the
    student logits, detached). top_p >= 1 is the full vocabulary."""
    _check_logits(student_logits, teacher_logits, mask)
    if not top_p > 0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    nucleus = (student_logits if nucleus_logits is None else nucleus_logits).detach()
    if top_p < 1:
        _check_logits(student_logits, nucleus, mask)
    rows = mask.bool().nonzero()
    chunk_rows = max(1, chunk_elements // student_logits.shape[-1])
    return _SetReverseKL.apply(student_logits, teacher_logits.detach(), nucleus, rows,
                               effective_temperature(temperature), min(float(top_p), 1.0),
                               chunk_rows)


# --- top-k: from teacher server replies ---------------------------------------------------------

def top_k_reverse_kl(student_logits: torch.Tensor, teacher_ids: torch.Tensor,
                     teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                     temperature: float = 1.0,
                     teacher_temperature: float | None = None) -> torch.Tensor:
    """Reverse KL over S = the teacher's top-k ids, both sides renormalised over S, [B, T].

    student_logits [B, T, V]; teacher_ids (long) and teacher_logprobs [B, T, k] as the server
    returned them. teacher_temperature: the temperature the server computed its log-probs at
    (default: the rollout's); they are rescaled to the rollout temperature, exactly, because a
    renormalisation over S cancels the server's per-position normaliser."""
    if teacher_ids.shape != teacher_logprobs.shape or teacher_ids.shape[:-1] != mask.shape:
        raise ValueError(f"teacher top-k ids {tuple(teacher_ids.shape)} and log-probs "
                         f"{tuple(teacher_logprobs.shape)} must both be [B, T, k] over the mask "
                         f"{tuple(mask.shape)}")
    m = mask.bool()
    ids = teacher_ids.long().masked_fill(~m[..., None], 0)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= student_logits.shape[-1]):
        raise ValueError(f"teacher top-k ids outside the student vocabulary [0, "
                         f"{student_logits.shape[-1]}); the teacher's tokenizer must match")
    t_rollout = effective_temperature(temperature)
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    ls = torch.log_softmax(student_logits.gather(-1, ids).to(dtype) / t_rollout, dim=-1)
    scale = 1.0 if teacher_temperature is None else \
        effective_temperature(teacher_temperature) / t_rollout
    raw = teacher_logprobs.detach().to(dtype).masked_fill(~m[..., None], 0) * scale
    lt = torch.log_softmax(raw, dim=-1)
    p = ls.exp()
    kl = (p * torch.where(p > 0, ls - lt, torch.zeros_like(ls))).sum(dim=-1)
    return torch.where(m, kl, torch.zeros_like(kl))


# --- dispatch, reduction, metrics ----------------------------------------------------------------

def distribution_reverse_kl(cfg: OpdConfig, student_logits: torch.Tensor, mask: torch.Tensor,
                            temperature: float, *, teacher_logits: torch.Tensor | None = None,
                            teacher_ids: torch.Tensor | None = None,
                            teacher_logprobs: torch.Tensor | None = None,
                            nucleus_logits: torch.Tensor | None = None,
                            teacher_temperature: float | None = None) -> torch.Tensor:
    """Per-position KL_t [B, T] of a loss-term mode (top_p, top_k, full) from what it needs."""
    if cfg.mode == "top_k":
        if teacher_ids is None or teacher_logprobs is None:
            raise ValueError("mode = 'top_k' needs the teacher's top-k ids and log-probs")
        return top_k_reverse_kl(student_logits, teacher_ids, teacher_logprobs, mask, temperature,
                                teacher_temperature)
    if cfg.mode not in TEACHER_LOGIT_MODES:
        raise ValueError(f"mode = {cfg.mode!r} is not a loss term; use shaped_advantages")
    if teacher_logits is None:
        raise ValueError(f"mode = {cfg.mode!r} needs the teacher's logits (a colocated teacher)")
    top_p = cfg.top_p if cfg.mode == "top_p" else 1.0
    return top_p_reverse_kl(student_logits, teacher_logits, mask, top_p, temperature,
                            nucleus_logits)


def opd_loss(kl: torch.Tensor, mask: torch.Tensor, num_samples_in_step: int,
             kl_coef: float) -> torch.Tensor:
    """kl_coef * sum over samples of the masked token mean of KL_t / num_samples_in_step."""
    return kl_coef * masked_sample_sum(kl, mask.to(kl.dtype)) / num_samples_in_step


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
