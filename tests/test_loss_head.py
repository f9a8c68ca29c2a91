"""algos/loss_head.py: log-probs, entropies and OPD set KLs from hidden states and the output
weight equal, in values and in gradients to both, the logits functions of algos/logprobs.py and
algos/opd.py on logits = hidden @ weight.T, at chunks of 1, a few and more than all tokens and at
temperatures 1, 0.7 and 0 (greedy: 1); no tensor of the size of the logits is ever made; two
gloo ranks, each with half of the vocabulary, give what one rank with all of it gives."""

from __future__ import annotations

import pytest
import torch
import tqdm
from torch._inductor import config as inductor_config
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from algos import loss_head, opd
from algos.logprobs import effective_temperature, response_logprobs
from algos.loss_head import (
    HEAD_CHUNK_BYTES,
    chunk_bytes,
    chunk_tokens_for,
    compiled_kernels,
    head_logprobs,
    head_set_kl,
    head_top_k_ids,
    head_weighted_set_kl,
    same_rows,
    vocab_logits,
)
from tests.helpers import two_gloo_ranks

N, H, HT, V, K = 13, 8, 5, 37, 5  # tokens, hidden sizes (student, teacher), vocabulary, top-k
CHUNKS = [1, 3, 50, None]  # one token, a few (13 = 4 x 3 + 1), more than N, the default
TEMPS = [1.0, 0.7, 0.0]
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
SET_CASES = ["full", "top_p", "top_p_ids", "top_k_logprobs", "top_k_teacher"]


