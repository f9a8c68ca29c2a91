"""True on-policy mode (models/invariant): each kernel's batch invariance, the invariant forward's
agreement across the trainer's pass, the worker's prefill and its cached decode, and the
end-to-end bitwise agreement of an inference worker and the trainer.

Every equality here is bitwise (`torch.equal`); tolerances appear only where the invariant
forward is compared with transformers' (it must compute the same function). The Triton
kernels run under the interpreter on CPU (skipped without Triton) and for real on a CUDA GPU
(skipped without one)."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import torch

from actors.inference import InferenceWorkerConfig
from actors.trainer import TrainerConfig
from algos.logprobs import token_logprobs_and_entropy
from algos.opd import OpdConfig
from models.invariant import cpu, decoder_for, enable, log_softmax
from models.invariant.ops import attention, linear, rmsnorm, silu_mul
from models.tiny import build_tiny
from tests.test_engine import PROMPT, _held_request, out_logprobs, serve, until
from training.aux_models import micro_batch_logprobs
from training.batching import make_micro_batch
from training.config import MicroBatchConfig
from training.step import TrainState, train_on_batch
from transport.schema import Sample

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def cuda_opened_before_the_leak_check():
    """CUDA (and cuBLAS, Triton's driver) open their device files once per process, at first
    use: open them before tests/conftest.py's per-test descriptor snapshot (module fixtures are
    set up before function ones)."""
    if torch.cuda.is_available():
        from models.invariant import gpu

        x = torch.ones(8, 8, device="cuda")
        (x @ x).sum().item()
        (x.double() @ x.double()).sum().item()
        if gpu.AVAILABLE:
            gpu.rmsnorm(x, torch.ones(8, device="cuda"), 1e-6).sum().item()
        torch.cuda.synchronize()
    yield


def rows_invariant(fn, x: torch.Tensor) -> None:
    """fn's row i is bitwise the same in batches of 1, 7 and 64, alone, and shuffled."""
    full = fn(x)
    for m in (1, 7, 64):
        assert torch.equal(fn(x[:m]), full[:m])
    for i in (0, 13, 63):
        assert torch.equal(fn(x[i:i + 1])[0], full[i])
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(3))
    assert torch.equal(fn(x[perm]), full[perm])


# ----------------------------------------------------------------------------- kernels (CPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 96, 896])
def test_linear_rows_are_batch_invariant_and_accurate(dtype, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(64, k, generator=g).to(dtype)
    w = (torch.randn(48, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    rows_invariant(lambda t: linear(t, w, b), x)
    rows_invariant(lambda t: linear(t, w, None, torch.float32), x)
    ref = x.double() @ w.double().T + b.double()
    got = linear(x, w, b).double()
    tol = 1e-7 if dtype == torch.float32 else 1e-2  # float32: the rounding of the output
    assert float(((got - ref).abs() / (ref.abs() + 1)).max()) < tol
    assert cpu.matmul_bits(k) * 2 + (k - 1).bit_length() <= 53  # the sums stay exact


def test_norm_silu_and_log_softmax_rows_are_batch_invariant():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(64, 96, generator=g) * 3).to(dtype)
        w = torch.randn(96, generator=g).to(dtype)
        rows_invariant(lambda t: rmsnorm(t, w, 1e-6), x)
        rows_invariant(lambda t: silu_mul(t, t * 2), x)
        ref = w.float() * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)
                                                   + 1e-6)).to(dtype).float()
        assert torch.allclose(rmsnorm(x, w, 1e-6).float(), ref, rtol=1e-2 if dtype !=
                              torch.float32 else 1e-5, atol=1e-5)
    logits = torch.randn(64, 54, generator=g) * 4
    rows_invariant(lambda t: log_softmax(t, 0.7), logits)
    temps = torch.rand(64, generator=g) + 0.5  # one temperature per row, as in a wave
    rows_invariant(lambda t: log_softmax(t[:, 1:], t[:, 0]), torch.cat([temps[:, None], logits],
                                                                        1))
    assert torch.allclose(log_softmax(logits, temps), torch.log_softmax(logits / temps[:, None],
                                                                        -1), atol=1e-6)


