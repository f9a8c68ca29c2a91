"""Packed micro-batches (training/packing.py) give what the padded ones give, computing less.

On a tiny Qwen2 (fp32, random init, fixed seed): per-sample response log-probs, entropies,
hidden states and parameter gradients of the packed form equal the padded micro-batch's
(training/batching.py + training/aux_models.py `micro_batch_logprobs`) under each attention
mechanism; the layout, the token counts, determinism and bad input are checked without a model.
"""

from __future__ import annotations

from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface

from algos.logprobs import position_ids_from_mask, response_slice
from models.tiny import build_tiny
from training.aux_models import micro_batch_logprobs
from training.batching import make_micro_batch
from training.packing import (
    attention_mechanism,
    flat_cu_seqlens,
    pack,
    packed_forward,
    packed_logprobs,
    response_targets,
    unflatten,
    unpack,
)
from transport.schema import Sample

TEMPERATURE = 0.7
# (prompt, response) lengths: very different, one empty response, one sample (90) longer than
# the cap of 64 and one exactly at it, so both sit alone in their rows
SHAPES = [(3, 40), (5, 2), (1, 1), (10, 30), (4, 0), (30, 60), (2, 62), (7, 9)]
CAP = 64


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def samples(shapes=SHAPES, seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(shapes):
        ids = torch.randint(4, 54, (p + r,), generator=gen).tolist()
        out.append(Sample(group_id=f"g{i}", index=0, domain="d", prompt_ids=ids[:p],
                          response_ids=ids[p:], loss_mask=[1] * r, rollout_logprobs=[0.0] * r))
    return out


@pytest.fixture(scope="module")
def model():
    return build_tiny("tiny-qwen2", seed=0)[0]


def valid_cols(shapes=SHAPES) -> torch.Tensor:
    cols = max(1, max(r for _, r in shapes))
    return torch.arange(cols)[None, :] < torch.tensor([r for _, r in shapes])[:, None]


def assert_close_on(valid, got, want, tol=1e-5):
    assert got.shape == want.shape
    assert (got[valid] - want[valid]).abs().max().item() <= tol
    assert (got[~valid] == 0).all()  # nothing past a sample's response


@pytest.mark.parametrize("mechanism", ["position_ids", "mask"])
def test_packed_logprobs_and_entropies_equal_the_padded_ones(model, mechanism):
    batch = samples()
    with torch.no_grad():
        want_lp, want_ent = micro_batch_logprobs(model, make_micro_batch(batch), TEMPERATURE)
        got_lp, got_ent = packed_logprobs(model, pack(batch, CAP), TEMPERATURE,
                                          mechanism=mechanism)
    valid = valid_cols()
    assert_close_on(valid, got_lp, want_lp)
    assert_close_on(valid, got_ent, want_ent)


def test_eager_attention_builds_the_same_block_mask_from_position_ids():
    model = build_tiny("tiny-qwen2", seed=1)[0]
    model.set_attn_implementation("eager")
    assert attention_mechanism(model) == "position_ids"
    batch = samples(seed=1)
    with torch.no_grad():
        want, _ = micro_batch_logprobs(model, make_micro_batch(batch), 1.0, with_entropy=False)
        got, ent = packed_logprobs(model, pack(batch, CAP), 1.0, with_entropy=False)
    assert ent is None
    assert_close_on(valid_cols(), got, want)


def test_flex_attention_rows_get_the_samples_block_mask_without_reading_the_device(
        monkeypatch):
    """FlexAttention (a CUDA path; its eager form runs forward on the CPU): packed rows get a
    BlockMask of their samples made from the positions, and equal the padded micro-batch and
    the dense mask's rows; making it reads nothing back from the device (transformers' own
    mask from the positions finds the samples with a read, `find_packed_sequence_indices`)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as hf_flex

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda q, k, v, training=False, **kw: flex_attention(q, k, v, **kw))
    model = build_tiny("tiny-qwen2", seed=1)[0]
    batch = samples(seed=1)
    with torch.no_grad():  # sdpa (transformers' padded FlexAttention mask would be compiled)
        want, _ = micro_batch_logprobs(model, make_micro_batch(batch), 1.0, with_entropy=False)
    model.set_attn_implementation("flex_attention")
    assert attention_mechanism(model) == "block_mask"
    reads = []
    real_all = torch.Tensor.all
    monkeypatch.setattr(torch.Tensor, "all", lambda t, *a, **k: reads.append(1) or
                        real_all(t, *a, **k))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention (unfused) warns
        got, _ = packed_logprobs(model, pack(batch, CAP), 1.0, with_entropy=False)
        assert reads == []
        dense, _ = packed_logprobs(model, pack(batch, CAP), 1.0, with_entropy=False,
                                   mechanism="mask")
    assert_close_on(valid_cols(), got, want)
    assert_close_on(valid_cols(), got, dense, tol=1e-6)


def grads(model, lp, ent, mask):
    loss = (lp * mask).sum() + 0.1 * (ent * mask).sum()
    return torch.autograd.grad(loss, [p for p in model.parameters()])


@pytest.mark.parametrize("mechanism", ["position_ids", "mask"])
def test_gradients_of_a_summed_loss_agree(model, mechanism):
    batch = samples()
    mb = make_micro_batch(batch)
    model.requires_grad_(True)
    want = grads(model, *micro_batch_logprobs(model, mb, TEMPERATURE), mb.mask)
    got = grads(model, *packed_logprobs(model, pack(batch, CAP), TEMPERATURE,
                                        mechanism=mechanism), mb.mask)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item() + 1e-12


def varlen_stand_in(calls):
    """An attention function reading what transformers hands flash_attn_varlen_func: causal
    sdpa over each [cu[i], cu[i+1]) of the one flattened sequence."""
    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        cu = kw["cu_seq_lens_q"].tolist()
        assert query.shape[0] == 1 and attention_mask is None and kw["max_length_q"] == max(
            b - a for a, b in pairwise(cu))
        calls.append((query.shape[2], cu))
        out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling,
            enable_gqa=True) for a, b in pairwise(cu)], dim=2)
        return out.transpose(1, 2), None
    return attend


def test_varlen_path_flattens_real_tokens_and_passes_sample_boundaries():
    """flash-attn is not installed here: a stand-in reading the same keyword arguments checks
    the varlen path's flattening, boundaries and unpacking."""
    model = build_tiny("tiny-qwen2", seed=2)[0]
    batch = samples(seed=2)
    packed = pack(batch, CAP)
    with torch.no_grad():
        want_lp, want_ent = micro_batch_logprobs(model, make_micro_batch(batch), TEMPERATURE)
        calls: list = []
        AttentionInterface.register("rlx_test_varlen", varlen_stand_in(calls))
        model.set_attn_implementation("rlx_test_varlen")
        got_lp, got_ent = packed_logprobs(model, packed, TEMPERATURE, mechanism="varlen")
        hidden = packed_forward(model, packed, "varlen", output_hidden_states=True)
    assert calls and all(n == packed.num_tokens for n, _ in calls)  # no padding computed
    assert calls[0][1] == flat_cu_seqlens(packed).tolist()
    assert_close_on(valid_cols(), got_lp, want_lp)
    assert_close_on(valid_cols(), got_ent, want_ent)
    rows = unflatten(hidden.hidden_states[-1], packed)
    assert rows.shape[:2] == packed.input_ids.shape
    assert attention_mechanism(model) == "mask"  # an implementation transformers has no mask for


def test_attention_mechanism_prefers_flash_varlen_then_position_ids(model):
    assert attention_mechanism(model) == "position_ids"  # sdpa, the default here
    fake = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert attention_mechanism(fake) == "varlen"
    with pytest.raises(ValueError, match="unknown attention mechanism"):
        packed_forward(model, pack(samples(), CAP), mechanism="ring")


def test_unpack_hidden_states_match_the_padded_response_slice(model):
    batch = samples()
    mb = make_micro_batch(batch)
    packed = pack(batch, CAP)
    with torch.no_grad():
        padded = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                       position_ids=position_ids_from_mask(mb.attention_mask), use_cache=False,
                       output_hidden_states=True).hidden_states[-1]
        got = unpack(packed_forward(model, packed, output_hidden_states=True).hidden_states[-1],
                     packed)
    want = response_slice(padded[:, :-1], mb.prompt_lens, mb.num_response_cols)
    assert_close_on(valid_cols(), got, want)
    ids = response_slice(mb.input_ids[:, 1:], mb.prompt_lens, mb.num_response_cols)
    assert (response_targets(packed)[valid_cols()] == ids[valid_cols()]).all()


