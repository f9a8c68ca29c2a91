"""Multi-teacher distillation: routing, vocabulary checks, server scoring through the worker's
HTTP API, colocated teachers under a budget that forces swaps, and distillation steps."""

from __future__ import annotations

import collections
import copy
import logging
import math

import msgspec
import numpy as np
import pytest
import torch

from actors.teacher_pool import TeacherPool, TeacherPoolConfig
from actors.trainer import TrainerConfig
from algos.logprobs import token_logprobs
from algos.opd import OpdConfig, distribution_reverse_kl, opd_loss
from engine.client import SglangClient
from logic.teachers import (
    ScoreError,
    TeacherSpec,
    check_vocab,
    parse_scores,
    route,
    route_table,
    score_request,
)
from models.load import load_model
from runtime.facts import RunFacts
from tests.helpers import context
from tests.test_engine import serve
from training.batching import make_micro_batch
from training.colocated_teachers import (
    ColocatedTeachers,
    TeacherMemoryConfig,
    prepare_opd,
    student_pass,
)
from training.config import LossConfig, MicroBatchConfig, OptimizerConfig
from training.state import TrainState
from training.step import train_on_batch
from transport.codec import Codec
from transport.schema import Kind, Sample, SampleGroup, TrainBatch

TEACHERS = [TeacherSpec(name="arith", model="examples/teacher-arith", domains=["math"]),
            TeacherSpec(name="reverse", model="examples/teacher-reverse", domains=["reverse"])]


def samples(tok, n_per_domain: int = 4) -> list[Sample]:
    """Equal rewards (GRPO advantages 0): only the distillation signal can move the student."""
    out = []
    for g, (domain, prompt, ans) in enumerate([("math", "3+4=", "7"), ("reverse", "rev abc=",
                                                                       "cba")]):
        for i in range(n_per_domain):
            ids = tok.encode(ans[: 1 + i % len(ans)], add_special_tokens=False)
            ids = ids + [tok.eos_token_id]
            out.append(Sample(group_id=f"g{g}", index=i, domain=domain,
                              prompt_ids=[tok.bos_token_id] + tok.encode(
                                  prompt, add_special_tokens=False),
                              response_ids=ids, loss_mask=[1] * len(ids),
                              rollout_logprobs=[-1.0] * len(ids), reward=0.0,
                              teacher="arith" if domain == "math" else "reverse"))
    return out


async def test_a_server_teachers_coef_travels_with_its_samples_to_the_trainer(ipc):
    """The pool routes each sample with its teacher's coef; the trainer of a server-mode run,
    which holds no teacher list, weighs each sample's OPD term by it (after the wire)."""
    cfg = TeacherPoolConfig(mode="colocated", teachers=[
        TeacherSpec(name="arith", model="examples/teacher-arith", domains=["math"], coef=0.25),
        TeacherSpec(name="reverse", model="examples/teacher-reverse", domains=["reverse"])])
    pool = TeacherPool(context("teachers", ipc, facts=RunFacts(model="examples/base-tiny")), cfg)
    sent = []

    class Out:
        async def send(self, msg):
            sent.append(msg)

    pool.table, pool.coefs, pool.clients = route_table(cfg.teachers), {"arith": 0.25}, {}
    pool.out, pool._publish = Out(), lambda: None
    _, tok = load_model("examples/base-tiny", "cpu", torch.float32)
    batch = [msgspec.structs.replace(s, teacher="") for s in samples(tok)]
    try:
        await pool.on_inbox(SampleGroup(samples=batch))
    finally:
        pool.factory.close()
    routed = sent[0].samples
    assert [(s.teacher, s.teacher_coef) for s in routed] == \
        [("arith", 0.25)] * 4 + [("reverse", 1.0)] * 4
    frames = Codec().encode(Kind.REPLY, 1, TrainBatch(step=0, samples=routed))
    received = Codec().decode([bytearray(f) for f in frames]).body.samples
    trainer = TrainerConfig(model="examples/base-tiny", workers=["w"],  # no teachers: server
                            opd=OpdConfig(mode="sampled"), loss=LossConfig(
                                advantage_estimator="none"))
    mb = make_micro_batch(received, tok.pad_token_id or 0)
    (inp,) = prepare_opd([mb], [None], trainer, None, temperature=1.0)
    assert inp.coef.tolist() == [0.25] * 4 + [1.0] * 4


