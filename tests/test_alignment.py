"""The trainer's unpadded per-length forward: bit-identical to one sequence at a time when the
sequence is alone at its length (sequences sharing a length go through one batched matrix
product, whose sums some CPUs order by batch size: AVX2 kernels differ in the last bit), and the
same gradients as the padded forward."""

from __future__ import annotations

import collections

import torch

from algos.logprobs import token_logprobs
from models.tiny import build_tiny
from tests.test_trainer_options import batch
from training.aux_models import micro_batch_logprobs
from training.batching import make_micro_batch


def test_by_length_forward_equals_each_sequence_alone_and_keeps_gradients():
    model, tok = build_tiny("tiny-qwen2", seed=0)
    samples = batch(tok)
    assert len({len(s.prompt_ids) + len(s.response_ids) for s in samples}) > 2  # real padding
    mb = make_micro_batch(samples, tok.pad_token_id)
    grouped, ent = micro_batch_logprobs(model, mb, 0.7, by_length=True)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    assert 1 in collections.Counter(lengths).values()  # some sequence is alone at its length
    for i, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        p, n = len(s.prompt_ids), len(s.response_ids)
        alone = token_logprobs(model, ids, temperature=0.7)[0, p - 1:p - 1 + n]
        if lengths.count(lengths[i]) == 1:
            assert torch.equal(grouped[i, :n], alone)  # bit for bit
        else:
            assert (grouped[i, :n] - alone).abs().max() <= 1e-6
    padded, pent = micro_batch_logprobs(model, mb, 0.7, by_length=False)
    assert torch.allclose(grouped * mb.mask, padded * mb.mask, atol=1e-5)
    assert torch.allclose(ent * mb.mask, pent * mb.mask, atol=1e-5)
    grads = []
    for logp in (grouped, padded):
        model.zero_grad()
        (logp * mb.mask).sum().backward(retain_graph=True)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-4, rtol=1e-4)
