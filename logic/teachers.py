"""Multi-teacher distillation bookkeeping (pure logic): teachers, routing, compatibility, replies.

A run declares teachers (name, checkpoint, the sample domains routed to it, a coefficient) and
optionally a default teacher for domains no teacher claims. Routing is by the sample's domain;
a domain with no teacher and no default gets teacher "" (no distillation signal; counted).
A teacher declared with the student's tokenizer (`tokenizer = "student"`, the default) whose
vocabulary differs is refused before anything runs: token ids are compared, not texts, since
distillation compares log-probs of the same token ids. A teacher with its own tokenizer
(`tokenizer = "auto"`: the teacher checkpoint's, or a tokenizer directory) that differs is
scored across vocabularies (`CrossVocab`): the student's prompt and response are decoded and
re-encoded with the teacher's tokenizer, each segment of text between special tokens on its own
(so no teacher token straddles a special token or the prompt/response boundary), with character
offsets; a special token of the response counts as one character and maps to the teacher's
token of the same role (bos, eos, pad), else its span is unaligned. The spans and signals are
algos/cross_tokenizer.py's.

Server replies: a teacher server (the embedded worker or SGLang) scores `prompt + response` with
`max_new_tokens = 0`, `logprob_start_len = len(prompt) - 1` and, for top-k, `top_logprobs_num = k`.
SGLang's `meta_info.input_token_logprobs` then holds one `[logprob, token_id, text]` per token of
the window `input_ids[len(prompt) - 1:]` (the last prompt token, then each response token), and
the FIRST entry's logprob is null: SGLang reports none for the first token of the returned
window, whatever context precedes it. Starting the window one token early therefore puts that
null on the last prompt token and gives every response token, the first one included, its real
log-prob. `meta_info.input_top_logprobs` is aligned the same way (null, then one list of up to k
triples per response token). tests/fixtures/sglang/ holds such answers and the SGLang version
they follow.
Invariant: every parsed reply is response-aligned and checked against the sample's token ids; a
null anywhere but the window's first position, a missing or non-finite value, or other tokens is
a ScoreError naming the teacher and the sample. Top-k come out as [response_len, k] arrays
(`Sample`'s int32 ids and float32 log-probs), so every position must hold the same number of
entries, token ids must fit int32, and log-probs float32.
"""

from __future__ import annotations

import collections
import math
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from algos.cross_tokenizer import (
    Alignment,
    MappedTopK,
    align,
    map_topk,
    prefix_teacher_logprobs,
    span_starts,
    spread_sampled,
    vocab_map,
)
from algos.opd_config import OpdConfig
from transport.errors import RlxError
from transport.schema import TOPK_IDS_DTYPE, TOPK_LOGPROBS_DTYPE

TOPK_ID_LIMIT = 1 << 31  # token ids of a top-k reply must fit TOPK_IDS_DTYPE (int32)


class TeacherSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One teacher of a distillation run."""

    name: str  # used in metrics (opd/<name>/...) and in Sample.teacher
    model: str  # checkpoint: an HF directory or a built-in tiny model name
    domains: list[str] = []  # sample domains routed to this teacher
    coef: float = 1.0  # multiplies the run's opd kl_coef for this teacher's samples
    worker: str = ""  # server mode: peer name of the inference worker serving this teacher
    url: str = ""  # server mode: base URL of an external teacher server (e.g. SGLang)
    opd: OpdConfig | None = None  # this teacher's signal (colocated only; None = the run's opd)
    # "student": the teacher shares the student's tokenizer (refused if its vocabulary differs);
    # "auto": the teacher checkpoint's own tokenizer, scored across vocabularies where it
    # differs (server or colocated); or a tokenizer directory
    tokenizer: str = "student"
    # across vocabularies, sampled signal within a span of several student tokens: "spread"
    # (each carries the span's difference) or "prefix" (each its own causal share, from the
    # teacher's top-`prefix_top_k` prefix probabilities): algos/cross_tokenizer.py
    span_credit: str = "spread"
    prefix_top_k: int = 20
    # across vocabularies, top_k mode: "exact" (the teacher's top-k ids mapped to student ids of
    # the same text, at spans of one token on each side) or "first_token" (each teacher token to
    # the student token its text starts with, probabilities of one student token summed, at the
    # first student token of every aligned span): algos/cross_tokenizer.py `map_topk`
    topk_map: str = "exact"

    def __post_init__(self) -> None:
        if not self.tokenizer:
            raise ValueError(f"teacher {self.name!r}: tokenizer must be 'student', 'auto' or a "
                             "tokenizer directory")
        if self.span_credit not in ("spread", "prefix"):
            raise ValueError(f"teacher {self.name!r}: span_credit = {self.span_credit!r}; use "
                             "'spread' or 'prefix'")
        if self.topk_map not in ("exact", "first_token"):
            raise ValueError(f"teacher {self.name!r}: topk_map = {self.topk_map!r}; use "
                             "'exact' or 'first_token'")
        if self.prefix_top_k < 1:
            raise ValueError(f"teacher {self.name!r}: prefix_top_k must be >= 1")


def tokenizer_source(spec: TeacherSpec) -> str:
    """Where the teacher's tokenizer is loaded from: its checkpoint, or its `tokenizer` path."""
    return spec.model if spec.tokenizer in ("student", "auto") else spec.tokenizer


def route_table(teachers: Sequence[TeacherSpec], default: str = "") -> dict[str, str]:
    """domain -> teacher name; ValueError for duplicate names, a domain claimed twice, or an
    unknown default."""
    names = [t.name for t in teachers]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"teacher names must be unique; repeated: {dup}")
    if default and default not in names:
        raise ValueError(f"default_teacher = {default!r} is not a declared teacher {names}")
    table: dict[str, str] = {}
    for t in teachers:
        for d in t.domains:
            if d in table:
                raise ValueError(f"domain {d!r} is routed to both {table[d]!r} and {t.name!r}; "
                                 "give each domain one teacher")
            table[d] = t.name
    return table


def opd_configs(teachers: Sequence[TeacherSpec], run: OpdConfig) -> dict[str, OpdConfig]:
    """Each teacher's OPD config: its own, else the run's."""
    return {t.name: t.opd or run for t in teachers}


def route(domain: str, table: dict[str, str], default: str = "") -> str:
    return table.get(domain, default)


def same_vocab(student: Any, teacher: Any) -> bool:
    """The two tokenizers map every token to the same id and agree on bos / eos / pad."""
    return student.get_vocab() == teacher.get_vocab() and all(
        getattr(student, a, None) == getattr(teacher, a, None)
        for a in ("bos_token_id", "eos_token_id", "pad_token_id"))


def cross_vocab(student: Any, teacher: Any, spec: TeacherSpec) -> CrossVocab | None:
    """The teacher's `CrossVocab` against the student when its tokenizer differs, None when
    both share one; ValueError for a teacher declared with the student's tokenizer
    (`tokenizer = "student"`, the default) whose vocabulary differs, or whose tokenizer gives no
    character offsets."""
    if same_vocab(student, teacher):
        return None
    if spec.tokenizer == "student":
        check_vocab(student, teacher, spec.name)  # raises, naming the differences
    if not getattr(teacher, "is_fast", False):
        raise ValueError(f"teacher {spec.name!r}: its tokenizer gives no character offsets "
                         "(a fast, tokenizers-library tokenizer is needed to align it with "
                         "the student's)")
    return CrossVocab(student, teacher)