def test_attention_prefill_cached_decode_and_training_agree():
    """A query's output is the same over its own keys (prefill), over a KV cache with spare
    capacity full of garbage (decode, one row or a mixed batch) and in a right-padded batch."""
    g = torch.Generator().manual_seed(1)
    lengths = [5, 17, 70]
    hq, hkv, d, width = 4, 2, 16, max(lengths)
    q = torch.randn(3, hq, width, d, generator=g)
    k = torch.randn(3, hkv, width, d, generator=g)
    v = torch.randn(3, hkv, width, d, generator=g)
    zero = torch.zeros(3, dtype=torch.long)
    train = attention(q, k, v, zero, 0.25)  # [3, width, hq, d], rows right-padded
    for b, n in enumerate(lengths):
        alone = attention(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n], zero[:1], 0.25)
        assert torch.equal(alone[0], train[b, :n])
        scores = (q[b, :, :n] @ k[b].repeat_interleave(2, 0)[:, :n].transpose(-1, -2)) * 0.25
        probs = torch.softmax(scores + torch.full((n, n), float("-inf")).triu(1), -1)
        ref = (probs @ v[b].repeat_interleave(2, 0)[:, :n]).transpose(0, 1)
        assert torch.allclose(alone[0], ref, atol=1e-5)
    cache_k = torch.randn(3, hkv, 128, d, generator=g)  # capacity 128; garbage beyond each row
    cache_v = torch.randn(3, hkv, 128, d, generator=g)
    cache_k[:, :, :width], cache_v[:, :, :width] = k, v
    for i in (0, 4, 16, 31, 32, 63, 69):
        rows = [b for b, n in enumerate(lengths) if i < n]
        one = attention(q[rows][:, :, i:i + 1], cache_k[rows], cache_v[rows],
                        torch.full((len(rows),), i), 0.25)
        assert torch.equal(one[:, 0], train[rows, i])
    pos = torch.tensor([4, 16, 69])  # a decode batch, each row at its own position
    mixed = attention(q[torch.arange(3), :, pos][:, :, None], cache_k, cache_v, pos, 0.25)
    assert torch.equal(mixed[:, 0], train[torch.arange(3), pos])


def test_tree_sum_ignores_a_zero_tail():
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(2))
    padded = torch.cat([x, torch.zeros(5, 91)], -1)
    assert torch.equal(cpu.tree_sum(x), cpu.tree_sum(padded))
    assert torch.allclose(cpu.tree_sum(x), x.sum(-1), atol=1e-5)


# ----------------------------------------------------------------------------- the forward
def sequences(n: int, seed: int, low: int = 4, high: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 54, (int(k),), generator=g).tolist()
            for k in torch.randint(low, high, (n,), generator=g)]


def right_padded(seqs: list[list[int]], extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs)) + extra
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    return ids, mask


def tiny(name: str, dtype: torch.dtype):
    model, _ = build_tiny(name, seed=0)
    return model.to(dtype)


@pytest.mark.parametrize("name,dtype", [("tiny-qwen2", torch.float32),
                                        ("tiny-qwen2", torch.bfloat16),
                                        ("tiny-qwen3", torch.float32)])
