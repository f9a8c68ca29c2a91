"""Context parallelism of the megatron backend (backends/megatron/context_parallel.py) on CPU
over gloo: a tiny GPTModel (megatron's local spec, fp32, GQA, qk-norm, RoPE) at cp = 2 against
the same weights at cp = 1, on right-padded rows of uneven lengths: the gathered logits, and the
parameter gradients of a loss on the gathered log-probs (summed over the CP group, the
reduction megatron's DDP does over the data-parallel-with-CP group), within 1e-5; at cp = 1
the module equals megatron's DotProductAttention exactly; bad placements give clear errors.
Two ranks run TP=1 x CP=2, four ranks TP=2 x CP=2.

The child processes report tensors to the parent (rank 0 writes them, the tests assert), so a
failure shows here with its values and any rank's traceback.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")

from backends.megatron import context_parallel as cpmod  # noqa: E402
from backends.megatron.mcore import get_gpt_layer_local_spec  # noqa: E402
from tests.test_megatron_parallel import run_ranks as spawn_ranks  # noqa: E402

SPAWN_TIMEOUT_S = 420  # four ranks on a loaded two-core machine took two minutes
VOCAB = 64
LENGTHS = (13, 9, 5)  # right-padded to 13: at cp = 2 padded to 16


def run_ranks(target: str, tmp_path: Path, world: int) -> dict:
    """This module's `target`(rank, tmp_path) on `world` child processes (megatron on CPU over
    gloo); rank 0's report."""
    return spawn_ranks(target, tmp_path, world, __name__, SPAWN_TIMEOUT_S)


# ---------------------------------------------------------------------------------------------
# in the ranks


def tiny_config(tp: int, cp: int, **changes):
    from backends.megatron.mcore import TransformerConfig
    from backends.megatron.model import PORTABLE_DEFAULTS

    shape = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                 kv_channels=8, ffn_hidden_size=48, normalization="RMSNorm",
                 layernorm_epsilon=1e-6, add_bias_linear=False, gated_linear_unit=True,
                 activation_func=F.silu, qk_layernorm=True, params_dtype=torch.float32,
                 hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**(PORTABLE_DEFAULTS | shape | changes),
                             tensor_model_parallel_size=tp, context_parallel_size=cp)


def tiny_gpt(tp: int, cp: int, context_parallel_spec: bool = True):
    from backends.megatron.mcore import GPTModel

    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    if context_parallel_spec:
        spec = cpmod.cp_layer_spec(spec)
    return GPTModel(tiny_config(tp, cp), spec, vocab_size=VOCAB, max_sequence_length=64,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    rotary_base=10000)


