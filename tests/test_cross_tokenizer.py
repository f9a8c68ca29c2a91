"""Distillation across vocabularies: span alignment, the signals (float64 references on
hand-made tokenizations whose merges differ), the trainer's reading of them, the pool's
re-tokenization against a served teacher of its own vocabulary, and its config checks."""

from __future__ import annotations

import collections
import copy
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.teacher_pool import TeacherPool, TeacherPoolConfig, cross_teachers
from algos.cross_tokenizer import (
    align,
    map_topk,
    prefix_teacher_logprobs,
    repeated_entries,
    sorted_prob_distance,
    span_differences,
    span_starts,
    spread_sampled,
    vocab_map,
)
from algos.opd import (
    OpdConfig,
    gather_scores,
    ids_reverse_kl,
    sampled_log_ratio,
    top_k_reverse_kl,
)
from logic.teachers import CrossVocab, TeacherSpec
from memory.config import TeacherMemoryConfig
from models.load import load_model, load_tokenizer
from runtime.facts import RunFacts
from tests.helpers import context, metric_records, trainer_steps
from tests.test_engine import serve
from training.batching import make_micro_batch
from training.colocated_teachers import (
    ColocatedTeachers,
    OpdInputs,
    OpdSignals,
    _fill_server,
    _put_topk,
    sampled_ratio,
)
from training.config import TrainConfig
from training.opd_heads import sorted_term_loss
from training.step import opd_term_loss
from transport.schema import Sample

ROOT = Path(__file__).resolve().parent.parent
STUDENT = "examples/base-tiny"
BPE_TEACHER = "examples/teacher-arith-bpe"


def offsets(pieces: list[str]) -> list[tuple[int, int]]:
    out, pos = [], 0
    for p in pieces:
        out.append((pos, pos + len(p)))
        pos += len(p)
    return out


# --- alignment ----------------------------------------------------------------------------------

def test_spans_are_the_shortest_stretches_both_tokenizations_cut():
    # "abcdef": student ab|cd|ef, teacher a|b|cde|f: shared cuts 0, 2, 6
    al = align(offsets(["ab", "cd", "ef"]), offsets(["a", "b", "cde", "f"]), 6)
    assert al.spans.tolist() == [[0, 2], [2, 6]]
    assert al.student_span.tolist() == [0, 1, 1]
    assert al.teacher_span.tolist() == [0, 0, 1, 1]
    assert al.char_frac == 1.0 and not al.one_to_one().any()
    # "12+7=19": student by character, teacher 12|+|7=|19
    al = align(offsets(list("12+7=19")), offsets(["12", "+", "7=", "19"]), 7)
    assert al.spans.tolist() == [[0, 2], [2, 3], [3, 5], [5, 7]]
    assert al.student_span.tolist() == [0, 0, 1, 2, 2, 3, 3]
    assert al.one_to_one().tolist() == [False, False, True, False, False, False, False]
    assert al.teacher_of().tolist() == [-1, -1, 1, -1, -1, -1, -1]
    # the same cuts: every token is its own span, all one-to-one
    al = align(offsets(["ab", "c"]), offsets(["ab", "c"]), 3)
    assert al.one_to_one().all() and al.teacher_of().tolist() == [0, 1]


def test_spans_without_an_exact_tiling_are_not_aligned():
    # the teacher's unknown token spoils its span only
    al = align(offsets(["a", "b", "c"]), offsets(["a", "b", "c"]), 3, teacher_ok=[1, 0, 1])
    assert al.student_span.tolist() == [0, -1, 1] and al.aligned_chars == 2
    assert al.char_frac == pytest.approx(2 / 3)
    # a character the teacher's tokens skip (a normaliser dropped it): its stretch is lost
    al = align(offsets(["ab", "c", "d"]), [(0, 1), (3, 4)], 4)
    assert al.spans.tolist() == [[3, 4]] and al.student_span.tolist() == [-1, -1, 0]
    # overlapping teacher tokens: the stretch they share is not tiled
    al = align(offsets(["a", "b", "c"]), [(0, 2), (1, 3)], 3)
    assert al.num_spans == 0 and al.char_frac == 0.0
    # a span mixing policy and observation tokens is not aligned
    al = align(offsets(["a", "b", "c"]), offsets(["ab", "c"]), 3, student_group=[1, 0, 0])
    assert al.student_span.tolist() == [-1, -1, 0]
    # zero-width tokens belong to the span starting at their offset (the last one at the end)
    al = align([(0, 1), (1, 1), (1, 2), (2, 2)], offsets(["a", "b"]), 2)
    assert al.student_span.tolist() == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="beyond the text"):
        align([(0, 4)], [(0, 3)], 3)


# --- sampled-token signal -------------------------------------------------------------------------

# "12+7=19": student characters, teacher 12|+|7=|19; log-probs chosen by hand
S_PIECES, T_PIECES = list("12+7=19"), ["12", "+", "7=", "19"]
S_LP = [-0.5, -1.25, -0.125, -2.0, -0.25, -0.75, -1.5]
T_LP = [-0.3, -0.2, -1.0, -3.0]