def test_training_forward_prefill_and_cached_decode_agree_bitwise(name, dtype):
    model = tiny(name, dtype)
    dec = decoder_for(model)
    seqs = sequences(5, 0, 4, 30) + [sequences(1, 9, 75, 76)[0]]  # one row past a 64-cache step
    ids, mask = right_padded(seqs)
    with torch.no_grad():
        train, _ = dec.token_logprobs(ids, mask, 0.7)
        wide, _ = dec.token_logprobs(*right_padded(seqs, extra=9), 0.7)  # more padding
        for i, s in enumerate(seqs):  # micro-batches of one, and the row alone
            alone, _ = dec.token_logprobs(torch.tensor([s]), None, 0.7)
            assert torch.equal(alone[0], train[i, :len(s) - 1])
            assert torch.equal(wide[i, :len(s) - 1], train[i, :len(s) - 1])
        # the worker: prompts of different lengths prefilled together, then one token per step
        # at each row's own position; rows finish (and leave the cache) at different steps
        prompt = [max(2, 2 * len(s) // 3) for s in seqs]
        p_ids, _ = right_padded([s[:p] for s, p in zip(seqs, prompt)])
        logits, cache = dec.prefill(p_ids, torch.tensor(prompt), 3)
        window = log_softmax(logits[0], 0.7)  # row 0's last 3 positions (input log-probs)
        for t in range(3):
            if prompt[0] - 3 + t >= 0:
                pos = prompt[0] - 3 + t
                assert torch.equal(window[t, seqs[0][pos + 1]], train[0, pos])
        live, nxt = list(range(len(seqs))), list(prompt)  # nxt[b]: the token row b predicts
        step = log_softmax(logits[:, -1], 0.7)
        while live:
            for j, b in enumerate(live):
                assert torch.equal(step[j, seqs[b][nxt[b]]], train[b, nxt[b] - 1])
            keep = [j for j, b in enumerate(live) if nxt[b] + 1 < len(seqs[b])]
            cache.select(torch.tensor(keep, dtype=torch.long))
            live = [live[j] for j in keep]
            if live:
                out = dec.decode(torch.tensor([seqs[b][nxt[b]] for b in live]),
                                 torch.tensor([nxt[b] for b in live]), cache)
                step = log_softmax(out, 0.7)
                for b in live:
                    nxt[b] += 1
        assert cache.k[0].shape[1] == 128  # grown past one 64-position step


def test_invariant_forward_is_the_model_and_its_gradients_are_the_models():
    model = tiny("tiny-qwen2", torch.float32)
    twin = copy.deepcopy(model)
    ids, mask = right_padded(sequences(4, 5, 6, 20))
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1,
                          generator=torch.Generator().manual_seed(0)) * mask[:, 1:]
    logp, ent = decoder_for(model).token_logprobs(ids, mask, 0.7)
    ref_logp, ref_ent = token_logprobs_and_entropy(twin, ids, mask, 0.7)
    valid = mask[:, 1:].bool()
    assert float((logp - ref_logp).detach()[valid].abs().max()) < 2e-6
    assert float((ent - ref_ent).detach()[valid].abs().max()) < 2e-5
    ((logp * weights).sum() + 0.3 * (ent * valid).sum()).backward()
    ((ref_logp * weights).sum() + 0.3 * (ref_ent * valid).sum()).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad.abs().max() > 0, name
        assert float((p.grad - q.grad).norm() / q.grad.norm()) < 1e-5, name
    with torch.no_grad():  # the forward that trains gives the no-grad values, bit for bit
        assert torch.equal(decoder_for(model).token_logprobs(ids, mask, 0.7)[0], logp.detach())


def test_micro_batch_logprobs_use_the_invariant_forward_once_enabled():
    model = tiny("tiny-qwen2", torch.float32)
    _, tok = build_tiny("tiny-qwen2")
    samples = [Sample(group_id="g", index=i, domain="d", prompt_ids=s[:3], response_ids=s[3:],
                      loss_mask=[1] * (len(s) - 3), rollout_logprobs=[0.0] * (len(s) - 3))
               for i, s in enumerate(sequences(6, 3, 6, 25))]
    mb = make_micro_batch(samples, tok.pad_token_id)
    plain, _ = micro_batch_logprobs(model, mb, 1.0)
    enable(model)
    with torch.no_grad():
        invariant, _ = micro_batch_logprobs(model, mb, 1.0)
        halves = [micro_batch_logprobs(model, make_micro_batch(part, tok.pad_token_id), 1.0)[0]
                  for part in (samples[:1], samples[1:])]
    assert not torch.equal(plain * mb.mask, invariant * mb.mask)  # another kernel path ...
    assert torch.allclose(plain * mb.mask, invariant * mb.mask, atol=2e-6)  # ... same function
    for i, s in enumerate(samples):
        part = halves[0][0] if i == 0 else halves[1][i - 1]
        n = len(s.response_ids)
        assert torch.equal(part[:n], invariant[i, :n])


# ----------------------------------------------------------------------------- end to end
def as_samples(prompts, results, version: int = 0) -> list[Sample]:
    out = []
    for i, (p, r) in enumerate(zip(prompts, results)):
        n = len(r["output_ids"])
        out.append(Sample(group_id=f"g{i // 2}", index=i % 2, domain="d", prompt_ids=list(p),
                          response_ids=r["output_ids"], loss_mask=[1] * n,
                          rollout_logprobs=out_logprobs(r), reward=float(i % 3),
                          weight_version=version))
    return out


def trainer(true_on_policy: bool, size: int, temperature: float):
    torch.manual_seed(0)
    model, tok = build_tiny("tiny-qwen2", seed=0)
    state = TrainState(model, tok, torch.optim.AdamW(model.parameters(), lr=1e-3))
    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], true_on_policy=true_on_policy,
                        micro_batches=MicroBatchConfig(size=size))
    state.temperature = temperature  # the run's sampling temperature (RunFacts)
    return state, cfg


