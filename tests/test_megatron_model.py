"""The megatron backend at TP=1 in this process: log-probs equal the transformers model's,
native option pass-through, HF export, and a training step equal to the torch backend's."""

from __future__ import annotations

import warnings

import pytest
import torch
import tqdm

with warnings.catch_warnings():  # megatron-core warns at import that Apex / TE are absent
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")
    from backends.megatron import model as mg

from algos.logprobs import token_logprobs_and_entropy
from backends.megatron import cpu_shim as shim
from tests.test_megatron_convert import NAMES, hf_config, hf_model

# megatron-core's internal calls use arguments it has itself deprecated
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    """One gloo rank with megatron's parallel state (TP=PP=1) and the CPU shim, once per module:
    megatron's group setup leaves a process-wide gloo transport (4 fds) behind even after every
    group is destroyed, which a per-test setup would report as a leak."""
    shim.install()
    store = torch.distributed.FileStore(str(tmp_path_factory.mktemp("mg") / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    mg.initialize_parallel(1, 1, seed=0)
    yield
    mg.parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    del store
    shim.uninstall()


def padded_batch(vocab: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of lengths 9, 6, 3 padded to 9 (right, as the trainer pads, or left)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 9), generator=gen)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for row, n in enumerate((9, 6, 3)):
        (mask[row, 9 - n:] if left else mask[row, :n]).fill_(1)
    return ids.masked_fill(mask == 0, 0), mask


def batch(tok) -> list:
    """Two GRPO groups of two answers (rewards 1 and 0), of different lengths."""
    from transport.schema import Sample

    out = []
    for g, (prompt, answers) in enumerate([("1+2=", ["3", "4"]), ("rev ab=", ["ba", "ab"])]):
        for i, (ans, reward) in enumerate(zip(answers, [1.0, 0.0])):
            ids = tok.encode(ans, add_special_tokens=False) + [tok.eos_token_id]
            prompt_ids = [tok.bos_token_id] + tok.encode(prompt, add_special_tokens=False)
            out.append(Sample(group_id=f"g{g}", index=i, domain="d", prompt_ids=prompt_ids,
                              response_ids=ids, loss_mask=[1] * len(ids),
                              rollout_logprobs=[-1.0] * len(ids), reward=reward))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_logprobs_match_transformers(tp1, name):
    hf = hf_model(name)
    model = mg.from_hf_model(hf)
    for left in (False, True):
        ids, mask = padded_batch(hf.config.vocab_size, left)
        with torch.no_grad():
            want, want_ent = token_logprobs_and_entropy(hf, ids, mask, 0.7)
            got, got_ent = token_logprobs_and_entropy(model, ids, mask, 0.7)
        real = (mask[:, 1:] * mask[:, :-1]).bool()  # a real token predicted from a real one
        assert (got - want).abs()[real].max() < 1e-5
        assert (got_ent - want_ent).abs()[real].max() < 1e-5
    assert want[real].std() > 0.1  # random weights: a wrong layout would not match this closely


def test_options_pass_through_natively_and_bad_ones_are_refused(tp1):
    model = mg.build_model(hf_config("qwen2"), {"hidden_dropout": 0.25, "init_method_std": 0.5,
                                                "fp16_lm_cross_entropy": True})
    assert model.core.config.hidden_dropout == 0.25 and model.core.config.init_method_std == 0.5
    assert model.core.fp16_lm_cross_entropy is True  # a GPTModel argument
    with pytest.raises(ValueError, match=r"unknown megatron option 'hiden_dropout'.*"
                                         r"'hidden_dropout'"):
        mg.build_model(hf_config("qwen2"), {"hiden_dropout": 0.1})
    with pytest.raises(ValueError, match="'num_layers' is set from the HF config"):
        mg.build_model(hf_config("qwen2"), {"num_layers": 3})
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 differs"):
        mg.build_model(hf_config("qwen2"), {"tensor_model_parallel_size": 2})
    # command-line strings take the option's type
    config_kw, model_kw = mg.split_options({"params_dtype": "bfloat16", "hidden_dropout": "0.5",
                                            "recompute_num_layers": "2",
                                            "fp16_lm_cross_entropy": "true",
                                            "recompute_granularity": "selective"})
    assert config_kw == {"params_dtype": torch.bfloat16, "hidden_dropout": 0.5,
                         "recompute_num_layers": 2, "recompute_granularity": "selective"}
    assert model_kw == {"fp16_lm_cross_entropy": True}
    with pytest.raises(ValueError, match="hidden_dropout='x': expected float"):
        mg.split_options({"hidden_dropout": "x"})


def test_hf_export_loads_back_into_transformers(tp1, tmp_path):
    from transformers import AutoModelForCausalLM

    from models.load import quiet_progress

    hf = hf_model("qwen3")
    model = mg.from_hf_model(hf)
    with torch.no_grad():
        model.core.decoder.layers[1].self_attention.q_layernorm.weight.add_(0.5)
    model.save_pretrained(str(tmp_path / "hf"))
    with quiet_progress():
        back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    changed = back.model.layers[1].self_attn.q_norm.weight
    assert torch.equal(changed, hf.model.layers[1].self_attn.q_norm.weight + 0.5)
    assert torch.equal(back.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert back.config.model_type == "qwen3" and back.config.tie_word_embeddings



@pytest.mark.parametrize("masters", [False, True])
def test_training_step_equals_the_torch_backend(tp1, masters, monkeypatch):
    """masters: through fp32 master weights (in fp32 they change nothing numerically; the torch
    backend clips the masters' gradients, megatron its own parameters' before the step).
    "schedule": the one-stage megatron model through the pipeline runner (megatron's schedule
    without pipelining) instead of its whole forward. "packed": the whole forward on packed
    rows (micro_batches.pack, a block-causal 4D mask). Every step's log-probs come from the
    loss head over the output layer's rows (algos/loss_head.py), not from logits."""
    import msgspec

    import algos.loss_head as heads
    from actors.trainer import TrainerConfig
    from backends.megatron.pipeline import PipelineRunner
    from models.tiny import build_tiny
    from training.backends import get_backend
    from training.config import MicroBatchConfig, OptimizerConfig
    from training.master_weights import MasterWeightOptimizer
    from training.step import TrainState, train_on_batch

    hf, tok = build_tiny("tiny-qwen2", seed=0)
    model, _ = mg.load_model("tiny-qwen2", seed=0)  # the trainer's entry: same weights as hf
    scheduled, _ = mg.load_model("tiny-qwen2", seed=0)
    packed, _ = mg.load_model("tiny-qwen2", seed=0)
    before = hf.model.embed_tokens.weight.detach().clone()
    # one padded forward per micro-batch (not CPU fp32's by-length forwards, which keep logits)
    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"],
                        micro_batches=MicroBatchConfig(size=3, forward_by_length=False),
                        optimizer=OptimizerConfig(grad_clip=0.5))
    pack_cfg = msgspec.structs.replace(cfg, micro_batches=MicroBatchConfig(size=3, pack=True))
    head_calls, widths = [], {}
    real = heads.head_logprobs
    monkeypatch.setattr(heads, "head_logprobs",
                        lambda *a, **k: head_calls.append(a[1].shape) or real(*a, **k))
    for net in (model, packed):
        net.core.register_forward_pre_hook(
            lambda _m, args, net=net: widths.setdefault(id(net), []).append(args[0].numel()))
    stats = {}
    for name, net, runner, c in (("torch", hf, None, cfg), ("megatron", model, None, cfg),
                                 ("schedule", scheduled, PipelineRunner(scheduled), cfg),
                                 ("packed", packed, None, pack_cfg)):
        opt = (MasterWeightOptimizer(net.parameters(), lambda ps: torch.optim.SGD(ps, lr=1.0))
               if masters else torch.optim.SGD(net.parameters(), lr=1.0))
        state = TrainState(net, tok, opt, backend=get_backend("torch" if net is hf else "megatron"))
        head_calls.clear()
        stats[name] = train_on_batch(state, batch(tok), c, runner=runner)
        # the head path (the pipeline runner's last stage too): the output layer's rows
        assert head_calls and head_calls[0] == hf.lm_head.weight.shape, name
    for key in ("train/loss", "train/grad_norm", "train/entropy", "train/policy_kl"):
        for name in ("megatron", "schedule", "packed"):
            assert stats[name][key] == pytest.approx(stats["torch"][key], rel=1e-5,
                                                     abs=1e-7), (name, key)
    assert stats["torch"]["train/grad_norm"] > 0.5  # clipping was active
    # packed rows compute fewer tokens than the padded ones, pass for pass
    assert sum(widths[id(packed)]) < sum(widths[id(model)])
    assert len(widths[id(packed)]) == len(widths[id(model)])
    # SGD at lr 1: the weights move by the clipped gradient itself, so this compares gradients
    # (Adam would amplify float noise in near-zero gradients to a full lr-sized step)
    after = model.hf_state_dict()
    assert (after["model.embed_tokens.weight"] - before).abs().max() > 1e-2
    via_schedule, via_packed = scheduled.hf_state_dict(), packed.hf_state_dict()
    for key, want in hf.state_dict().items():
        if key != "lm_head.weight":
            assert (after[key] - want).abs().max() < 1e-5, key
            assert (via_schedule[key] - want).abs().max() < 1e-5, key
            assert (via_packed[key] - want).abs().max() < 1e-5, key


def test_trainer_backend_megatron_state_checkpoint_and_weight_names(tp1, tmp_path):
    from actors.trainer import TrainerActor, TrainerConfig
    from models.tiny import build_tiny
    from training.setup import load_train_state

    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], backend="megatron",
                        megatron={"hidden_dropout": 0.0})
    state = load_train_state(cfg, str(tmp_path), resume=False)
    hf, _ = build_tiny("tiny-qwen2", seed=0)
    named = dict(state.named_weights())  # what the in-memory weight-sync paths send
    assert sorted(named) == sorted(k for k in hf.state_dict() if k != "lm_head.weight" or
                                   not hf.config.tie_word_embeddings)
    assert torch.equal(named["model.embed_tokens.weight"], hf.model.embed_tokens.weight)
    with torch.no_grad():
        state.model.core.embedding.word_embeddings.weight.add_(0.5)
    state.step = 3
    state.save(tmp_path / "checkpoints" / "step_000003")
    resumed = load_train_state(cfg, str(tmp_path), resume=True)
    assert resumed.step == 3
    assert torch.equal(dict(resumed.named_weights())["model.embed_tokens.weight"],
                       hf.model.embed_tokens.weight + 0.5)
    with pytest.raises(ValueError, match="runs on CUDA devices"):
        TrainerActor.check_config(cfg)
    with pytest.raises(ValueError, match="backend = 'torch'"):
        TrainerActor.check_config(TrainerConfig(model="tiny-qwen2", workers=["w"],
                                                megatron={"hidden_dropout": 0.0}))


