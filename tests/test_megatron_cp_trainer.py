"""Context parallelism (parallel.cp) in the megatron trainer: on two gloo ranks at cp = 2
(dp = 1) one `training.step.train_on_batch` of tiny Qwen3 (q/k norms) equals the one-rank step
(weights, loss, gradient norm, log-prob difference), replicated and with the distributed
optimizer; the HF export at cp = 2 is the model; the layouts the trainer cannot place are
refused at load.

One pair of child processes runs both layouts and reports tensors to the parent (rank 0 writes
them), so a failure shows here with its values and any rank's traceback.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import msgspec
import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")

from tests.test_megatron_parallel import run_ranks  # noqa: E402

SPAWN_TIMEOUT_S = 400  # two ranks, three steps each, on a loaded two-core machine
STATS = ("train/loss", "train/grad_norm", "train/logprob_abs_diff")


def _config(distributed: bool = False, cp: int = 1, pp: int = 1, head: bool = False):
    """head: one forward per micro-batch (not CPU fp32's by-length forwards, on logits), so the
    step's values come from the loss head over the gathered hidden states."""
    from actors.trainer import TrainerConfig
    from training.config import MicroBatchConfig, OptimizerConfig, ParallelConfig

    return TrainerConfig(model="x", workers=["w"], backend="megatron",
                         micro_batches=MicroBatchConfig(size=3,
                                                        forward_by_length=False if head else None),
                         optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.5),
                         parallel=ParallelConfig(cp=cp, pp=pp,
                                                 distributed_optimizer=distributed))


def _step(hf, dp, optimizer: str = "sgd", cp: int = 1, pp: int = 1, head: bool = False
          ) -> dict:
    """One train_on_batch (clipping on) on this rank's megatron model of `hf`: "sgd" (lr 1,
    the gradient itself in the weights), "adamw" / "distributed" (AdamW through
    training/setup.py's optimizer, replicated or the distributed optimizer)."""
    from backends.megatron.model import from_hf_model
    from models.tiny import build_char_tokenizer
    from tests.test_megatron_model import batch
    from training.backends import get_backend, model_runner
    from training.setup import build_optimizer
    from training.step import TrainState, train_on_batch

    tok = build_char_tokenizer()
    backend = get_backend("megatron")
    cfg = _config(optimizer == "distributed", cp, pp, head)
    model = from_hf_model(hf)
    opt = (torch.optim.SGD(model.parameters(), lr=1.0) if optimizer == "sgd"
           else build_optimizer(cfg, backend, model, torch.float32))
    state = TrainState(model, tok, opt, backend=backend)
    stats = train_on_batch(state, batch(tok), cfg, dp, model_runner(backend, cfg, model))
    return {"stats": torch.tensor([stats[k] for k in STATS], dtype=torch.float64),
            "weights": model.hf_state_dict(), "model": model, "optimizer": state.optimizer}


def cp_ranks(rank: int, tmp: Path) -> dict:
    """cp = 2 on both ranks (export, log-probs, the step replicated and distributed), then the
    same two ranks as dp = 2 running the whole batch each (the one-rank step)."""
    from algos.logprobs import token_logprobs_and_entropy
    from backends.megatron import checkpoint
    from backends.megatron.model import from_hf_model, initialize_parallel, parallel_state
    from backends.megatron.parallel import ExpertDataParallel
    from tests.test_megatron_convert import hf_model
    from tests.test_megatron_model import padded_batch
    from training.backends import get_backend
    from training.setup import build_optimizer

    hf = hf_model("qwen3")
    ids, mask = padded_batch(hf.config.vocab_size)
    initialize_parallel(1, 1, context_parallel_size=2)
    assert parallel_state.get_context_parallel_world_size() == 2
    model = from_hf_model(hf)
    with torch.no_grad():
        want = token_logprobs_and_entropy(hf, ids, mask)[0]
        got = token_logprobs_and_entropy(model, ids, mask)[0]
    real = (mask[:, 1:] * mask[:, :-1]).bool()
    report = {"logprob_diff": (got - want).abs()[real].max(), "export": model.hf_state_dict()}
    dp = ExpertDataParallel()
    report["dp_size"] = dp.world_size
    report["cp2"] = _step(hf, dp, cp=2)
    report["cp2_head"] = _step(hf, dp, cp=2, head=True)
    report["cp2_adamw"] = _step(hf, dp, "adamw", cp=2)
    report["cp2_distributed"] = _step(hf, ExpertDataParallel(), "distributed", cp=2)
    saved = report["cp2_distributed"]  # resumed below at cp = 1 (dp = 2)
    checkpoint.save_distributed(saved["model"], tmp / "ckpt", saved["optimizer"], step=1,
                                version=1)
    parallel_state.destroy_model_parallel()
    initialize_parallel(1, 1)  # dp = 2: each rank the whole batch alone (no reductions)
    report["cp1"] = _step(hf, None)
    report["cp1_head"] = _step(hf, None, head=True)
    report["cp1_adamw"] = _step(hf, None, "adamw")
    resumed = from_hf_model(hf_model("qwen3", seed=7))
    optimizer = build_optimizer(_config(True), get_backend("megatron"), resumed, torch.float32)
    report["resumed_step"] = checkpoint.load_distributed(resumed, tmp / "ckpt", optimizer)["step"]
    report["resumed"] = resumed.hf_state_dict()
    parallel_state.destroy_model_parallel()
    for part in report.values():
        if isinstance(part, dict):
            part.pop("model", None)
            part.pop("optimizer", None)
    report["hf"] = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return report