async def test_worker_and_trainer_log_probs_are_bitwise_equal_end_to_end(ipc, caplog):
    """An inference worker (HTTP, waves of mixed size, top-p sampling) and a trainer step, both
    with true_on_policy, on the same fp32 weights on CPU: every token's log-prob is equal."""
    sp = {"max_new_tokens": 14, "temperature": 0.8, "top_p": 0.9, "ignore_eos": True}
    prompts = [PROMPT[:1 + i % 5] + [10 + i] for i in range(6)]
    async with serve(ipc, true_on_policy=True, batch_wait_ms=30.0) as (worker, client):
        together = await asyncio.gather(*(client.generate(p, {**sp, "sampling_seed": i})
                                          for i, p in enumerate(prompts)))
        alone = await client.generate(prompts[0], {**sp, "sampling_seed": 0})
        assert max(worker.scheduler.wave_sizes) > 1
    assert alone["output_ids"] == together[0]["output_ids"]
    assert out_logprobs(alone) == out_logprobs(together[0])  # wave of one vs a shared wave
    samples = as_samples(prompts, together)
    with caplog.at_level(logging.WARNING, logger="training.step"):
        for size in (4, 64):  # micro-batches unlike the worker's waves
            state, cfg = trainer(True, size, 0.8)
            stats = train_on_batch(state, samples, cfg)
            assert stats["train/logprob_bitwise_equal_frac"] == 1.0
            assert stats["train/engine_logprob_bitwise_equal_frac"] == 1.0
            assert stats["train/logprob_abs_diff"] == 0.0 and stats["train/ppo_kl"] == 0.0
    assert not [r for r in caplog.records if "true_on_policy" in r.getMessage()]
    state, cfg = trainer(False, 4, 0.8)  # the default kernels on the same tokens: not bitwise
    stats = train_on_batch(state, samples, cfg)
    assert stats["train/logprob_bitwise_equal_frac"] < 1.0
    assert 0.0 < stats["train/logprob_abs_diff"] < 1e-5


def test_a_differing_token_is_warned_at_once_naming_the_step(caplog):
    model, _ = build_tiny("tiny-qwen2", seed=0)
    seqs = sequences(4, 11, 8, 16)
    dec = decoder_for(model)
    samples = []
    for i, s in enumerate(seqs):
        with torch.no_grad():
            lp, _ = dec.token_logprobs(torch.tensor([s]), None, 1.0)
        resp = lp[0, 3:].tolist()  # the invariant log-probs of tokens 4.. (prompt = 4 tokens)
        samples.append(Sample(group_id=f"g{i // 2}", index=i % 2, domain="d", prompt_ids=s[:4],
                              response_ids=s[4:], loss_mask=[1] * len(resp),
                              rollout_logprobs=resp, reward=float(i)))
    state, cfg = trainer(True, 2, 1.0)
    state.step = 7
    with caplog.at_level(logging.WARNING, logger="training.step"):
        assert train_on_batch(state, samples, cfg)["train/logprob_bitwise_equal_frac"] == 1.0
        assert not caplog.records
        bumped = list(samples[2].rollout_logprobs)
        bumped[1] = float(torch.nextafter(torch.tensor(bumped[1]), torch.tensor(0.0)))  # 1 ulp
        samples[2] = msgspec.structs.replace(samples[2], rollout_logprobs=bumped)
        state, cfg = trainer(True, 2, 1.0)
        state.step = 7
        stats = train_on_batch(state, samples, cfg)
    total = sum(len(s.response_ids) for s in samples)
    assert stats["train/logprob_bitwise_equal_frac"] == (total - 1) / total
    [record] = [r for r in caplog.records if "true_on_policy" in r.getMessage()]
    assert "step 7" in record.getMessage() and f"1 of {total} tokens" in record.getMessage()