@pytest.mark.parametrize("rows", ["right", "left", "packed"])
def test_torch_attention_at_one_context_rank_equals_megatrons(tp1, monkeypatch, rows):
    """The core attention through torch's fused kernel at cp = 1 (the CUDA default,
    `sdpa_at_cp1`) gives megatron's own attention's logits and gradients: on right- and
    left-padded rows and on packed rows (a block-causal 4D mask)."""
    from backends.megatron.context_parallel import ContextParallelAttention
    from training.packing import block_causal_mask, pack

    hf = hf_model("qwen2")
    model = mg.from_hf_model(hf)
    ids, mask = padded_batch(hf.config.vocab_size, left=rows == "left")
    if rows == "packed":
        seqs = [ids[r, :int(m.sum())].tolist() for r, m in enumerate(mask)]
        packed = pack_rows(seqs, pack, 12)
        ids, mask = packed.input_ids, block_causal_mask(packed, torch.float32)
    out = {}
    for sdpa in (False, True):
        monkeypatch.setattr(ContextParallelAttention, "sdpa_at_cp1", sdpa)
        model.zero_grad()
        logits = model(ids, attention_mask=mask).logits
        real = mask.reshape(-1).bool() if rows != "packed" else None
        picked = logits.reshape(-1, logits.shape[-1])[real] if real is not None else logits
        (picked.float() ** 2).mean().backward()
        out[sdpa] = (picked.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert (out[True][0] - out[False][0]).abs().max() < 1e-5
    for name, grad in out[False][1].items():
        assert (out[True][1][name] - grad).abs().max() < 1e-5, name


def pack_rows(seqs: list[list[int]], pack, cap: int):
    """Token lists packed by training/packing.py `pack` into rows of `cap` tokens."""
    from transport.schema import Sample

    samples = [Sample(group_id="g", index=i, domain="d", prompt_ids=s[:1], response_ids=s[1:],
                      loss_mask=[1] * (len(s) - 1), rollout_logprobs=[0.0] * (len(s) - 1),
                      reward=0.0) for i, s in enumerate(seqs)]
    return pack(samples, cap)


def test_activation_checkpointing_recomputes_each_layer_and_changes_no_value(tp1, tmp_path,
                                                                              monkeypatch):
    """activation_checkpointing on the megatron backend (training/setup.py checkpoint_layers):
    the pass with gradients runs each TransformerLayer under torch.utils.checkpoint, the
    no-grad passes do not, and the step's values and weights equal the step without."""
    from actors.trainer import TrainerConfig
    from training.config import MicroBatchConfig
    from training.master_weights import as_train_optimizer
    from training.setup import load_train_state
    from training.step import train_on_batch

    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    out = {}
    for ckpt in (False, True):
        calls.clear()
        cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], backend="megatron",
                            activation_checkpointing=ckpt,
                            micro_batches=MicroBatchConfig(size=4, forward_by_length=False))
        state = load_train_state(cfg, str(tmp_path / str(ckpt)), False)
        state.optimizer = as_train_optimizer(torch.optim.SGD(state.model.parameters(), lr=1.0),
                                             state.backend.grad_clip(state.model))
        stats = train_on_batch(state, batch(state.tokenizer), cfg)
        # one micro-batch: the policy pass runs each of the two layers once under checkpoint
        assert len(calls) == (2 if ckpt else 0)
        out[ckpt] = (stats, state.model.hf_state_dict())
    (a, wa), (b, wb) = out[False], out[True]
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-8), key
    assert a["train/grad_norm"] > 0.1
    for name, value in wa.items():
        assert (wb[name] - value).abs().max() < 1e-6, name