def test_routing_and_bad_registries():
    table = route_table(TEACHERS, default="arith")
    assert route("math", table) == "arith" and route("reverse", table) == "reverse"
    assert route("code", table, "arith") == "arith" and route("code", table) == ""
    with pytest.raises(ValueError, match="routed to both"):
        route_table(TEACHERS + [TeacherSpec(name="x", model="m", domains=["math"])])
    with pytest.raises(ValueError, match="not a declared teacher"):
        route_table(TEACHERS, default="nobody")
    with pytest.raises(ValueError, match="unique"):
        route_table(TEACHERS + TEACHERS[:1])


def test_teacher_with_another_vocabulary_is_refused():
    from models.load import load_tokenizer

    student = load_tokenizer("examples/base-tiny")
    check_vocab(student, load_tokenizer("examples/teacher-arith"), "arith")

    class Shifted:  # the same tokens under other ids
        def __init__(self, tok):
            self.vocab = {t: (i + 1) % len(tok.get_vocab()) for t, i in tok.get_vocab().items()}
            self.bos_token_id, self.eos_token_id = tok.bos_token_id, tok.eos_token_id
            self.pad_token_id = tok.pad_token_id

        def get_vocab(self):
            return self.vocab

    with pytest.raises(ValueError, match="'odd' has a different vocabulary from the student"):
        check_vocab(student, Shifted(student), "odd")


def float64_scores(model, s: Sample, temperature: float) -> torch.Tensor:
    """[R, V] float64 log-probs of the distributions the response tokens were drawn from, by a
    float64 copy of `model` at `temperature` (row j: the one predicting response token j)."""
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
    return torch.log_softmax(logits[len(s.prompt_ids) - 1:-1] / temperature, dim=-1)