async def test_retract_and_reprefill_keep_the_log_probs_bitwise(ipc):
    """A "retract" pause drops the KV cache; the re-prefill continues with the same log-probs
    the uninterrupted decode gave (prefill and cached decode agree)."""
    async with serve(ipc, true_on_policy=True) as (worker, client):
        sp = {"max_new_tokens": 16, "temperature": 0.8, "sampling_seed": 5, "ignore_eos": True}
        reference = await client.generate(PROMPT, sp)
        task, gate = await _held_request(worker, client, sp)
        pausing = asyncio.ensure_future(client.pause_generation("retract"))
        await until(lambda: worker.scheduler.paused == "retract")
        gate.go.set()
        await pausing
        await client.continue_generation()
        resumed = await task
    assert resumed["meta_info"].get("total_retractions", 1) >= 1
    assert resumed["output_ids"] == reference["output_ids"]
    assert out_logprobs(resumed) == out_logprobs(reference)


def test_config_fields_and_what_true_on_policy_refuses():
    assert InferenceWorkerConfig(true_on_policy=True).true_on_policy
    assert TrainerConfig(model="tiny-qwen2", workers=["w"], true_on_policy=True).true_on_policy
    with pytest.raises(ValueError, match="megatron"):
        TrainerConfig(model="tiny-qwen2", workers=["w"], true_on_policy=True, backend="megatron")
    with pytest.raises(ValueError, match="OPD loss-term"):
        TrainerConfig(model="tiny-qwen2", workers=["w"], true_on_policy=True,
                      opd=OpdConfig(mode="top_k", top_k=4, top_k_from="teacher"))


# ----------------------------------------------------------------------------- Triton kernels
INTERPRETED = textwrap.dedent("""
    import numpy, torch
    import triton.runtime.interpreter as interp
    _patch = interp._patch_lang_tensor
    def _patched(tensor, scope):  # numpy >= 2.3 refuses int() of a one-element array
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interp._patch_lang_tensor = _patched
    from models.invariant import decoder_for, gpu, log_softmax
    from models.tiny import build_tiny
    from tests.test_invariant import kernel_checks, right_padded, sequences
    kernel_checks(gpu, torch.float16, "cpu")  # the 16-bit tensor-core path (numpy has no bf16)
    model, _ = build_tiny("tiny-qwen2", seed=0)  # float32: the IEEE matmul/attention paths
    dec = decoder_for(model)
    seqs = sequences(3, 4, 5, 12)
    with torch.no_grad():
        train, _ = dec.token_logprobs(*right_padded(seqs), 1.0)
        logits, cache = dec.prefill(right_padded([s[:4] for s in seqs])[0], torch.full((3,), 4),
                                    1)
        step = log_softmax(logits[:, -1], 1.0)
        for b, s in enumerate(seqs):
            assert torch.equal(step[b, s[4]], train[b, 3])
        out = log_softmax(dec.decode(torch.tensor([s[4] for s in seqs]), torch.full((3,), 4),
                                     cache), 1.0)
        for b, s in enumerate(seqs):
            assert torch.equal(out[b, s[5]], train[b, 4])
    print("INTERPRETED OK")
""")