def padded_rows(left: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [3, 13], mask, per-position loss weights) of rows of LENGTHS, right-padded (as the
    trainer pads) or left-padded."""
    gen = torch.Generator().manual_seed(3)
    length = max(LENGTHS)
    ids = torch.randint(1, VOCAB, (len(LENGTHS), length), generator=gen)
    mask = (torch.arange(length)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    if left:
        mask = mask.flip(1)
    ids = ids * mask
    weights = torch.randn(len(LENGTHS), length - 1, generator=gen)
    return ids, mask, weights


def loss_of(logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A policy-gradient-like loss on next-token log-probs [B, T-1] of the real tokens."""
    real = (mask[:, 1:] * mask[:, :-1]).float()
    return -(logprobs * weights * real).sum() / real.sum()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _error(fn) -> str:
    """The ValueError message of fn(), or '' when it raised none."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def reference_pass(tp: int) -> dict:
    """At cp = 1 (the world as tp x dp): megatron's own DotProductAttention model, the same
    weights under ContextParallelAttention, their logits and the reference gradients."""
    from backends.megatron.mcore import parallel_state, tensor_parallel
    from backends.megatron.model import blocked_attention

    parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=1,
                                             create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)  # megatron's CPU initialization draws from torch's generator: the
    # same weights on every rank (each TP rank keeps its shard of one full matrix)
    ids, mask, weights = padded_rows()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    ref = tiny_gpt(tp, 1, context_parallel_spec=False)
    mine = tiny_gpt(tp, 1)
    mine.load_state_dict(ref.state_dict())
    logits = ref(ids, positions, blocked_attention(mask), runtime_gather_output=True)
    loss_of(cpmod.local_token_logprobs(logits, cpmod.next_token_labels(ids))[:, :-1], mask,
            weights).backward()
    with torch.no_grad():
        same_full = mine(ids, positions, blocked_attention(mask), runtime_gather_output=True)
        same_compact = mine(ids, positions, cpmod.key_padding_mask(mask, 1),
                            runtime_gather_output=True)
    with torch.no_grad():
        helper = cpmod.cp_logits(ref, ids, mask)  # plain DotProductAttention, cp = 1
        left_ids, left_mask, _ = padded_rows(left=True)
        left = cpmod.cp_logits(ref, left_ids, left_mask)
    errors = {
        # TransformerConfig says cp = 2, the parallel state has a CP group of 1
        "group": _error(lambda: tiny_gpt(tp, 2)),
        # 4 query heads over 3 key/value groups (3 groups over 2 tensor ranks at tp = 2)
        "heads": _error(lambda: cpmod.ContextParallelAttention(
            tiny_config(1, 1, num_query_groups=3), 1, cpmod.AttnMaskType.causal, "self")),
    }
    out = {"state": {k: v.clone() for k, v in ref.state_dict().items()
                     if isinstance(v, torch.Tensor)},
           "logits": logits.detach(), "grads": _grads(ref),
           "exact_full": torch.equal(same_full, logits),
           "exact_compact": torch.equal(same_compact, logits),
           "exact_helper": torch.equal(helper, logits), "left": left, "errors": errors}
    parallel_state.destroy_model_parallel()
    return out


def _max_over_world(values: dict[str, float]) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def compare_layouts(rank: int, tmp: Path) -> dict:
    """cp = 2 (tp = world / 2) against cp = 1 on the same ranks: max differences over all
    ranks."""
    world = torch.distributed.get_world_size()
    from backends.megatron.mcore import parallel_state, tensor_parallel
    from backends.megatron.model import blocked_attention

    tp, cp = world // 2, 2
    ref = reference_pass(tp)
    parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp,
                                             create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    assert parallel_state.get_context_parallel_world_size() == cp
    ids, mask, weights = padded_rows()
    model = tiny_gpt(tp, cp)
    model.load_state_dict(ref["state"])  # TP rank = global rank % tp in both layouts

    batch = cpmod.split_batch(ids, mask, cpmod.next_token_labels(ids))
    local = model(batch.input_ids, batch.position_ids, batch.attention_mask,
                  runtime_gather_output=True)
    logits = cpmod.gather_from_cp(local, 1, batch.length)
    # the loss on the gathered per-token log-probs (computed locally, V times less to move)
    lp = cpmod.gather_from_cp(cpmod.local_token_logprobs(local, batch.labels), 1, batch.length)
    loss_of(lp[:, :-1], mask, weights).backward()
    grads_lp = _grads(model)
    model.zero_grad(set_to_none=True)
    # the same loss on the gathered logits (cp_logits: split, forward, gather)
    whole = cpmod.cp_logits(model, ids, mask)
    loss_of(cpmod.local_token_logprobs(whole, cpmod.next_token_labels(ids))[:, :-1], mask,
            weights).backward()
    grads_logits = _grads(model)
    model.zero_grad(set_to_none=True)
    # megatron's masked softmax on explicit scores (what dropout or a softmax offset use)
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.use_sdpa = False
    explicit = cpmod.cp_logits(model, ids, mask)
    loss_of(cpmod.local_token_logprobs(explicit, cpmod.next_token_labels(ids))[:, :-1], mask,
            weights).backward()
    grads_explicit = _grads(model)
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.use_sdpa = True
    group = parallel_state.get_context_parallel_group()
    for grads in (grads_lp, grads_logits, grads_explicit):
        for g in grads.values():
            torch.distributed.all_reduce(g, group=group)

    # the other two mask shapes: the whole sequence's [B, 1, S, S], this rank's rows [B, 1, s, S]
    total = cpmod.padded_length(ids.shape[1], cp)
    padded_mask = torch.cat([mask, mask.new_zeros(mask.shape[0], total - mask.shape[1])], 1)
    whole_mask = blocked_attention(padded_mask)
    rows = whole_mask.index_select(2, cpmod.positions(total, cp,
                                                      parallel_state.get_context_parallel_rank()))
    with torch.no_grad():
        by_whole = model(batch.input_ids, batch.position_ids, whole_mask,
                         runtime_gather_output=True)
        by_rows = model(batch.input_ids, batch.position_ids, rows, runtime_gather_output=True)
        compact = model(batch.input_ids, batch.position_ids, batch.attention_mask,
                        runtime_gather_output=True)

        # left-padded rows: their real tokens (a padding query sees no key at all; its
        # output, never used, is an average over all keys, and cp = 2 has 3 more of them)
        left_ids, left_mask, _ = padded_rows(left=True)
        left = cpmod.cp_logits(model, left_ids, left_mask)
    real = left_mask.bool()

    attention = model.decoder.layers[0].self_attention.core_attention
    odd = torch.zeros(5, 1, attention.num_attention_heads_per_partition, 8)
    odd_kv = torch.zeros(5, 1, attention.num_query_groups_per_partition, 8)
    errors = ref["errors"] | {
        "split": _error(lambda: cpmod.positions(ids.shape[1], cp, 0)),
        "odd_local_length": _error(lambda: attention(odd, odd_kv, odd_kv, None)),
        # the parallel state has CP groups of 2, the TransformerConfig says cp = 1
        "config": _error(lambda: tiny_gpt(tp, 1)),
        "mask_keys": _error(lambda: model(batch.input_ids, batch.position_ids,
                                          blocked_attention(mask), runtime_gather_output=True)),
    }
    diffs = _max_over_world({
        "logits": (logits - ref["logits"]).abs().max(),
        "grad_logprobs": max((grads_lp[n] - g).abs().max() for n, g in ref["grads"].items()),
        "grad_logits": max((grads_logits[n] - g).abs().max()
                           for n, g in ref["grads"].items()),
        "mask_whole": (by_whole - compact).abs().max(),
        "mask_rows": (by_rows - compact).abs().max(),
        "ref_exact": 0.0 if ref["exact_full"] and ref["exact_compact"]
        and ref["exact_helper"] else 1.0,
        "logits_helper": (whole - ref["logits"]).abs().max(),
        "logits_left": (left - ref["left"]).abs()[real].max(),
        "logits_explicit": (explicit - ref["logits"]).abs().max(),
        "grad_explicit": max((grads_explicit[n] - g).abs().max()
                             for n, g in ref["grads"].items()),
    })
    grad_scale = max(g.abs().max() for g in ref["grads"].values())
    parallel_state.destroy_model_parallel()
    return {"diffs": diffs, "errors": errors, "grad_scale": float(grad_scale),
            "local_len": int(batch.input_ids.shape[1]), "names": sorted(ref["grads"])}


# ---------------------------------------------------------------------------------------------
# the tests


@pytest.fixture(scope="module")
def cp2(tmp_path_factory) -> dict:
    return run_ranks("compare_layouts", tmp_path_factory.mktemp("cp2"), world=2)


@pytest.fixture(scope="module")
def tp2_cp2(tmp_path_factory) -> dict:
    return run_ranks("compare_layouts", tmp_path_factory.mktemp("tp2cp2"), world=4)


def _check(report: dict) -> None:
    diffs = report["diffs"]
    assert report["local_len"] == 8  # 13 tokens padded to 16, two chunks of 4 per rank
    assert diffs["ref_exact"] == 0.0  # cp = 1: megatron's DotProductAttention, bit for bit
    assert diffs["logits"] < 1e-5 and diffs["logits_helper"] < 1e-5
    assert diffs["logits_left"] < 1e-5
    assert diffs["logits_explicit"] < 1e-5 and diffs["grad_explicit"] < 1e-5
    assert report["grad_scale"] > 1e-3  # the gradients compared are not all zero
    assert diffs["grad_logprobs"] < 1e-5
    assert diffs["grad_logits"] < 1e-5
    assert diffs["mask_whole"] == 0.0 and diffs["mask_rows"] == 0.0


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)  # the ranks start in the fixture, timed with it
def test_cp2_equals_cp1(cp2):
    _check(cp2)


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_tp2_cp2_equals_tp2_cp1(tp2_cp2):
    _check(tp2_cp2)
    assert "3 key/value groups cannot be split over 2 tensor-parallel" in \
        tp2_cp2["errors"]["heads"]


@pytest.mark.timeout(2 * SPAWN_TIMEOUT_S)
def test_bad_placements_say_why(cp2):
    errors = cp2["errors"]
    assert "multiple of 2 * cp = 4" in errors["split"]
    assert "context_parallel_size = 2 in the TransformerConfig but the context-parallel " \
        "group has 1 ranks" in errors["group"]
    assert "context_parallel_size = 1 in the TransformerConfig but the context-parallel " \
        "group has 2 ranks" in errors["config"]
    assert "3 key/value groups" in errors["heads"]  # (not a multiple of, at tp = 1)
    assert "must be equal and even" in errors["odd_local_length"]
    assert "the last dim covers the whole sequence" in errors["mask_keys"]


def test_load_balanced_layout():
    """Each rank holds chunks r and 2cp-1-r; together the ranks hold every position once."""
    assert cpmod.padded_length(13, 2) == 16 and cpmod.padded_length(16, 2) == 16
    assert cpmod.padded_length(13, 1) == 13
    assert cpmod.positions(13, 1, 0).tolist() == list(range(13))
    assert cpmod.positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 3, 4):
        held = torch.cat([cpmod.positions(8 * cp, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(8 * cp))
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        cpmod.positions(8, 2, 2)
    # alone (no process group): cp = 1, the helpers hand tensors back as they are
    x = torch.arange(6).view(1, 6)
    assert cpmod.split_for_cp(x) is x
    assert cpmod.gather_from_cp(x, 1, 4).tolist() == [[0, 1, 2, 3]]


def test_layer_spec_swaps_core_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    swapped = cpmod.cp_layer_spec(spec)
    assert swapped.submodules.self_attention.submodules.core_attention \
        is cpmod.ContextParallelAttention
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention
    with pytest.raises(ValueError, match="no megatron DotProductAttention"):
        cpmod.cp_layer_spec(swapped)