def test_a_compiled_decoder_layer_is_one_graph(tp1, monkeypatch):
    """compile_layers on the megatron backend: torch.compile traces a whole TransformerLayer
    (attention through torch's fused kernel, as on CUDA) into one graph. megatron-core's
    row-parallel linears warned on every call (tp_group=None), which split each layer into
    10 graphs here; the backend's GroupedRowParallelLinear passes the group."""
    from backends.megatron.context_parallel import ContextParallelAttention

    model = mg.from_hf_model(hf_model("qwen2"))
    rows = [m for m in model.modules() if isinstance(m, mg.RowParallelLinear)]
    assert rows and all(isinstance(m, mg.GroupedRowParallelLinear) for m in rows)
    layer = model.core.decoder.layers[0]
    seen = {}
    hook = layer.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.update(args=args, kwargs=kwargs), with_kwargs=True)
    ids, mask = padded_batch(model.config.vocab_size)
    model(ids, attention_mask=mask)
    hook.remove()
    monkeypatch.setattr(ContextParallelAttention, "sdpa_at_cp1", True)
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # dynamo's bars: no monitor thread
    torch._dynamo.reset()
    with warnings.catch_warnings():  # dynamo's tracing of megatron warns (as it compiles)
        warnings.simplefilter("ignore")
        explained = torch._dynamo.explain(layer.forward)(*seen["args"], **seen["kwargs"])
    assert [b.reason for b in explained.break_reasons] == []
    assert explained.graph_count == 1