def kernel_checks(kern, dtype: torch.dtype, device: str) -> None:
    """Batch invariance of every Triton kernel (`kern` = models.invariant.gpu), and a check of
    its values against torch, on `device`."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for k, n in ((64, 48), (96, 200)):
        x, w, b = rand(64, k), rand(n, k, scale=k ** -0.5), rand(n)
        rows_invariant(lambda t: kern.linear(t, w, b, dtype), x)
        ref = x.double() @ w.double().T + b.double()
        assert float((kern.linear(x, w, b, torch.float32).double() - ref).abs().max()) < tol * 10
    x, w = rand(200, 96), rand(130, 96, scale=0.1)  # rows in other M tiles, at other offsets
    full = kern.linear(x, w, None, torch.float32)
    assert torch.equal(kern.linear(x[100:137], w, None, torch.float32), full[100:137])
    for i in (0, 63, 64, 130, 199):
        assert torch.equal(kern.linear(x[i:i + 1], w, None, torch.float32)[0], full[i])
    x, w = rand(64, 96, scale=3), rand(96)
    rows_invariant(lambda t: kern.rmsnorm(t, w, 1e-6), x)
    lg = torch.randn(64, 300, generator=g).to(device) * 4
    temps = torch.full((64,), 0.7, device=device)
    rows_invariant(lambda t: kern.log_softmax(t, temps[:t.shape[0]]), lg)
    assert torch.allclose(kern.log_softmax(lg, temps), torch.log_softmax(lg / 0.7, -1),
                          atol=1e-5)
    lengths, hq, hkv, d = [5, 70], 4, 2, 16
    q, k, v = rand(2, hq, 70, d), rand(2, hkv, 70, d), rand(2, hkv, 70, d)
    zero = torch.zeros(2, dtype=torch.long, device=device)
    train = kern.attention(q, k, v, zero, 0.25)
    alone = kern.attention(q[:1, :, :5], k[:1, :, :5], v[:1, :, :5], zero[:1], 0.25)
    assert torch.equal(alone[0], train[0, :5])
    ck, cv = rand(2, hkv, 128, d), rand(2, hkv, 128, d)
    ck[:, :, :70], cv[:, :, :70] = k, v
    for i in (0, 4, 63, 64, 69):
        rows = [r for r, n in enumerate(lengths) if i < n]
        one = kern.attention(q[rows][:, :, i:i + 1], ck[rows], cv[rows],
                             torch.full((len(rows),), i, device=device), 0.25)
        assert torch.equal(one[:, 0], train[rows, i])
    ref = cpu.attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), zero.cpu(), 0.25)
    assert float((train.float().cpu() - ref).abs()[1].max()) < tol * 10


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"),
                    reason="Triton is not installed (the GPU image has it)")
def test_triton_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "RLX_INVARIANT_BACKEND": "triton",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "INTERPRETED OK" in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernels_and_forward_on_cuda(dtype):
    from models.invariant import gpu

    kernel_checks(gpu, dtype, "cuda")
    model = tiny("tiny-qwen2", dtype).cuda()
    dec = decoder_for(model)
    seqs = sequences(9, 2, 4, 80)
    ids, mask = right_padded(seqs)
    with torch.no_grad():
        train, _ = dec.token_logprobs(ids.cuda(), mask.cuda(), 1.0)
        for i, s in enumerate(seqs[:3]):
            alone, _ = dec.token_logprobs(torch.tensor([s]).cuda(), None, 1.0)
            assert torch.equal(alone[0], train[i, :len(s) - 1])
        p_ids, p_len = right_padded([s[:3] for s in seqs])
        logits, cache = dec.prefill(p_ids.cuda(), torch.full((9,), 3).cuda(), 1)
        positions = 3
        lp = log_softmax(logits[:, -1], 1.0)
        while True:
            live = [b for b, s in enumerate(seqs) if positions < len(s)]
            for j, b in enumerate(live):
                assert torch.equal(lp[j, seqs[b][positions]], train[b, positions - 1])
            keep = [j for j, b in enumerate(live) if positions + 1 < len(seqs[b])]
            if not keep:
                break
            cache.select(torch.tensor(keep, device="cuda"))
            live = [live[j] for j in keep]
            lp = log_softmax(dec.decode(torch.tensor([seqs[b][positions] for b in live]).cuda(),
                                        torch.full((len(live),), positions).cuda(), cache), 1.0)
            positions += 1
