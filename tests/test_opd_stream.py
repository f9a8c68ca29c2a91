"""Streamed teacher signals in the train step, the rollout's recorded top-p nucleus and top-p
replay: against float64 references, with peak memory measured from the allocator's events."""

from __future__ import annotations

import copy
import math
from functools import partial

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from algos.opd import OpdConfig
from bench.opd_memory import cpu_peak_bytes
from engine.sampling import filter_probs, nucleus, top_list
from engine.session import HttpSession
from logic.teachers import TeacherSpec
from memory.layout import FlatLayout, module_tensors
from memory.manager import WeightMemory
from models.load import load_model
from tests.test_engine import serve
from training.batching import make_micro_batch
from training.colocated_teachers import ColocatedTeachers, OpdSignals, meta_skeleton
from training.config import LossConfig, MicroBatchConfig, MismatchConfig, TrainConfig
from training.state import TrainState
from training.step import opd_term_loss, replayed_logprobs, train_on_batch
from transport.codec import Codec
from transport.schema import NUCLEUS_IDS_DTYPE, NUCLEUS_LOGMASS_DTYPE, Kind, Sample, TrainBatch

VOCAB = 4096


def tiny(seed: int, vocab: int = VOCAB) -> torch.nn.Module:
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                      max_position_embeddings=256, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # sharper than the default init: KLs of a few nats, not ~0
        model.lm_head.weight.mul_(20.0)
    return model.eval()


def colocated(tmp_path, models: dict[str, torch.nn.Module], slots: int = 1
              ) -> ColocatedTeachers:
    """Teachers built in code on a WeightMemory of `slots` device slots (all on the host)."""
    tensors = {name: module_tensors(m) for name, m in models.items()}
    size = max(FlatLayout.from_state_dict(t).total_bytes for t in tensors.values())
    memory = WeightMemory("cpu", gpu_slots=slots, slot_bytes=size,
                          host_budget_bytes=size * len(models), nvme_dir=str(tmp_path / "nvme"))
    for name, t in tensors.items():
        memory.load_tensors(f"teacher:{name}", t)
    skeletons = {name: meta_skeleton(copy.deepcopy(m), "cpu") for name, m in models.items()}
    return ColocatedTeachers(memory, skeletons,
                             [TeacherSpec(name=n, model="code") for n in models])


