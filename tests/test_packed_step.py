"""The train step with `micro_batches.pack = true` equals the padded step, computing fewer tokens.

On a tiny Qwen2 (fp32, CPU, random init, fixed seed) and samples of very different lengths: a
GRPO step, a step with a KL loss to a reference and one with the entropy bonus give the same
statistics, gradients and updated weights packed as padded (within float tolerance), while
every model pass of the packed step runs on packed rows (training/heads.py `packed_forward`)
with fewer tokens than the padded micro-batches' B x L. Where a combination cannot pack, the
step runs padded and says why; the field loads from hosts.toml.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest
import torch

import training.heads
from actors.trainer import TrainerConfig
from launch.config import ConfigError, load
from logic.teachers import TeacherSpec
from models.tiny import build_tiny
from tests.test_config import OK_LOOP
from training.aux_models import AuxModel
from training.batching import make_micro_batch
from training.config import KlConfig, LossConfig, MicroBatchConfig, OptimizerConfig
from training.data_parallel import plan_micro_batches
from training.packing import pack
from training.runner import TorchRunner
from training.step import TrainState, packing_allowed, train_on_batch
from transport.schema import Sample

# (prompt, response) lengths: long-tailed, one response of one token, one 90-token sample
SHAPES = [(3, 40), (5, 2), (1, 1), (10, 30), (4, 3), (30, 60), (2, 62), (7, 9), (6, 5),
          (3, 14)]
REL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate(SHAPES):
        ids = torch.randint(4, 54, (p + r,), generator=gen).tolist()
        lps = (-torch.rand(r, generator=gen) * 4).tolist()
        out.append(Sample(group_id=f"g{i // 2}", index=i % 2, domain="d", prompt_ids=ids[:p],
                          response_ids=ids[p:], loss_mask=[1] * r, rollout_logprobs=lps,
                          reward=float(i % 3 == 0)))
    return out


class Passes:
    """Counts the packed forwards of training/heads.py and the tokens their rows hold."""

    def __init__(self, monkeypatch):
        self.calls, self.tokens = 0, 0
        real = training.heads.packed_forward

        def spy(model, packed, *args, **kwargs):
            self.calls += 1
            self.tokens += packed.num_computed_tokens
            return real(model, packed, *args, **kwargs)

        monkeypatch.setattr(training.heads, "packed_forward", spy)


def run(pack_rows: bool, micro: dict, with_ref: bool = False, **overrides):
    """(stats, gradients after the step, weights after the step) of one step."""
    torch.manual_seed(0)
    model, tok = build_tiny("tiny-qwen2", seed=0)
    ref = AuxModel.frozen_copy(build_tiny("tiny-qwen2", seed=1)[0], "cpu") if with_ref else None
    state = TrainState(model, tok, torch.optim.SGD(model.parameters(), lr=0.5), ref)
    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"],
                        micro_batches=MicroBatchConfig(pack=pack_rows, **micro),
                        optimizer=OptimizerConfig(lr=0.5, grad_clip=0.0), **overrides)
    stats = train_on_batch(state, samples(), cfg)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return stats, grads, weights


def assert_same(padded, packed):
    stats_a, grads_a, weights_a = padded
    stats_b, grads_b, weights_b = packed
    assert stats_a.keys() == stats_b.keys()
    for key, value in stats_a.items():
        assert stats_b[key] == pytest.approx(value, rel=REL, abs=1e-6), key
    for name, g in grads_a.items():
        scale = g.abs().max().item()
        assert scale > 0, name  # every parameter trains
        assert (grads_b[name] - g).abs().max().item() <= REL * scale + 1e-8, name
        assert torch.allclose(weights_b[name], weights_a[name], rtol=REL, atol=1e-7), name


# no cap: micro-batches of 3 samples, one packed row each; a cap of 64 tokens: first-fit
# decreasing micro-batches, the 90-token sample alone
@pytest.mark.parametrize("micro", [{"size": 3}, {"max_tokens": 64}], ids=["size", "max_tokens"])
def test_a_grpo_step_packed_equals_the_padded_step(monkeypatch, micro):
    padded = run(False, micro)
    passes = Passes(monkeypatch)
    packed = run(True, micro)
    assert_same(padded, packed)
    assert padded[0]["train/grad_norm"] > 0 and padded[0]["train/policy_kl"] > 0
    plan = plan_micro_batches(samples(), micro.get("size", 16), micro.get("max_tokens", 0))
    batches = [[samples()[i] for i in idx] for idx in plan.micro_batches]
    # recompute, policy pass, the pass after the update: three packed forwards per micro-batch
    assert passes.calls == 3 * len(batches)
    padded_tokens = sum(make_micro_batch(b).input_ids.numel() for b in batches)
    assert passes.tokens < 0.8 * 3 * padded_tokens  # long-tailed: much less than B x L
    real = sum(p + r for p, r in SHAPES)
    if "max_tokens" in micro:  # every micro-batch fits its cap: one row of its real tokens
        assert passes.tokens == 3 * real


def test_a_step_with_kl_to_a_reference_packed_equals_the_padded_step(monkeypatch):
    overrides = dict(kl=KlConfig(coef=0.5, use_kl_loss=True, estimator="k3"))
    padded = run(False, {"size": 4}, with_ref=True, **overrides)
    passes = Passes(monkeypatch)
    packed = run(True, {"size": 4}, with_ref=True, **overrides)
    assert_same(padded, packed)
    assert padded[0]["train/kl_loss"] > 0.01  # a reference of other weights: a real KL term
    assert passes.calls == 4 * 3  # the reference's pass is packed too


def test_a_step_with_the_entropy_bonus_packed_equals_the_padded_step(monkeypatch):
    overrides = dict(loss=LossConfig(entropy_coef=0.5))
    padded = run(False, {"size": 4}, **overrides)
    Passes(monkeypatch)
    packed = run(True, {"size": 4}, **overrides)
    assert_same(padded, packed)
    plain = run(False, {"size": 4})
    # the bonus changes the update, so equal updates above are the entropy's gradient too
    assert any(not torch.allclose(plain[1][n], g, rtol=1e-3) for n, g in padded[1].items())


def test_packed_rows_hold_fewer_tokens_than_padded_micro_batches():
    batch = samples()
    padded = make_micro_batch(batch).input_ids.numel()  # B x longest
    rows = pack(batch, sum(p + r for p, r in SHAPES))
    assert rows.input_ids.shape[0] == 1 and rows.num_computed_tokens == rows.num_tokens
    assert rows.num_computed_tokens < 0.35 * padded


def test_combinations_that_cannot_pack_run_padded_and_say_why(caplog):
    model, _ = build_tiny("tiny-qwen2", seed=0)
    state = TrainState(model, None, torch.optim.SGD(model.parameters(), lr=0.1))
    runner = TorchRunner(model)
    base = dict(model="tiny-qwen2", workers=["w"], micro_batches=MicroBatchConfig(pack=True))
    assert packing_allowed(state, TrainerConfig(**base), runner)
    with caplog.at_level(logging.WARNING, logger="training.step"):
        assert not packing_allowed(state, TrainerConfig(**base, true_on_policy=True), runner)

        class Pipeline:  # a runner without `packs` (the megatron pipeline runner)
            whole_model, is_last_stage = False, True

        assert not packing_allowed(state, TrainerConfig(**base), Pipeline())
    text = caplog.text
    assert "true_on_policy" in text and "pipeline" in text and "padded" in text


def test_pack_with_forward_by_length_is_refused():
    with pytest.raises(ValueError, match="forward_by_length"):
        MicroBatchConfig(pack=True, forward_by_length=True)
    assert MicroBatchConfig(pack=True, forward_by_length=False).pack


def with_micro(micro: str) -> str:
    """tests/test_config.py's small loop with `micro_batches = { <micro> }` for the trainer."""
    old = 'config = { model = "examples/base-tiny", workers = ["w"] }'
    assert old in OK_LOOP
    return OK_LOOP.replace(old, old[:-2] + f", micro_batches = {{ {micro} }} }}")