def test_each_student_token_carries_its_spans_difference_float64():
    al = align(offsets(S_PIECES), offsets(T_PIECES), 7)
    # by hand: spans "12", "+", "7=", "19"
    want_d = [(-0.5 - 1.25) - (-0.3), -0.125 - (-0.2), (-2.0 - 0.25) - (-1.0),
              (-0.75 - 1.5) - (-3.0)]
    assert span_differences(S_LP, T_LP, al).tolist() == pytest.approx(want_d, abs=1e-15)
    spread = spread_sampled(S_LP, T_LP, al)
    per_token = [want_d[i] for i in (0, 0, 1, 2, 2, 3, 3)]
    assert (np.asarray(S_LP) - spread).tolist() == pytest.approx(per_token, abs=1e-15)
    # the trainer's r_t = student - teacher (algos/opd.py), at the rollout's log-probs: D_S
    r = sampled_log_ratio(torch.tensor([S_LP], dtype=torch.float64),
                          torch.tensor([spread.tolist()], dtype=torch.float64),
                          torch.ones(1, 7))
    assert r[0].tolist() == pytest.approx(per_token, abs=1e-15)
    # a one-token span on both sides is the same-tokenizer r_t
    assert r[0, 2].item() == pytest.approx(S_LP[2] - T_LP[1], abs=1e-15)
    # unaligned tokens: teacher value = the student's own (r = 0)
    al = align(offsets(S_PIECES), offsets(T_PIECES), 7, teacher_ok=[1, 1, 0, 1])
    spread = spread_sampled(S_LP, T_LP, al)
    assert (np.asarray(S_LP) - spread).tolist() == pytest.approx(
        [want_d[0]] * 2 + [want_d[1], 0.0, 0.0] + [want_d[3]] * 2, abs=1e-15)


def test_prefix_credit_gives_each_student_token_its_causal_share_float64():
    """Student 1|8|+|34|1|+ against teacher 18|+|3|4|1|+: the 2:1 span "18" is split by the
    teacher's prefix probability of "1" (its top-k texts starting with "1"), the 1:2 "34" gets
    the sum of its teacher tokens, and after the 1:1 "1" (a prefix of "18", "19") what is left
    of the teacher's "1" (it ends there) moves to the next token "+"; the values sum to the
    teacher's log-prob of the text."""
    strings = ["18", "1", "19", "8", "2", "+", "3", "4"]  # teacher id -> text
    pieces_s, pieces_t = ["1", "8", "+", "34", "1", "+"], ["18", "+", "3", "4", "1", "+"]
    al = align(offsets(pieces_s), offsets(pieces_t), 8)
    t_ids = [0, 5, 6, 7, 1, 5]
    t_lp = np.log([0.5, 0.9, 0.6, 0.7, 0.3, 0.8]).tolist()
    top_ids = np.array([[0, 1, 2, 4], [5, 6, 7, 4], [6, 7, 5, 4], [7, 6, 5, 4],
                        [0, 1, 2, 4], [5, 6, 7, 4]])
    top_lps = np.log(np.array([[0.5, 0.2, 0.1, 0.1], [0.9, 0.05, 0.03, 0.02],
                               [0.6, 0.2, 0.1, 0.1], [0.7, 0.2, 0.05, 0.05],
                               [0.5, 0.3, 0.1, 0.05], [0.8, 0.1, 0.05, 0.05]]))
    s_lp = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    got = prefix_teacher_logprobs(s_lp, t_lp, al, "18+341+", offsets(pieces_s), t_ids,
                                  top_ids, top_lps, strings)
    p1 = 0.5 + 0.2 + 0.1  # "18", "1", "19" start with "1"
    q1 = 0.5 + 0.3 + 0.1  # at the second "1": "18" 0.5, "1" 0.3, "19" 0.1
    log = math.log
    want = [log(p1), log(0.5) - log(p1), log(0.9), log(0.6) + log(0.7), log(q1),
            log(0.8) + log(0.3) - log(q1)]
    assert got.tolist() == pytest.approx(want, abs=1e-15)
    assert got.sum() == pytest.approx(sum(t_lp), abs=1e-12)
    # the trainer's r_t = its own log-prob - value: each token's causal gap, whatever its drift
    student = torch.tensor([s_lp], dtype=torch.float64) + 0.01
    r = sampled_log_ratio(student, torch.tensor([got.tolist()], dtype=torch.float64),
                          torch.ones(1, 6))
    assert r[0].tolist() == pytest.approx([x + 0.01 - w for x, w in zip(s_lp, want)],
                                          abs=1e-15)
    # u outside its own top-k still counts in every prefix: P_1 >= p_T(u)
    top_ids[0] = [1, 2, 4, 3]
    top_lps[0] = np.log([0.2, 0.1, 0.1, 0.05])
    got = prefix_teacher_logprobs(s_lp, t_lp, al, "18+341+", offsets(pieces_s), t_ids,
                                  top_ids, top_lps, strings)
    assert got[:2].tolist() == pytest.approx([log(p1), log(0.5) - log(p1)], abs=1e-15)


def sample(prompt: list[int], response: list[int], **kw) -> Sample:
    return Sample(group_id="g", index=0, domain="math", prompt_ids=prompt,
                  response_ids=response, loss_mask=[1] * len(response),
                  rollout_logprobs=kw.pop("rollout", [-1.0] * len(response)),
                  teacher=kw.pop("teacher", "t"), **kw)


