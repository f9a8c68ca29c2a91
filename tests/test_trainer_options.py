"""Trainer options end to end on the tiny model: estimators, reference KL, critic, token cap,
and incompatible options failing at config load."""

from __future__ import annotations

import copy

import msgspec
import pytest
import torch

from actors.trainer import TrainerConfig
from algos.logprobs import token_logprobs
from algos.mismatch import MismatchConfig
from models.tiny import build_tiny
from training.aux_models import AuxModel, CriticConfig, CriticModel
from training.config import KlConfig, LossConfig, MicroBatchConfig, OptimizerConfig
from training.setup import build_aux_models
from training.step import TrainState, train_on_batch
from transport.schema import Sample

ANSWERS = [("1+2=", ["3", "4", "33"]), ("rev ab=", ["ba", "ab", "b"])]


def batch(tok) -> list[Sample]:
    out = []
    for g, (prompt, answers) in enumerate(ANSWERS):
        for i, (ans, r) in enumerate(zip(answers, [1.0, 0.0, 0.5])):
            ids = tok.encode(ans, add_special_tokens=False) + [tok.eos_token_id]
            out.append(Sample(group_id=f"g{g}", index=i, domain="d",
                              prompt_ids=[tok.bos_token_id] + tok.encode(prompt,
                                                                         add_special_tokens=False),
                              response_ids=ids, loss_mask=[1] * len(ids),
                              rollout_logprobs=[-2.0] * len(ids), reward=r + 0.3 * g))
    return out


def setup(**overrides):
    torch.manual_seed(0)
    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], **{
        "micro_batches": MicroBatchConfig(size=2), "optimizer": OptimizerConfig(lr=1e-3),
        **overrides})
    model, tok = build_tiny("tiny-qwen2", seed=0)
    ref, critic = build_aux_models(cfg, model)
    state = TrainState(model, tok, torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr),
                       ref, critic)
    return state, cfg, batch(tok)


def step(**overrides):
    state, cfg, samples = setup(**overrides)
    stats = train_on_batch(state, samples, cfg)
    return {k: v.clone() for k, v in state.model.state_dict().items()}, stats, state


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_estimators_give_distinct_updates_and_dr_grpo_alias():
    params = {est: step(loss=LossConfig(advantage_estimator=est))[0] for est in
              ("grpo", "dr_grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")}
    names = list(params)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert max_diff(params[a], params[b]) > 1e-6, (a, b)
    alias = step(loss=LossConfig(std_normalization=False))[0]
    assert max_diff(alias, params["dr_grpo"]) == 0.0


def test_kl_in_reward_is_zero_against_the_initial_weights_and_not_after_a_change():
    rpp = LossConfig(advantage_estimator="reinforce_plus_plus")
    shaping = KlConfig(coef=0.5, in_reward=True, estimator="k1")
    plain = step(loss=rpp)[0]
    shaped = step(loss=rpp, kl=shaping)[0]
    assert max_diff(plain, shaped) == 0.0  # reference == policy: every k1 is exactly 0
    state, cfg, samples = setup(loss=rpp, kl=shaping)
    perturb(state.ref)
    train_on_batch(state, samples, cfg)
    assert max_diff(plain, state.model.state_dict()) > 1e-6


def perturb(ref: AuxModel) -> None:
    tensors = {k: v + 0.05 * torch.randn_like(v) for k, v in ref.state().items()}
    ref.load_state(tensors)


def test_kl_loss_matches_an_independent_computation():
    state, cfg, samples = setup(kl=KlConfig(coef=0.1, use_kl_loss=True, estimator="k3"))
    perturb(state.ref)
    policy, ref = copy.deepcopy(state.model), state.ref.module
    expected = 0.0
    for s in samples:  # one unpadded sequence at a time, k3 in float64
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        n, p = len(s.response_ids), len(s.prompt_ids)
        with torch.no_grad():
            a = token_logprobs(policy, ids)[0, p - 1:p - 1 + n].double()
            b = token_logprobs(ref, ids)[0, p - 1:p - 1 + n].double()
        expected += float((torch.exp(b - a) - 1 + (a - b)).mean()) / len(samples)
    stats = train_on_batch(state, samples, cfg)
    assert expected > 1e-4
    assert stats["train/kl_loss"] == pytest.approx(expected, rel=1e-4)


def test_ppo_trains_the_critic_towards_the_returns():
    # Adam moves every weight by ~lr: on the random tiny model 1e-5 is a small step
    params, first, state = step(loss=LossConfig(advantage_estimator="ppo", gae_lambda=1.0),
                                critic=CriticConfig(lr=1e-5))
    before = CriticModel(build_tiny("tiny-qwen2", seed=0)[0], "cpu", CriticConfig()).state()
    assert max_diff(before, state.critic.state()) > 5e-6
    assert first["train/value_loss"] > 0
    again = train_on_batch(state, batch(state.tokenizer), state_cfg(state))
    assert again["train/value_loss"] < first["train/value_loss"]
    assert max_diff(params, step()[0]) > 1e-6  # not the GRPO update


def state_cfg(state) -> TrainerConfig:
    return TrainerConfig(model="tiny-qwen2", workers=["w"], micro_batches=MicroBatchConfig(size=2),
                         optimizer=OptimizerConfig(lr=0.0), critic=state.critic.cfg,
                         loss=LossConfig(advantage_estimator="ppo", gae_lambda=1.0))