def tp_cp_ranks(rank: int, tmp: Path) -> dict:
    """tp = 2 x cp = 2 on four ranks (one replica), then the same ranks as dp = 4 (each the
    whole batch alone): the SGD step of each."""
    from backends.megatron.model import initialize_parallel, parallel_state
    from backends.megatron.parallel import ExpertDataParallel
    from tests.test_megatron_convert import hf_model

    hf = hf_model("qwen3")
    initialize_parallel(2, 1, context_parallel_size=2)
    report = {"tp2cp2": _step(hf, ExpertDataParallel(), cp=2)}
    parallel_state.destroy_model_parallel()
    initialize_parallel(1, 2, context_parallel_size=2)  # two stages, each over two CP ranks
    report["pp2cp2"] = _step(hf, ExpertDataParallel(), cp=2, pp=2)
    parallel_state.destroy_model_parallel()
    initialize_parallel(1, 1)
    report["cp1"] = _step(hf, None)
    report["cp1_head"] = _step(hf, None, head=True)
    parallel_state.destroy_model_parallel()
    for part in report.values():
        part.pop("model", None)
        part.pop("optimizer", None)
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_ranks("cp_ranks", tmp_path_factory.mktemp("cp"), world=2, module=__name__,
                     timeout_s=SPAWN_TIMEOUT_S)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_context_parallel_forward_and_export_equal_the_model(report):
    assert report["dp_size"] == 1  # the CP ranks are one replica
    assert report["logprob_diff"] < 1e-5
    hf = report["hf"]
    export = report["export"]
    assert set(export) == {k for k in hf if k != "lm_head.weight"} or set(export) == set(hf)
    for key, value in export.items():
        assert torch.equal(value, hf[key]), key


@pytest.mark.parametrize("kind, want, tolerance", [
    ("cp2", "cp1", 1e-5),  # SGD, lr 1: the weights carry the clipped gradient itself
    # the loss head over the gathered hidden states; its weight's gradient 1 / cp on each rank
    ("cp2_head", "cp1_head", 1e-5),
    # AdamW's first step is about lr * sign(gradient): elements whose gradient is near zero
    # move by up to lr on float-order noise, hence the looser bound (lr = 1e-2)
    ("cp2_adamw", "cp1_adamw", 1e-3),
    ("cp2_distributed", "cp1_adamw", 1e-3),
])
def test_context_parallel_step_equals_one_rank(report, kind, want, tolerance):
    got, want = report[kind], report[want]
    assert torch.allclose(got["stats"], want["stats"], rtol=1e-5, atol=1e-6), (
        dict(zip(STATS, got["stats"].tolist())), dict(zip(STATS, want["stats"].tolist())))
    assert want["stats"][1] > 0.5  # the clip applied (grad_clip = 0.5)
    assert _max_diff(got["weights"], want["weights"]) < tolerance
    start = {k: report["hf"][k] for k in want["weights"]}
    assert _max_diff(want["weights"], start) > 1e-3  # it moved