def server_inputs(samples: list[Sample], mode: str) -> OpdInputs:
    mb = make_micro_batch(samples)
    inp = OpdInputs(mask=mb.mask, coef=torch.ones(len(samples)),
                    configs=[OpdConfig(mode=mode, top_k=3 if mode == "top_k" else 0,
                                       top_k_from="teacher" if mode == "top_k" else "student")]
                    * len(samples))
    _fill_server(inp, mb, mode)
    return inp


def test_the_trainer_reads_the_spread_as_the_spans_difference():
    """Through the sample and the trainer's own reading (training/colocated_teachers.py):
    r_t = trainer log-prob - teacher value = D_S + the token's drift from the rollout."""
    al = align(offsets(S_PIECES), offsets(T_PIECES), 7)
    s = sample([1, 5], list(range(4, 11)), rollout=S_LP)
    s.teacher_logprobs = spread_sampled(S_LP, T_LP, al).tolist()
    inp = server_inputs([s], "sampled")
    drift = torch.tensor([[0.0, 0.01, 0.0, -0.02, 0.0, 0.0, 0.03]])
    student = torch.tensor([S_LP]) + drift  # the trainer's recomputed log-probs
    r = sampled_ratio(student, inp)
    want = torch.tensor([[span_differences(S_LP, T_LP, al)[i] for i in (0, 0, 1, 2, 2, 3, 3)]])
    assert torch.allclose(r.double(), want + drift.double(), atol=1e-6, rtol=0)


# --- distribution signals -----------------------------------------------------------------------

# student vocabulary by id and a teacher's of other ids, merges ("12") and a repeated text
S_VOCAB = ["<eos>", "1", "2", "+", "7", "=", "9", "x"]
T_VOCAB = ["<eos>", "=", "+", "12", "9", "7", "1", "2", "y", "y"]


def test_vocab_map_pairs_equal_unique_texts():
    m = vocab_map([None] + S_VOCAB[1:], [None] + T_VOCAB[1:])
    assert m.tolist() == [-1, 5, 3, -1, 6, 4, 1, 2, -1, -1]


def topk_case():
    """Student "1","2","+","7" vs teacher "12","+","7": spans "12" (2:1), "+" and "7" (1:1)."""
    al = align(offsets(["1", "2", "+", "7"]), offsets(["12", "+", "7"]), 4)
    id_map = vocab_map([None] + S_VOCAB[1:], [None] + T_VOCAB[1:])
    lp = np.log
    t_ids = np.array([[3, 6, 7], [2, 3, 8], [5, 4, 1]])  # teacher top-3 of its 3 tokens
    t_lps = np.array([[lp(0.7), lp(0.2), lp(0.05)],
                      [lp(0.6), lp(0.3), lp(0.05)],  # "12" has no student token: dropped
                      [lp(0.5), lp(0.25), lp(0.125)]])
    return al, id_map, t_ids, t_lps


def test_topk_moves_onto_student_ids_and_reports_the_dropped_mass():
    al, id_map, t_ids, t_lps = topk_case()
    m = map_topk(t_ids, t_lps, [1, 2, 3, 4], al, id_map)
    assert m.matched.tolist() == [False, False, True, True]
    assert m.dropped_mass.tolist() == pytest.approx([0, 0, 0.3 + 0.05, 0.0], abs=1e-15)
    # the 2:1 span's rows: the student's own token alone (log-prob 0), padded by repeats
    assert m.ids[:2].tolist() == [[1, 1, 1], [2, 2, 2]]
    assert m.valid[:2].tolist() == [[True, False, False]] * 2
    assert m.ids[2].tolist() == [3, 3, 3] and m.valid[2].tolist() == [True, False, False]
    assert m.logprobs[2, 0] == pytest.approx(math.log(0.6), abs=1e-15)
    assert m.ids[3].tolist() == [4, 6, 5]  # "7", "9", "=" in the teacher's order
    assert m.logprobs[3].tolist() == pytest.approx([math.log(0.5), math.log(0.25),
                                                    math.log(0.125)], abs=1e-15)
    assert repeated_entries(torch.from_numpy(m.ids)).tolist() == (~m.valid).tolist()


def test_first_token_projection_counts_merged_tokens_for_their_first_student_token():
    """`topk_map = "first_token"`: the teacher's "12" maps to the student's "1" (its first
    token), merged with the teacher's "1" (0.7 + 0.2), at the first student token of every
    aligned span (also the 2:1 span "12"); only the text of no student token ("y") is dropped."""
    al, id_map, t_ids, t_lps = topk_case()
    first = id_map.copy()
    first[T_VOCAB.index("12")] = S_VOCAB.index("1")
    m = map_topk(t_ids, t_lps, [1, 2, 3, 4], al, first, rows="span_starts")
    assert m.matched.tolist() == [True, False, True, True]
    assert m.ids[0, :2].tolist() == [1, 2] and m.valid[0].tolist() == [True, True, False]
    assert m.logprobs[0, :2].tolist() == pytest.approx([math.log(0.9), math.log(0.05)],
                                                       abs=1e-15)
    assert m.ids[1].tolist() == [2, 2, 2] and m.logprobs[1, 0] == 0.0  # inside the span
    assert m.ids[2, :2].tolist() == [3, 1]  # "+", then "12" as "1"
    assert m.logprobs[2, :2].tolist() == pytest.approx([math.log(0.6), math.log(0.3)],
                                                       abs=1e-15)
    assert m.dropped_mass.tolist() == pytest.approx([0, 0, 0.05, 0], abs=1e-15)
    assert m.ids[3].tolist() == [4, 6, 5]  # as with the exact map
    with pytest.raises(ValueError, match="rows = 'x'"):
        map_topk(t_ids, t_lps, [1, 2, 3, 4], al, first, rows="x")
    with pytest.raises(ValueError, match="topk_map = 'x'"):
        TeacherSpec(name="t", model="m", topk_map="x")


