"""fp32 master weights behind bfloat16 parameters: small updates survive, the trainer's bf16 step
uses them by default, the invariant (parameters = masters rounded) holds, checkpoints keep them."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from actors.trainer import TrainerConfig
from tests.test_dp_train import make_batch
from training.config import MicroBatchConfig, OptimizerConfig
from training.master_weights import MasterWeightOptimizer, PlainOptimizer, make_optimizer
from training.setup import load_train_state
from training.step import train_on_batch


def sgd_steps(master: bool, steps: int = 10) -> tuple[torch.Tensor, MasterWeightOptimizer | None]:
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = (MasterWeightOptimizer([p], lambda ps: torch.optim.SGD(ps, lr=1e-3)) if master
           else torch.optim.SGD([p], lr=1e-3))
    for _ in range(steps):
        opt.zero_grad()
        p.grad = torch.ones_like(p)
        opt.step()
    return p.detach(), opt if master else None


def test_updates_below_half_a_bf16_ulp_accumulate_in_the_masters():
    pure, _ = sgd_steps(master=False)
    assert torch.equal(pure, torch.ones(4, dtype=torch.bfloat16))  # 1 - 1e-3 rounds back to 1
    mixed, opt = sgd_steps(master=True)
    assert torch.allclose(opt.master[0], torch.full((4,), 0.99), atol=1e-6)
    assert torch.equal(mixed, torch.full((4,), 0.99).to(torch.bfloat16))  # 0.98828125


def test_step_sums_over_ranks_clips_and_returns_the_norm():
    """`step(max_norm, dp)`: the gradients summed by `dp`, clipped to max_norm (the norm of the
    fp32 masters, or of the parameters without), one update; the norm returned."""
    class Doubling:  # a stand-in for two data-parallel ranks holding the same gradient
        def sum_grads(self, params):
            for q in params:
                q.grad = q.grad * 2

    for master in (True, False):
        p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16 if master else torch.float32))
        opt = make_optimizer([p], p.dtype, master, lr=1.0)
        opt.optimizer = torch.optim.SGD(opt.master if master else [p], lr=1.0)
        p.grad = torch.full((4,), 1.5, dtype=p.dtype)
        norm = opt.step(1.0, Doubling())
        assert norm == pytest.approx(6.0)  # |(3, 3, 3, 3)| before the clip
        assert torch.allclose(p.float(), torch.full((4,), 0.5), atol=1e-2)  # 1 - 3 * 1/6
        p.grad = torch.ones(4, dtype=p.dtype)
        assert math.isnan(opt.step())  # torch's API: the update alone, no norm taken
        assert torch.allclose(p.float(), torch.full((4,), -0.5), atol=1e-2)


def test_optimizer_choice_follows_the_dtype():
    p = [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    assert isinstance(make_optimizer(p, torch.bfloat16, None, 1e-3), MasterWeightOptimizer)
    for plain in (make_optimizer(p, torch.float32, None, 1e-3),
                  make_optimizer(p, torch.bfloat16, False, 1e-3)):
        assert isinstance(plain, PlainOptimizer) and not plain.has_masters
        assert isinstance(plain.optimizer, torch.optim.AdamW)


def changed_fraction(master: bool | None, tmp_path) -> tuple[float, object]:
    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], dtype="bfloat16",
                        optimizer=OptimizerConfig(lr=1e-5, master_weights=master),
                        micro_batches=MicroBatchConfig(size=8))
    state = load_train_state(cfg, str(tmp_path), False)
    before = [p.detach().clone() for p in state.model.parameters()]
    batch = make_batch(state.tokenizer)
    for _ in range(4):
        train_on_batch(state, batch, cfg)
    moved = sum(int((p.detach() != b).sum()) for p, b in zip(state.model.parameters(), before))
    return moved / sum(b.numel() for b in before), state


def test_bf16_trainer_steps_move_the_weights_only_with_masters(tmp_path):
    pure, _ = changed_fraction(False, tmp_path / "pure")
    mixed, state = changed_fraction(None, tmp_path / "mixed")  # the default for bfloat16
    assert isinstance(state.optimizer, MasterWeightOptimizer)
    assert mixed > 0.4 and pure < 0.5 * mixed, (pure, mixed)  # measured: 0.16 vs 0.56
    for p, m in zip(state.optimizer.params, state.optimizer.master):
        assert m.dtype == torch.float32 and torch.equal(p.detach(), m.detach().to(p.dtype))
    # a checkpoint keeps the masters exactly; a trainer without masters refuses it
    state.step = 4
    state.save(tmp_path / "ckpt")
    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], dtype="bfloat16",
                        optimizer=OptimizerConfig(lr=1e-5))
    resumed = load_train_state(cfg, str(tmp_path / "other"), False)
    resumed.load(tmp_path / "ckpt", "cpu")
    assert all(torch.equal(a, b) for a, b in zip(resumed.optimizer.master, state.optimizer.master))
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(),
                                                 state.model.parameters()))
    plain = load_train_state(msgspec.structs.replace(cfg, optimizer=OptimizerConfig(
                                 lr=1e-5, master_weights=False)),
                             str(tmp_path / "plain"), False)
    with pytest.raises(ValueError, match="master weights"):
        plain.load(tmp_path / "ckpt", "cpu")
