"""The weight store (memory/store.py) and the trainer's models on it (training/aux_models.py):
tagged host copies with no-op backups, in-place restores into a resident module, CRC checks, the
critic's offload, and the reference following the actor (`kl.ref_update_interval`) across a
resume."""

from __future__ import annotations

import msgspec
import pytest
import torch

from actors.trainer import TrainerConfig
from algos.mismatch import MismatchConfig
from models.tiny import build_tiny
from tests.test_trainer_options import batch
from training.aux_models import AuxModel, CriticModel
from training.config import CriticConfig, KlConfig, LossConfig, MicroBatchConfig, OptimizerConfig
from training.setup import load_train_state
from training.state import TrainState
from training.step import train_on_batch
from memory.checksum import ChecksumError
from memory.host import HostBudgetError, PinnedArena
from memory.layout import FlatLayout, bind
from memory.store import WeightStore, weight_tensors
from training.weight_sets import hollow_copy


def tiny(seed: int = 0) -> torch.nn.Module:
    return build_tiny("tiny-qwen2", seed=seed)[0]


def values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in weight_tensors(module).items()}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_backup_copies_only_what_changed_and_restore_is_in_place():
    sets = WeightStore()
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert sets.backup("actor", model) is True
    d2h = sets.counters["d2h_bytes"]
    assert sets.backup("actor", model) is False  # unchanged: nothing copied
    assert sets.counters["d2h_bytes"] == d2h and sets.counters["backup_noops"] == 1
    first = values(model)

    sum(p.sum() for p in model.parameters()).backward()
    opt.step()  # in place through the parameters: the version counters move
    assert not equal(first, values(model))
    assert sets.backup("actor.new", model) is True
    assert sets.backup("actor", model) is True  # changed since its last backup: copied
    assert sets.counters["d2h_bytes"] == 3 * d2h

    # restore the first weights into the live model: same storage, the old values
    sets.backup("actor.v0", {n: t for n, t in first.items()})
    ptrs = {n: t.data_ptr() for n, t in weight_tensors(model).items()}
    assert sets.restore("actor.v0", model) is True
    assert equal(values(model), first)
    assert {n: t.data_ptr() for n, t in weight_tensors(model).items()} == ptrs
    assert sets.restore("actor.v0", model) is False  # it holds that set already
    assert sets.backup("actor.v0", model) is False  # and a backup of it finds no change

    sets.copy("actor.new", "actor.copy")
    assert equal(sets.host_tensors("actor.copy"), sets.host_tensors("actor.new"))
    assert sets.nbytes == 4 * sets.layout("actor").total_bytes
    sets.close()


def test_a_resident_module_switches_sets_and_binds_host_memory_on_the_cpu():
    sets = WeightStore()
    a, b = tiny(0), tiny(1)
    sets.backup("a", a)
    sets.backup("b", b)
    scratch = hollow_copy(a).requires_grad_(False)
    assert all(t.numel() == 0 for t in weight_tensors(scratch).values())
    assert sets.restore("a", scratch, bind_cpu=True)
    assert equal(values(scratch), values(a))
    host = sets.host_tensors("a")
    assert all(t.data_ptr() == host[n].data_ptr() for n, t in weight_tensors(scratch).items())
    assert sets.counters["binds"] == 1 and sets.counters["h2d_bytes"] == 0  # no copy at all
    assert sets.restore("b", scratch, bind_cpu=True) and equal(values(scratch), values(b))
    assert sets.restore("a", scratch, bind_cpu=True)  # switched back: a again
    assert equal(values(scratch), values(a))
    with pytest.raises(ValueError, match="does not match"):
        sets.restore("a", torch.nn.Linear(3, 3))
    sets.close()


def test_a_modified_host_copy_fails_its_checksum_at_restore():
    sets = WeightStore(crc_chunk_bytes=4096)
    model = tiny()
    sets.backup("ref", model)
    host = sets.host_tensors("ref")
    name = next(iter(host))
    host[name].view(-1)[0] += 1.0  # a stray write into the host copy
    with pytest.raises(ChecksumError, match="'ref': host copy at byte offset 0"):
        sets.restore("ref", tiny(1))
    sets.close()


def test_a_set_filled_in_place_is_checked_and_a_fixed_arena_is_a_budget():
    model = tiny()
    want = values(model)
    layout = FlatLayout.from_state_dict(weight_tensors(model))
    sets = WeightStore(crc_chunk_bytes=4096, arena=PinnedArena.create(layout.total_bytes))
    sets.reserve("t", layout)
    target = hollow_copy(model)
    with pytest.raises(ValueError, match="reserved but never written"):
        sets.restore("t", target)
    for name, view in bind(sets.view("t"), layout).items():  # filled by its reader
        view.copy_(want[name])
    sets.written("t")
    assert sets.restore("t", target) and equal(values(target), want)
    with pytest.raises(HostBudgetError, match="host tier: 'u' needs"):  # the arena is full
        sets.reserve("u", layout)
    sets.drop("t")
    sets.reserve("u", layout)  # its region is free again
    sets.view("u")[layout.total_bytes - 1] ^= 1  # filled, then a stray write before `written`
    sets.written("u")
    sets.view("u")[4096 + 7] ^= 1  # a stray write after it
    with pytest.raises(ChecksumError, match="'u': host copy at byte offset 4096 "):
        sets.restore("u", target)
    sets.close()
    assert sets.arenas == []  # the store closed its arena