def test_the_trainers_topk_kl_over_mapped_sets_equals_a_float64_reference():
    """The mapped arrays as the pool sends them (int32 / float32 Sample arrays), read by the
    trainer (repeated ids are padding) into the top-k reverse KL: the KL over the mapped set at
    one-to-one spans, exactly 0 on the other rows."""
    al, id_map, t_ids, t_lps = topk_case()
    m = map_topk(t_ids, t_lps, [1, 2, 3, 4], al, id_map)
    s = sample([1, 5], [1, 2, 3, 4], teacher_topk_ids=m.ids.astype(np.int32),
               teacher_topk_logprobs=m.logprobs.astype(np.float32))
    inp = server_inputs([s], "top_k")
    torch.manual_seed(0)
    logits = torch.randn(1, 4, len(S_VOCAB), dtype=torch.float64)
    kl = top_k_reverse_kl(logits, inp.topk_ids, inp.topk_logp.double(), inp.mask, 1.0)

    def ref(row: int, ids: list[int], q: list[float]) -> float:
        z = logits[0, row].tolist()
        zs = [z[i] for i in ids]
        p = [math.exp(v - math.log(sum(math.exp(u) for u in zs))) for v in zs]
        qs = [x / sum(q) for x in q]
        return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, qs))

    assert kl[0, :3].tolist() == [0.0, 0.0, 0.0]
    assert kl[0, 3].item() == pytest.approx(ref(3, [4, 6, 5], [0.5, 0.25, 0.125]), abs=1e-6)


