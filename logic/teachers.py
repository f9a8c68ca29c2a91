"""Multi-teacher distillation bookkeeping (pure logic): teachers, routing, compatibility, replies.

A run declares teachers (name, checkpoint, the sample domains routed to it, a coefficient) and
optionally a default teacher for domains no teacher claims. Routing is by the sample's domain;
a domain with no teacher and no default gets teacher "" (no distillation signal; counted).
A teacher whose vocabulary differs from the student's is refused before anything runs: token
ids are compared, not texts, since distillation compares log-probs of the same token ids.

Server replies: a teacher server (the embedded worker or SGLang) scores `prompt + response` with
`max_new_tokens = 0`, `logprob_start_len = len(prompt)` and, for top-k, `top_logprobs_num = k`;
`meta_info.input_token_logprobs` then holds one `[logprob, token_id, text]` per response token,
and `meta_info.input_top_logprobs` one list of k such triples per response token.
Invariant: every parsed reply is response-aligned and checked against the response's token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from algos.opd import OpdConfig


class TeacherSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One teacher of a distillation run."""

    name: str  # used in metrics (opd/<name>/...) and in Sample.teacher
    model: str  # checkpoint: an HF directory or a built-in tiny model name
    domains: list[str] = []  # sample domains routed to this teacher
    coef: float = 1.0  # multiplies the run's opd kl_coef for this teacher's samples
    worker: str = ""  # server mode: peer name of the inference worker serving this teacher
    url: str = ""  # server mode: base URL of an external teacher server (e.g. SGLang)
    opd: OpdConfig | None = None  # this teacher's signal (colocated only; None = the run's opd)


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


def check_vocab(student: Any, teacher: Any, name: str) -> None:
    """Refuse a teacher whose tokenizer maps tokens to other ids than the student's."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        diff = sorted(set(s_vocab.items()) ^ set(t_vocab.items()))[:3]
        raise ValueError(
            f"teacher {name!r} has a different vocabulary from the student ({len(t_vocab)} vs "
            f"{len(s_vocab)} tokens; first differences {diff}): distillation compares log-probs "
            "of the same token ids, so the teacher must use the student's tokenizer")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(student, attr, None) != getattr(teacher, attr, None):
            raise ValueError(f"teacher {name!r}: {attr} differs from the student's")


def parse_scores(reply: dict, response_ids: Sequence[int], top_k: int = 0
                 ) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """(log-probs, top-k ids, top-k log-probs) per response token from a scoring reply."""
    meta = reply["meta_info"]
    triples = meta["input_token_logprobs"]
    if len(triples) != len(response_ids):
        raise ValueError(f"teacher scored {len(triples)} tokens for a response of "
                         f"{len(response_ids)}")
    ids = [t[1] for t in triples]
    if ids != list(response_ids):
        raise ValueError("teacher scored other tokens than the response's")
    logprobs = [float(t[0]) for t in triples]
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    if top_k:
        tops = meta["input_top_logprobs"]
        top_ids = [[int(t[1]) for t in pos] for pos in tops]
        top_lps = [[float(t[0]) for t in pos] for pos in tops]
    return logprobs, top_ids, top_lps


def score_request(prompt_ids: Sequence[int], response_ids: Sequence[int], temperature: float,
                  top_k: int = 0) -> dict[str, Any]:
    """The /generate body that scores a response under a teacher (no generation)."""
    body: dict[str, Any] = {"input_ids": list(prompt_ids) + list(response_ids),
                            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
                            "return_logprob": True, "logprob_start_len": len(prompt_ids)}
    if top_k:
        body["top_logprobs_num"] = top_k
    return body


def teacher_order(teachers: Sequence[str]) -> list[str]:
    """Distinct non-empty teachers in first-appearance order (one switch each per step)."""
    return list(dict.fromkeys(t for t in teachers if t))
