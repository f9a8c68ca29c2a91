"""On-policy distillation across vocabularies: character-span alignment and its signals (pure).

A teacher with another tokenizer scores the student's response re-tokenized for it (the pool
decodes the student's tokens once and encodes the text with the teacher's tokenizer, keeping
each token's character offsets: logic/teachers.py `retokenize`). Both tokenizations then cover
the same characters with different cuts; this module pairs them.

Alignment (`align`): a side's cuts are the start and end offsets of its tokens; the spans are
the intervals between consecutive cuts both sides share, so each span is the shortest stretch
both tokenizations can agree on (a student "1","2" against a teacher "12" is one span; where
both cut at every character every token is its own span). A span is *aligned* when each side's
tokens lying wholly inside it tile it exactly (contiguous, no overlap, no token straddling its
ends), each side has at least one token there, and none of them is marked bad (the student's:
a span mixing policy and observation tokens; the teacher's: its unknown token). Zero-width tokens
(a special token, a byte piece that completes a character later) belong to the span starting at
their offset (the last span at the text's end). Characters of unaligned spans carry no signal;
`Alignment.aligned_chars / total_chars` is the coverage the pool reports.

Signals, with n_s student and n_t teacher tokens and spans S (all float64 here):
1. sampled token (`spread_sampled`): the span's log-prob on each side is the sum over its tokens,
   `log pi_s(S) = sum_{t in S} s_t`, `log pi_T(S) = sum_{u in S} T_u`, and the span's difference
   `D_S = log pi_s(S) - log pi_T(S)` is what each student token of the span carries: the trainer
   computes `r_t = student_t - teacher_t` from the sample's per-token `teacher_logprobs`
   (training/colocated_teachers.py `sampled_ratio`, student_t its own log-prob of the token), so
   the pool writes `teacher_t = s_t - D_S` with s_t the rollout's log-prob, and r_t is then
   exactly D_S when the trainer's log-probs are the rollout's (e.g. `mismatch.bypass`), and
   `D_S + (student_t - s_t)` otherwise: the token's own drift, which a same-tokenizer teacher's
   r_t carries the same way. A span of one token on each side gives the same-tokenizer r_t.
   Each token of S carries the whole D_S (not a share): the policy gradient of the span is then
   `-beta D_S grad log pi_s(S)`, the span-level form of the per-token estimator. Unaligned
   tokens get `teacher_t = s_t` (r_t = 0 up to drift).
   Causal within a span (`prefix_teacher_logprobs`, a teacher's `span_credit = "prefix"`):
   where the student splits one teacher token finer, each student token instead gets its own
   teacher log-prob from the teacher's top-k prefix probabilities, which sum to the teacher
   token's over the span; r_t is then exact with the trainer's own log-probs.
2. distribution, exact-match (`map_topk`): at spans of one student and one teacher token, the
   teacher's top-k ids are mapped to student ids whose token strings are equal (`vocab_map`:
   strings unique on both sides), entries without a match are dropped and their teacher
   probability mass reported (`dropped_mass`); the trainer's top-k reverse KL over the mapped
   set (both sides renormalised there: algos/opd.py `ids_reverse_kl`) is then vocabulary-free.
   Elsewhere the set is the student's own token alone, whose KL is exactly 0. First-token
   projection (`rows = "span_starts"` with a first-token map, a teacher's `topk_map =
   "first_token"`): each teacher token maps to the student token its text starts with (the
   student tokenizer's first token of it; equal texts as above), entries of one student token
   merged (the teacher's probability that the next text starts with that student token, up to
   its top-k), at the first student token of every aligned span against the span's first
   teacher token, both conditioned on the text before the span: a teacher's merged tokens then
   count for their first student token instead of being dropped. Rows are padded
   by repeating their last entry (`Sample`'s top-k arrays must be finite and of one width);
   the trainer treats a repeated id in a row as padding.
3. distribution, sorted probabilities (`sorted_prob_distance`, ULD-style): where tokens do not
   match, compare the two distributions' probability vectors sorted descending, padded with
   zeros to one length: `sum_i |p_(i) - q_(i)|`; it needs no id correspondence at all, and
   ignores which token holds which probability. It is taken where both sides predict the same
   thing: at the first student token of an aligned span against the span's first teacher
   token (`span_starts`), both conditioned on all the text before the span, at spans the
   exact-match set does not cover (several tokens on a side, or no mapped entry); the
   teacher's side is its top-k (opd `uld_coef`).
Invariant: no function changes its inputs; every array out is new.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Alignment:
    """Spans shared by a student and a teacher tokenization of one text."""

    student_span: np.ndarray  # [n_s] int64: each student token's aligned span, -1 = none
    teacher_span: np.ndarray  # [n_t] int64: each teacher token's aligned span, -1 = none
    spans: np.ndarray  # [n_spans, 2] int64 character ranges [start, end) of aligned spans
    total_chars: int  # characters of the text

    @property
    def num_spans(self) -> int:
        return int(self.spans.shape[0])

    @property
    def aligned_chars(self) -> int:
        return int((self.spans[:, 1] - self.spans[:, 0]).sum())

    @property
    def char_frac(self) -> float:
        """Fraction of the text's characters inside aligned spans (1.0 for an empty text)."""
        return self.aligned_chars / self.total_chars if self.total_chars else 1.0

    def one_to_one(self) -> np.ndarray:
        """[n_s] bool: student tokens whose span holds exactly one token on each side."""
        n = self.num_spans
        s_count = np.bincount(self.student_span[self.student_span >= 0], minlength=n)
        t_count = np.bincount(self.teacher_span[self.teacher_span >= 0], minlength=n)
        single = (s_count == 1) & (t_count == 1)
        return (self.student_span >= 0) & single[np.maximum(self.student_span, 0)]

    def teacher_of(self) -> np.ndarray:
        """[n_s] int64: for one-to-one student tokens the teacher token of their span, else -1."""
        out = np.full(self.student_span.shape, -1, dtype=np.int64)
        by_span = np.full(self.num_spans, -1, dtype=np.int64)
        t = np.flatnonzero(self.teacher_span >= 0)
        by_span[self.teacher_span[t]] = t
        one = self.one_to_one()
        out[one] = by_span[self.student_span[one]]
        return out