def inputs(dtype: torch.dtype, seed: int = 0, vocab: int = V):
    """(hidden, weight) of the student (requiring grad), the teacher's, sampled targets; two
    vocabulary rows are equal, so every row of logits has a tie."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=gen).to(dtype)
    w = (torch.randn(vocab, H, generator=gen) * 0.6).to(dtype)
    w[vocab - 2] = w[3]
    th = torch.randn(N, HT, generator=gen).to(dtype)
    tw = (torch.randn(vocab, HT, generator=gen) * 0.6).to(dtype)
    y = torch.randint(0, vocab, (N,), generator=gen)
    return h.requires_grad_(), w.requires_grad_(), th, tw, y


def upstream(n: int, dtype: torch.dtype, seed: int = 7) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def grads(outs, gs, h, w):
    """d(sum_i out_i . g_i) / d(hidden, weight)."""
    return torch.autograd.grad(sum((o * g).sum() for o, g in zip(outs, gs)), (h, w),
                               retain_graph=True)


def close(a, b, dtype) -> None:
    torch.testing.assert_close(a, b, rtol=TOL[dtype], atol=TOL[dtype])


def ref_logprobs(h, w, y, temperature):
    """algos.logprobs on the materialised logits (which computes in float32 whatever the
    logits' dtype: for float64 the same formula in float64)."""
    z = h @ w.T
    if z.dtype == torch.float64:
        lp = torch.log_softmax(z / effective_temperature(temperature), dim=-1)
        return lp.gather(-1, y[:, None])[:, 0], -(lp.exp() * lp).sum(-1)
    ids = torch.cat([y[:1], y])[None]  # a one-token prompt: response column j = position j
    lp, ent, _ = response_logprobs(z[None], ids, torch.tensor([1]), N, temperature)
    return lp[0], ent[0]


def set_case(case, h, w, th, tw, temperature):
    """(head_set_kl's arguments, the algos.opd reference KL [N] on the logits)."""
    z, zt, mask = (h @ w.T)[None], (th @ tw.T)[None], torch.ones(1, N)
    teacher = {"teacher_hidden": th, "teacher_weight": tw}
    gen = torch.Generator().manual_seed(3)
    if case == "full":
        return {"mode": "full", **teacher}, opd.full_reverse_kl(z, zt, mask, temperature)[0]
    if case == "top_p":
        return ({"mode": "top_p", "top_p": 0.8, **teacher},
                opd.top_p_reverse_kl(z, zt, mask, 0.8, temperature)[0])
    if case == "top_p_ids":  # a recorded nucleus: ragged, padded ids
        ids = torch.randint(0, z.shape[-1], (N, 6), generator=gen)
        valid = torch.rand(N, 6, generator=gen) > 0.3
        valid[:, 0] = True
        ref = opd.ids_reverse_kl(z, ids[None], opd.gather_scores(zt, ids[None], temperature),
                                 mask, temperature, valid[None])[0]
        return {"mode": "top_p", "ids": ids, "valid": valid, **teacher}, ref
    if case == "top_k_logprobs":  # a server's top-k at temperature 0.5, one padded entry
        ids = opd.top_k_ids(z, K)[0]
        lps = torch.log_softmax(zt[0] / 0.5, dim=-1).gather(-1, ids)
        lps[0, -1] = float("-inf")
        ref = opd.top_k_reverse_kl(z, ids[None], lps[None], mask, temperature, 0.5)[0]
        return {"mode": "top_k", "ids": ids, "teacher_logprobs": lps,
                "teacher_temperature": 0.5}, ref
    ids = opd.top_k_ids(zt, K)[0]  # the teacher's top-k, its values from its hidden states
    ref = opd.ids_reverse_kl(z, ids[None], opd.gather_scores(zt, ids[None], temperature), mask,
                             temperature)[0]
    return {"mode": "top_k", "ids": ids, **teacher}, ref


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", TEMPS)
def test_logprobs_and_entropy_equal_the_logits_definition(dtype, chunk, temperature):
    h, w, _, _, y = inputs(dtype)
    logp, ent = head_logprobs(h, w, y, temperature, chunk_tokens=chunk)
    ref = ref_logprobs(h, w, y, temperature)
    assert logp.dtype == ent.dtype == torch.promote_types(dtype, torch.float32)
    close(logp, ref[0], dtype)
    close(ent, ref[1], dtype)
    gs = [upstream(N, dtype), upstream(N, dtype, 8)]
    for a, b in zip(grads([logp, ent], gs, h, w), grads(ref, gs, h, w)):
        close(a, b, dtype)
    # without the entropy, and the log-prob alone or the entropy alone upstream
    alone, none = head_logprobs(h, w, y, temperature, with_entropy=False, chunk_tokens=chunk)
    assert none is None
    close(alone, ref[0], dtype)
    for a, b in zip(grads([alone], gs, h, w), grads(ref[:1], gs, h, w)):
        close(a, b, dtype)
    ent = head_logprobs(h, w, y, temperature, chunk_tokens=chunk)[1]
    for a, b in zip(grads([ent], gs[1:], h, w), grads(ref[1:], gs[1:], h, w)):
        close(a, b, dtype)


@pytest.mark.parametrize("case", SET_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", TEMPS)
def test_set_kl_equals_the_logits_definition(case, dtype, chunk, temperature):
    h, w, th, tw, _ = inputs(dtype)
    args, ref = set_case(case, h, w, th, tw, temperature)
    kl = head_set_kl(h, w, temperature=temperature, chunk_tokens=chunk, **args)
    close(kl, ref, dtype)
    g = upstream(N, dtype)
    want = grads([ref], [g], h, w)
    for a, b in zip(grads([kl], [g], h, w), want):
        close(a, b, dtype)
    # the weighted form: the loss, the KL and the gradient made in one pass
    loss, kl = head_weighted_set_kl(h, w, g, temperature=temperature, chunk_tokens=chunk, **args)
    assert not kl.requires_grad
    close(kl, ref, dtype)
    close(loss, (ref * g).sum(), dtype)
    got = torch.autograd.grad(loss, (h, w))
    for a, b in zip(got, want):
        close(a, b, dtype)
    with pytest.raises(RuntimeError, match="already used"):  # made once, released once used
        torch.autograd.grad(loss, (h, w))
    loss = head_weighted_set_kl(h, w, g, temperature=temperature, chunk_tokens=chunk, **args)[0]
    for a, b in zip(torch.autograd.grad(2.0 * loss, (h, w)), got):  # an upstream scale
        assert torch.equal(a, 2.0 * b)


def test_greedy_counts_as_temperature_one():
    h, w, th, tw, y = inputs(torch.float32)
    assert torch.equal(head_logprobs(h, w, y, 0.0)[0], head_logprobs(h, w, y, 1.0)[0])
    args = {"teacher_hidden": th, "teacher_weight": tw, "top_p": 0.9}
    assert torch.equal(head_set_kl(h, w, "top_p", 0.0, **args),
                       head_set_kl(h, w, "top_p", 1.0, **args))


def test_the_nucleus_keeps_every_token_tied_with_its_last():
    """Logits (2, 1, 1, 0, ...): a top_p the first two tokens reach keeps both 1s."""
    z = torch.tensor([2.0, 1.0, 1.0] + [0.0] * 5)
    p = torch.softmax(z, -1)
    h = torch.tensor([[1.0, 0.0]]).requires_grad_()
    w = torch.stack([z, torch.randn(8)], dim=1).requires_grad_()
    teacher = {"teacher_hidden": torch.randn(1, 3), "teacher_weight": torch.randn(8, 3)}
    top_p = float(p[0] + p[1]) - 1e-3
    rebuilt = head_set_kl(h, w, "top_p", top_p=top_p, **teacher)
    given = head_set_kl(h, w, "top_p", ids=torch.tensor([[0, 1, 2]]), **teacher)
    close(rebuilt, given, torch.float32)
    for a, b in zip(grads([rebuilt], [torch.ones(1)], h, w), grads([given], [torch.ones(1)], h, w)):
        close(a, b, torch.float32)
    assert float(grads([rebuilt], [torch.ones(1)], h, w)[1][3:].abs().max()) == 0.0


def test_student_top_k_ids_are_those_of_the_logits():
    h, w, *_ = inputs(torch.float32)
    for chunk in (1, 4, None):
        got = head_top_k_ids(h, w, K, chunk_tokens=chunk)
        want = opd.top_k_ids((h @ w.T)[None], K)[0]
        z = (h @ w.T).detach()  # the logits at the ids: ids tied at the k-th may swap
        assert torch.equal(z.gather(-1, got).sort(-1).values, z.gather(-1, want).sort(-1).values)


@pytest.mark.parametrize("fn", ["logprobs", "set_kl"])
def test_gradients_pass_gradcheck_in_float64(fn):
    gen = torch.Generator().manual_seed(2)
    h, w, th, tw = (torch.randn(*shape, generator=gen, dtype=torch.float64)
                    for shape in ((6, 4), (11, 4), (6, 3), (11, 3)))
    h.requires_grad_()
    w.requires_grad_()
    y = torch.randint(0, 11, (6,), generator=gen)
    if fn == "logprobs":
        def f(a, b):
            return head_logprobs(a, b, y, 0.7, chunk_tokens=4)  # two chunks
    else:
        def f(a, b):
            return head_set_kl(a, b, "top_p", 0.7, top_p=0.9, teacher_hidden=th,
                               teacher_weight=tw, chunk_tokens=4)
    assert torch.autograd.gradcheck(f, (h, w))


def test_bfloat16_inputs_follow_the_bfloat16_logits():
    """bf16 hidden states and weight: the logits made in bf16, as the output layer makes them;
    the results and gradients those of the bf16 logits, in the inputs' dtype."""
    h, w, _, _, y = inputs(torch.float32)
    h = h.detach().bfloat16().requires_grad_()
    w = w.detach().bfloat16().requires_grad_()
    logp, ent = head_logprobs(h, w, y, 0.7, chunk_tokens=3)
    ref = ref_logprobs(h, w, y, 0.7)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref[0], rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(ent, ref[1], rtol=1e-2, atol=2e-2)
    gs = [upstream(N, torch.float32), upstream(N, torch.float32, 8)]
    for a, b in zip(grads([logp, ent], gs, h, w), grads(ref, gs, h, w)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_bad_arguments_are_refused():
    h, w, th, tw, y = inputs(torch.float32)
    teacher = {"teacher_hidden": th, "teacher_weight": tw}
    with pytest.raises(ValueError, match="outside the vocabulary"):
        head_logprobs(h, w, y + V)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # the host's bounds
        head_logprobs(h, w, y, token_bounds=(0, V))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        head_logprobs(h, w, y, token_bounds=(-1, 0))
    with pytest.raises(ValueError, match="exactly one"):
        head_set_kl(h, w, "full", teacher_hidden=th)
    with pytest.raises(ValueError, match="takes ids"):
        head_set_kl(h, w, "top_k", **teacher)
    with pytest.raises(ValueError, match="empty token set"):
        head_set_kl(h, w, "top_k", ids=torch.zeros(N, 2, dtype=torch.long),
                    valid=torch.zeros(N, 2, dtype=torch.bool), **teacher)
    with pytest.raises(ValueError, match="needs teacher_hidden"):
        head_set_kl(h, w, "full", teacher_logprobs=torch.zeros(N, 2))
    with pytest.raises(ValueError, match="same tokens"):
        head_set_kl(h, w, "full", teacher_hidden=th[1:], teacher_weight=tw)
    with pytest.raises(ValueError, match="mode"):
        head_set_kl(h, w, "sampled", **teacher)


class LargestTensor(TorchDispatchMode):
    """The largest storage any operator returns while active, in bytes."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.untyped_storage().nbytes())
        return out


def measure(run):
    """(largest tensor made by run() and its backward, bytes saved for the backward)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with LargestTensor() as largest:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = run()
        loss.backward()
    return largest.bytes, sum(saved.values())


def test_no_tensor_of_the_logits_size_is_made():
    """N x V = 256 x 4096: the fp32 logits are 4 MiB; a chunk of 8 tokens 128 KiB (the
    nucleus's sort: 256 KiB of int64 indices). The same measure on the materialised-logits
    reference sees the logits (so that an implementation holding them fails)."""
    n, vocab, hid, chunk = 256, 4096, 8, 8
    logits_bytes = n * vocab * 4
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, hid, generator=gen).requires_grad_()
    w = torch.randn(vocab, hid, generator=gen).requires_grad_()
    th, tw = torch.randn(n, hid, generator=gen), torch.randn(vocab, hid, generator=gen)
    y = torch.randint(0, vocab, (n,), generator=gen)
    g = torch.rand(n, generator=gen)
    ids = head_top_k_ids(h, w, 20, chunk_tokens=chunk)
    teacher = {"teacher_hidden": th, "teacher_weight": tw, "chunk_tokens": chunk}

    def logprobs():
        logp, ent = head_logprobs(h, w, y, 0.7, chunk_tokens=chunk)
        return (logp * g).sum() + (ent * g).sum()

    runs = {"logprobs": logprobs,
            "full": lambda: (head_set_kl(h, w, "full", 0.7, **teacher) * g).sum(),
            "top_p": lambda: (head_set_kl(h, w, "top_p", 0.7, top_p=0.9, **teacher) * g).sum(),
            "top_k": lambda: (head_set_kl(h, w, "top_k", 0.7, ids=ids, **teacher) * g).sum(),
            "weighted": lambda: head_weighted_set_kl(h, w, g, "full", 0.7, **teacher)[0]}
    for name, run in runs.items():
        largest, saved = measure(run)
        assert largest <= logits_bytes // 8, (name, largest)
        assert saved <= logits_bytes // 16, (name, saved)
    ref_largest, ref_saved = measure(lambda: (ref_logprobs_flat(h, w, y) * g).sum())
    assert ref_largest >= logits_bytes and ref_saved >= logits_bytes


def ref_logprobs_flat(h, w, y):
    lp = torch.log_softmax((h @ w.T).float() / 0.7, dim=-1)
    return lp.gather(-1, y[:, None])[:, 0]


def test_the_default_chunk_holds_at_most_head_chunk_bytes_of_logits():
    assert chunk_tokens_for(151_936) * 151_936 * 4 <= HEAD_CHUNK_BYTES
    assert chunk_tokens_for(151_936) >= 256
    assert chunk_tokens_for(10**12) == 1 and chunk_tokens_for(37, 5) == 5


# --- vocabulary parallel: two gloo ranks, half of the vocabulary each --------------------------

TP_VOCAB = 38  # 19 rows a rank


def tp_cases(y, ids, valid, lps, tw_whole):
    """name -> f(h, w, th, tw, **kw) = (outputs compared, outputs differentiated)."""
    def logprobs(h, w, th, tw, **kw):
        out = list(head_logprobs(h, w, y, **kw))
        return out, out

    def kl(**set_args):
        def f(h, w, th, tw, **kw):
            out = [head_set_kl(h, w, teacher_hidden=th, teacher_weight=tw, **set_args, **kw)]
            return out, out
        return f

    def top_k(h, w, th, tw, **kw):
        out = [head_set_kl(h, w, "top_k", ids=ids, teacher_logprobs=lps,
                           teacher_temperature=0.5, **kw)]
        return out, out

    def weighted(h, w, th, tw, **kw):
        loss, kl_ = head_weighted_set_kl(h, w, upstream(N, h.dtype), "top_p", top_p=0.8,
                                         teacher_hidden=th, teacher_weight=tw, **kw)
        return [loss, kl_], [loss]

    def whole_teacher(h, w, th, tw, **kw):  # a teacher not split: each rank reads its rows
        out = [head_set_kl(h, w, "full", teacher_hidden=th,
                           teacher_weight=same_rows(tw_whole, w, kw.get("group")), **kw)]
        return out, out

    def whole_logits(h, w, th, tw, group=None, **kw):  # [N, V] gathered, a term of its rows
        z = vocab_logits(h, w, group)
        return [z], [torch.log_softmax(z * 0.7, -1)[:, 3] + z[:, -1]]

    return {"logprobs": logprobs, "full": kl(mode="full"), "top_p": kl(mode="top_p", top_p=0.8),
            "top_p_ids": kl(mode="top_p", ids=ids, valid=valid),
            "top_k_teacher": kl(mode="top_k", ids=ids), "top_k_logprobs": top_k,
            "weighted": weighted, "whole_teacher": whole_teacher, "vocab_logits": whole_logits}


def worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    group, rows = dist.group.WORLD, slice(rank * TP_VOCAB // 2, (rank + 1) * TP_VOCAB // 2)
    report = {}
    for dtype in (torch.float32, torch.float64):
        h, w, th, tw, y = inputs(dtype, seed=1, vocab=TP_VOCAB)
        shard = w.detach()[rows].clone().requires_grad_()
        ids = head_top_k_ids(h, w, K)
        got_ids = head_top_k_ids(h, shard, K, group=group, chunk_tokens=4)
        z = (h @ w.T).detach()  # the logits at the ids: ids tied at the k-th may swap
        report[f"top_k_ids {dtype}"] = bool(torch.equal(z.gather(-1, ids).sort(-1).values,
                                                        z.gather(-1, got_ids).sort(-1).values))
        valid = torch.rand(N, K, generator=torch.Generator().manual_seed(5)) > 0.3
        valid[:, 0] = True
        lps = torch.log_softmax((th @ tw.T) / 0.5, dim=-1).gather(-1, ids)
        for name, f in tp_cases(y, ids, valid, lps, tw.detach()).items():
            for temperature in (1.0, 0.7):
                for chunk in (1, 5):
                    kw = {"temperature": temperature, "chunk_tokens": chunk}
                    whole, whole_d = f(h, w, th, tw, **kw)
                    mine, mine_d = f(h, shard, th, tw[rows], group=group, **kw)
                    gs = [upstream(N, dtype, 9 + i) for i in range(len(whole_d))]
                    gw_h, gw_w = grads(whole_d, gs, h, w)
                    gm_h, gm_w = grads(mine_d, gs, h, shard)
                    diff = max([float((a - b).abs().max()) for a, b in zip(whole, mine)]
                               + [float((gw_h - gm_h).abs().max()),
                                  float((gw_w[rows] - gm_w).abs().max())])
                    key = f"{name} {dtype}"
                    report[key] = max(report.get(key, 0.0), diff)
    torch.save(report, f"{out}.{rank}")
    dist.destroy_process_group()


def test_two_vocabulary_shards_equal_one_rank(tmp_path):
    for report in two_gloo_ranks("tests.test_loss_head", tmp_path):
        for key, value in report.items():
            if key.startswith("top_k_ids"):
                assert value is True, key
            else:
                dtype = torch.float64 if "float64" in key else torch.float32
                assert value <= TOL[dtype], (key, value)
        assert len(report) == 20


def test_a_caller_sets_the_chunk_for_its_block_only():
    """`chunk_bytes` (the trainer's micro_batches.head_chunk_mib) scopes the chunk to a block;
    outside it the default holds again, and the values do not depend on it."""
    default = chunk_tokens_for(V)
    h, w, _, _, y = inputs(torch.float32)
    want = head_logprobs(h, w, y, 0.7)[0]
    with chunk_bytes(4 * V * 2):  # two tokens of logits
        assert chunk_tokens_for(V) == 2
        close(head_logprobs(h, w, y, 0.7)[0], want, torch.float32)
    assert chunk_tokens_for(V) == default
    with pytest.raises(ValueError, match="at least 1 byte"):
        with chunk_bytes(0):
            pass


# importing torch's inductor (the first torch.compile) warns from torch's own modules
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_chunk_passes_equal_the_eager_ones(monkeypatch):
    """`compiled_kernels` (the trainer's micro_batches.head_compile, on CUDA by default) runs
    the chunk passes through torch.compile: forced onto the CPU here, the log-probs, entropies
    and gradients equal the eager ones and the logits definition, at T = 0.7, with chunks of 5
    of 13 tokens (a shorter last one, the same compiled graph) and every upstream combination."""
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # inductor's bars: no monitor thread
    h, w, _, _, y = inputs(torch.float32)
    gs = [upstream(N, torch.float32), upstream(N, torch.float32, 8)]
    ref = ref_logprobs(h, w, y, 0.7)
    eager = head_logprobs(h, w, y, 0.7, chunk_tokens=5)
    torch._dynamo.utils.counters.clear()
    # compiled in this process, without inductor's thread pool (the leak check's threads)
    with compiled_kernels(True, ("cpu",)), inductor_config.patch(compile_threads=1):
        out = head_logprobs(h, w, y, 0.7, chunk_tokens=5)
        alone = head_logprobs(h, w, y, 0.7, with_entropy=False, chunk_tokens=5)[0]
        for outs, ups, want in (([*out], gs, ref), ([alone], gs[:1], ref[:1]),
                                ([out[1]], gs[1:], ref[1:])):
            for a, b in zip(grads(outs, ups, h, w), grads(want, ups, h, w)):
                close(a, b, torch.float32)
    for a, b, r in zip(out, eager, ref):
        close(a, b, torch.float32)
        close(a, r, torch.float32)
    close(alone, ref[0], torch.float32)
    # each pass compiled once per variant (entropy or not; which upstream gradients), not per
    # chunk shape
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 5
    assert set(loss_head._COMPILED) == {loss_head._exp_sums, loss_head._logit_grads}
    with compiled_kernels(False):
        assert loss_head._kernel(loss_head._exp_sums, h.device) is loss_head._exp_sums
    assert loss_head._kernel(loss_head._exp_sums, h.device) is loss_head._exp_sums  # CPU


def test_a_failing_compiler_names_the_field_that_turns_it_off(monkeypatch):
    """Where torch.compile cannot build the chunk passes (no working Triton, say), the step's
    error says which config field runs them eagerly."""
    def broken(fn, **_):
        def run(*args):
            raise torch._dynamo.exc.BackendCompilerFailed(None, ValueError("no triton"), None)
        return run

    monkeypatch.setattr(loss_head, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken)
    h, w, _, _, y = inputs(torch.float32)
    with compiled_kernels(True, ("cpu",)):
        with pytest.raises(RuntimeError, match=r"ValueError: no triton.*"
                                               r"micro_batches.head_compile = false"):
            head_logprobs(h, w, y, 0.7)