def test_release_refuses_to_lose_weights_and_restore_brings_them_back():
    sets = WeightStore()
    model = tiny()
    want = values(model)
    with pytest.raises(KeyError):
        sets.release("m", model)
    sets.backup("m", model)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # changed since the backup
    with pytest.raises(ValueError, match="does not hold"):
        sets.release("m", model)
    sets.restore("m", model)
    sets.release("m", model)
    assert all(t.numel() == 0 for t in weight_tensors(model).values())
    sets.restore("m", model)
    assert equal(values(model), want)
    sets.close()


def critic_setup(offload: bool):
    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], micro_batches=MicroBatchConfig(size=2),
                        loss=LossConfig(advantage_estimator="ppo", gae_lambda=1.0),
                        critic=CriticConfig(lr=1e-3))
    model, tok = build_tiny("tiny-qwen2", seed=0)
    critic = CriticModel(model, "cpu", cfg.critic)
    if offload:  # the GPU path on the CPU: weights and optimizer state sleep in host sets
        critic.offload = True
        critic._sleep()
    state = TrainState(model, tok, torch.optim.AdamW(model.parameters(), lr=1e-3), None, critic)
    return state, cfg, batch(tok)


def test_an_offloaded_critic_trains_exactly_like_a_resident_one():
    runs = []
    for offload in (False, True):
        state, cfg, samples = critic_setup(offload)
        stats = [train_on_batch(state, samples, cfg)["train/value_loss"] for _ in range(3)]
        runs.append((stats, {k: v.clone() for k, v in state.critic.state().items()}, state))
    (plain, plain_w, _), (slept, slept_w, state) = runs
    assert plain == slept and equal(plain_w, slept_w)
    critic, store = state.critic, state.critic.store
    assert all(t.numel() == 0 for t in weight_tensors(critic.module).values())  # asleep
    assert store.has("critic.optimizer") and store.counters["backup_noops"] >= 3  # value passes
    saved = critic.checkpoint()
    assert saved["optimizer"]["state"] and all(t.numel() == 0 for t in weight_tensors(
        critic.module).values())
    fresh = critic_setup(True)[0].critic
    fresh.restore(saved)
    assert equal(fresh.state(), critic.state())


def follow_setup(tmp_path, interval: int):
    cfg = msgspec.convert({
        "model": "tiny-qwen2", "workers": ["w"], "micro_batches": {"size": 3},
        "optimizer": {"lr": 3e-3},
        "kl": {"coef": 0.1, "use_kl_loss": True, "ref_update_interval": interval}},
        TrainerConfig)
    return load_train_state(cfg, str(tmp_path), resume=True), cfg


def test_the_reference_follows_the_actor_every_n_steps_and_across_a_resume(tmp_path):
    state, cfg = follow_setup(tmp_path, 2)
    samples = batch(state.tokenizer)
    kls = [train_on_batch(state, samples, cfg)["train/kl_loss"] for _ in range(3)]
    # before step 1 the reference is the initial actor; after updates 1 (kl > 0) and 2 (a copy)
    assert kls[0] == 0.0 and kls[1] > 1e-6 and kls[2] == 0.0
    assert state.ref.updates == 1
    state.step = 3
    state.save(tmp_path / "checkpoints" / "step_000003")  # ref = the actor after update 2
    after_two = {k: v.clone() for k, v in state.ref.state().items()}
    ahead = [train_on_batch(state, samples, cfg)["train/kl_loss"] for _ in range(2)]
    assert ahead[0] > 1e-6 and ahead[1] == 0.0  # after update 3: not a copy; after 4: a copy

    resumed, _ = follow_setup(tmp_path, 2)
    assert resumed.step == 3 and equal(resumed.ref.state(), after_two)
    again = [train_on_batch(resumed, samples, cfg)["train/kl_loss"] for _ in range(2)]
    assert again == pytest.approx(ahead, abs=1e-7)

    frozen, cfg0 = follow_setup(tmp_path / "frozen", 0)
    kls0 = [train_on_batch(frozen, samples, cfg0)["train/kl_loss"] for _ in range(3)]
    assert kls0[0] == 0.0 and kls0[2] > kls0[1] > 0  # a frozen reference: the KL only grows
    with pytest.raises(msgspec.ValidationError, match="ref_update_interval"):
        msgspec.convert({"model": "tiny-qwen2", "workers": ["w"],
                         "kl": {"ref_update_interval": 2}}, TrainerConfig)


def test_reference_and_old_actors_share_one_resident_module(tmp_path):
    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], micro_batches=MicroBatchConfig(size=3),
                        optimizer=OptimizerConfig(lr=3e-3),
                        kl=KlConfig(coef=0.1, use_kl_loss=True),
                        mismatch=MismatchConfig(correction="decoupled",
                                                proximal="rollout_version", high=1e9,
                                                proximal_versions=2))
    state = load_train_state(cfg, str(tmp_path), resume=False)
    samples = batch(state.tokenizer)
    assert state.old_actors.resident is state.ref.resident_module
    for version in range(4):
        state.version = version
        for s in samples:
            s.weight_version = max(0, version - 1)
        stats = train_on_batch(state, samples, cfg)
        assert stats["train/proximal_fallback_samples"] == 0
    store = state.ref.store
    assert sorted(store.sets) == ["old_actor:v2", "old_actor:v3", "ref"]  # oldest recycled
    assert state.host_weight_sets_bytes() == 3 * store.layout("ref").total_bytes
    assert isinstance(state.ref, AuxModel) and store.counters["d2h_bytes"] == \
        5 * store.layout("ref").total_bytes  # the reference once, one snapshot per version