def test_sample_over_the_token_cap_is_trained_alone_and_counted():
    _, stats, _ = step(micro_batches=MicroBatchConfig(size=2, max_tokens=8))
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in batch(build_tiny("tiny-qwen2")[1])]
    over = sum(n > 8 for n in lengths)
    assert over >= 1 and stats["train/oversized_samples"] == over
    assert stats["train/samples"] == len(lengths)
    assert stats["train/tokens"] == sum(len(s.response_ids) for s in batch(
        build_tiny("tiny-qwen2")[1]))


def test_decoupled_correction_masks_far_behaviour_tokens():
    state, cfg, samples = setup(mismatch=MismatchConfig(correction="decoupled", high=1.5))
    # the random tiny model gives log p ~ -ln(54) ~ -4 to every token: behaviour log-probs of
    # -9 make w = pi_prox / pi_b ~ e^5 > 1.5 (masked), -3 make w ~ e^-1 (kept, weighted)
    for s in samples:
        s.rollout_logprobs = [-9.0] + [-3.0] * (len(s.response_ids) - 1)
    stats = train_on_batch(state, samples, cfg)
    tokens = sum(len(s.response_ids) for s in samples)
    assert stats["train/kept_token_frac"] == pytest.approx(1 - len(samples) / tokens)


@pytest.mark.parametrize("options, names", [
    ({"mismatch": {"bypass": True, "correction": "decoupled"}}, None),
    ({"loss": {"advantage_estimator": "ppo"}}, ("advantage_estimator = 'ppo'", "critic")),
    ({"critic": {}}, ("critic", "advantage_estimator = 'grpo'")),
    ({"kl": {"coef": 0.1, "in_reward": True}}, ("kl.in_reward = true",
                                                 "advantage_estimator = 'grpo'")),
    ({"kl": {"coef": 0.1, "in_reward": True, "use_kl_loss": True}},
     ("use_kl_loss = true", "in_reward = true", "`$.kl`")),
    ({"kl": {"coef": 0.1}}, ("coef = 0.1", "use_kl_loss", "`$.kl`")),
    ({"kl": {"use_kl_loss": True}}, ("use_kl_loss = true", "coef = 0")),
    ({"loss": {"std_normalization": False, "advantage_estimator": "reinforce_plus_plus"}},
     ("std_normalization = false", "advantage_estimator = 'reinforce_plus_plus'", "`$.loss`")),
    ({"kl": {"ref_model": "tiny-qwen2"}}, ("ref_model", "coef = 0")),
    ({"loss": {"advantage_estimator": "gae"}}, ("advantage_estimator = 'gae'",)),
    ({"kl": {"estimator": "k4"}}, ("estimator = 'k4'", "`$.kl`")),
    ({"micro_batches": {"size": 0}}, ("size >= 1", "`$.micro_batches`")),
    ({"micro_batch_size": 4}, ("unknown field `micro_batch_size`",)),
    ({"mismatch": {"proximal": "rollout_version", "correction": "tis"}},
     ("proximal = 'rollout_version'", "correction = 'tis'")),
])
def test_incompatible_options_fail_naming_both(options, names):
    with pytest.raises((ValueError, msgspec.ValidationError)) as info:  # as the launcher loads
        msgspec.convert({"model": "tiny-qwen2", "workers": ["w"], **options}, TrainerConfig)
    for name in names or ("bypass = true", "correction = 'decoupled'"):
        assert name in str(info.value), str(info.value)


def test_checkpoint_keeps_the_critic_and_rebuilds_the_reference(tmp_path):
    ppo = LossConfig(advantage_estimator="ppo")
    kl = KlConfig(coef=0.1, use_kl_loss=True)
    state, cfg, samples = setup(loss=ppo, critic=CriticConfig(), kl=kl)
    initial_ref = {k: v.clone() for k, v in state.ref.state().items()}
    train_on_batch(state, samples, cfg)
    state.save(tmp_path / "ckpt")
    resumed, _, _ = setup(loss=ppo, critic=CriticConfig(), kl=kl)
    resumed.load(tmp_path / "ckpt", "cpu")
    assert max_diff(resumed.critic.state(), state.critic.state()) == 0.0
    assert max_diff(resumed.model.state_dict(), state.model.state_dict()) == 0.0
    assert max_diff(resumed.ref.state(), initial_ref) == 0.0  # the initial weights, not step 1
    assert resumed.critic.optimizer.state_dict()["state"]  # Adam moments came back too


def test_decoupled_rollout_version_proximal_is_the_generating_weights():
    fix = MismatchConfig(correction="decoupled", proximal="rollout_version", high=1e9)
    state, cfg, samples = setup(mismatch=fix)
    initial = copy.deepcopy(state.model)
    first = train_on_batch(state, samples, cfg)  # version 0 samples, trainer at version 0
    assert first["train/ppo_kl"] == 0.0 and first["train/proximal_fallback_samples"] == 0
    state.version = 1  # the samples are now one version stale
    after_one = copy.deepcopy(state.model)
    second = train_on_batch(state, samples, cfg)
    expected, tokens = 0.0, 0
    for s in samples:  # ppo_kl = mean(log pi_prox - log pi_theta), pi_prox = version 0
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        n, p = len(s.response_ids), len(s.prompt_ids)
        with torch.no_grad():
            a = token_logprobs(initial, ids)[0, p - 1:p - 1 + n].double()
            b = token_logprobs(after_one, ids)[0, p - 1:p - 1 + n].double()
        expected += float((a - b).sum())
        tokens += n
    assert abs(expected / tokens) > 1e-5
    assert second["train/ppo_kl"] == pytest.approx(expected / tokens, rel=1e-3)
    state.version = 2  # two sets kept (versions 1 and 2): version 0 is gone, counted
    third = train_on_batch(state, samples, cfg)
    assert third["train/proximal_fallback_samples"] == len(samples)