@pytest.mark.parametrize("rows", ["packed", "padded"])
def test_flex_mask_function_is_the_dense_mask_and_causal(tp1, rows):
    """The FlexAttention mask function made from a [b, 1, s, s] mask (flex_block_mask): packed
    rows' block-causal mask becomes document indices (no [s, s] lookup), a padded rows' mask
    stays a dense lookup; either allows exactly the causal part of what the mask allows."""
    from backends.megatron import context_parallel as cpmod
    from training.packing import block_causal_mask, pack

    if rows == "packed":
        packed = pack_rows([list(range(3, 3 + n)) for n in (5, 2, 7, 4, 1)], pack, 10)
        blocked = block_causal_mask(packed, torch.float32) != 0
        assert cpmod._documents(blocked[:, 0]) is not None
    else:
        blocked = mg.blocked_attention(padded_batch(50)[1])
        assert cpmod._documents(blocked[:, 0]) is None
    rows_, sq = blocked.shape[0], blocked.shape[-1]
    b, q, k = (torch.arange(n).view(shape) for n, shape in
               ((rows_, (-1, 1, 1)), (sq, (1, -1, 1)), (sq, (1, 1, -1))))
    causal = torch.ones(sq, sq, dtype=torch.bool).tril()
    for documents in (True, False):  # the padded rows' mask is not looked through (False)
        allowed = cpmod.mask_function(blocked, documents)(b, 0, q, k)
        assert torch.equal(allowed, ~blocked[:, 0] & causal)
    assert allowed.sum() < causal.sum() * rows_  # the mask takes something away