def check_vocab(student: Any, teacher: Any, name: str) -> None:
    """Refuse a teacher whose tokenizer maps tokens to other ids than the student's."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        diff = sorted(set(s_vocab.items()) ^ set(t_vocab.items()))[:3]
        raise ValueError(
            f"teacher {name!r} has a different vocabulary from the student ({len(t_vocab)} vs "
            f"{len(s_vocab)} tokens; first differences {diff}): distillation compares log-probs "
            "of the same token ids, so the teacher must use the student's tokenizer, or declare "
            "its own (tokenizer = \"auto\": scored across vocabularies, docs/mopd.md)")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(student, attr, None) != getattr(teacher, attr, None):
            raise ValueError(f"teacher {name!r}: {attr} differs from the student's")


SPECIAL_ROLES = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Retokenized:
    """One sample in the teacher's tokens, and the spans it shares with the student's."""

    prompt_ids: list[int]  # the teacher's tokens of the decoded prompt
    response_ids: list[int]  # the teacher's tokens of the decoded response
    alignment: Alignment  # student response tokens <-> teacher response tokens
    text: str  # the response's characters (a special token: one NUL character)
    student_offsets: list[tuple[int, int]]  # each student response token's [start, end)


def token_strings(tokenizer: Any) -> list[str | None]:
    """Each id's decoded text (None for special tokens): what `vocab_map` compares."""
    special = set(tokenizer.all_special_ids)
    size = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    return [None if i in special else tokenizer.decode([i]) for i in range(size)]


def _char_offsets(tokenizer: Any, ids: list[int], text: str) -> list[tuple[int, int]]:
    """Each token's [start, end) in `text` (its decoding): one decode per token when they
    concatenate to the text, else by decoding prefixes (a token that completes no character,
    e.g. a partial UTF-8 byte, gets zero width)."""
    pieces = [tokenizer.decode([i]) for i in ids]
    if "".join(pieces) == text:
        ends = np.cumsum([len(p) for p in pieces]).tolist()
    else:
        ends, end = [], 0
        for n in range(1, len(ids) + 1):
            prefix = tokenizer.decode(ids[:n])
            if text.startswith(prefix) and len(prefix) >= end:
                end = len(prefix)
            ends.append(end)
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