def check_scores(lps, top_ids, top_lps, ref: torch.Tensor, s: Sample, k: int) -> None:
    want = ref.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
    assert len(lps) == len(s.response_ids)
    assert lps[0] == pytest.approx(want[0].item(), abs=1e-5)  # the first response token too
    assert torch.allclose(torch.tensor(lps, dtype=torch.float64), want, atol=1e-5, rtol=0)
    if not k:
        assert top_ids is None and top_lps is None
        return
    # [R, k] int32 ids and float32 log-probs; each position's k ids carry their reference
    # log-probs and are the k largest
    assert top_ids.dtype == np.int32 and top_lps.dtype == np.float32
    assert top_ids.shape == top_lps.shape == (len(s.response_ids), k)
    got = torch.from_numpy(top_lps).double()
    assert torch.allclose(got, ref.gather(1, torch.from_numpy(top_ids).long()), atol=1e-5, rtol=0)
    assert torch.all(got[:, -1] >= ref.topk(k, dim=-1).values[:, -1] - 1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_server_scores_equal_a_float64_forward(ipc, temperature):
    """The teacher path against the embedded engine: SGLang's null lands on the last prompt
    token and every response token, the first one included, gets the teacher's log-prob."""
    model, tok = load_model("examples/teacher-arith", "cpu", torch.float32)
    batch = samples(tok)
    bodies = [score_request(s.prompt_ids, s.response_ids, temperature, top_k=3) for s in batch]
    async with serve(ipc, model="examples/teacher-arith") as (_, client):
        replies = await client.generate([b["input_ids"] for b in bodies],
                                        bodies[0]["sampling_params"],
                                        logprob_start_len=[b["logprob_start_len"] for b in bodies],
                                        top_logprobs_num=3)
        probe = batch[1]
        old_style = await client.generate(probe.prompt_ids + probe.response_ids,
                                          {"max_new_tokens": 0}, return_logprob=True,
                                          logprob_start_len=len(probe.prompt_ids))
    for s, reply in zip(batch, replies):
        meta = reply["meta_info"]
        assert meta["input_token_logprobs"][0] == [None, s.prompt_ids[-1], None]
        assert meta["input_top_logprobs"][0] is None
        scores = parse_scores(reply, s.prompt_ids, s.response_ids, 3, "teacher 'arith'")
        check_scores(*scores, float64_scores(model, s, temperature), s, k=3)
    with pytest.raises(ScoreError, match="other tokens than the sample's: window position 1"):
        parse_scores(replies[1], probe.prompt_ids, [t + 1 for t in probe.response_ids])
    # asked from len(prompt) (the request before this fix), the first response token gets null
    assert old_style["meta_info"]["input_token_logprobs"][0][:2] == [None, probe.response_ids[0]]
    with pytest.raises(ScoreError, match="logprob_start_len = len.prompt. - 1"):
        parse_scores(old_style, probe.prompt_ids, probe.response_ids, 0, "teacher 'arith'")


def pool_for(ipc, url: str, clients: dict, top_k: int = 0):
    """A server-mode TeacherPool with its clients set (no actor loop: `_score` is called)."""
    cfg = TeacherPoolConfig(mode="server", max_retries=1,
                            request_timeout_s=30.0, opd=OpdConfig(
                                mode="top_k" if top_k else "sampled", top_k=top_k,
                                top_k_from="teacher" if top_k else "student"),
                            teachers=[TeacherSpec(name="arith", model="examples/teacher-arith",
                                                  domains=["math", "reverse"], url=url)])
    pool = TeacherPool(context("teachers", ipc, facts=RunFacts(model="examples/base-tiny")), cfg)
    pool.clients = clients
    pool.stats = collections.defaultdict(collections.Counter)
    return pool


@pytest.mark.parametrize("top_k", [0, 4])
async def test_teacher_pool_scores_through_the_engine(ipc, top_k):
    """TeacherPool._score end to end against the embedded engine: every sample scored (the first
    response token included) and the batch's token count and KL published."""
    model, tok = load_model("examples/teacher-arith", "cpu", torch.float32)
    batch = samples(tok)
    async with serve(ipc, model="examples/teacher-arith") as (worker, client):
        pool = pool_for(ipc, worker.bound.http, {"arith": client}, top_k)
        try:
            await pool._score("arith", batch)
        finally:
            pool.factory.close()
    assert all(s.teacher for s in batch) and pool.stats["arith"]["failed_samples"] == 0
    for s in batch:
        check_scores(s.teacher_logprobs, s.teacher_topk_ids, s.teacher_topk_logprobs,
                     float64_scores(model, s, 1.0), s, top_k)
    tokens = sum(len(s.response_ids) for s in batch)
    kl = sum(-1.0 - lp for s in batch for lp in s.teacher_logprobs)  # rollout log-probs -1
    assert pool.stats["arith"]["tokens"] == tokens
    assert pool.stats["arith"]["kl_sum"] == pytest.approx(kl, rel=1e-9)


class Replies:
    """A teacher client answering /generate with prepared replies (one per request)."""

    def __init__(self, replies):
        self.replies = replies

    async def generate(self, input_ids, sampling_params, **extra):
        return self.replies[:len(input_ids)]


async def test_a_malformed_reply_fails_only_its_sample(ipc, caplog):
    """A null where SGLang never puts one (inside the response) marks and counts that sample,
    with the teacher and the sample named; the other replies of the batch are used."""
    model, tok = load_model("examples/teacher-arith", "cpu", torch.float32)
    batch = samples(tok)[:3]
    bodies = [score_request(s.prompt_ids, s.response_ids, 1.0) for s in batch]
    async with serve(ipc, model="examples/teacher-arith") as (_, client):
        replies = await client.generate([b["input_ids"] for b in bodies],
                                        bodies[0]["sampling_params"],
                                        logprob_start_len=[b["logprob_start_len"] for b in bodies])
    replies[1]["meta_info"]["input_token_logprobs"][2][0] = None
    pool = pool_for(ipc, "http://unused", {"arith": Replies(replies)})
    try:
        with caplog.at_level(logging.WARNING, logger="actors.teacher_pool"):
            await pool._score("arith", batch)
    finally:
        pool.factory.close()
    assert [bool(s.teacher) for s in batch] == [True, False, True]
    assert pool.stats["arith"]["failed_samples"] == 1 and batch[1].teacher_logprobs == []
    assert ("teacher 'arith', sample g0/1: input_token_logprobs has null at window position 2 "
            "(response token 1)") in caplog.text
    check_scores(batch[2].teacher_logprobs, None, None, float64_scores(model, batch[2], 1.0),
                 batch[2], 0)


@pytest.mark.parametrize("logits", [False, True])
def test_colocated_with_swaps_equals_everything_resident(tmp_path, logits):
    _, tok = load_model("examples/base-tiny", "cpu", torch.float32)
    batch = samples(tok)
    mbs = [make_micro_batch(batch[i:i + 3], tok.pad_token_id or 0) for i in range(0, 8, 3)]
    tight = ColocatedTeachers.load(TEACHERS, "cpu", torch.float32, TeacherMemoryConfig(
        gpu_slots=1, host_budget_bytes=400_000, nvme_dir=str(tmp_path / "a")), str(tmp_path))
    roomy = ColocatedTeachers.load(TEACHERS, "cpu", torch.float32, TeacherMemoryConfig(
        gpu_slots=2, nvme_dir=str(tmp_path / "b")), str(tmp_path))
    try:
        for _ in range(2):  # two steps: the tight one swaps; the second starts with the teacher
            # left in its slot and loads only the other
            a = tight.outputs(mbs, 1.0, logits)
            b = roomy.outputs(mbs, 1.0, logits)
        assert a.keys() == b.keys() and len(a) == 4  # (teacher, micro-batch) pairs
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert tight.memory.counters["gpu_loads"] == 3 and roomy.memory.counters["gpu_loads"] == 2
        # the teachers really differ: the same micro-batch scored by each
        model, _ = load_model("examples/teacher-arith", "cpu", torch.float32)
        with torch.no_grad():
            ref = token_logprobs(model, mbs[0].input_ids, mbs[0].attention_mask)
        if not logits:
            from algos.logprobs import response_slice

            want = response_slice(ref, mbs[0].prompt_lens, mbs[0].num_response_cols)
            assert torch.allclose(a[("arith", 0)], want, atol=1e-6)
    finally:
        tight.close()
        roomy.close()


@pytest.mark.parametrize("mode", ["sampled", "full", "top_k", "top_k_student", "top_p",
                                  "per_teacher"])
def test_pure_distillation_moves_the_student_towards_its_teachers(tmp_path, mode):
    """A = 0 (equal rewards): only the OPD term trains; the reverse KL to each sample's teacher
    falls over a few steps. top_k: server replies (the teacher's top-k); top_k_student:
    colocated, the student's top-k; top_p: colocated, the nucleus rebuilt from the student's
    logits (no recorded one); per_teacher: arith in "full", reverse in "sampled", one run."""
    torch.manual_seed(0)
    model, tok = load_model("examples/base-tiny", "cpu", torch.float32)
    opd = OpdConfig(mode={"per_teacher": "sampled", "top_k_student": "top_k"}.get(mode, mode),
                    kl_coef=1.0, top_k=5 if mode.startswith("top_k") else 0,
                    top_k_from="teacher" if mode == "top_k" else "student",
                    top_p=0.9 if mode == "top_p" else 1.0)
    colocated = mode != "top_k"
    teachers = TEACHERS
    if mode == "per_teacher":
        teachers = [TeacherSpec(name="arith", model="examples/teacher-arith", domains=["math"],
                                opd=OpdConfig(mode="full", kl_coef=1.0)), TEACHERS[1]]
    cfg = TrainerConfig(model="examples/base-tiny", workers=["w"], opd=opd,
                        optimizer=OptimizerConfig(lr=3e-3), loss=LossConfig(
                            advantage_estimator="none"), micro_batches=MicroBatchConfig(size=4),
                        teachers=teachers if colocated else [])
    state = TrainState(model, tok, torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr))
    batch = samples(tok)
    if colocated:
        state.teachers = ColocatedTeachers.load(teachers, "cpu", torch.float32, TeacherMemoryConfig(
            gpu_slots=1, nvme_dir=str(tmp_path)), str(tmp_path))
    else:  # server replies: the teachers' top-k from a local forward, as a server computes it
        attach_topk(batch, k=5)
    try:
        kls = []
        for _ in range(6):
            stats = train_on_batch(state, batch, cfg)
            kls.append(stats["opd/arith/reverse_kl"] + stats["opd/reverse/reverse_kl"])
        assert stats["opd/arith/tokens"] > 0 and stats["opd/reverse/tokens"] > 0
        assert kls[-1] < 0.7 * kls[0], kls
    finally:
        if state.teachers is not None:
            state.teachers.close()