def samples(n: int, response: int, teachers: list[str], seed: int = 0) -> list[Sample]:
    """Random tokens; sample i goes to teachers[(i // 2) % len(teachers)], so micro-batches of
    2 alternate between teachers in the planned order."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (8 + response,), generator=g).tolist()
        out.append(Sample(group_id=f"g{i // 4}", index=i % 4, domain="d", prompt_ids=ids[:8],
                          response_ids=ids[8:], loss_mask=[1] * response,
                          rollout_logprobs=[-8.0] * response, reward=float(i % 3),
                          teacher=teachers[(i // 2) % len(teachers)]))
    return out


class _Tok:
    pad_token_id = 0


def config(opd: OpdConfig, teachers: list[str], mb: int, **kw) -> TrainConfig:
    return TrainConfig(model="code", opd=opd, teachers=[TeacherSpec(name=t, model="code")
                                                        for t in teachers],
                       micro_batches=MicroBatchConfig(size=mb), **kw)


def float64_kl(student, teacher, s: Sample, temperature: float, keep=None) -> list[float]:
    """Per response token KL(student || teacher) over the vocabulary (or `keep(j)` ids), both
    renormalised there, by float64 copies of the models."""
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        zs = copy.deepcopy(student).double()(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]
        zt = copy.deepcopy(teacher).double()(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]
    out = []
    for j in range(len(s.response_ids)):
        sel = slice(None) if keep is None else torch.tensor(keep(j))
        ls = torch.log_softmax(zs[j, sel] / temperature, -1)
        lt = torch.log_softmax(zt[j, sel] / temperature, -1)
        out.append(float((ls.exp() * (ls - lt)).sum()))
    return out


def mean_kl(student, teacher, batch, name, temperature, keep=None) -> float:
    vals = [v for s in batch if s.teacher == name
            for v in float64_kl(student, teacher, s, temperature, keep and partial(keep, s))]
    return sum(vals) / len(vals)


# --- streaming: values, switches, memory -----------------------------------------------------

@pytest.mark.parametrize("mode", ["full", "top_k"])
def test_streamed_step_equals_float64_teachers_and_one_micro_batch(tmp_path, mode):
    """Micro-batches that alternate between two teachers run in teacher order, each teacher
    switched in once per step (one device slot), each sample scored by its own teacher: the
    per-teacher reverse KL equals a float64 reference; 4 micro-batches give the update of 1."""
    names = ["a", "b"]
    batch = samples(8, 12, names)
    opd = OpdConfig(mode=mode, top_k=16 if mode == "top_k" else 0)
    teachers = {"a": tiny(1), "b": tiny(2)}
    results = []
    for mb in (2, 8):
        student = tiny(0)
        state = TrainState(student, _Tok(), torch.optim.SGD(student.parameters(), lr=1.0))
        state.teachers = colocated(tmp_path / f"mb{mb}", teachers)
        state.temperature = 0.8
        try:
            stats = train_on_batch(state, batch, config(opd, names, mb, loss=LossConfig(
                advantage_estimator="none")))
            assert state.teachers.memory.counters["gpu_loads"] == 2  # one switch per teacher
        finally:
            state.teachers.close()
        results.append((stats, student))
    (stats, student), (stats1, student1) = results
    for p, q in zip(student.parameters(), student1.parameters()):
        assert torch.allclose(p, q, atol=1e-5)
    for name in names:
        assert stats[f"opd/{name}/reverse_kl"] == pytest.approx(
            stats1[f"opd/{name}/reverse_kl"], rel=1e-5)
        if mode == "full":
            want = mean_kl(tiny(0), teachers[name], batch, name, 0.8)
            assert stats[f"opd/{name}/reverse_kl"] == pytest.approx(want, rel=1e-4)
        else:  # the student's 16 most likely tokens
            def top16(s, j):
                ids = torch.tensor([s.prompt_ids + s.response_ids])
                with torch.no_grad():
                    z = tiny(0)(input_ids=ids).logits[0, len(s.prompt_ids) - 1 + j]
                return z.double().topk(16).indices.tolist()
            want = mean_kl(tiny(0), teachers[name], batch, name, 0.8, top16)
            assert stats[f"opd/{name}/reverse_kl"] == pytest.approx(want, rel=1e-4)
        assert stats[f"opd/{name}/reverse_kl"] > 0.1


def test_peak_memory_does_not_grow_with_the_micro_batches(tmp_path):
    """Full-vocabulary OPD with a colocated teacher: the step's peak over its 1 micro-batch of
    4 samples and over 4 such micro-batches differ by far less than one micro-batch's teacher
    logits (holding them for the step would add three)."""
    response = 120
    logits_bytes = 4 * response * VOCAB * 4
    peaks = {}
    for n in (4, 16):
        student = tiny(0)
        state = TrainState(student, _Tok(), torch.optim.SGD(student.parameters(), lr=0.1))
        state.teachers = colocated(tmp_path / f"n{n}", {"a": tiny(1)})
        cfg = config(OpdConfig(mode="full"), ["a"], 4)
        batch = samples(n, response, ["a"])
        step = partial(train_on_batch, state, batch, cfg)
        try:
            cpu_peak_bytes(step)  # warm-up, seen by the profiler (see cpu_peak_bytes)
            peaks[n], _ = cpu_peak_bytes(step)
        finally:
            state.teachers.close()
    assert peaks[4] > logits_bytes  # the measurement sees the micro-batch's logits
    assert peaks[16] - peaks[4] < 0.25 * logits_bytes, (peaks, logits_bytes)


@pytest.mark.parametrize("opd", [OpdConfig(mode="sampled"), OpdConfig(mode="full"),
                                 OpdConfig(mode="top_k", top_k=8),
                                 OpdConfig(mode="top_p", top_p=0.9)], ids=lambda c: c.mode)
def test_the_step_never_holds_a_micro_batch_of_logits(tmp_path, opd):
    """A whole step (recompute, policy pass with a colocated teacher, backward, AdamW) of each
    OPD mode peaks below half of one micro-batch's float32 logits, once the loss head's
    chunks are a fraction of them (`micro_batches.head_chunk_mib`, training/heads.py; the logits
    path held several copies).
    One padded forward per micro-batch, as on a GPU (the CPU's default by-length forwards keep
    the logits path: their point is the engine's exact reduction order)."""
    response, n = 400, 4
    logits_bytes = n * (8 + response) * VOCAB * 4
    student = tiny(0)
    state = TrainState(student, _Tok(), torch.optim.AdamW(student.parameters(), lr=1e-3))
    state.teachers = colocated(tmp_path, {"a": tiny(1)})
    cfg = TrainConfig(model="code", opd=opd, teachers=[TeacherSpec(name="a", model="code")],
                      loss=LossConfig(advantage_estimator="none"),
                      micro_batches=MicroBatchConfig(size=n, forward_by_length=False,
                                                     head_chunk_mib=1))  # 64 tokens of V = 4096
    step = partial(train_on_batch, state, samples(n, response, ["a"]), cfg)
    try:
        cpu_peak_bytes(step)  # warm-up, seen by the profiler (see cpu_peak_bytes)
        peak, stats = cpu_peak_bytes(step)
    finally:
        state.teachers.close()
    assert stats["opd/a/reverse_kl"] > 0  # the teacher's signal was computed
    assert peak < 0.5 * logits_bytes, (peak, logits_bytes)


def test_signals_hold_one_micro_batch_of_teacher_outputs(tmp_path):
    """OpdSignals gives each micro-batch its teacher logits when asked, in the declared order,
    and refuses another order; the outputs are those of the teacher's own forward."""
    names = ["a", "b"]
    batch = samples(8, 6, names)
    mbs = [make_micro_batch(batch[i:i + 2]) for i in range(0, 8, 2)]
    teachers = {"a": tiny(1), "b": tiny(2)}
    pool = colocated(tmp_path, teachers)
    cfg = config(OpdConfig(mode="full"), names, 2)
    order = [0, 2, 1, 3]  # a, a, b, b
    signals = OpdSignals(mbs, cfg, 1.0, pool, order)
    try:
        with pytest.raises(RuntimeError, match="out of the declared order"):
            signals.inputs(1)
        for j in order:
            inp = signals.inputs(j)
            name = mbs[j].samples[0].teacher
            ids = mbs[j].input_ids
            with torch.no_grad():
                want = teachers[name](input_ids=ids).logits[:, 7:-1]
            assert torch.allclose(inp.teacher_logits, want, atol=1e-5)
        assert pool.memory.counters["gpu_loads"] == 2
    finally:
        signals.close()
        pool.close()


# --- the rollout's nucleus: recording, the top_p term, replay ---------------------------------

def test_nucleus_is_the_set_the_engine_samples_from():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(50, generator=g) * 2
        logprobs = torch.log_softmax(logits / 0.7, -1)
        kept = set(torch.nonzero(filter_probs(logprobs.exp(), -1, 0.8, 0.0)).flatten().tolist())
        ids, log_mass = nucleus(top_list(logprobs, 50), 0.8)
        assert set(ids) == kept
        assert log_mass == pytest.approx(math.log(float(logprobs.double().exp()[ids].sum())),
                                         abs=1e-6)
    assert nucleus(top_list(logprobs, 2), 0.999) is None  # more than 2 tokens needed


class TopClient:
    """A /generate answering with prepared output tokens and top log-probs."""

    def __init__(self, outs):
        self.outs, self.asked = outs, []

    async def generate(self, input_ids, params, **extra):
        self.asked.append(extra.get("top_logprobs_num"))
        ids, tops = self.outs.pop(0)
        return {"output_ids": ids, "meta_info": {
            "finish_reason": {"type": "length"}, "weight_version": "0",
            "output_token_logprobs": [[top[0][0], t, None] for t, top in zip(ids, tops)],
            "output_top_logprobs": [[[lp, i, None] for lp, i in top] for top in tops]}}


class _CharTok:
    bos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 50 + 3 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


async def test_session_records_the_nucleus_per_token():
    top = [(math.log(0.5), 7), (math.log(0.3), 9), (math.log(0.15), 4), (math.log(0.05), 2)]
    client = TopClient([([9, 7], [top, top]), ([4], [top])])
    s = HttpSession(client, _CharTok(), "ab", {"temperature": 1.0, "top_p": 0.75},
                    "k", 4, nucleus_top_logprobs=4)
    await s.generate()
    s.observe("x")
    await s.generate()  # token 4 lies past the 0.75 nucleus {7, 9}: extended to it
    assert client.asked == [4, 4]
    sample = s.to_sample("g", 0, "d", 1.0)
    assert sample.rollout_nucleus_ids.dtype == NUCLEUS_IDS_DTYPE
    assert sample.rollout_nucleus_logmass.dtype == NUCLEUS_LOGMASS_DTYPE
    assert sample.rollout_nucleus_offsets.tolist() == [0, 2, 4, 4, 7]  # "x": one empty range
    assert sample.rollout_nucleus_ids.tolist() == [7, 9, 7, 9, 7, 9, 4]
    assert sample.rollout_nucleus_logmass.tolist() == pytest.approx(
        [math.log(0.8), math.log(0.8), 0.0, math.log(0.95)], abs=1e-6)
    frames = Codec().encode(Kind.REPLY, 1, TrainBatch(step=0, samples=[sample]))
    back = Codec().decode([bytearray(f) for f in frames]).body.samples[0]  # tensor frames
    for field in ("rollout_nucleus_ids", "rollout_nucleus_offsets", "rollout_nucleus_logmass"):
        assert np.array_equal(getattr(back, field), getattr(sample, field))
        assert getattr(back, field).dtype == getattr(sample, field).dtype
    # token 9: its 0.9 nucleus holds more than the 2 top log-probs returned; token 3: not
    # among its top log-probs. Both keep an empty nucleus and the episode goes on
    small = HttpSession(TopClient([([9, 7, 3], [top[:2], top, top])]), _CharTok(), "ab",
                        {"temperature": 1.0, "top_p": 0.9}, "k", 4, nucleus_top_logprobs=4)
    await small.generate()
    kept = small.to_sample("g", 0, "d", 1.0)
    assert kept.status == "ok" and small.nucleus_fallback_tokens == 2
    assert kept.rollout_nucleus_offsets.tolist() == [0, 0, 3, 3]
    assert kept.rollout_nucleus_ids.tolist() == [7, 9, 4]
    assert kept.rollout_nucleus_logmass.tolist() == pytest.approx([0.0, math.log(0.95), 0.0],
                                                                  abs=1e-6)
    plain = HttpSession(TopClient([([9], [top])]), _CharTok(), "ab",
                        {"temperature": 1.0, "top_p": 1.0}, "k", 4, nucleus_top_logprobs=4)
    await plain.generate()  # top_p = 1: nothing to record, nothing asked
    assert plain.client.asked == [None] and plain.to_sample("g", 0, "d", 0.0) \
        .rollout_nucleus_ids is None


async def test_embedded_worker_nuclei_equal_a_float64_forward(ipc):
    """Through the worker's HTTP API: each token's recorded nucleus is the top-p set of the
    float64 sampling distribution at that position, holding the token, with its mass."""
    model, tok = load_model("examples/base-tiny", "cpu", torch.float32)
    async with serve(ipc, model="examples/base-tiny") as (_, client):
        s = HttpSession(client, tok, "rev abc=", {"temperature": 1.3, "top_p": 0.85,
                                                  "sampling_seed": 5},
                        "k", 6, nucleus_top_logprobs=64)
        await s.generate()
    sample = s.to_sample("g", 0, "d", 0.0)
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        ref = torch.log_softmax(copy.deepcopy(model).double()(input_ids=ids).logits[0] / 1.3, -1)
    offsets = sample.rollout_nucleus_offsets
    for j, token in enumerate(sample.response_ids):
        got = sample.rollout_nucleus_ids[offsets[j]:offsets[j + 1]].tolist()
        row = ref[len(sample.prompt_ids) - 1 + j]
        order = row.argsort(descending=True).tolist()
        mass = row.exp()[order].cumsum(0)
        want = order[:int((mass < 0.85).sum()) + 1]
        assert set(got) == set(want) and token in got
        assert sample.rollout_nucleus_logmass[j] == pytest.approx(
            math.log(float(row.exp()[want].sum())), abs=1e-5)


def with_nucleus(batch: list[Sample], rollout, temperature: float, top_p: float) -> None:
    """Each sample's nucleus as a rollout with weights `rollout` would record it."""
    for s in batch:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            lp = torch.log_softmax(rollout(input_ids=ids).logits[0].double() / temperature, -1)
        members, masses = [], []
        for j, token in enumerate(s.response_ids):
            pairs = top_list(lp[len(s.prompt_ids) - 1 + j], VOCAB)
            got, log_mass = nucleus(pairs, top_p)
            if token not in got:  # random tokens: put the sampled one in, as sampling would
                got = got[:-1] + [token] if len(got) > 1 else [token]
            members.append(got)
            masses.append(log_mass)
        s.rollout_nucleus_ids = np.array([t for m in members for t in m], NUCLEUS_IDS_DTYPE)
        s.rollout_nucleus_offsets = np.concatenate([[0], np.cumsum([len(m) for m in members])]
                                                   ).astype(NUCLEUS_IDS_DTYPE)
        s.rollout_nucleus_logmass = np.array(masses, NUCLEUS_LOGMASS_DTYPE)


def test_top_p_step_uses_the_recorded_nucleus(tmp_path):
    """top_p mode on samples of stale weights: the step's reverse KL is the float64 KL over
    the nucleus each token was recorded with, not over the student's current nucleus."""
    batch = samples(4, 10, ["a"])
    with_nucleus(batch, tiny(7), 1.0, 0.9)
    teacher = tiny(1)
    stats = {}
    for recorded in (True, False):
        student = tiny(0)
        state = TrainState(student, _Tok(), torch.optim.SGD(student.parameters(), lr=0.0))
        state.teachers = colocated(tmp_path / str(recorded), {"a": teacher})
        run = batch if recorded else [Sample(**{**{f: getattr(s, f) for f in s.__struct_fields__},
                                                "rollout_nucleus_ids": None,
                                                "rollout_nucleus_offsets": None,
                                                "rollout_nucleus_logmass": None}) for s in batch]
        try:
            stats[recorded] = train_on_batch(state, run, config(
                OpdConfig(mode="top_p", top_p=0.9), ["a"], 2,
                loss=LossConfig(advantage_estimator="none")))
        finally:
            state.teachers.close()

    def keep(s, j):
        o = s.rollout_nucleus_offsets
        return s.rollout_nucleus_ids[o[j]:o[j + 1]].tolist()

    want = mean_kl(tiny(0), teacher, batch, "a", 1.0, keep)
    assert stats[True]["opd/a/reverse_kl"] == pytest.approx(want, rel=1e-4)
    assert stats[True]["opd/rollout_nucleus_samples"] == 4
    assert stats[False]["opd/student_nucleus_samples"] == 4
    assert stats[False]["opd/a/reverse_kl"] != pytest.approx(want, rel=1e-2)


def test_replayed_logprobs_renormalise_over_the_nucleus():
    """Top-p replay: training, proximal and rollout log-probs of each token renormalised over
    its recorded nucleus (float64 reference), only on the rows whose config sets it."""
    batch = samples(2, 6, ["a"])
    with_nucleus(batch, tiny(7), 0.9, 0.8)
    student = tiny(0).double()
    mb = make_micro_batch(batch)
    cfg = config(OpdConfig(mode="sampled", top_p_replay=True), ["a"], 2)
    signals = OpdSignals([mb], cfg, 1.0, None)
    inp = signals.inputs(0)
    inp.configs[1] = OpdConfig(mode="sampled")  # row 1: no replay
    with torch.no_grad():
        z = student(input_ids=mb.input_ids).logits[:, 7:-1]
    lp = torch.log_softmax(z / 0.9, -1)
    tokens = mb.input_ids[:, 8:]
    logp = lp.gather(-1, tokens[..., None])[..., 0]
    old = logp - 0.01
    train, prox, roll = replayed_logprobs(logp, old, mb, inp, z, 0.9)
    s = batch[0]
    for j in range(6):
        keep = s.rollout_nucleus_ids[s.rollout_nucleus_offsets[j]:
                                     s.rollout_nucleus_offsets[j + 1]].tolist()
        log_mass = float(torch.logsumexp(lp[0, j, keep], 0))
        assert float(train[0, j]) == pytest.approx(float(logp[0, j]) - log_mass, abs=1e-9)
        assert float(prox[0, j]) == pytest.approx(float(old[0, j]) - log_mass, abs=1e-9)
        assert float(roll[0, j]) == pytest.approx(-8.0 - float(s.rollout_nucleus_logmass[j]),
                                                  abs=1e-5)
    assert torch.equal(train[1], logp[1]) and torch.equal(roll[1], mb.rollout_logp[1])


def test_replay_changes_the_update_and_is_neutral_on_the_whole_vocabulary(tmp_path):
    """GRPO with top_p_replay: the gradient of log p(x) - log p(N) differs from plain; with a
    nucleus of every token (mass 1) it is the plain step."""
    batch = samples(4, 5, ["a"])
    full = copy.deepcopy(batch)
    for s in full:
        n = len(s.response_ids)
        s.rollout_nucleus_ids = np.tile(np.arange(VOCAB), n).astype(NUCLEUS_IDS_DTYPE)
        s.rollout_nucleus_offsets = (np.arange(n + 1) * VOCAB).astype(NUCLEUS_IDS_DTYPE)
        s.rollout_nucleus_logmass = np.zeros(n, NUCLEUS_LOGMASS_DTYPE)
    with_nucleus(batch, tiny(7), 1.0, 0.5)
    updates = {}
    for name, run, replay in (("plain", batch, False), ("replay", batch, True),
                              ("whole", full, True)):
        student = tiny(0)
        state = TrainState(student, _Tok(), torch.optim.SGD(student.parameters(), lr=1.0))
        train_on_batch(state, run, TrainConfig(
            model="code", opd=OpdConfig(mode="sampled", kl_coef=0.0, top_p_replay=replay),
            loss=LossConfig(advantage_estimator="grpo"), micro_batches=MicroBatchConfig(size=2)))
        updates[name] = torch.cat([(p - q).flatten() for p, q in
                                   zip(student.parameters(), tiny(0).parameters())])
    assert updates["plain"].abs().max() > 1e-4
    assert torch.allclose(updates["whole"], updates["plain"], atol=1e-6)
    assert not torch.allclose(updates["replay"], updates["plain"], atol=1e-4)


def drop_nucleus(s: Sample, j: int) -> None:
    """Token j's record emptied, as the session leaves a token whose nucleus its top log-probs
    do not determine."""
    o = s.rollout_nucleus_offsets.astype(np.int64)
    sizes = np.diff(o)
    sizes[j] = 0
    s.rollout_nucleus_ids = np.concatenate([s.rollout_nucleus_ids[:o[j]],
                                            s.rollout_nucleus_ids[o[j + 1]:]])
    s.rollout_nucleus_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(NUCLEUS_IDS_DTYPE)
    s.rollout_nucleus_logmass = s.rollout_nucleus_logmass.copy()
    s.rollout_nucleus_logmass[j] = 0.0


def recorded_ids(s: Sample, j: int) -> list[int]:
    o = s.rollout_nucleus_offsets
    return s.rollout_nucleus_ids[o[j]:o[j + 1]].tolist()


def float64_logprobs(model, s: Sample, temperature: float) -> torch.Tensor:
    """[n, V] float64 log-probs at the response positions."""
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        z = copy.deepcopy(model).double()(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]
    return torch.log_softmax(z / temperature, -1)


def test_tokens_without_a_nucleus_keep_plain_logprobs_and_are_counted():
    """Replay on a record with an empty range on a policy token: that token keeps its plain
    log-probs, the others are renormalised; the token is counted."""
    batch = samples(2, 6, ["a"])
    with_nucleus(batch, tiny(7), 0.9, 0.8)
    drop_nucleus(batch[0], 2)
    drop_nucleus(batch[1], 0)
    student = tiny(0).double()
    mb = make_micro_batch(batch)
    signals = OpdSignals([mb], config(OpdConfig(mode="sampled", top_p_replay=True), ["a"], 2),
                         1.0, None)
    inp = signals.inputs(0)
    assert signals.counts["nucleus_fallback_tokens"] == 2
    with torch.no_grad():
        z = student(input_ids=mb.input_ids).logits[:, 7:-1]
    lp = torch.log_softmax(z / 0.9, -1)
    logp = lp.gather(-1, mb.input_ids[:, 8:, None])[..., 0]
    train, prox, roll = replayed_logprobs(logp, logp - 0.01, mb, inp, z, 0.9)
    for b, s in enumerate(batch):
        for j in range(6):
            keep = recorded_ids(s, j)
            log_mass = float(torch.logsumexp(lp[b, j, keep], 0)) if keep else 0.0
            roll_mass = float(s.rollout_nucleus_logmass[j]) if keep else 0.0
            assert float(train[b, j]) == pytest.approx(float(logp[b, j]) - log_mass, abs=1e-9)
            assert float(prox[b, j]) == pytest.approx(float(logp[b, j]) - 0.01 - log_mass,
                                                      abs=1e-9)
            assert float(roll[b, j]) == pytest.approx(-8.0 - roll_mass, abs=1e-5)


def student_nucleus(lp: torch.Tensor, top_p: float) -> list[int]:
    """The top-p set of one float64 log-prob row (ties with the last member kept)."""
    p = lp.exp()
    ordered = p.sort(descending=True).values
    n = int((ordered.cumsum(0) < top_p).sum()) + 1
    return torch.nonzero(p >= ordered[n - 1]).flatten().tolist()


def test_top_p_term_over_recorded_and_fallback_tokens(tmp_path):
    """top_p mode: a token with a recorded nucleus is scored over it, a token without one over
    the student's own nucleus; each sample's mean divides by all its policy tokens."""
    T, top_p, N = 0.9, 0.8, 5
    batch = samples(2, 6, ["a"])
    with_nucleus(batch, tiny(7), T, top_p)
    drop_nucleus(batch[0], 2)
    drop_nucleus(batch[0], 4)
    teacher, student = tiny(1), tiny(0)
    mb = make_micro_batch(batch)
    cfg = config(OpdConfig(mode="top_p", top_p=top_p, kl_coef=0.5), ["a"], 2)
    pool = colocated(tmp_path, {"a": teacher})
    signals = OpdSignals([mb], cfg, T, pool)
    try:
        inp = signals.inputs(0)
        z = student(input_ids=mb.input_ids).logits[:, 7:-1]
        loss = opd_term_loss(cfg, T, mb, inp, z, N, None, signals.counts)
    finally:
        signals.close()
        pool.close()
    want = 0.0
    for s in batch:
        ls, lt = float64_logprobs(student, s, T), float64_logprobs(teacher, s, T)
        kls = []
        for j in range(6):
            keep = torch.tensor(recorded_ids(s, j) or student_nucleus(ls[j], top_p))
            p, q = torch.log_softmax(ls[j, keep], 0), torch.log_softmax(lt[j, keep], 0)
            kls.append(float((p.exp() * (p - q)).sum()))
        want += 0.5 * sum(kls) / 6 / N
    assert loss.item() == pytest.approx(want, rel=1e-5)
    assert signals.counts["nucleus_fallback_tokens"] == 2
    assert signals.counts["student_nucleus_samples"] == 1


@pytest.mark.parametrize("fallback", [0, 1])
def test_replayed_sampled_teacher_is_renormalised_over_the_nucleus(tmp_path, fallback):
    """sampled mode with top_p_replay and a colocated teacher: r_t compares the student and
    the teacher both renormalised over the token's recorded nucleus (whole vocabulary for a
    token without one), against float64."""
    T = 0.9
    batch = samples(4, 6, ["a"])
    with_nucleus(batch, tiny(7), T, 0.7)
    if fallback:
        drop_nucleus(batch[1], 3)
    teacher, student = tiny(1), tiny(0)
    state = TrainState(student, _Tok(), torch.optim.SGD(student.parameters(), lr=0.0))
    state.teachers, state.temperature = colocated(tmp_path, {"a": teacher}), T
    try:
        stats = train_on_batch(state, batch, config(
            OpdConfig(mode="sampled", top_p_replay=True), ["a"], 2,
            loss=LossConfig(advantage_estimator="none")))
    finally:
        state.teachers.close()
    replayed, plain = [], []
    for s in batch:
        ls, lt = float64_logprobs(tiny(0), s, T), float64_logprobs(teacher, s, T)
        for j, x in enumerate(s.response_ids):
            keep = recorded_ids(s, j) or list(range(VOCAB))
            replayed.append(float(ls[j, x] - torch.logsumexp(ls[j, keep], 0)
                                  - lt[j, x] + torch.logsumexp(lt[j, keep], 0)))
            plain.append(float(ls[j, x] - lt[j, x]))
    want = sum(replayed) / len(replayed)
    assert stats["opd/a/reverse_kl"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert want != pytest.approx(sum(plain) / len(plain), rel=1e-2)  # the whole vocabulary's
    assert stats["opd/nucleus_fallback_tokens"] == fallback


def test_replayed_sampled_server_teacher_keeps_the_whole_vocabulary_gap():
    """sampled mode with top_p_replay and a teacher server (its reply: the sampled token's
    whole-vocabulary log-prob): r_t pairs it with the student's whole-vocabulary log-prob."""
    T = 0.9
    batch = samples(4, 6, ["a"])
    with_nucleus(batch, tiny(7), T, 0.7)
    teacher, student = tiny(1), tiny(0)
    plain = []
    for s in batch:
        ls, lt = float64_logprobs(student, s, T), float64_logprobs(teacher, s, T)
        s.teacher_logprobs = [float(lt[j, x]) for j, x in enumerate(s.response_ids)]
        plain += [float(ls[j, x] - lt[j, x]) for j, x in enumerate(s.response_ids)]
    state = TrainState(student, _Tok(), torch.optim.SGD(student.parameters(), lr=0.0))
    state.temperature = T
    stats = train_on_batch(state, batch, TrainConfig(
        model="code", opd=OpdConfig(mode="sampled", top_p_replay=True),
        loss=LossConfig(advantage_estimator="none"),
        micro_batches=MicroBatchConfig(size=2)))
    assert stats["opd/a/reverse_kl"] == pytest.approx(sum(plain) / len(plain), rel=1e-4)


def test_replay_refuses_what_it_cannot_renormalise():
    """At load (the config), not at the first step."""
    replay = OpdConfig(mode="sampled", top_p_replay=True)
    with pytest.raises(ValueError, match="proximal = 'rollout_version'"):
        TrainConfig(model="code", opd=replay, loss=LossConfig(advantage_estimator="grpo"),
                    mismatch=MismatchConfig(correction="decoupled", proximal="rollout_version"))
    with pytest.raises(ValueError, match="use true_on_policy = false or top_p_replay = false"):
        TrainConfig(model="code", opd=replay, true_on_policy=True)
    assert TrainConfig(model="code", opd=replay).opd.top_p_replay  # alone it loads