def test_pack_loads_from_hosts_toml(tmp_path: Path):
    path = tmp_path / "hosts.toml"
    path.write_text(with_micro("pack = true, max_tokens = 512"))
    cfg = msgspec.convert(load(path).actors["trainer"].config, TrainerConfig)
    assert cfg.micro_batches.pack and cfg.micro_batches.max_tokens == 512
    path.write_text(with_micro("pack = true, forward_by_length = true"))
    with pytest.raises(ConfigError, match="forward_by_length"):
        load(path)


@pytest.mark.parametrize("mode", ["full", "top_k"])
def test_a_distillation_step_packed_equals_the_padded_step(tmp_path, monkeypatch, mode):
    """Colocated teachers (padded rows, their own forwards) and the student's packed passes:
    the OPD loss terms from the student's head gathered from the packed rows give the update
    and the per-teacher KL of the padded step."""
    from algos.opd import OpdConfig
    from tests.test_opd_stream import VOCAB, _Tok, colocated, tiny
    from training.config import TrainConfig

    gen = torch.Generator().manual_seed(3)
    batch = []
    for i, (p, r) in enumerate(SHAPES[:8]):
        ids = torch.randint(3, VOCAB, (p + r,), generator=gen).tolist()
        batch.append(Sample(group_id=f"g{i // 4}", index=i % 4, domain="d",
                            prompt_ids=ids[:p], response_ids=ids[p:], loss_mask=[1] * r,
                            rollout_logprobs=[-8.0] * r, reward=float(i % 3),
                            teacher="ab"[(i // 2) % 2]))
    teachers = {"a": tiny(1), "b": tiny(2)}
    results, passes = [], None
    for pack_rows in (False, True):
        if pack_rows:
            passes = Passes(monkeypatch)
        student = tiny(0)
        state = TrainState(student, _Tok(), torch.optim.SGD(student.parameters(), lr=1.0))
        state.teachers = colocated(tmp_path / f"pack{pack_rows}", teachers)
        state.temperature = 0.8
        cfg = TrainConfig(model="code", opd=OpdConfig(mode=mode, top_k=16 if mode == "top_k"
                                                      else 0),
                          teachers=[TeacherSpec(name=t, model="code") for t in "ab"],
                          micro_batches=MicroBatchConfig(size=2, pack=pack_rows))
        try:
            stats = train_on_batch(state, batch, cfg)
        finally:
            state.teachers.close()
        results.append((stats, {n: p.detach().clone() for n, p in student.named_parameters()}))
    (padded, weights), (packed, weights_packed) = results
    assert passes.calls == 3 * 4  # recompute, policy (with the OPD terms), after the update
    for name in "ab":
        assert padded[f"opd/{name}/reverse_kl"] > 0.1
    for key, value in padded.items():
        if not key.startswith("opd/teacher_time"):
            assert packed[key] == pytest.approx(value, rel=REL, abs=1e-6), key
    for name, w in weights.items():
        assert torch.allclose(weights_packed[name], w, rtol=REL, atol=1e-6), name


def test_a_ppo_step_with_a_critic_and_kl_in_the_reward_packed_equals_the_padded_step(
        monkeypatch):
    """The critic keeps its padded rows; the policy's, the reference's and the recompute's
    passes run packed; TIS weights from the packed log-probs: the same step."""
    from algos.mismatch import MismatchConfig
    from training.aux_models import CriticConfig, CriticModel

    results = []
    for pack_rows in (False, True):
        if pack_rows:
            passes = Passes(monkeypatch)
        torch.manual_seed(0)
        cfg = TrainerConfig(model="tiny-qwen2", workers=["w"],
                            micro_batches=MicroBatchConfig(max_tokens=48, pack=pack_rows),
                            loss=LossConfig(advantage_estimator="ppo", gamma=0.99,
                                            gae_lambda=0.9),
                            critic=CriticConfig(lr=1e-3), kl=KlConfig(coef=0.1, in_reward=True),
                            mismatch=MismatchConfig(correction="tis"),
                            optimizer=OptimizerConfig(lr=1e-3, grad_clip=0.5))
        model, tok = build_tiny("tiny-qwen2", seed=0)
        ref = AuxModel.frozen_copy(build_tiny("tiny-qwen2", seed=1)[0], "cpu")
        state = TrainState(model, tok, torch.optim.SGD(model.parameters(), lr=0.5), ref,
                           CriticModel(model, "cpu", cfg.critic))
        stats = train_on_batch(state, samples(), cfg)
        results.append((stats, {n: p.detach().clone() for n, p in model.named_parameters()},
                        {n: t.clone() for n, t in state.critic.state().items()}))
    (padded, weights, critic), (packed, weights_packed, critic_packed) = results
    mbs = len(plan_micro_batches(samples(), 16, 48).micro_batches)
    assert passes.calls == 4 * mbs  # recompute, reference, policy, after the update
    assert padded["train/value_loss"] > 0
    for key, value in padded.items():
        assert packed[key] == pytest.approx(value, rel=REL, abs=1e-6), key
    for name, w in weights.items():
        assert torch.allclose(weights_packed[name], w, rtol=REL, atol=1e-7), name
    # the critic's AdamW step divides by sqrt(v): its near-zero gradients turn the float noise
    # of the returns (KL in the reward, from packed log-probs) into ~1e-7; lr is 1e-3
    for name, w in critic.items():
        assert torch.allclose(critic_packed[name], w, rtol=REL, atol=2e-6), name


def test_a_packing_trainer_on_cuda_gets_an_attention_without_a_dense_mask(monkeypatch):
    """sdpa on CUDA would build a dense [L, L] mask per packed row (an H200 ran out of memory at
    1.5B, 8k-token rows): the trainer's model is switched to FlashAttention's varlen or, without
    flash-attn, FlexAttention's document mask; on CPU it keeps sdpa."""
    from training import packing

    assert packing.preferred_attn_implementation("cpu") == "sdpa"
    monkeypatch.setattr(packing, "flash_attn_available", lambda: False)
    assert packing.preferred_attn_implementation("cuda") == "flex_attention"
    monkeypatch.setattr(packing, "flash_attn_available", lambda: True)
    assert packing.preferred_attn_implementation("cuda") == "flash_attention_2"
    model, _ = build_tiny("qwen2-0.5b-shape", 0)  # heads of 64 dimensions
    assert packing.use_packed_attention(model, "cpu") == "sdpa"
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(packing, "preferred_attn_implementation", lambda d: "flex_attention")
    assert packing.use_packed_attention(model, "cuda") == "sdpa"  # fp32: not where measured
    model.to(torch.bfloat16)
    assert packing.use_packed_attention(model, "cuda") == "flex_attention"
    assert model.config._attn_implementation == "flex_attention"
    assert packing.attention_mechanism(model) == "block_mask"  # the samples' BlockMask
    small, _ = build_tiny("tiny-qwen2", 0)  # heads of 16 dimensions: keeps sdpa
    assert packing.use_packed_attention(small.to(torch.bfloat16), "cuda") == "sdpa"
