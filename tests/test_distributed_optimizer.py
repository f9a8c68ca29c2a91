"""training/distributed_optimizer.py on two gloo ranks: bf16 parameters with fp32 main weights,
three steps against the replicated fp32-master AdamW (training/master_weights.py) on the same
summed gradients, bit for bit; half the optimizer state on each rank; the per-parameter view a
checkpoint writes equals the replicated optimizer's state, and loading it back restores the
ranges (a resumed run continues the same update)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import two_gloo_ranks



def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (3,), (11, 2), (4, 4)]  # 35 + 3 + 22 + 16 = 76 elements: ranges of 38
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16)) for s in shapes]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in _params(0)]


def worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from training.distributed_optimizer import DistributedOptimizer
    from training.master_weights import make_optimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    mine, replicated = _params(0), _params(0)
    dist_opt = DistributedOptimizer(mine, dist.group.WORLD, lr=1e-2, weight_decay=0.1)
    ref = make_optimizer(replicated, torch.bfloat16, True, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        for p, q, g in zip(mine, replicated, _grads(step)):  # the summed gradients
            p.grad, q.grad = g.clone(), g.clone()
        dist_opt.step()
        ref.step()
    view = dist_opt.full_view()  # collective
    report = {
        "equal": all(torch.equal(p, q) for p, q in zip(mine, replicated)),
        "range": dist_opt.master[0].numel(),
        "view_master": all(torch.equal(m, r) for m, r in zip(view.master, ref.master)),
        "view_moments": all(
            torch.equal(view.optimizer.state[m][k], ref.optimizer.state[r][k])
            for m, r in zip(view.master, ref.master) for k in ("exp_avg", "exp_avg_sq")),
        "view_step": float(view.optimizer.state[view.master[0]]["step"]),
    }
    # a fresh optimizer loads the view (a resume) and takes the fourth step as the first did
    again = DistributedOptimizer(_params(1), dist.group.WORLD, lr=1e-2, weight_decay=0.1)
    with torch.no_grad():
        for p, m in zip(again.params, view.master):
            p.copy_(m)
    again.load_view(view)
    for p, q, g in zip(again.params, replicated, _grads(3)):
        p.grad, q.grad = g.clone(), g.clone()
    again.step()
    ref.step()
    report["resumed_equal"] = all(torch.equal(p, q) for p, q in zip(again.params, replicated))
    # the reduce-scatter path: each rank its own gradients, the sum and the clip (max norm 1)
    # done by the optimizer on its range, against the replicated fp32-master step on the sum
    mine, replicated = _params(2), _params(2)
    dist_opt = DistributedOptimizer(mine, dist.group.WORLD, lr=1e-2, weight_decay=0.1)
    ref = make_optimizer(replicated, torch.bfloat16, True, lr=1e-2, weight_decay=0.1)
    norms = []
    for step in range(3):
        per_rank = [_grads(10 * step + r) for r in range(2)]
        for p, g in zip(mine, per_rank[rank]):
            p.grad = g.clone()
        norms.append(dist_opt.reduce_and_clip(1.0))
        dist_opt.step()
        total = [a.float() + b.float() for a, b in zip(*per_rank)]
        norm = torch.sqrt(sum(t.square().sum() for t in total))
        for m, t in zip(ref.master, total):
            m.grad = t * min(1.0, 1.0 / (float(norm) + 1e-6))
        ref.step()
        norms.append(float(norm))
    report["rs_norms"] = norms
    report["rs_max_abs"] = max(float((p.float() - q.float()).abs().max())
                               for p, q in zip(mine, replicated))
    report["rs_main_max_abs"] = float((dist_opt.full_view().master[0] - ref.master[0]).abs().max())
    torch.save(report, f"{out}.{rank}")
    dist.destroy_process_group()


def test_two_ranks_step_half_the_state_each_and_match_the_replicated_update(tmp_path):
    for got in two_gloo_ranks("tests.test_distributed_optimizer", tmp_path):
        assert got["equal"] and got["resumed_equal"], got
        assert got["range"] == 38  # half of the 76 elements
        assert got["view_master"] and got["view_moments"] and got["view_step"] == 3.0
        # reduce-scattered and clipped by the optimizer: the replicated step up to the norm's
        # summation order (fp32 main weights within 1e-6; bf16 weights within one unit)
        norms = got["rs_norms"]
        for mine, want in zip(norms[::2], norms[1::2]):
            assert mine == pytest.approx(want, rel=1e-6) and want > 1.0  # clipping is on
        assert got["rs_main_max_abs"] < 1e-6, got
        assert got["rs_max_abs"] <= 2 ** -7, got


def test_it_is_refused_outside_megatron_and_without_main_weights():
    from actors.trainer import TrainerConfig
    from training.config import OptimizerConfig, ParallelConfig

    with pytest.raises(ValueError, match="needs backend = 'megatron'"):
        TrainerConfig(model="m", workers=["w"],
                      parallel=ParallelConfig(distributed_optimizer=True))
    with pytest.raises(ValueError, match="keeps fp32 main weights"):
        TrainerConfig(model="m", workers=["w"], backend="megatron", dtype="bfloat16",
                      megatron={"use_distributed_optimizer": True},
                      optimizer=OptimizerConfig(master_weights=False))