def attach_topk(batch: list[Sample], k: int) -> None:
    for t in TEACHERS:
        model, _tok = load_model(t.model, "cpu", torch.float32)
        for s in batch:
            if s.teacher != t.name:
                continue
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            rows = lp[len(s.prompt_ids) - 1:]
            top = rows.topk(k, dim=-1)  # as parse_scores gives a server's reply
            s.teacher_topk_ids = top.indices.numpy().astype(np.int32)
            s.teacher_topk_logprobs = top.values.numpy().astype(np.float32)


def list_topk_inputs(mb, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's [B, R, k] top-k inputs as they were built before top-k were arrays, from
    rows of Python numbers (training/colocated_teachers.py `_fill_server`, protocol 1)."""
    B, R = mb.mask.shape
    ids = torch.zeros(B, R, k, dtype=torch.long)
    lps = torch.full((B, R, k), -math.inf)
    for b, s in enumerate(mb.samples):
        rows = zip(s.teacher_topk_ids.tolist(), s.teacher_topk_logprobs.tolist())
        for j, (pi, pl) in enumerate(rows):
            ids[b, j, :len(pi)] = torch.tensor(pi)
            lps[b, j, :len(pl)] = torch.tensor(pl)
    return ids, lps


def float64_topk_kl(logits: torch.Tensor, s: Sample, temperature: float) -> list[float]:
    """Reverse KL over each position's top-k set, both sides renormalised over it, in float64
    from the sample's arrays: logits [R, V] of its rows (algos/opd.py's definition)."""
    out = []
    for j in range(len(s.response_ids)):
        ids = torch.from_numpy(s.teacher_topk_ids[j]).long()
        ls = torch.log_softmax(logits[j, ids].double() / temperature, -1)
        lt = torch.log_softmax(torch.from_numpy(s.teacher_topk_logprobs[j]).double(), -1)
        out.append(float((ls.exp() * (ls - lt)).sum()))
    return out


def test_topk_loss_from_arrays_equals_the_list_path_and_a_float64_reference():
    """Server top-k after the wire (arrays, as the trainer receives them from the buffer):
    the trainer's [B, R, k] inputs are exactly the ones the list path built, so the top-k OPD
    loss is the same value bit for bit, and it matches a float64 reference."""
    torch.manual_seed(0)
    model, tok = load_model("examples/base-tiny", "cpu", torch.float32)
    batch = samples(tok)
    attach_topk(batch, k=5)
    frames = Codec().encode(Kind.REPLY, 1, TrainBatch(step=0, samples=batch))
    received = Codec().decode([bytearray(f) for f in frames]).body.samples
    assert all(isinstance(s.teacher_topk_ids, np.ndarray) for s in received)
    temperature = 0.7
    cfg = TrainerConfig(model="examples/base-tiny", workers=["w"],
                        opd=OpdConfig(mode="top_k", top_k=5, kl_coef=0.5,
                                      top_k_from="teacher"),
                        loss=LossConfig(advantage_estimator="none"))
    mb = make_micro_batch(received, tok.pad_token_id or 0)
    assert len(set(map(len, (s.response_ids for s in received)))) > 1  # rows of padding too
    (inp,) = prepare_opd([mb], [None], cfg, None, temperature=temperature)
    ids, lps = list_topk_inputs(mb, 5)
    assert torch.equal(inp.topk_ids, ids) and torch.equal(inp.topk_logp, lps)
    with torch.no_grad():
        _, _, logits = student_pass(model, mb, temperature)

    def loss(topk_ids, topk_logp):
        kl = distribution_reverse_kl(cfg.opd, logits, inp.mask, temperature,
                                     teacher_ids=topk_ids, teacher_logprobs=topk_logp)
        return kl, opd_loss(kl * inp.coef[:, None], inp.mask, len(received), cfg.opd.kl_coef)

    kl, got = loss(inp.topk_ids, inp.topk_logp)
    assert got.item() == loss(ids, lps)[1].item() and got.item() > 0
    want_kl = [float64_topk_kl(logits[b], s, temperature) for b, s in enumerate(received)]
    for b, row in enumerate(want_kl):
        assert kl[b, :len(row)].tolist() == pytest.approx(row, abs=1e-6)
    want = 0.5 * sum(sum(row) / len(row) for row in want_kl) / len(received)
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_per_teacher_mode_terms_equal_separate_runs(tmp_path):
    """A mixed batch (arith: full, reverse: sampled) gives each teacher the same reverse-KL
    metric as a run where that mode applies to everyone."""
    _, tok = load_model("examples/base-tiny", "cpu", torch.float32)
    stats = {}
    for name, teachers, run_mode in [
            ("mixed", [TeacherSpec(name="arith", model="examples/teacher-arith",
                                   domains=["math"], opd=OpdConfig(mode="full")), TEACHERS[1]],
             "sampled"),
            ("full", TEACHERS, "full"), ("sampled", TEACHERS, "sampled")]:
        model, _ = load_model("examples/base-tiny", "cpu", torch.float32)
        cfg = TrainerConfig(model="examples/base-tiny", workers=["w"],
                            optimizer=OptimizerConfig(lr=0.0),
                            loss=LossConfig(advantage_estimator="none"),
                            opd=OpdConfig(mode=run_mode), micro_batches=MicroBatchConfig(size=8),
                            teachers=teachers)
        state = TrainState(model, tok, torch.optim.SGD(model.parameters(), lr=0.0))
        state.teachers = ColocatedTeachers.load(teachers, "cpu", torch.float32,
                                                TeacherMemoryConfig(nvme_dir=str(tmp_path / name)),
                                                str(tmp_path))
        try:
            stats[name] = train_on_batch(state, samples(tok), cfg)
        finally:
            state.teachers.close()
    assert stats["mixed"]["opd/arith/reverse_kl"] == pytest.approx(
        stats["full"]["opd/arith/reverse_kl"], rel=1e-6)
    assert stats["mixed"]["opd/reverse/reverse_kl"] == pytest.approx(
        stats["sampled"]["opd/reverse/reverse_kl"], rel=1e-6)
    assert stats["full"]["opd/reverse/reverse_kl"] != pytest.approx(
        stats["sampled"]["opd/reverse/reverse_kl"], rel=1e-3)  # the modes really differ


async def test_a_failing_teacher_server_marks_and_counts_its_samples(ipc):
    _, tok = load_model("examples/base-tiny", "cpu", torch.float32)
    url = "http://127.0.0.1:9"  # nothing listens there
    pool = pool_for(ipc, url, {"arith": SglangClient(url, timeout_s=2.0, retries=1,
                                                     backoff_s=0.01)})
    batch = [s for s in samples(tok) if s.domain == "math"]
    try:
        await pool._score("arith", batch)
    finally:
        await pool.clients["arith"].close()
        pool.factory.close()
    assert all(s.teacher == "" for s in batch)  # marked: no signal, trained without it
    assert pool.stats["arith"]["failed_samples"] == len(batch)


def test_opd_metrics_agree_on_teachers_across_ranks():
    """A rank that saw no sample of a teacher still reduces a row for it (same tensor shape on
    every rank), and the summed metric covers both ranks."""
    from training.step import opd_stats

    class OtherRankHasReverse:  # this rank: arith only; the other rank: reverse only
        def gather(self, obj):
            return [obj, ["reverse"]]

        def sum_tensor(self, t):
            assert t.shape == (2, 2)  # both teachers, in name order
            return t + torch.tensor([[0.0, 0.0], [3.0, 2.0]], dtype=torch.float64)

    state = TrainState(torch.nn.Linear(1, 1), None, None)
    stats = opd_stats(state, {"arith": [1.0, 4.0], "": [0.0, 0.0]}, 0.5, OtherRankHasReverse())
    assert stats["opd/arith/reverse_kl"] == pytest.approx(0.25)
    assert stats["opd/arith/tokens"] == 4.0
    assert stats["opd/reverse/reverse_kl"] == pytest.approx(1.5)
    assert stats["opd/teacher_time_s"] == 0.5 and not any(k.startswith("opd//") for k in stats)