def test_unpack_takes_next_token_outputs_one_shorter_than_the_rows():
    """[rows, L-1] values (entry t: about token t+1), as token log-probs come; an empty
    response ending the widest row clamps inside them and unpacks to 0."""
    shapes = [(3, 0), (1, 1)]
    packed = pack(samples(shapes), 3)  # one row each: the first ends exactly at L - 1
    ids = unpack(packed.input_ids[:, 1:], packed)
    assert ids.tolist() == [[0], [samples(shapes)[1].response_ids[0]]]


def test_layout_rows_positions_and_cu_seqlens():
    packed = pack(samples(), CAP, pad_id=53)
    lengths = [p + r for p, r in SHAPES]
    for i, slot in enumerate(packed.slots):
        assert (slot.length, slot.prompt_len) == (lengths[i], SHAPES[i][0])
        assert packed.position_ids[slot.row, slot.start:slot.start + slot.length].tolist() == \
            list(range(slot.length))
    alone = [s.row for s in packed.slots if s.length >= CAP]  # 90 over the cap, 64 at it
    assert len(alone) == 2 and all(sum(s.row == r for s in packed.slots) == 1 for r in alone)
    over = packed.slots[5]  # the 90-token sample: its own row, as wide as the batch
    assert packed.row_lens[over.row] == 90 == packed.input_ids.shape[1]
    assert packed.cu_seqlens[over.row].tolist() == [0, 90]
    for r, cu in enumerate(packed.cu_seqlens):
        starts = sorted(s.start for s in packed.slots if s.row == r)
        assert cu.tolist()[:-1] == starts and cu[-1] == packed.row_lens[r] <= max(CAP, 90)
        assert (packed.input_ids[r, packed.row_lens[r]:] == 53).all()
    assert flat_cu_seqlens(packed)[-1] == packed.num_tokens == sum(lengths)


