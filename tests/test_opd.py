"""OPD signals against references written differently: per-position float64 Python loops."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from algos.logprobs import gather_logprobs, logits_to_logprobs
from algos.opd import (
    OpdConfig,
    check_placement,
    distribution_reverse_kl,
    full_reverse_kl,
    ids_reverse_kl,
    is_loss_term,
    needs_teacher_logits,
    nucleus_logprobs,
    opd_loss,
    opd_weights,
    sampled_log_ratio,
    teacher_kl_metrics,
    teacher_kl_sums,
    token_logprobs_chunked,
    top_k_reverse_kl,
    top_p_reverse_kl,
    weighted_set_kl,
)
from algos.policy_loss import ppo_clip_loss

B, T, V = 3, 5, 11


def case(seed: int, dtype=torch.float32, vocab: int = V):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(B, T, vocab, generator=g) * 2).to(dtype)
    teacher = (torch.randn(B, T, vocab, generator=g) * 2).to(dtype)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[1, 3:] = 0  # right padding
    mask[2] = 0  # a sample with no response tokens
    mask[0, 0] = 1
    return student, teacher, mask


def row_logprobs(logits: list[float], temperature: float, keep: list[int]) -> dict[int, float]:
    """log softmax(logits / T) renormalised over the token ids `keep`, in Python floats."""
    scaled = {v: logits[v] / temperature for v in keep}
    top = max(scaled.values())
    lse = top + math.log(sum(math.exp(x - top) for x in scaled.values()))
    return {v: x - lse for v, x in scaled.items()}


def set_kl(s_row, t_row, temperature, keep) -> float:
    ls, lt = row_logprobs(s_row, temperature, keep), row_logprobs(t_row, temperature, keep)
    return sum(math.exp(ls[v]) * (ls[v] - lt[v]) for v in keep)


def nucleus(row: list[float], temperature: float, top_p: float) -> list[int]:
    """Tokens by descending probability until their mass reaches top_p."""
    lp = row_logprobs(row, temperature, list(range(len(row))))
    kept, mass = [], 0.0
    for v in sorted(lp, key=lp.get, reverse=True):
        kept.append(v)
        mass += math.exp(lp[v])
        if mass >= top_p:
            break
    return kept


def reference(student, teacher, mask, temperature, keep_fn):
    s, t = student.double().tolist(), teacher.double().tolist()
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for i in range(mask.shape[1]):
            if mask[b, i]:
                out[b, i] = set_kl(s[b][i], t[b][i], temperature, keep_fn(b, i))
    return out


def everything(b, i):
    return list(range(V))


# --- sampled token ---------------------------------------------------------------------------

def test_sampled_ratio_is_the_difference_of_gathered_logprobs():
    student, teacher, mask = case(0)
    student.requires_grad_(True)
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    s_lp = gather_logprobs(logits_to_logprobs(student, 0.8), tokens)
    t_lp = gather_logprobs(logits_to_logprobs(teacher, 0.8), tokens)
    r = sampled_log_ratio(s_lp, t_lp, mask)
    assert not r.requires_grad
    s, t = student.detach().double().tolist(), teacher.double().tolist()
    for b in range(B):
        for i in range(T):
            x = int(tokens[b, i])
            expect = (row_logprobs(s[b][i], 0.8, everything(b, i))[x]
                      - row_logprobs(t[b][i], 0.8, everything(b, i))[x]) if mask[b, i] else 0.0
            assert r[b, i].item() == pytest.approx(expect, abs=1e-5)


def test_pure_distillation_policy_gradient_is_the_full_kl_gradient():
    """A = 0: weighting every token by its probability (the exact expectation over samples),
    the policy-gradient of -beta * r equals beta * grad of the full-vocabulary reverse KL."""
    student, teacher, _ = case(3, torch.float64)
    z = student[0].clone().requires_grad_(True)  # T positions x V tokens
    lp = torch.log_softmax(z, dim=-1)  # float64 (algos.logprobs works in float32)
    lp_t = torch.log_softmax(teacher[0], dim=-1)
    ones = torch.ones(T, V, dtype=torch.float64)
    adv = -0.7 * sampled_log_ratio(lp, lp_t, ones)  # the step's sampled-mode advantages, A = 0
    assert adv.detach().numpy() == pytest.approx((-0.7 * (lp - lp_t)).detach().numpy())
    weights = lp.exp().detach()  # each (position, token) "sample" weighted by its probability
    pg = ppo_clip_loss(lp, lp.detach(), adv, ones, num_samples_in_step=1, token_weights=weights)
    (grad_pg,) = torch.autograd.grad(pg.loss * V, z)  # undo the per-sample token mean over V
    kl = full_reverse_kl(z, teacher[0], ones[:, 0])
    (grad_kl,) = torch.autograd.grad(0.7 * kl.sum(), z)
    assert torch.allclose(grad_pg, grad_kl, atol=1e-10)
    assert grad_kl.abs().max() > 1e-3


# --- full vocabulary ---------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_full_reverse_kl_matches_the_float64_reference(temperature):
    student, teacher, mask = case(4)
    ref = reference(student, teacher, mask, temperature or 1.0, everything)
    for chunk in (V, 3 * V, 1 << 20):  # one row, three rows, everything per chunk
        got = full_reverse_kl(student, teacher, mask, temperature, chunk_elements=chunk)
        assert got.dtype == torch.float32
        assert torch.allclose(got.double(), ref, atol=1e-5), chunk
    assert (ref[mask.bool()] > 0).all()


def test_full_reverse_kl_gradient_matches_finite_differences():
    student, teacher, mask = case(5, torch.float64, vocab=6)
    student.requires_grad_(True)
    teacher.requires_grad_(True)

    def loss(z):
        return opd_loss(full_reverse_kl(z, teacher, mask, 0.8, chunk_elements=12), mask, 4, 0.5)

    assert torch.autograd.gradcheck(loss, (student,), eps=1e-6, atol=1e-8)
    grad, teacher_grad = torch.autograd.grad(loss(student), (student, teacher), allow_unused=True)
    assert (grad[~mask.bool()] == 0).all() and grad[mask.bool()].abs().max() > 1e-3
    assert teacher_grad is None  # the teacher is detached even when its logits carry a graph
    assert not full_reverse_kl(student.detach(), teacher, mask).requires_grad


def test_full_reverse_kl_keeps_bfloat16_inputs_and_gradients():
    student, teacher, mask = case(6)
    s16 = student.bfloat16().requires_grad_(True)
    kl = full_reverse_kl(s16, teacher.bfloat16(), mask)
    ref = reference(s16.detach().float(), teacher.bfloat16().float(), mask, 1.0, everything)
    assert torch.allclose(kl.double(), ref, atol=1e-4)
    kl.sum().backward()
    assert s16.grad.dtype == torch.bfloat16 and torch.isfinite(s16.grad.float()).all()


# --- top-p -------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
@pytest.mark.parametrize("own_nucleus", [True, False])
def test_top_p_matches_the_float64_reference(top_p, own_nucleus):
    student, teacher, mask = case(7)
    rollout = student + 0.5 * torch.randn(student.shape, generator=torch.Generator().manual_seed(8))
    nuc = student if own_nucleus else rollout
    rows = nuc.double().tolist()
    ref = reference(student, teacher, mask, 1.3,
                    lambda b, i: nucleus(rows[b][i], 1.3, top_p))
    got = top_p_reverse_kl(student, teacher, mask, top_p, 1.3,
                           None if own_nucleus else rollout, chunk_elements=2 * V)
    assert torch.allclose(got.double(), ref, atol=1e-5)
    full = reference(student, teacher, mask, 1.3, everything)
    assert not torch.allclose(ref, full, atol=1e-3)  # the nucleus really is a strict subset


def test_top_p_gradient_matches_finite_differences():
    student, teacher, mask = case(9, torch.float64, vocab=7)
    rollout = student + 0.3
    student.requires_grad_(True)

    def loss(z):
        return top_p_reverse_kl(z, teacher, mask, 0.6, 0.9, rollout, chunk_elements=14).sum()

    assert torch.autograd.gradcheck(loss, (student,), eps=1e-6, atol=1e-8)
    (grad,) = torch.autograd.grad(loss(student), student)
    outside = torch.zeros_like(mask, dtype=torch.long)
    for b in range(B):  # tokens outside the nucleus get no gradient
        for i in range(T):
            keep = set(nucleus(rollout[b, i].tolist(), 0.9, 0.6)) if mask[b, i] else set()
            outside[b, i] = sum(1 for v in range(7) if v not in keep and grad[b, i, v] != 0)
    assert int(outside.sum()) == 0


def test_top_p_one_equals_full_vocabulary():
    student, teacher, mask = case(10)
    a = student.clone().requires_grad_(True)
    b = student.clone().requires_grad_(True)
    kl_p = top_p_reverse_kl(a, teacher, mask, 1.0, 0.9)
    kl_f = full_reverse_kl(b, teacher, mask, 0.9)
    assert torch.equal(kl_p, kl_f)
    kl_p.sum().backward()
    kl_f.sum().backward()
    assert torch.equal(a.grad, b.grad)
    cfg = distribution_reverse_kl(OpdConfig(mode="top_p", top_p=1.0), student, mask, 0.9,
                                  teacher_logits=teacher)
    assert torch.equal(cfg, kl_f.detach())


# --- top-k -------------------------------------------------------------------------------------

def teacher_top_k(teacher, k, temperature):
    lp = logits_to_logprobs(teacher, temperature)
    values, ids = lp.topk(k, dim=-1)
    return ids, values


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_matches_the_float64_reference(k):
    student, teacher, mask = case(11)
    ids, lps = teacher_top_k(teacher, k, 0.8)
    id_rows = ids.tolist()
    ref = reference(student, teacher, mask, 0.8, lambda b, i: id_rows[b][i])
    got = top_k_reverse_kl(student, ids, lps, mask, 0.8)
    assert torch.allclose(got.double(), ref, atol=1e-5)
    if k == 1:
        assert (got == 0).all()  # one token renormalised is the same point mass on both sides


def test_top_k_with_k_equal_to_vocab_equals_full():
    student, teacher, mask = case(12)
    a = student.clone().requires_grad_(True)
    b = student.clone().requires_grad_(True)
    ids, lps = teacher_top_k(teacher, V, 0.7)
    kl_k = top_k_reverse_kl(a, ids, lps, mask, 0.7)
    kl_f = full_reverse_kl(b, teacher, mask, 0.7)
    assert torch.allclose(kl_k, kl_f, atol=1e-6)
    kl_k.sum().backward()
    kl_f.sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_top_k_rescales_server_logprobs_from_another_temperature():
    student, teacher, mask = case(13)
    ids, at_one = teacher_top_k(teacher, 4, 1.0)
    _, at_rollout = teacher_top_k(teacher, 4, 0.6)
    want = top_k_reverse_kl(student, ids, at_rollout, mask, 0.6)
    got = top_k_reverse_kl(student, ids, at_one, mask, 0.6, teacher_temperature=1.0)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(top_k_reverse_kl(student, ids, at_one, mask, 0.6), want, atol=1e-3)


def test_top_k_gradient_matches_finite_differences():
    student, teacher, mask = case(14, torch.float64, vocab=8)
    ids, lps = teacher_top_k(teacher, 3, 1.2)
    lps = lps.double()
    ids = ids.masked_fill(~mask.bool()[..., None], 99)  # server padding off the mask is ignored
    student.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda z: top_k_reverse_kl(z, ids, lps, mask, 1.2).sum(), (student,), eps=1e-6, atol=1e-8)


def top_ids(logits_row: list[float], k: int) -> list[int]:
    return sorted(range(len(logits_row)), key=lambda v: -logits_row[v])[:k]


@pytest.mark.parametrize("source", ["student", "teacher"])
def test_top_k_from_logits_matches_the_float64_reference(source):
    """top_k_from: S_t is the student's (the source's definition) or the teacher's k most
    likely tokens; the teacher is read from its logits at those ids."""
    student, teacher, mask = case(18)
    rows = (student if source == "student" else teacher).double().tolist()
    ref = reference(student, teacher, mask, 0.8, lambda b, i: top_ids(rows[b][i], 4))
    cfg = OpdConfig(mode="top_k", top_k=4, top_k_from=source)
    got = distribution_reverse_kl(cfg, student, mask, 0.8, teacher_logits=teacher)
    assert torch.allclose(got.double(), ref, atol=1e-5)
    if source == "teacher":  # the same set and values a teacher server returns
        ids, lps = teacher_top_k(teacher, 4, 0.8)
        assert torch.allclose(got, top_k_reverse_kl(student, ids, lps, mask, 0.8), atol=1e-6)
    with pytest.raises(ValueError, match="needs the teacher's logits"):
        distribution_reverse_kl(OpdConfig(mode="top_k", top_k=4), student, mask, 0.8,
                                teacher_ids=torch.zeros(B, T, 4, dtype=torch.long),
                                teacher_logprobs=torch.zeros(B, T, 4))


def test_student_and_teacher_top_k_are_different_objectives():
    """On random logits the two sets give KLs over a nat apart (the student's top-k holds what it
    samples, the teacher's what the teacher likes): top_k_from matters."""
    g = torch.Generator().manual_seed(30)
    student, teacher = torch.randn(2, 64, 1000, generator=g).mul(3).unbind(0)
    mask = torch.ones(2, 32)
    student, teacher = student.view(2, 32, 1000), teacher.view(2, 32, 1000)
    kls = {src: distribution_reverse_kl(OpdConfig(mode="top_k", top_k=20, top_k_from=src),
                                        student, mask, 1.0, teacher_logits=teacher).mean()
           for src in ("student", "teacher")}
    assert abs(float(kls["student"] - kls["teacher"])) > 1.0, kls  # 1.5 nats here


def test_top_k_from_student_gradient_matches_finite_differences():
    student, teacher, mask = case(19, torch.float64, vocab=9)
    student.requires_grad_(True)
    cfg = OpdConfig(mode="top_k", top_k=3)
    assert torch.autograd.gradcheck(
        lambda z: distribution_reverse_kl(cfg, z, mask, 0.9, teacher_logits=teacher).sum(),
        (student,), eps=1e-6, atol=1e-8)


def test_server_top_k_padding_is_out_of_the_set():
    """A position a server answered with fewer entries (-inf log-probs, id 0 padding) is the
    KL over the real entries only."""
    student, teacher, mask = case(20)
    ids, lps = teacher_top_k(teacher, 4, 1.0)
    padded_ids = torch.cat([ids, torch.zeros_like(ids[..., :1])], -1)
    padded = torch.cat([lps, torch.full_like(lps[..., :1], -math.inf)], -1)
    assert torch.allclose(top_k_reverse_kl(student, padded_ids, padded, mask),
                          top_k_reverse_kl(student, ids, lps, mask), atol=1e-6)


# --- chunks over the vocabulary, the weighted (streaming) form ---------------------------------

@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_vocabulary_slices_match_the_float64_reference(top_p):
    """chunk_elements below V: the full KL walks the vocabulary in slices (streamed
    log-sum-exp); top-p keeps whole rows (its nucleus needs a sort)."""
    student, teacher, mask = case(21)
    rows = student.double().tolist()
    keep = everything if top_p == 1 else (lambda b, i: nucleus(rows[b][i], 0.7, top_p))
    ref = reference(student, teacher, mask, 0.7, keep)
    for chunk in (1, 4, 10):  # slices of 1, 4 (the last of 3) and 10 (then 1) tokens
        got = top_p_reverse_kl(student, teacher, mask, top_p, 0.7, chunk_elements=chunk)
        assert torch.allclose(got.double(), ref, atol=1e-5), chunk


def test_vocabulary_slices_gradient_matches_finite_differences():
    student, teacher, mask = case(22, torch.float64, vocab=7)
    student.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda z: full_reverse_kl(z, teacher, mask, 0.8, chunk_elements=3).sum(),
        (student,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_weighted_set_kl_is_the_opd_loss_and_keeps_no_teacher_logits(top_p):
    """The trainer's form: sum_t w_t KL_t with the weights of opd_loss gives opd_loss's value
    and gradient (computed in the forward, scaled by the backward's incoming gradient), its
    KL_t equal the per-position function's, and the teacher's logits are free after it."""
    student, teacher, mask = case(23, torch.float64)
    rollout = student + 0.4 * torch.randn(student.shape, generator=torch.Generator()
                                          .manual_seed(24), dtype=torch.float64)
    coef = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    a, b = student.clone().requires_grad_(True), student.clone().requires_grad_(True)
    want_kl = top_p_reverse_kl(b, teacher, mask, top_p, 0.9, rollout, chunk_elements=2 * V)
    want = opd_loss(want_kl * coef[:, None], mask, 6, 0.5)
    t = teacher.clone()
    alive = weakref.ref(t)
    loss, kl = weighted_set_kl(a, t, mask, opd_weights(mask, coef, 6, 0.5), 0.9, top_p,
                               rollout, chunk_elements=2 * V)
    del t
    gc.collect()
    assert alive() is None  # nothing kept the teacher's logits
    assert not kl.requires_grad and torch.allclose(kl, want_kl.detach(), atol=1e-12)
    assert loss.item() == pytest.approx(want.item(), rel=1e-10)
    (3.0 * loss).backward()
    (3.0 * want).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-12) and a.grad.abs().max() > 1e-3


# --- the nucleus the rollout recorded, top-p replay --------------------------------------------

def recorded(rollout: torch.Tensor, mask, temperature: float, top_p: float):
    """[B, T, K] ids / valid of each position's nucleus under `rollout` logits (Python)."""
    rows = rollout.double().tolist()
    sets = [[nucleus(rows[b][i], temperature, top_p) if mask[b, i] else [0]
             for i in range(T)] for b in range(B)]
    K = max(len(x) for row in sets for x in row)
    ids = torch.zeros(B, T, K, dtype=torch.long)
    valid = torch.zeros(B, T, K, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            ids[b, i, :len(sets[b][i])] = torch.tensor(sets[b][i])
            valid[b, i, :len(sets[b][i])] = True
    return sets, ids, valid


def test_recorded_nucleus_matches_the_float64_reference():
    """top_p with the nucleus the rollout sampled from (stale weights: not the student's
    current nucleus) is the KL over exactly those ids."""
    student, teacher, mask = case(25)
    rollout = student + 0.8 * torch.randn(student.shape, generator=torch.Generator()
                                          .manual_seed(26))
    sets, ids, valid = recorded(rollout, mask, 1.3, 0.8)
    ref = reference(student, teacher, mask, 1.3, lambda b, i: sets[b][i])
    got = distribution_reverse_kl(OpdConfig(mode="top_p", top_p=0.8), student, mask, 1.3,
                                  teacher_logits=teacher, nucleus_ids=ids, nucleus_valid=valid)
    assert torch.allclose(got.double(), ref, atol=1e-5)
    rebuilt = top_p_reverse_kl(student, teacher, mask, 0.8, 1.3)  # the student's own nucleus
    assert not torch.allclose(rebuilt.double(), ref, atol=1e-3)
    z = student.double().requires_grad_(True)
    scores = teacher.double().gather(-1, ids) / 1.3
    assert torch.autograd.gradcheck(
        lambda x: ids_reverse_kl(x, ids, scores, mask, 1.3, valid).sum(), (z,), eps=1e-6,
        atol=1e-8)


def test_nucleus_logprobs_match_the_float64_reference():
    """Top-p replay: log p(x_t) renormalised over the recorded nucleus."""
    student, _, mask = case(27, torch.float64)
    sets, ids, valid = recorded(student + 0.3, mask, 0.9, 0.7)
    tokens = torch.tensor([[sets[b][i][-1] for i in range(T)] for b in range(B)])
    z = student.clone().requires_grad_(True)
    got = nucleus_logprobs(z, tokens, ids, valid, mask, 0.9)
    rows = student.tolist()
    for b in range(B):
        for i in range(T):
            want = row_logprobs(rows[b][i], 0.9, sets[b][i])[int(tokens[b, i])] \
                if mask[b, i] else 0.0
            assert got[b, i].item() == pytest.approx(want, abs=1e-10)
    assert torch.autograd.gradcheck(
        lambda x: nucleus_logprobs(x, tokens, ids, valid, mask, 0.9).sum(), (z,), eps=1e-6,
        atol=1e-8)


def test_token_logprobs_chunked_equal_the_gathered_log_softmax():
    student, _, _ = case(28)
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(29))
    want = gather_logprobs(logits_to_logprobs(student, 0.7), tokens)
    for chunk in (V, 2 * V, None):
        got = token_logprobs_chunked(student.bfloat16().float(), tokens, 0.7, chunk)
        want16 = gather_logprobs(logits_to_logprobs(student.bfloat16(), 0.7), tokens)
        assert torch.allclose(got, want16, atol=1e-5) and got.dtype == torch.float32
    assert torch.allclose(token_logprobs_chunked(student, tokens, 0.7), want, atol=1e-6)


# --- reduction, metrics, config ----------------------------------------------------------------

def test_opd_loss_is_the_sample_mean_and_adds_up_over_micro_batches():
    student, teacher, mask = case(15)
    kl = full_reverse_kl(student, teacher, mask)
    want = 0.0
    for b in range(B):
        n = int(mask[b].sum())
        want += sum(float(kl[b, i]) for i in range(T) if mask[b, i]) / n if n else 0.0
    assert float(opd_loss(kl, mask, 6, 2.0)) == pytest.approx(2.0 * want / 6, rel=1e-6)
    split = opd_loss(kl[:1], mask[:1], 6, 2.0) + opd_loss(kl[1:], mask[1:], 6, 2.0)
    assert float(split) == pytest.approx(float(opd_loss(kl, mask, 6, 2.0)), rel=1e-6)


def test_teacher_kl_metrics_per_teacher():
    student, teacher, mask = case(16)
    kl = full_reverse_kl(student, teacher, mask)
    sums = teacher_kl_sums(kl[:2], mask[:2], ["math", "code"])
    teacher_kl_sums(kl[2:], mask[2:], ["math"], into=sums)
    got = teacher_kl_metrics(sums)
    math_vals = [float(kl[0, i]) for i in range(T) if mask[0, i]]
    code_vals = [float(kl[1, i]) for i in range(T) if mask[1, i]]
    assert got["opd/math/reverse_kl"] == pytest.approx(sum(math_vals) / len(math_vals))
    assert got["opd/code/reverse_kl"] == pytest.approx(sum(code_vals) / len(code_vals))
    assert got["opd/math/tokens"] == len(math_vals) and got["opd/code/tokens"] == len(code_vals)


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "forward_kl"}, "opd mode"),
    ({"kl_coef": -0.1}, "kl_coef"),
    ({"kl_coef": float("nan")}, "kl_coef"),
    ({"mode": "top_p", "top_p": 0.0}, "top_p must be"),
    ({"mode": "top_p", "top_p": 1.5}, "top_p must be"),
    ({"mode": "full", "top_p": 0.9}, "only used by mode = 'top_p'"),
    ({"mode": "top_k"}, "needs top_k >= 1"),
    ({"mode": "sampled", "top_k": 5}, "only used by mode = 'top_k'"),
    ({"mode": "top_k", "top_k": -2}, "top_k must be"),
    ({"mode": "top_k", "top_k": 2, "top_k_from": "both"}, "top_k_from = 'both'"),
    ({"mode": "full", "top_k_from": "teacher"}, "only used by mode = 'top_k'"),
])
def test_bad_config_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OpdConfig(**kwargs)