def test_sorted_probability_distance_float64():
    logits = torch.log(torch.tensor([[[0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]], dtype=torch.float64))
    teacher = torch.log(torch.tensor([[[0.25, 0.6], [0.9, 0.05]]], dtype=torch.float64))
    d = sorted_prob_distance(logits, teacher, torch.tensor([[1, 0]]))
    # sorted: student .5 .3 .2 against teacher .6 .25 0
    assert d[0].tolist() == pytest.approx([0.1 + 0.05 + 0.2, 0.0], abs=1e-15)
    # temperature and the gradient: d/dz of |p_(i) - q_(i)| through the softmax
    z = torch.tensor([[[0.3, -1.0, 2.0, 0.5]]], dtype=torch.float64, requires_grad=True)
    q = torch.log(torch.tensor([[[0.5, 0.3, 0.1]]], dtype=torch.float64))
    assert torch.autograd.gradcheck(
        lambda x: sorted_prob_distance(x, q, torch.ones(1, 1), temperature=0.7), (z,))


# --- the pool: re-tokenization, a served teacher of its own vocabulary, config checks ----------

def test_the_sorted_term_compares_span_starts_the_mapped_set_misses():
    """`span_starts` and `onto_student(sorted_term=True)`: at "12+7=19" (student characters,
    teacher 12|+|7=|19) the rows are the first student token of each span the exact-match set
    does not cover, with the top-k of that span's first teacher token; observation spans are
    left out; `sorted_term_loss` is uld_coef x the float64 sorted distance there, weighted
    over the sample's policy tokens, its gradient the reference's."""
    al = align(offsets(S_PIECES), offsets(T_PIECES), 7)
    first_s, first_t = span_starts(al)
    assert first_s.tolist() == [0, 2, 3, 5] and first_t.tolist() == [0, 1, 2, 3]
    rng = np.random.default_rng(0)
    top_lps = np.log(rng.dirichlet(np.ones(5), size=4))[:, :3]
    top_ids = np.tile(np.arange(3), (4, 1))
    cv = CrossVocab.__new__(CrossVocab)  # the id map alone: teacher ids 0..2 -> student 7, -1
    cv._id_map = np.array([7, -1, -1])
    r = type("R", (), {"alignment": al, "response_ids": [0] * 4})()
    mask = [1, 1, 1, 1, 1, 0, 0]  # the span "19" holds observation tokens
    st: collections.Counter = collections.Counter()
    got = cv.onto_student(r, S_LP, list(range(7)), mask, T_LP, top_ids, top_lps, 3, False, st,
                          sorted_term=True)
    # span "+" is one-to-one with a mapped entry (teacher id 0 -> student 7): exact term
    assert got.topk.matched.tolist() == [False, False, True, False, False, False, False]
    assert got.sorted_positions.tolist() == [0, 3]  # "12", "7=" (not "+", not "19")
    assert got.sorted_logprobs.tolist() == top_lps[[0, 2]].tolist()
    assert st["sorted_rows"] == 2
    # the loss term against float64
    torch.manual_seed(0)
    logits = torch.randn(1, 7, 6, dtype=torch.float64, requires_grad=True)
    inp = OpdInputs(mask=torch.tensor([mask], dtype=torch.float64),
                    coef=torch.tensor([0.5], dtype=torch.float64), configs=[None])
    pos = torch.zeros(1, 7, dtype=torch.bool)
    pos[0, [0, 3]] = True
    lp = torch.full((1, 7, 3), -math.inf, dtype=torch.float64)
    lp[0, [0, 3]] = torch.from_numpy(got.sorted_logprobs)
    inp.sorted_pos, inp.sorted_logp = pos, lp
    cfg = OpdConfig(mode="top_k", top_k=3, top_k_from="teacher", uld_coef=0.25)
    counts: collections.Counter = collections.Counter()
    loss = sorted_term_loss(lambda b, j: logits[b, j], cfg, inp.mask, inp, 2,
                            inp.mask.sum(1), 0.5, counts)
    want = 0.0
    for j in (0, 3):
        p = torch.softmax(logits[0, j] / 0.5, -1).sort(descending=True).values
        q = torch.tensor(np.exp(lp[0, j].numpy())).sort(descending=True).values
        want = want + (p - torch.nn.functional.pad(q, (0, 3))).abs().sum()
    want = 0.25 * 0.5 * want / 5 / 2  # uld_coef x coef x sum / policy tokens / samples
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    g, = torch.autograd.grad(loss, logits)
    g_ref, = torch.autograd.grad(want, logits)
    assert torch.allclose(g, g_ref, atol=1e-14) and g[0, 1].abs().sum() == 0
    assert counts["uld_tokens"] == 2


def test_retokenize_for_a_bpe_teacher():
    student, teacher = load_tokenizer(STUDENT), load_tokenizer(BPE_TEACHER)
    cv = CrossVocab(student, teacher)
    enc = student.encode
    r = cv.retokenize([student.bos_token_id] + enc("9+9=", add_special_tokens=False),
                      enc("18", add_special_tokens=False) + [student.eos_token_id])
    assert r.prompt_ids == [teacher.bos_token_id] + teacher.encode("9+9=",
                                                                   add_special_tokens=False)
    assert r.response_ids == [teacher.convert_tokens_to_ids("18"), teacher.eos_token_id]
    assert r.alignment.student_span.tolist() == [0, 0, 1]  # "1","8" | <eos>
    assert r.alignment.teacher_span.tolist() == [0, 1] and r.alignment.char_frac == 1.0
    assert teacher.get_vocab() != student.get_vocab()
    # every student character has a teacher token of its text, at another id
    m = cv.id_map
    for ch in "0123456789+=":
        assert m[teacher.convert_tokens_to_ids(ch)] == student.convert_tokens_to_ids(ch)
    assert m[teacher.convert_tokens_to_ids("12")] == -1
    assert m[teacher.eos_token_id] == student.eos_token_id  # by role


def cross_opd(top_k: int) -> OpdConfig:
    """sampled, or top_k from the teacher with the sorted-probability term."""
    return OpdConfig(mode="top_k", top_k=top_k, top_k_from="teacher", uld_coef=0.5) if top_k \
        else OpdConfig()


def pool_config(mode: str, tokenizer: str, top_k: int = 0, url: str = "",
                credit: str = "spread") -> TeacherPoolConfig:
    opd = cross_opd(top_k)
    return TeacherPoolConfig(mode=mode, max_retries=1, request_timeout_s=30.0, opd=opd,
                             teachers=[TeacherSpec(name="arith", model=BPE_TEACHER,
                                                   domains=["math"], tokenizer=tokenizer,
                                                   span_credit=credit,
                                                   url=url or ("http://x" if mode == "server"
                                                               else ""))])


def test_the_pool_refuses_what_it_cannot_align():
    facts = RunFacts(model=STUDENT)
    with pytest.raises(ValueError, match="different vocabulary.*tokenizer = \"auto\""):
        TeacherPool.check_facts(pool_config("server", "student"), facts)
    TeacherPool.check_facts(pool_config("colocated", "auto"), facts)  # the trainer scores it
    TeacherPool.check_facts(pool_config("server", "auto"), facts)
    assert list(cross_teachers(pool_config("server", "auto"), facts)) == ["arith"]
    # a teacher of the student's vocabulary declared with its own tokenizer: the plain path
    same = TeacherPoolConfig(mode="colocated", teachers=[TeacherSpec(
        name="a", model="examples/teacher-arith", tokenizer="auto")])
    assert cross_teachers(same, facts) == {}


def float64_teacher_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[len(response), V] float64 log-probs of the teacher's distributions at its tokens."""
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([prompt + response])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


@pytest.mark.parametrize("top_k,credit", [(0, "spread"), (4, "spread"), (0, "prefix")])
async def test_the_pool_scores_a_teacher_of_its_own_vocabulary(ipc, top_k, credit):
    """TeacherPool._score against the embedded engine serving teacher-arith-bpe: the request
    carries the teacher's token ids, and each student token gets the float64 reference of its
    span's difference (sampled) or its mapped top-k; the alignment counts are published."""
    student = load_tokenizer(STUDENT)
    model, _ = load_model(BPE_TEACHER, "cpu", torch.float32)
    batch = cross_batch(student)
    facts = RunFacts(model=STUDENT)
    async with serve(ipc, model=BPE_TEACHER) as (worker, client):
        cfg = pool_config("server", "auto", top_k, url=worker.bound.http, credit=credit)
        pool = TeacherPool(context("teachers", ipc, facts=facts), cfg)
        pool.clients = {"arith": client}
        pool.cross = cross_teachers(cfg, facts)
        pool.stats = collections.defaultdict(collections.Counter)
        try:
            await pool._score("arith", batch)
        finally:
            pool.factory.close()
    st = pool.stats["arith"]
    assert st["failed_samples"] == 0 and all(s.teacher == "arith" for s in batch)
    spans = check_cross_scores(batch, pool.cross["arith"], model, top_k, credit)
    assert st["spans"] == spans and st["cross_samples"] == 3
    assert st["aligned_chars"] == st["chars"] == 3 + 2 + 3  # "18<eos>", "7<eos>", "17<eos>"
    assert st["tokens"] == sum(len(s.response_ids) for s in batch)


def cross_batch(student) -> list[Sample]:
    enc = student.encode
    return [sample([student.bos_token_id] + enc(p, add_special_tokens=False),
                   enc(a, add_special_tokens=False) + [student.eos_token_id],
                   rollout=[-0.5, -0.25, -0.125][:len(a) + 1], teacher="arith")
            for p, a in [("9+9=", "18"), ("3+4=", "7"), ("9+8=", "17")]]


def check_cross_scores(batch: list[Sample], cv: CrossVocab, model, top_k: int,
                       credit: str) -> int:
    """Each sample's teacher_logprobs / top-k against the float64 reference of the teacher on
    its own tokens: each student token carries its span's difference (spread), the values sum
    to the teacher's and a 2:1 span's first is log P_1 (prefix), mapped top-k in the teacher's
    order, and the sorted term's rows; returns the spans counted."""
    spans = sorted_rows = 0
    for s in batch:
        r = cv.retokenize(s.prompt_ids, s.response_ids, s.loss_mask)
        spans += r.alignment.num_spans
        ref = float64_teacher_logprobs(model, r.prompt_ids, r.response_ids)
        t_lp = ref.gather(1, torch.tensor(r.response_ids)[:, None])[:, 0].tolist()
        d = span_differences(s.rollout_logprobs, t_lp, r.alignment)
        want = [d[j] for j in r.alignment.student_span]
        got = [a - b for a, b in zip(s.rollout_logprobs, s.teacher_logprobs)]
        if credit == "prefix":  # the values sum to the teacher's; a 2:1 span's first: P_1
            assert sum(s.teacher_logprobs) == pytest.approx(sum(t_lp), abs=1e-5)
            if len(s.response_ids) == 3:  # "1x<eos>": teacher "1x", <eos>
                top = ref[0].topk(20)
                mass = sum(math.exp(v) for i, v in zip(top.indices.tolist(),
                                                       top.values.tolist())
                           if (cv.teacher_strings[i] or "").startswith("1"))
                assert s.teacher_logprobs[0] == pytest.approx(math.log(mass), abs=1e-5)
            assert s.teacher_topk_ids is None
            continue
        assert got == pytest.approx(want, abs=1e-5)
        if top_k:
            one = r.alignment.teacher_of()
            for j, t in enumerate(one):
                if t < 0:  # the student's own token alone
                    assert set(s.teacher_topk_ids[j].tolist()) == {s.response_ids[j]}
                    continue
                top = ref[t].topk(top_k)
                mapped = [(cv.id_map[i], v) for i, v in zip(top.indices.tolist(),
                                                            top.values.tolist())
                          if cv.id_map[i] >= 0]
                n = len(mapped)
                assert n >= 1
                assert s.teacher_topk_ids[j, :n].tolist() == [i for i, _ in mapped]
                assert s.teacher_topk_logprobs[j, :n].tolist() == pytest.approx(
                    [v for _, v in mapped], abs=1e-5)
            # the sorted term: a span's first student token where the mapped set misses,
            # against the span's first teacher token's top-k
            al, rows = r.alignment, []
            for span in range(al.num_spans):
                first = int(np.flatnonzero(al.student_span == span)[0])
                if one[first] < 0 or not len(set(s.teacher_topk_ids[first].tolist())
                                             - {s.response_ids[first]}) and \
                        s.teacher_topk_ids[first][0] == s.response_ids[first] and \
                        s.teacher_topk_logprobs[first][0] == 0:
                    rows.append((first, int(np.flatnonzero(al.teacher_span == span)[0])))
            assert s.teacher_sorted_positions.tolist() == [a for a, _ in rows]
            sorted_rows += len(rows)
            for (a, t), got in zip(rows, s.teacher_sorted_logprobs):
                assert got.tolist() == pytest.approx(ref[t].topk(top_k).values.tolist(),
                                                     abs=1e-5)
    assert sorted_rows >= (2 if top_k else 0)  # "18", "17": two student tokens, one teacher's
    return spans


@pytest.mark.parametrize("top_k,credit", [(0, "spread"), (4, "spread"), (0, "prefix")])
def test_a_colocated_teacher_of_its_own_vocabulary_scores_as_a_server(tmp_path, top_k, credit):
    """The trainer's colocated teacher of another vocabulary (training/colocated_teachers.py
    `_cross_output`): its forward on its own tokens from weight memory, moved onto the
    student's tokens, gives the float64 reference of the pool's server path; the step's
    inputs hold them (teacher_logp, the mapped top-k in topk_rows) and the counts."""
    student = load_tokenizer(STUDENT)
    model, _ = load_model(BPE_TEACHER, "cpu", torch.float32)
    spec = TeacherSpec(name="arith", model=BPE_TEACHER, domains=["math"], tokenizer="auto",
                       span_credit=credit)
    opd = cross_opd(top_k)
    teachers = ColocatedTeachers.load([spec], "cpu", torch.float32, TeacherMemoryConfig(
        nvme_dir=str(tmp_path / "nvme")), str(tmp_path), student_tokenizer=student)
    batch = cross_batch(student)
    try:
        assert list(teachers.cross) == ["arith"]
        cfg = TrainConfig(model=STUDENT, teachers=[spec], opd=opd)
        mbs = [make_micro_batch(batch[:2]), make_micro_batch(batch[2:])]
        signals = OpdSignals(mbs, cfg, 1.0, teachers, [0, 1])
        inputs = [signals.inputs(0), signals.inputs(1)]
        signals.close()
    finally:
        teachers.close()
    for mb, inp in zip(mbs, inputs):
        assert torch.equal(inp.mask, mb.mask)  # every sample scored
        assert inp.teacher_logits is None and inp.teacher_heads is None
        for b, s in enumerate(mb.samples):
            n = len(s.response_ids)
            s.teacher_logprobs = inp.teacher_logp[b, :n].double().tolist()
            if top_k:
                assert bool(inp.topk_rows[b])
                s.teacher_topk_ids = inp.topk_ids[b, :n].numpy()
                s.teacher_topk_logprobs = inp.topk_logp[b, :n].numpy()
                s.teacher_sorted_positions = inp.sorted_pos[b, :n].nonzero()[:, 0].numpy()
                s.teacher_sorted_logprobs = inp.sorted_logp[b, :n][inp.sorted_pos[b, :n]].numpy()
    spans = check_cross_scores(batch, teachers.cross["arith"], model, top_k, credit)
    st = signals.cross_stats["arith"]
    assert st["spans"] == spans and st["cross_samples"] == 3 and st["failed_samples"] == 0
    assert st["aligned_chars"] == st["chars"] == 8
    if top_k:
        assert st["topk_policy_tokens"] == 8 and 0 < st["topk_matched"] <= 8


def test_a_colocated_teacher_projects_its_topk_onto_first_student_tokens(tmp_path):
    """topk_map = "first_token" through the trainer's colocated path: at the first student
    token of each span the set is the teacher's float64 top-k at the span's first teacher
    token, each entry counted for the student token its text starts with ("18" for "1")."""
    student = load_tokenizer(STUDENT)
    model, _ = load_model(BPE_TEACHER, "cpu", torch.float32)
    spec = TeacherSpec(name="arith", model=BPE_TEACHER, domains=["math"], tokenizer="auto",
                       topk_map="first_token")
    teachers = ColocatedTeachers.load([spec], "cpu", torch.float32, TeacherMemoryConfig(
        nvme_dir=str(tmp_path / "nvme")), str(tmp_path), student_tokenizer=student)
    batch = cross_batch(student)
    try:
        cfg = TrainConfig(model=STUDENT, teachers=[spec], opd=OpdConfig(
            mode="top_k", top_k=6, top_k_from="teacher"))
        mb = make_micro_batch(batch)
        signals = OpdSignals([mb], cfg, 1.0, teachers, [0])
        inp = signals.inputs(0)
        signals.close()
    finally:
        teachers.close()
    cv = teachers.cross["arith"]
    two_digit = 0
    for b, s in enumerate(batch):
        r = cv.retokenize(s.prompt_ids, s.response_ids, s.loss_mask)
        ref = float64_teacher_logprobs(model, r.prompt_ids, r.response_ids)
        first_s, first_t = span_starts(r.alignment)
        for j, t in zip(first_s.tolist(), first_t.tolist()):
            top = ref[t].topk(6)
            want: dict[int, float] = {}
            for i, v in zip(top.indices.tolist(), top.values.tolist()):
                sid = int(cv.first_map[i])
                if sid >= 0:
                    want[sid] = want.get(sid, 0.0) + math.exp(v)
            ids = inp.topk_ids[b, j].tolist()
            got = {i: math.exp(v) for i, v in zip(ids, inp.topk_logp[b, j].tolist())
                   if v > -math.inf}
            assert got.keys() == want.keys() and ids[0] == next(iter(want))
            for i in want:
                assert got[i] == pytest.approx(want[i], abs=1e-5)
            two_digit += any(len(cv.teacher_strings[i] or "") == 2 for i in top.indices.tolist())
    assert two_digit  # merged teacher tokens were counted for their first digit
    st = signals.cross_stats["arith"]
    assert st["topk_matched"] == sum(len(s.response_ids) for s in batch) - 2  # not "8", "7"


def test_the_step_reads_a_teachers_own_topk_beside_colocated_logits():
    """A micro-batch whose top_k rows come from a teacher of another vocabulary (its mapped
    set) and from a colocated teacher's logits: each row's KL is the one of its own source."""
    torch.manual_seed(0)
    samples = [sample([1, 2], [3, 4, 5]), sample([1, 2], [6, 7, 0])]
    mb = make_micro_batch(samples)
    cfg_k = OpdConfig(mode="top_k", top_k=2, top_k_from="teacher")
    logits = torch.randn(2, 3, 8, dtype=torch.float64)
    teacher_logits = torch.randn(2, 3, 8, dtype=torch.float64)
    inp = OpdInputs(mask=mb.mask.double(), coef=torch.ones(2, dtype=torch.float64),
                    configs=[cfg_k, cfg_k], teacher_logits=teacher_logits)
    ids = torch.tensor([[[1, 2], [3, 3], [0, 5]]])
    lps = torch.tensor([[[-0.5, -1.5], [-0.1, -math.inf], [-1.0, -2.0]]], dtype=torch.float64)
    _put_topk(inp, [0], ids, lps)
    assert inp.topk_rows.tolist() == [True, False]
    cfg = TrainConfig(model=STUDENT, opd=cfg_k)
    sums: dict[str, list[float]] = {}
    got = opd_term_loss(cfg, 1.0, mb, inp, logits, 2, sums)
    row0 = top_k_reverse_kl(logits[:1], ids, lps, mb.mask[:1].double(), 1.0)
    top = teacher_logits[1:].topk(2, dim=-1).indices
    row1 = ids_reverse_kl(logits[1:], top, gather_scores(teacher_logits[1:], top, 1.0),
                          mb.mask[1:].double(), 1.0)
    want = (row0.sum() / 3 + row1.sum() / 3) / 2  # sample means, over the step's 2 samples
    assert float(got) == pytest.approx(float(want), rel=1e-9)


# --- one short run through the launcher -----------------------------------------------------------

@pytest.mark.timeout(240)
def test_a_cross_vocabulary_run_through_the_launcher(tmp_path):
    """examples/mopd-cross-vocab.toml for two steps: the teacher of its own vocabulary is
    served, every math sample scored, its alignment published, the trainer distils on it."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "launch.cluster", "examples/mopd-cross-vocab.toml", "--run-dir",
         str(run_dir), "--set", "rl.num_steps=2", "--set", "rl.eval_every=0", "--set",
         "rl.save_every=0", "--set", "rl.groups_per_batch=8", "--set", "rl.workers=1",
         "--set", "run.plots=false"],  # ~2 s of CPU (tests/test_mopd_cluster.py draws them)
        cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert result.returncode == 0, result.stdout[-3000:]
    pool = [r["values"] for r in metric_records(run_dir) if r["actor"] == "teachers"]
    last = pool[-1]
    assert last["opd/arith/tokens_scored"] > 0 and last["opd/arith/failed_samples"] == 0
    assert 0.9 <= last["opd/arith/aligned_char_frac"] <= 1.0
    assert last["opd/arith/aligned_spans_per_sample"] >= 1.0
    steps = trainer_steps(run_dir)
    assert [v["version"] for v in steps] == [1, 2]
    assert all(v["opd/arith/tokens"] > 0 for v in steps)


@pytest.mark.timeout(240)
def test_a_colocated_cross_vocabulary_run_through_the_launcher(tmp_path):
    """examples/mopd-cross-vocab-colocated.toml for two steps in top_k mode: the trainer runs
    the teacher of its own vocabulary from its weight memory, publishes its alignment and
    mapped top-k metrics, and distils on it; a mode that needs the teacher's distribution at
    student ids is refused at load."""
    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "launch.cluster", "examples/mopd-cross-vocab-colocated.toml"]
    refused = subprocess.run(base + ["--dry-run", "--set", "rl.opd={mode='full'}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "teacher 'arith': mode = 'full'" in refused.stdout + refused.stderr
    result = subprocess.run(
        base + ["--run-dir", str(run_dir), "--set", "rl.num_steps=2", "--set",
                "rl.eval_every=0", "--set", "rl.save_every=0", "--set", "rl.groups_per_batch=8",
                "--set", "rl.workers=1", "--set", "run.plots=false", "--set",
                "rl.opd={mode='top_k', top_k=4, top_k_from='teacher', uld_coef=0.1}"],
        cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert result.returncode == 0, result.stdout[-3000:]
    steps = trainer_steps(run_dir)
    assert [v["version"] for v in steps] == [1, 2]
    for v in steps:
        assert v["opd/arith/tokens"] > 0 and v["opd/arith/failed_samples"] == 0
        assert 0.9 <= v["opd/arith/aligned_char_frac"] <= 1.0
        assert v["opd/arith/aligned_spans_per_sample"] >= 1.0
        assert 0.0 < v["opd/arith/topk_matched_frac"] <= 1.0
        assert math.isfinite(v["opd/arith/reverse_kl"]) and v["opd/arith/reverse_kl"] >= 0
        # two-digit sums are one teacher token: the sorted term's rows
        assert v["opd/uld_tokens"] > 0 and 0 < v["opd/uld_distance"] <= 2
        assert 0 < v["opd/arith/sorted_rows_frac"] < 1


def test_uld_coef_needs_the_teachers_top_k():
    OpdConfig(mode="top_k", top_k=4, top_k_from="teacher", uld_coef=0.1)
    for kw in ({"mode": "sampled"}, {"mode": "top_k", "top_k": 4}, {"mode": "full"}):
        with pytest.raises(ValueError, match="uld_coef = 0.1 compares .* top_k_from = 'teacher'"):
            OpdConfig(uld_coef=0.1, **kw)
    with pytest.raises(ValueError, match="uld_coef must be a finite number >= 0"):
        OpdConfig(mode="top_k", top_k=4, top_k_from="teacher", uld_coef=-1.0)