def test_packed_rows_by_position_ids_are_the_block_causal_masks_function(tp1, monkeypatch):
    """Packed rows given as restarting position ids and no mask (the backend's
    `packed_attention`) give the logits and gradients of the same rows under
    training/packing.py's block-causal 4D mask; where FlexAttention runs, its block mask is
    made from the documents those positions give, which allow exactly what the dense mask
    allows (no [T, T] mask made)."""
    from algos.logprobs import segment_causal, segments
    from backends.megatron import context_parallel as cpmod
    from training.packing import attention_mechanism, block_causal_mask, pack

    hf = hf_model("qwen2")
    model = mg.from_hf_model(hf)
    assert attention_mechanism(model) == "position_ids"
    ids, mask = padded_batch(hf.config.vocab_size)
    packed = pack_rows([ids[r, :int(m.sum())].tolist() for r, m in enumerate(mask)], pack, 12)
    assert packed.input_ids.shape[0] == 2  # rows of 9 and 6 + 3 tokens (+ 3 padding)
    out = []
    for kwargs in ({"attention_mask": block_causal_mask(packed, torch.float32)},
                   {"position_ids": packed.position_ids}):
        model.zero_grad()
        logits = model(packed.input_ids, **kwargs).logits
        (logits.float() ** 2).mean().backward()
        out.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert (out[0][0] - out[1][0]).abs().max() < 1e-6
    for name, grad in out[0][1].items():
        assert (out[1][1][name] - grad).abs().max() < 1e-6, name
    docs = segments(packed.position_ids)
    dense = block_causal_mask(packed, torch.float32) != 0
    assert torch.equal(~segment_causal(docs), dense)
    rows, sq = docs.shape
    b, q, k = (torch.arange(n).view(shape) for n, shape in
               ((rows, (-1, 1, 1)), (sq, (1, -1, 1)), (sq, (1, 1, -1))))
    assert torch.equal(cpmod.document_mask_function(docs)(b, 0, q, k), ~dense[:, 0])
    made = []
    monkeypatch.setattr(mg, "flex_applies", lambda *args: True)
    monkeypatch.setattr(mg, "flex_block_mask", lambda *args: made.append(args) or "block")
    assert mg.layer_mask(model.core, None, True, docs) == "block"
    assert made[0][0] is None and made[0][2] is docs
    # a forward finds the attention cores without walking the model's modules again (a walk
    # of a 28-layer model's thousands of modules was ~3 ms of host time per forward)
    walks = []
    monkeypatch.setattr(torch.nn.Module, "modules", lambda *a: walks.append(a) or iter(()))
    assert mg.layer_mask(model.core, None, True, docs) == "block" and len(made) == 2
    assert walks == []


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_from_a_table_made_once_equals_megatrons_per_layer_rope(tp1, interleaved):
    """The rotary module gives cos and sin once per forward (backends/megatron/rope.py), and
    the layers rotate with them: logits and gradients are those of megatron's own path (which
    evaluates cos and sin in every layer), halves rotated or interleaved pairs."""
    from backends.megatron import rope

    model = mg.from_hf_model(hf_model("qwen2"))
    rotary = model.core.rotary_pos_emb
    assert type(rotary) is rope.CosSinRotary
    model.core.config.rotary_interleaved = rotary.rotary_interleaved = interleaved
    ids, mask = padded_batch(model.config.vocab_size)
    out = []
    for cls in (rope.CosSinRotary, rope._rotary.RotaryEmbedding):
        rotary.__class__ = cls
        model.zero_grad()
        logits = model(ids, attention_mask=mask).logits
        (logits[mask.bool()] ** 2).mean().backward()
        out.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    rotary.__class__ = rope.CosSinRotary
    table = rotary(9)
    assert rope.is_table(table) and table.shape == (9, 1, 1, 2, 16)
    # bf16: rotated in float32 and rounded once (how a compiled layer's graphs fuse it cannot
    # change the rounding), where megatron's own function rounds each product
    q = torch.randn(9, 2, 4, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    cos, sin = table.unbind(-2)
    half = rope._rotate_half(q.float(), interleaved)
    once = (q.float() * cos + half * sin).bfloat16()
    assert torch.equal(rope.apply_table(q, table, model.core.config), once)
    angles = rope._rotary.RotaryEmbedding.forward(rotary, 9)
    assert not torch.equal(rope._ORIGINAL["apply_rotary_pos_emb"](q, angles, model.core.config),
                           once)
    assert (out[0][0] - out[1][0]).abs().max() < 1e-6
    for name, grad in out[0][1].items():
        assert (out[1][1][name] - grad).abs().max() < 1e-6, name


def test_flex_expands_keys_to_the_heads_where_their_count_is_not_a_power_of_two():
    """FlexAttention's keys and values: grouped-query attention at a power-of-two head count,
    each group's keys and values repeated for its heads at another (12 heads over 2 groups,
    Qwen2.5-1.5B's), which attends exactly as the grouped form does."""
    from torch.nn.attention.flex_attention import flex_attention

    from backends.megatron.context_parallel import flex_key_value

    key, value = torch.randn(2, 5, 1, 2, 8).unbind(0)  # [s, b, groups, d]
    assert flex_key_value(key, value, 16)[2] is True
    assert flex_key_value(key, value, 2) == (key, value, False)
    k12, v12, gqa = flex_key_value(key, value, 12)
    assert not gqa and k12.shape == (5, 1, 12, 8)
    assert all(torch.equal(k12[:, :, h], key[:, :, h // 6]) for h in range(12))
    assert all(torch.equal(v12[:, :, h], value[:, :, h // 6]) for h in range(12))
    query = torch.randn(5, 1, 12, 8)
    with warnings.catch_warnings():  # eager FlexAttention (unfused) warns
        warnings.simplefilter("ignore")
        grouped, expanded = (flex_attention(query.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                            v.permute(1, 2, 0, 3), enable_gqa=g)
                             for k, v, g in ((key, value, True), (k12, v12, False)))
    assert (grouped - expanded).abs().max() < 1e-6


def test_flex_applies_on_cuda_in_half_precision_and_a_block_mask_needs_its_conditions(
        tp1, monkeypatch):
    """FlexAttention is chosen on CUDA for bf16/fp16 heads of >= 64 dimensions only (a CPU
    model never builds a block mask); where it applies, the layers get one block mask unless a
    layer cannot use it (dropout in training mode: the dense mask); a layer handed a block mask
    where it cannot use one says so instead of computing something else."""
    from torch.nn.attention.flex_attention import create_block_mask

    from backends.megatron.context_parallel import flex_applies

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert flex_applies(cuda, torch.bfloat16, 64) and flex_applies(cuda, torch.float16, 128)
    assert not flex_applies(cpu, torch.bfloat16, 64)
    assert not flex_applies(cuda, torch.float32, 64) and not flex_applies(cuda, torch.bfloat16, 32)
    model = mg.from_hf_model(hf_model("qwen2"))
    dense = mg.blocked_attention(padded_batch(50)[1])
    assert mg.layer_mask(model.core, dense, False) is dense  # the CPU
    made = []
    monkeypatch.setattr(mg, "flex_applies", lambda *args: True)
    monkeypatch.setattr(mg, "flex_block_mask", lambda *args: made.append(args) or "block")
    assert mg.layer_mask(model.core, dense, False) == "block" and made == [(dense, False, None)]
    attention = model.core.decoder.layers[0].self_attention.core_attention
    attention.attention_dropout.p = 0.5
    attention.train()
    assert mg.layer_mask(model.core, dense, False) is dense and len(made) == 1
    block = create_block_mask(lambda b, h, q, k: k <= q, 1, None, 4, 4, device="cpu")
    q = torch.randn(4, 1, attention.num_attention_heads_per_partition, 16)
    with pytest.raises(ValueError, match="pass the dense mask"):
        attention(q, q, q, block)


def test_an_armed_process_installs_the_shim_and_runs_megatrons_fusions_eagerly():
    """A process started with tests/megatron_shim on its path (the launcher's actors, the rank
    processes): importing the backend installs the CPU stand-ins, and megatron's jit_fuser is
    its no-op decorator (torch.compile'd helpers would need a compiler on the CPU; ~1 s of CPU
    per process at import)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(root / "tests" / "megatron_shim"), os.environ.get("PYTHONPATH")]))}
    probe = ("import warnings; warnings.simplefilter('ignore')\n"
             "import backends.megatron.mcore\n"
             "from backends.megatron import cpu_shim\n"
             "from megatron.core import jit\n"
             "from megatron.core.fusions import fused_bias_swiglu as f\n"
             "print(cpu_shim.armed(), bool(cpu_shim._saved), jit.jit_fuser is "
             "jit.noop_decorator, type(f.swiglu).__name__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "True", "function"], out.stderr[-2000:]