def test_modes_tell_what_they_need():
    assert [needs_teacher_logits(m) for m in ("sampled", "top_p", "top_k", "full")] == \
        [False, True, False, True]
    assert needs_teacher_logits("top_k", "student")
    assert [is_loss_term(m) for m in ("sampled", "top_p", "top_k", "full")] == \
        [False, True, True, True]
    check_placement(OpdConfig(mode="top_k", top_k=8, top_k_from="teacher"), "server")
    check_placement(OpdConfig(mode="top_k", top_k=8), "colocated")
    with pytest.raises(ValueError, match="top_k_from = 'teacher'.*or use colocated teachers"):
        check_placement(OpdConfig(mode="top_k", top_k=8), "server")  # the student's top-k
    check_placement(OpdConfig(mode="full"), "colocated")
    with pytest.raises(ValueError, match="colocated"):
        check_placement(OpdConfig(mode="full"), "server", "math")
    with pytest.raises(ValueError, match="opd mode"):
        needs_teacher_logits("topk")


def test_mismatched_inputs_raise():
    student, teacher, mask = case(17)
    with pytest.raises(ValueError, match="vocabulary"):
        full_reverse_kl(student, teacher[..., :-1], mask)
    ids, lps = teacher_top_k(torch.randn(B, T, V + 4), 3, 1.0)
    ids[0, 0, 0] = V + 2
    with pytest.raises(ValueError, match="outside the student vocabulary"):
        top_k_reverse_kl(student, ids, lps, mask)
    with pytest.raises(ValueError, match="teacher's logits"):
        distribution_reverse_kl(OpdConfig(mode="full"), student, mask, 1.0)