def _offsets(offsets, name: str) -> np.ndarray:
    a = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if a.size and ((a[:, 0] > a[:, 1]).any() or (a < 0).any()):
        raise ValueError(f"{name} offsets must be [start, end) pairs with 0 <= start <= end")
    return a


def _assign(offsets: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Each token's interval index between consecutive shared cuts, -1 when it is not inside
    one (it straddles a shared cut or lies outside them)."""
    n_int = len(cuts) - 1
    if n_int < 1 or not len(offsets):
        return np.full(len(offsets), -1, dtype=np.int64)
    start, end = offsets[:, 0], offsets[:, 1]
    idx = np.searchsorted(cuts, start, side="right") - 1
    idx = np.where((start == end) & (start == cuts[-1]), n_int - 1, idx)  # zero-width at the end
    inside = (idx >= 0) & (idx < n_int)
    safe = np.clip(idx, 0, n_int - 1)
    inside &= end <= cuts[safe + 1]
    return np.where(inside, idx, -1)


def _tiled(offsets: np.ndarray, interval: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """[n_intervals] bool: the tokens of each interval cover it exactly, with at least one
    token of positive width, without overlap."""
    n_int = len(cuts) - 1
    width = offsets[:, 1] - offsets[:, 0]
    inside = interval >= 0
    covered = np.bincount(interval[inside], weights=width[inside], minlength=n_int)
    ok = covered == np.diff(cuts)
    has = np.bincount(interval[inside & (width > 0)], minlength=n_int) > 0
    ok &= has
    # overlap: within one interval, sorted by start, a token starting before the last end
    order = np.lexsort((offsets[:, 0], interval))
    prev_end = -1
    prev_int = -2
    for i in order:
        j = interval[i]
        if j < 0 or width[i] == 0:
            continue
        if j == prev_int and offsets[i, 0] < prev_end:
            ok[j] = False
        prev_int, prev_end = j, offsets[i, 1]
    return ok


def align(student_offsets: Sequence, teacher_offsets: Sequence, text_len: int,
          student_ok: Sequence[bool] | None = None,
          teacher_ok: Sequence[bool] | None = None,
          student_group: Sequence[int] | None = None) -> Alignment:
    """The aligned spans of two tokenizations of a text of `text_len` characters, each given
    as per-token character offsets [n, 2] ([start, end)); `*_ok` marks tokens that may be
    aligned (default all); `student_group` (e.g. the loss mask): a span whose student tokens
    are not all of one group is not aligned. See the module docstring."""
    s, t = _offsets(student_offsets, "student"), _offsets(teacher_offsets, "teacher")
    if (s.size and s[:, 1].max() > text_len) or (t.size and t[:, 1].max() > text_len):
        raise ValueError(f"token offsets beyond the text's {text_len} characters")
    s_ok = np.ones(len(s), bool) if student_ok is None else np.asarray(student_ok, bool)
    t_ok = np.ones(len(t), bool) if teacher_ok is None else np.asarray(teacher_ok, bool)
    if s_ok.shape != (len(s),) or t_ok.shape != (len(t),):
        raise ValueError("student_ok / teacher_ok must hold one flag per token")
    cuts = np.intersect1d(np.unique(s), np.unique(t))  # both sides cut there
    n_int = max(len(cuts) - 1, 0)
    s_int, t_int = _assign(s, cuts), _assign(t, cuts)
    good = np.zeros(n_int, dtype=bool)
    if n_int:
        good = _tiled(s, s_int, cuts) & _tiled(t, t_int, cuts)
        for interval, ok in ((s_int, s_ok), (t_int, t_ok)):
            bad = interval[(interval >= 0) & ~ok]
            good[bad] = False
        if student_group is not None:
            g = np.asarray(student_group, dtype=np.int64)
            if g.shape != (len(s),):
                raise ValueError("student_group must hold one label per student token")
            inside = s_int >= 0
            lo = np.full(n_int, np.iinfo(np.int64).max)
            hi = np.full(n_int, np.iinfo(np.int64).min)
            np.minimum.at(lo, s_int[inside], g[inside])
            np.maximum.at(hi, s_int[inside], g[inside])
            good &= lo == hi
    new_index = np.cumsum(good) - 1  # aligned intervals renumbered 0..n_spans-1
    spans = np.stack([cuts[:-1][good], cuts[1:][good]], axis=1) if n_int else \
        np.zeros((0, 2), dtype=np.int64)

    def span_of(interval: np.ndarray) -> np.ndarray:
        out = np.full(len(interval), -1, dtype=np.int64)
        keep = interval >= 0
        keep[keep] = good[interval[keep]]
        out[keep] = new_index[interval[keep]]
        return out

    return Alignment(span_of(s_int), span_of(t_int), spans.astype(np.int64).reshape(-1, 2),
                     int(text_len))


def span_sums(values: Sequence[float], span: np.ndarray, num_spans: int) -> np.ndarray:
    """[num_spans] float64: the sum of `values` over each span's tokens (span index -1: none)."""
    v = np.asarray(values, dtype=np.float64)
    if v.shape != span.shape:
        raise ValueError(f"{v.shape[0]} values for {span.shape[0]} tokens")
    keep = span >= 0
    return np.bincount(span[keep], weights=v[keep], minlength=num_spans)


def span_differences(student_logprobs: Sequence[float], teacher_logprobs: Sequence[float],
                     al: Alignment) -> np.ndarray:
    """[n_spans] float64: D_S = log pi_s(S) - log pi_T(S), each the sum over its tokens."""
    return (span_sums(student_logprobs, al.student_span, al.num_spans)
            - span_sums(teacher_logprobs, al.teacher_span, al.num_spans))


def spread_sampled(student_logprobs: Sequence[float], teacher_logprobs: Sequence[float],
                   al: Alignment) -> np.ndarray:
    """[n_s] float64 per-student-token teacher values `s_t - D_S` (s_t for unaligned tokens),
    so that `s_t - value_t` is each token's span difference D_S (0 unaligned)."""
    s = np.asarray(student_logprobs, dtype=np.float64)
    d = span_differences(s, teacher_logprobs, al)
    aligned = al.student_span >= 0
    return np.where(aligned, s - d[np.maximum(al.student_span, 0)] if al.num_spans else s, s)


# --- distributions: exact-match strings, sorted probabilities ----------------------------------

def vocab_map(student_strings: Sequence[str | None], teacher_strings: Sequence[str | None]
              ) -> np.ndarray:
    """[len(teacher_strings)] int64: for each teacher id the student id whose token string is
    equal, -1 where there is none or the string is not unique on either side (None = a token
    that is never mapped, e.g. a special token)."""
    def unique(strings: Sequence[str | None]) -> dict[str, int]:
        seen: dict[str, int] = {}
        dup: set[str] = set()
        for i, x in enumerate(strings):
            if x is None or x == "":
                continue
            if x in seen:
                dup.add(x)
            seen[x] = i
        return {x: i for x, i in seen.items() if x not in dup}

    s, t = unique(student_strings), unique(teacher_strings)
    out = np.full(len(teacher_strings), -1, dtype=np.int64)
    for x, j in t.items():
        if x in s:
            out[j] = s[x]
    return out


@dataclass(frozen=True)
class MappedTopK:
    """A teacher's top-k moved onto the student's tokens (`map_topk`)."""

    ids: np.ndarray  # [n_s, k] int64 student ids; rows padded by repeating their last entry
    logprobs: np.ndarray  # [n_s, k] float64 the teacher's log-probs of those ids
    valid: np.ndarray  # [n_s, k] bool: the real (non-padding) entries
    matched: np.ndarray  # [n_s] bool: rows of a one-to-one span with >= 1 mapped entry
    dropped_mass: np.ndarray  # [n_s] float64: teacher top-k probability without a match


def map_topk(teacher_ids: np.ndarray, teacher_logprobs: np.ndarray,
             student_tokens: Sequence[int], al: Alignment, id_map: np.ndarray,
             rows: str = "one_to_one") -> MappedTopK:
    """The teacher's top-k ([n_t, k] ids and log-probs) as sets over student ids, one row per
    student token: at the rows' student tokens the entries whose teacher id maps to a student
    id (`id_map`: `vocab_map`'s exact texts, or a first-token map), in the teacher's order,
    entries mapped to one student id merged (their probabilities summed); every other row is
    the student's own token with log-prob 0 alone (its set KL is exactly 0). `rows`:
    "one_to_one" (spans of one token on each side, against that teacher token) or
    "span_starts" (the first student token of every aligned span, against the span's first
    teacher token: `span_starts`). `dropped_mass` is the teacher probability of the dropped
    entries of those rows (0 elsewhere)."""
    ids = np.asarray(teacher_ids, dtype=np.int64)
    lps = np.asarray(teacher_logprobs, dtype=np.float64)
    tokens = np.asarray(student_tokens, dtype=np.int64)
    n_s = len(tokens)
    if ids.ndim != 2 or ids.shape != lps.shape or ids.shape[0] != len(al.teacher_span):
        raise ValueError(f"teacher top-k {ids.shape} / {lps.shape} must be [n_t, k] with n_t = "
                         f"{len(al.teacher_span)}")
    if al.student_span.shape != (n_s,):
        raise ValueError(f"{n_s} student tokens for an alignment of {len(al.student_span)}")
    k = max(ids.shape[1], 1)
    out_ids = np.repeat(tokens[:, None], k, axis=1)
    out_lps = np.zeros((n_s, k), dtype=np.float64)
    valid = np.zeros((n_s, k), dtype=bool)
    valid[:, 0] = True
    matched = np.zeros(n_s, dtype=bool)
    dropped = np.zeros(n_s, dtype=np.float64)
    if rows == "one_to_one":
        partner = al.teacher_of()
    elif rows == "span_starts":
        partner = np.full(n_s, -1, dtype=np.int64)
        first_s, first_t = span_starts(al)
        ok = (first_s < n_s) & (first_t < len(al.teacher_span))
        partner[first_s[ok]] = first_t[ok]
    else:
        raise ValueError(f"rows = {rows!r}; use 'one_to_one' or 'span_starts'")
    for i in np.flatnonzero(partner >= 0):
        row_ids, row_lps = ids[partner[i]], lps[partner[i]]
        in_range = (row_ids >= 0) & (row_ids < len(id_map))
        mapped = np.where(in_range, id_map[np.clip(row_ids, 0, len(id_map) - 1)], -1)
        keep = mapped >= 0
        dropped[i] = float(np.exp(row_lps[~keep]).sum())
        if not keep.any():
            continue
        # entries of one student id merged, in the order of their first appearance
        uniq, first, inverse = np.unique(mapped[keep], return_index=True, return_inverse=True)
        merged = np.full(len(uniq), -np.inf)
        np.logaddexp.at(merged, inverse, row_lps[keep])
        order = np.argsort(first, kind="stable")
        m = len(uniq)
        out_ids[i, :m], out_lps[i, :m] = uniq[order], merged[order]
        out_ids[i, m:], out_lps[i, m:] = uniq[order][-1], merged[order][-1]
        valid[i] = False
        valid[i, :m] = True
        matched[i] = True
    return MappedTopK(out_ids, out_lps, valid, matched, dropped)


def span_starts(al: Alignment) -> tuple[np.ndarray, np.ndarray]:
    """([n_spans] the first student token of each aligned span, [n_spans] its first teacher
    token): the two positions whose next-token distributions condition on the same text (all
    of it before the span), where the sorted-probability term compares them."""
    n = al.num_spans
    out = []
    for span in (al.student_span, al.teacher_span):
        first = np.full(n, len(span), dtype=np.int64)
        at = np.flatnonzero(span >= 0)
        np.minimum.at(first, span[at], at)
        out.append(first)
    return out[0], out[1]


def repeated_entries(ids: torch.Tensor) -> torch.Tensor:
    """[..., k] bool: entries whose id already appeared earlier in the same row (padding of
    `map_topk`'s rows; a server's top-k never repeats an id)."""
    import torch  # here: the numpy alignment above is read without it (logic/teachers.py)

    k = ids.shape[-1]
    eq = ids[..., :, None] == ids[..., None, :]  # [..., k, k]
    earlier = torch.ones(k, k, dtype=torch.bool, device=ids.device).tril(-1)
    return (eq & earlier).any(-1)


def sorted_prob_distance(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor,
                         mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """ULD-style distance per position [B, T]: `sum_i |p_(i) - q_(i)|` between the student's
    probabilities (softmax(logits / T) over its vocabulary, sorted descending) and the
    teacher's (exp of `teacher_logprobs` [B, T, k], e.g. a server's top-k, -inf = padding,
    sorted descending), both padded with zeros to one length; differentiable in the student
    logits [B, T, V], the teacher detached, 0 off the mask. Costs a sort of the student's
    vocabulary per position; no token correspondence is used."""
    if student_logits.shape[:-1] != mask.shape or teacher_logprobs.shape[:-1] != mask.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher log-probs "
                         f"{tuple(teacher_logprobs.shape)} must be [B, T, *] over the mask "
                         f"{tuple(mask.shape)}")
    import torch  # here: the numpy alignment above is read without it (logic/teachers.py)

    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    t = temperature if temperature > 0 else 1.0
    p = torch.softmax(student_logits.to(dtype) / t, dim=-1).sort(dim=-1, descending=True).values
    q = teacher_logprobs.detach().to(dtype).exp().sort(dim=-1, descending=True).values
    width = max(p.shape[-1], q.shape[-1])
    p = torch.nn.functional.pad(p, (0, width - p.shape[-1]))
    q = torch.nn.functional.pad(q, (0, width - q.shape[-1]))
    d = (p - q).abs().sum(-1)
    return torch.where(mask.bool(), d, torch.zeros_like(d))


# --- sampled token, causal within a span: the teacher's prefix probabilities ---------------------

def prefix_teacher_logprobs(student_logprobs: Sequence[float], teacher_logprobs: Sequence[float],
                            al: Alignment, text: str, student_offsets: Sequence,
                            teacher_ids: Sequence[int], top_ids: np.ndarray,
                            top_logprobs: np.ndarray,
                            teacher_strings: Sequence[str | None]) -> np.ndarray:
    """[n_s] float64 per-student-token teacher values for `span_credit = "prefix"`: causal
    values from the teacher's prefix probabilities at spans of one teacher token u (and any
    number m of student tokens c_1..c_m): student token j gets `log P_j - log P_{j-1}`, P_j the
    teacher's probability, at u's position, that its next token's text starts with c_1..c_j
    (summed over its top-k entries with such a text, u itself always counted; at least
    p_T(u), at most 1), P_0 = 1. What is left of u's log-prob, `log p_T(u) - log P_m` (the
    teacher's token ends exactly here, not in a longer token: "1" and not "12"), goes to the
    next student token when that one starts a span of one teacher token too, else stays on
    c_m. So the values sum to the teacher's log-prob of the whole aligned text, each student
    token has a causal teacher log-prob of its own, and the trainer's r_t = student_t -
    value_t is exact with the trainer's own log-probs. Spans of one student token and several
    teacher tokens get log pi_T(S); spans of several tokens on both sides the spread of
    `spread_sampled`. `text`: the response's characters in the alignment's coordinates;
    student_offsets [n_s, 2]; top_ids / top_logprobs [n_t, k]: the teacher's top-k at its
    tokens; teacher_strings: each teacher id's text (None: special)."""
    s = np.asarray(student_logprobs, dtype=np.float64)
    t_lp = np.asarray(teacher_logprobs, dtype=np.float64)
    offs = _offsets(student_offsets, "student")
    out = spread_sampled(s, t_lp, al)
    n = al.num_spans
    s_count = np.bincount(al.student_span[al.student_span >= 0], minlength=n)
    t_count = np.bincount(al.teacher_span[al.teacher_span >= 0], minlength=n)
    t_sum = span_sums(t_lp, al.teacher_span, n)
    aligned = np.flatnonzero(al.student_span >= 0)
    alone = aligned[s_count[al.student_span[aligned]] == 1]
    out[alone] = t_sum[al.student_span[alone]]
    teacher_of_span = np.full(n, -1, dtype=np.int64)
    t_idx = np.flatnonzero(al.teacher_span >= 0)
    teacher_of_span[al.teacher_span[t_idx]] = t_idx
    causal = t_count == 1
    carry = 0.0  # the previous span's remainder, owed to this span's first student token
    for span in range(n):  # spans are in text order
        if not causal[span]:
            continue
        u = int(teacher_of_span[span])
        u_id, u_lp = int(teacher_ids[u]), float(t_lp[u])
        entries = [(teacher_strings[i] if 0 <= i < len(teacher_strings) else None, lp)
                   for i, lp in zip(np.asarray(top_ids[u]).tolist(),
                                    np.asarray(top_logprobs[u], dtype=np.float64).tolist())
                   if i != u_id]
        entries.append((teacher_strings[u_id], u_lp))
        members = np.flatnonzero(al.student_span == span)
        members = members[np.argsort(offs[members, 1], kind="stable")]
        start = int(al.spans[span, 0])
        prev = 0.0  # log P_0
        for t in members:
            prefix = text[start:int(offs[t, 1])]
            mass = sum(math.exp(lp) for x, lp in entries
                       if x is not None and prefix and x.startswith(prefix))
            cur = min(max(math.log(mass) if mass > 0 else u_lp, u_lp), 0.0)
            out[t] = cur - prev
            prev = cur
        out[members[0]] += carry
        carry = u_lp - prev
        nxt = members[-1] + 1
        if not (nxt < len(s) and al.student_span[nxt] >= 0 and causal[al.student_span[nxt]]
                and al.student_span[nxt] != span):
            out[members[-1]] += carry  # no causal token next: the remainder stays here
            carry = 0.0
    return out