def test_a_cp_2_checkpoint_resumes_at_cp_1(report):
    """The distributed optimizer's checkpoint written at cp = 2 loads at cp = 1 (dp = 2)."""
    assert report["resumed_step"] == 1
    saved = report["cp2_distributed"]["weights"]
    for key, value in report["resumed"].items():
        assert torch.equal(value, saved[key]), key


def test_tensor_and_context_parallel_four_ranks_equal_one(tmp_path):
    """tp = 2 x cp = 2, and pp = 2 x cp = 2 through megatron's pipeline schedule (each stage
    sends its CP share of the activations), each equal to the one-rank step."""
    got = run_ranks("tp_cp_ranks", tmp_path, world=4, module=__name__,
                    timeout_s=SPAWN_TIMEOUT_S)
    for name in ("tp2cp2", "pp2cp2"):
        assert torch.allclose(got[name]["stats"], got["cp1"]["stats"], rtol=1e-5, atol=1e-6), \
            name
        assert _max_diff(got[name]["weights"], got["cp1"]["weights"]) < 1e-5, name


def _check(changes: dict, model: str = "examples/base-tiny") -> None:
    from actors.trainer import TrainerActor, TrainerConfig

    base = {"model": model, "workers": ["w"], "backend": "megatron", "device": "cuda:0"}
    TrainerActor.check_config(msgspec.convert(base | changes, TrainerConfig))


@pytest.mark.parametrize("changes, words", [
    ({"backend": "torch", "device": "cpu", "parallel": {"cp": 2}},
     r"parallel.cp = 2 needs backend = 'megatron'"),
    ({"parallel": {"cp": 2, "devices": ["cuda:0", "cuda:1", "cuda:2"]}},
     r"lists 3 devices, not a multiple of tp \* pp = 1 times cp = 2"),
    ({"parallel": {"cp": 2}, "megatron": {"context_parallel_size": 4}},
     r"context_parallel_size = 4 and parallel.cp = 2 conflict"),
    ({"parallel": {"cp": 2}, "megatron": {"sequence_parallel": True}},
     r"sequence_parallel needs Transformer Engine's norm layers"),
    ({"parallel": {"tp": 2}, "megatron": {"sequence_parallel": True}},
     r"unset sequence_parallel \(tensor parallelism runs without it\)"),
])
def test_context_parallel_placement_is_checked_at_load(changes, words):
    with pytest.raises(ValueError, match=words):
        _check(changes)


def test_context_parallel_with_a_mixture_of_experts_model_is_accepted():
    """cp with MoE (tests/test_megatron_moe.py runs it): accepted with and without ep, and ep
    must still divide dp * cp."""
    _check({"parallel": {"cp": 2}}, model="tiny-qwen3-moe")
    _check({"parallel": {"cp": 2, "ep": 2}}, model="tiny-qwen3-moe")
    with pytest.raises(ValueError, match=r"ep = 4"):
        _check({"parallel": {"cp": 2, "ep": 4}}, model="tiny-qwen3-moe")


def test_context_parallel_derives_the_data_parallel_size():
    from training.config import ParallelConfig

    par = ParallelConfig(cp=2, tp=2, devices=[f"cuda:{i}" for i in range(8)])
    assert (par.dp, par.world_size) == (2, 8)


@pytest.mark.timeout(400)
def test_context_parallel_trainer_from_hosts_toml_resumes_at_another_cp(tmp_path):
    """examples/moe-tiny with `parallel = { cp = 2, ep = 2 }` from hosts.toml (two trainer
    ranks, one replica: each sequence split over them, each holding half of the experts, the
    workers' routes replayed; tests/test_megatron_moe.py `moe_run_and_resume`): resumed at
    cp = ep = 1 on one rank it continues from the cp = 2 checkpoint."""
    from tests.test_megatron_moe import moe_run_and_resume

    steps = moe_run_and_resume(tmp_path, (4, "cp = 2, ep = 2"), (5, "cp = 1, ep = 1"))
    assert [v.get("train/cp_size") for v in steps] == [2.0] * 4 + [None]
    assert [v.get("train/ep_size") for v in steps] == [2.0] * 4 + [None]