def test_packing_computes_fewer_tokens_than_padding_on_long_tailed_lengths():
    shapes = [(4, 96), (2, 8), (3, 9), (2, 6), (3, 6), (5, 6), (4, 6), (2, 5), (6, 7), (4, 6)]
    batch = samples(shapes)
    padded = make_micro_batch(batch)
    packed = pack(batch, 128)
    assert padded.input_ids.numel() == 10 * 100  # every row padded to the longest sample
    # first-fit decreasing: [100, 13, 12] then [11, 10, 10, 10, 9, 8, 7]
    assert packed.row_lens == [125, 65] and packed.num_computed_tokens == 2 * 125
    assert packed.num_tokens == 190  # the varlen path: the real tokens only


def test_packing_is_deterministic_and_a_micro_batch_packs_like_its_samples():
    batch = samples()
    a, b = pack(batch, CAP), pack(batch, CAP)
    c = pack(make_micro_batch(batch), CAP)
    for other in (b, c):
        assert torch.equal(a.input_ids, other.input_ids)
        assert torch.equal(a.position_ids, other.position_ids)
        assert a.slots == other.slots and a.row_lens == other.row_lens
        assert torch.equal(a.resp_cols, other.resp_cols)
    ties = pack(samples([(2, 3)] * 4), 10)  # equal lengths keep the given order
    assert [(s.row, s.start) for s in ties.slots] == [(0, 0), (0, 5), (1, 0), (1, 5)]


@pytest.mark.parametrize("args, match", [
    ((samples(), 0), "max_tokens must be a positive integer"),
    ((samples(), -3), "max_tokens must be a positive integer"),
    ((samples(), 2.5), "max_tokens must be a positive integer"),
    (([], 64), "no samples"),
    ((samples([(0, 3)]), 64), "no prompt token"),
])
def test_bad_input_is_refused_clearly(args, match):
    with pytest.raises(ValueError, match=match):
        pack(*args)


@pytest.mark.parametrize("mechanism", ["varlen", "position_ids", "mask"])
def test_a_micro_batch_with_packed_rows_gives_the_padded_head_values_and_gradients(
        monkeypatch, mechanism):
    """`mb.packed` set (micro_batches.pack): `micro_batch_logprobs` runs one packed forward and
    the loss head on the response hidden states gathered from the rows (training/heads.py
    `response_head`), under each attention mechanism (varlen: the stand-in)."""
    import training.heads

    model = build_tiny("tiny-qwen2", seed=3)[0].requires_grad_(True)
    batch = samples(seed=3)
    mb = make_micro_batch(batch)
    want_lp, want_ent = micro_batch_logprobs(model, mb, TEMPERATURE)
    want = grads(model, want_lp, want_ent, mb.mask)
    calls: list = []
    if mechanism == "varlen":
        AttentionInterface.register("rlx_test_varlen", varlen_stand_in(calls))
        model.set_attn_implementation("rlx_test_varlen")
    monkeypatch.setattr(training.heads, "attention_mechanism", lambda _model: mechanism)
    mb.packed = pack(batch, CAP)
    assert make_micro_batch(batch).to("cpu").packed is None
    assert mb.to("cpu").packed is not None  # a micro-batch moved keeps its rows
    got_lp, got_ent = micro_batch_logprobs(model, mb, TEMPERATURE)
    got = grads(model, got_lp, got_ent, mb.mask)
    valid = valid_cols()
    for g, w in ((got_lp, want_lp), (got_ent, want_ent)):
        assert (g[valid] - w[valid]).abs().max().item() <= 1e-5
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item() + 1e-12
    if mechanism == "varlen":  # the real tokens only, sample boundaries passed
        assert calls and all(n == mb.packed.num_tokens for n, _ in calls)