class CrossVocab:
    """A student tokenizer and a teacher tokenizer of another vocabulary: re-tokenization of
    samples for the teacher, the aligned spans, and the exact-match id map (see the module
    docstring)."""

    def __init__(self, student: Any, teacher: Any):
        self.student, self.teacher = student, teacher
        self.student_special = set(student.all_special_ids)
        self.roles = {getattr(student, r): getattr(teacher, r, None) for r in SPECIAL_ROLES
                      if getattr(student, r, None) is not None}
        self.teacher_unk = getattr(teacher, "unk_token_id", None)
        self._id_map: np.ndarray | None = None
        self._first_map: np.ndarray | None = None
        self._teacher_strings: list[str | None] | None = None

    @property
    def teacher_strings(self) -> list[str | None]:
        """Each teacher id's text (None: special); built on first use."""
        if self._teacher_strings is None:
            self._teacher_strings = token_strings(self.teacher)
        return self._teacher_strings

    @property
    def first_map(self) -> np.ndarray:
        """Teacher id -> the student id of the same text (`id_map`), else of the student
        tokenizer's first token of its text (-1: a text of no student token); built on first
        use (one encode per teacher id)."""
        if self._first_map is None:
            m = self.id_map.copy()
            for t_id in np.flatnonzero(m < 0):
                text = self.teacher_strings[t_id] if t_id < len(self.teacher_strings) else None
                if text:
                    ids = self.student.encode(text, add_special_tokens=False)
                    if ids and ids[0] not in self.student_special:
                        m[t_id] = ids[0]
            self._first_map = m
        return self._first_map

    @property
    def id_map(self) -> np.ndarray:
        """Teacher id -> student id of the same text, or of the same role for bos / eos / pad
        (-1: none); built on first use."""
        if self._id_map is None:
            m = vocab_map(token_strings(self.student), self.teacher_strings)
            for s_id, t_id in self.roles.items():  # special tokens map by role (eos to eos)
                if t_id is not None and 0 <= t_id < len(m):
                    m[t_id] = s_id
            self._id_map = m
        return self._id_map

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.teacher(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def _convert(self, ids: list[int]) -> tuple[list, list[int], list, str]:
        """(student offsets, teacher ids, teacher offsets, text) of a token list: text
        between special tokens re-encoded segment by segment; a special token is one
        character, mapped to the teacher's token of its role where there is one."""
        s_off: list[tuple[int, int]] = []
        t_ids: list[int] = []
        t_off: list[tuple[int, int]] = []
        texts: list[str] = []
        pos = i = 0
        while i < len(ids):
            if ids[i] in self.student_special:
                texts.append("\0")
                s_off.append((pos, pos + 1))
                mapped = self.roles.get(ids[i])
                if mapped is not None:
                    t_ids.append(mapped)
                    t_off.append((pos, pos + 1))
                pos += 1
                i += 1
                continue
            j = i
            while j < len(ids) and ids[j] not in self.student_special:
                j += 1
            segment = ids[i:j]
            text = self.student.decode(segment)
            s_off += [(pos + a, pos + b) for a, b in _char_offsets(self.student, segment, text)]
            enc_ids, enc_off = self._encode(text)
            t_ids += enc_ids
            t_off += [(pos + a, pos + b) for a, b in enc_off]
            texts.append(text)
            pos += len(text)
            i = j
        return s_off, t_ids, t_off, "".join(texts)

    def retokenize(self, prompt_ids: Sequence[int], response_ids: Sequence[int],
                   loss_mask: Sequence[int] | None = None) -> Retokenized:
        """The sample in the teacher's tokens (prompt and response converted separately, so
        the boundary stays a boundary) and the spans its response shares with the student's;
        `loss_mask`: a span mixing policy and observation tokens is not aligned."""
        t_prompt = self._convert(list(prompt_ids))[1]
        if not t_prompt:
            raise ScoreError("the prompt converts to no teacher token: a response cannot be "
                             "scored without one")
        s_off, t_ids, t_off, text = self._convert(list(response_ids))
        t_ok = [t != self.teacher_unk for t in t_ids]
        al = align(s_off, t_off, len(text), teacher_ok=t_ok,
                   student_group=None if loss_mask is None else list(loss_mask))
        return Retokenized(t_prompt, t_ids, al, text, s_off)


    def onto_student(self, r: Retokenized, rollout_logprobs: Sequence[float],
                     response_ids: Sequence[int], loss_mask: Sequence[int],
                     logprobs: Sequence[float], top_ids: np.ndarray | None,
                     top_lps: np.ndarray | None, top_k: int, prefix: bool,
                     stats: collections.Counter | None = None, sorted_term: bool = False,
                     topk_map: str = "exact") -> StudentScores:
        """The teacher's scores of its own tokens (`logprobs` [n_t], top-k [n_t, >= k]) moved onto
        the student's tokens of sample `r` (algos/cross_tokenizer.py): the per-token
        teacher values [n_s] float64 (`spread_sampled`, or with `prefix` the causal
        shares of `prefix_teacher_logprobs`, which read the top-k), with `top_k` the
        first k entries mapped to student ids (`map_topk`, by `topk_map`: "exact" or
        "first_token"), and with `sorted_term` the teacher's top-k log-probs at the
        first policy token of each span the mapped set does not cover (`span_starts`:
        the sorted-probability term's rows); the alignment's counts are added to `stats`
        (chars, aligned_chars, spans, cross_samples; topk_policy_tokens, topk_matched,
        topk_dropped_mass; sorted_rows). The teacher pool and colocated teachers both
        read scores this way."""
        al = r.alignment
        if prefix:
            values = prefix_teacher_logprobs(rollout_logprobs, logprobs, al, r.text,
                                             r.student_offsets, r.response_ids, top_ids,
                                             top_lps, self.teacher_strings)
        else:
            values = spread_sampled(rollout_logprobs, logprobs, al)
        mapped = None
        if top_k:  # the run's k (a prefix teacher may have been asked for more)
            first = topk_map == "first_token"
            mapped = map_topk(top_ids[:, :top_k], top_lps[:, :top_k], response_ids, al,
                              self.first_map if first else self.id_map,
                              "span_starts" if first else "one_to_one")
        out = StudentScores(values, mapped)
        if sorted_term and mapped is not None:
            first_s, first_t = span_starts(al)
            keep = first_t < len(r.response_ids)
            pos, t_pos = first_s[keep], first_t[keep]
            keep = ~mapped.matched[pos] & (np.asarray(loss_mask, dtype=bool)[pos])
            out.sorted_positions = pos[keep]
            out.sorted_logprobs = np.asarray(top_lps, dtype=np.float64)[t_pos[keep], :top_k]
            if stats is not None:
                stats["sorted_rows"] += int(keep.sum())
        if stats is not None:
            if mapped is not None:
                policy = np.asarray(loss_mask, dtype=bool)
                stats["topk_policy_tokens"] += int(policy.sum())
                stats["topk_matched"] += int((mapped.matched & policy).sum())
                stats["topk_dropped_mass"] += float(
                    mapped.dropped_mass[mapped.matched & policy].sum())
            stats["cross_samples"] += 1
            stats["chars"] += al.total_chars
            stats["aligned_chars"] += al.aligned_chars
            stats["spans"] += al.num_spans
        return out


@dataclass
class StudentScores:
    """A teacher of another vocabulary's scores on the student's tokens (`onto_student`)."""

    values: np.ndarray  # [n_s] float64 per-token teacher values (Sample.teacher_logprobs)
    topk: MappedTopK | None = None  # its top-k mapped to student ids (top_k mode)
    # the sorted-probability term's rows: student token positions [m] int64 and the teacher's
    # top-k log-probs there [m, k] float64 (None: not asked)
    sorted_positions: np.ndarray | None = None
    sorted_logprobs: np.ndarray | None = None


def cross_metrics(name: str, st: Mapping[str, float]) -> dict[str, float]:
    """A cross-vocabulary teacher's alignment metrics from `onto_student`'s counts:
    opd/<name>/aligned_char_frac (response characters inside aligned spans),
    aligned_spans_per_sample, and for top-k topk_matched_frac (policy tokens with a mapped
    set), topk_dropped_mass (the teacher's top-k probability without a student token, per
    matched token) and sorted_rows_frac (policy tokens given the sorted-probability term)."""
    out: dict[str, float] = {}
    if st.get("cross_samples"):
        out[f"opd/{name}/aligned_char_frac"] = (
            st["aligned_chars"] / st["chars"] if st.get("chars") else 1.0)
        out[f"opd/{name}/aligned_spans_per_sample"] = st["spans"] / st["cross_samples"]
    if st.get("topk_policy_tokens"):
        out[f"opd/{name}/topk_matched_frac"] = st["topk_matched"] / st["topk_policy_tokens"]
        out[f"opd/{name}/topk_dropped_mass"] = \
            st["topk_dropped_mass"] / max(st["topk_matched"], 1)
        out[f"opd/{name}/sorted_rows_frac"] = st.get("sorted_rows", 0) / st["topk_policy_tokens"]
    return out


CROSS_COUNTS = ("cross_samples", "chars", "aligned_chars", "spans", "topk_policy_tokens",
                "topk_matched", "topk_dropped_mass", "sorted_rows")  # `onto_student`'s keys


class ScoreError(RlxError, ValueError):
    """A teacher server's reply that cannot be read as scores of the sample it was asked about."""


def score_request(prompt_ids: Sequence[int], response_ids: Sequence[int], temperature: float,
                  top_k: int = 0) -> dict[str, Any]:
    """The /generate body that scores a response under a teacher (no generation); the log-prob
    window starts at the prompt's last token (see the module docstring)."""
    if not prompt_ids:
        raise ValueError("cannot score a response without a prompt: the first response token's "
                         "log-prob needs at least one token before it")
    body: dict[str, Any] = {"input_ids": list(prompt_ids) + list(response_ids),
                            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
                            "return_logprob": True, "logprob_start_len": len(prompt_ids) - 1}
    if top_k:
        body["top_logprobs_num"] = top_k
    return body


def parse_scores(reply: Any, prompt_ids: Sequence[int], response_ids: Sequence[int],
                 top_k: int = 0, where: str = "teacher reply"
                 ) -> tuple[list[float], np.ndarray | None, np.ndarray | None]:
    """(log-probs, top-k ids, top-k log-probs) per response token from the reply to
    `score_request(prompt_ids, response_ids, ...)`; ScoreError (prefixed with `where`, e.g.
    "teacher 'arith', sample g3/1") if the reply is not one. The top-k are
    [len(response_ids), k] arrays (`Sample`'s dtypes; None without top_k), k the number of
    entries the server gave per position: 1 to top_k, the same at every position."""
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(entries, list):
        raise ScoreError(f"{where}: the reply has no meta_info.input_token_logprobs list (was "
                         f"it asked with return_logprob?): {reprlib.repr(reply)}")
    if not prompt_ids:
        raise ScoreError(f"{where}: a sample without a prompt cannot be scored")
    window = [prompt_ids[-1], *response_ids]
    if len(entries) != len(window):
        raise ScoreError(
            f"{where}: {len(entries)} input log-probs for a window of {len(window)} tokens (the "
            f"last prompt token and {len(response_ids)} response tokens); the request must ask "
            f"from logprob_start_len = len(prompt) - 1 = {len(prompt_ids) - 1}")
    ids = [e[1] if isinstance(e, (list, tuple)) and len(e) >= 2 else None for e in entries]
    if ids != window:
        i = next(i for i, (a, b) in enumerate(zip(ids, window)) if a != b)
        raise ScoreError(f"{where}: scored other tokens than the sample's: window position {i} "
                         f"is {reprlib.repr(entries[i])}, expected token {window[i]}")
    logprobs = [_logprob(e[0], where, i, "input_token_logprobs")
                for i, e in enumerate(entries) if i > 0]
    if not top_k:
        return logprobs, None, None
    tops = meta.get("input_top_logprobs")
    if not isinstance(tops, list) or len(tops) != len(window):
        raise ScoreError(f"{where}: meta_info.input_top_logprobs must hold {len(window)} "
                         f"positions (asked with top_logprobs_num = {top_k}), got "
                         f"{reprlib.repr(tops)}")
    top_ids: list[int] = []  # row after row, flat
    top_lps: list[float] = []
    width = len(tops[1]) if len(tops) > 1 and isinstance(tops[1], list) else top_k
    for i, position in enumerate(tops[1:], start=1):
        if not isinstance(position, list) or not 1 <= len(position) <= top_k or not all(
                isinstance(t, (list, tuple)) and len(t) >= 2 and _is_int(t[1])
                and 0 <= t[1] < TOPK_ID_LIMIT for t in position):
            raise ScoreError(f"{where}: input_top_logprobs at window position {i} must be "
                             f"1 to {top_k} [logprob, token_id, text] entries (token ids in "
                             f"[0, {TOPK_ID_LIMIT})), got {reprlib.repr(position)}")
        if len(position) != width:
            raise ScoreError(f"{where}: input_top_logprobs holds {width} entries at window "
                             f"position 1 but {len(position)} at position {i}; a server "
                             f"returns the same number (top_logprobs_num) at every position")
        top_ids += [t[1] for t in position]
        top_lps += [_logprob(t[0], where, i, "input_top_logprobs") for t in position]
    shape = (len(response_ids), width)
    lps = np.array(top_lps, dtype=np.float64)
    if lps.size and np.abs(lps).max() > np.finfo(TOPK_LOGPROBS_DTYPE).max:
        raise ScoreError(f"{where}: input_top_logprobs holds log-probs beyond float32's range")
    return (logprobs, np.array(top_ids, dtype=TOPK_IDS_DTYPE).reshape(shape),
            lps.astype(TOPK_LOGPROBS_DTYPE).reshape(shape))


def _logprob(value: Any, where: str, i: int, field: str) -> float:
    """A log-prob at window position i >= 1, where SGLang always reports a number."""
    if value is None:
        raise ScoreError(f"{where}: {field} has null at window position {i} (response token "
                         f"{i - 1}); SGLang puts null only at the window's first position, so "
                         "the reply is malformed (or the value was not finite: JSON has no "
                         "-inf)")
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)):
        raise ScoreError(f"{where}: {field} at window position {i} is "
                         f"{reprlib.repr(value)}, not a finite log-prob")
    return float(value)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def teacher_order(teachers: Sequence[str]) -> list[str]:
    """Distinct non-empty teachers in first-appearance order (one switch each per step)."""
    return list(dict.fromkeys(t for t in teachers if t))
