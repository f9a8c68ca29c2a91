"""The megatron backend on two gloo processes: TP=2 against TP=1 and transformers, resharding a
distributed checkpoint, and pipeline-parallel (PP=2) steps through megatron's schedule (the
train step with `backends.megatron.pipeline.PipelineRunner`): plain GRPO, a KL loss term to a
reference, PPO with a critic and KL reward shaping, and a top-k OPD loss term, each equal to the
one-stage step on the transformers model.

One pair of child processes runs both layouts and reports tensors to the parent (rank 0 writes
them, the tests assert), so a failure shows here with its values and any rank's traceback.
"""

from __future__ import annotations

import importlib
import traceback
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import run_forked

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")

SPAWN_TIMEOUT_S = 100


def run_ranks(target: str, tmp_path: Path, world: int = 2, module: str = __name__,
              timeout_s: float = SPAWN_TIMEOUT_S, weights_only: bool = True) -> dict:
    """Run `module`'s `target`(rank, tmp_path) (default: this module's) on `world` child
    processes, each given `timeout_s`; rank 0's report (`weights_only = False`: a report that
    holds more than tensors and plain data)."""
    codes = run_forked(rank_main, lambda r: (target, r, world, str(tmp_path), module), world,
                       timeout_s, tmp_path)
    errors = [f.read_text() for f in sorted(tmp_path.glob("error-*.txt"))]
    assert not errors, "\n".join(errors)
    assert codes == [0] * world
    return torch.load(tmp_path / "report.pt", weights_only=weights_only)


def rank_main(target: str, rank: int, world: int, tmp: str, module: str = __name__) -> None:
    """Child entry: megatron on CPU over gloo, the traceback written for the parent on failure."""
    warnings.simplefilter("ignore")
    try:
        from backends.megatron import cpu_shim as shim

        shim.install()
        store = torch.distributed.FileStore(f"{tmp}/store", world)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world)
        report = getattr(importlib.import_module(module), target)(rank, Path(tmp))
        if rank == 0:
            torch.save(report, f"{tmp}/report.pt")
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(tmp, f"error-{rank}.txt").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def _step(name: str, grad_clip: float, **micro: object) -> dict:
    """One train_on_batch with SGD (lr 1) on this rank's megatron shard of tiny `name`
    (`micro`: micro_batches fields)."""
    from actors.trainer import TrainerConfig
    from backends.megatron.model import from_hf_model
    from models.tiny import build_char_tokenizer
    from tests.test_megatron_convert import hf_model
    from tests.test_megatron_model import batch
    from training.backends import get_backend
    from training.config import MicroBatchConfig, OptimizerConfig
    from training.step import TrainState, train_on_batch

    tok = build_char_tokenizer()
    model = from_hf_model(hf_model(name))
    state = TrainState(model, tok, torch.optim.SGD(model.parameters(), lr=1.0),
                       backend=get_backend("megatron"))
    cfg = TrainerConfig(model="x", workers=["w"], micro_batches=MicroBatchConfig(size=3, **micro),
                        optimizer=OptimizerConfig(grad_clip=grad_clip))
    stats = train_on_batch(state, batch(tok), cfg)
    return {"loss": stats["train/loss"], "model": model, "optimizer": state.optimizer,
            "norm": model.clip_grad_norm(0.0), "weights": model.hf_state_dict()}


def tensor_parallel_ranks(rank: int, tmp: Path) -> dict:
    from algos.logprobs import token_logprobs_and_entropy
    from backends.megatron import checkpoint
    from backends.megatron.model import from_hf_model, initialize_parallel, parallel_state
    from tests.test_megatron_convert import hf_model
    from tests.test_megatron_model import padded_batch

    initialize_parallel(2, 1)
    hf = hf_model("qwen2-untied")
    ids, mask = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        want = token_logprobs_and_entropy(hf, ids, mask)[0]
        got = token_logprobs_and_entropy(from_hf_model(hf), ids, mask)[0]
    tp2 = _step("qwen2-untied", grad_clip=0.0)
    heads = _head_steps()
    checkpoint.save_distributed(tp2["model"], tmp / "ckpt", tp2["optimizer"], step=1, version=1)
    shard_rows = tp2["model"].core.embedding.word_embeddings.weight.shape[0]
    parallel_state.destroy_model_parallel()
    initialize_parallel(1, 1)  # the same two ranks as TP=1 x DP=2
    tp1 = _step("qwen2-untied", grad_clip=0.0)
    heads1 = _head_steps()
    resharded = from_hf_model(hf_model("qwen2-untied", seed=7))
    meta = checkpoint.load_distributed(resharded, tmp / "ckpt")
    resharded_weights = resharded.hf_state_dict()
    parallel_state.destroy_model_parallel()
    real = (mask[:, 1:] * mask[:, :-1]).bool()
    return {"logprob_diff": (got - want).abs()[real].max(), "shard_rows": shard_rows,
            "loss": torch.tensor([tp2["loss"], tp1["loss"]]),
            "norm": torch.tensor([tp2["norm"], tp1["norm"]]),
            "tp2": tp2["weights"], "tp1": tp1["weights"], "resharded": resharded_weights,
            "step": meta["step"], "heads": heads, "heads1": heads1}


def _head_steps() -> dict:
    """Steps whose passes run the loss head over each tensor rank's vocabulary rows (one padded
    forward per micro-batch, or packed rows), and a top-k OPD term from teacher replies: their
    losses, norms and weights, and the row count and group the head saw."""
    import algos.loss_head as heads

    seen = []
    real = heads.head_logprobs

    def spy(*args, **kwargs):
        group = kwargs.get("group")
        seen.append((args[1].shape[0], 1 if group is None else group.size()))
        return real(*args, **kwargs)

    heads.head_logprobs = spy
    try:
        out = {}
        for name, micro in (("padded", dict(forward_by_length=False)), ("packed", dict(pack=True))):
            seen.clear()
            step = _step("qwen2-untied", grad_clip=0.0, **micro)
            out[name] = {"loss": step["loss"], "norm": step["norm"], "weights": step["weights"],
                         "head": seen[0]}
        from backends.megatron.model import from_hf_model
        from training.step import train_on_batch

        model = from_hf_model(hf_model_fresh())
        state, cfg, samples = _case_setup("opd_top_k", model)
        cfg = msgspec_replace(cfg, forward_by_length=False)
        stats = train_on_batch(state, samples, cfg)
        out["opd_top_k"] = {"loss": stats["train/loss"], "norm": stats["train/grad_norm"],
                            "weights": model.hf_state_dict()}
        return out
    finally:
        heads.head_logprobs = real


def msgspec_replace(cfg, **micro):
    import msgspec

    return msgspec.structs.replace(cfg, micro_batches=msgspec.structs.replace(
        cfg.micro_batches, **micro))


def both_layouts(rank: int, tmp: Path) -> dict:
    """TP=2 then PP=2 on the same two ranks (one process start-up for both tests)."""
    return {"tp": tensor_parallel_ranks(rank, tmp), "pp": pipeline_ranks(rank, tmp)}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    return run_ranks("both_layouts", tmp_path_factory.mktemp("ranks"))


def test_tensor_parallel_two_ranks_equal_one(reports):
    report = reports["tp"]
    assert report["shard_rows"] == 27  # the 54-token vocabulary split over two ranks
    assert report["logprob_diff"] < 1e-5
    tp2_loss, tp1_loss = report["loss"].tolist()
    assert tp2_loss == pytest.approx(tp1_loss, rel=1e-5)
    tp2_norm, tp1_norm = report["norm"].tolist()
    assert tp2_norm == pytest.approx(tp1_norm, rel=1e-5) and tp1_norm > 0.1
    for key, want in report["tp1"].items():
        assert (report["tp2"][key] - want).abs().max() < 1e-5, key
        assert torch.equal(report["resharded"][key], report["tp2"][key]), key
    assert report["step"] == 1
    for name in ("padded", "packed", "opd_top_k"):  # the loss head on each rank's rows
        two, one = report["heads"][name], report["heads1"][name]
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5), name
        assert two["norm"] == pytest.approx(one["norm"], rel=1e-5) and one["norm"] > 0.1, name
        for key, want in one["weights"].items():
            assert (two["weights"][key] - want).abs().max() < 1e-5, (name, key)
    for name in ("padded", "packed"):
        assert report["heads"][name]["head"] == (27, 2), name  # half the rows, over 2 ranks
        assert report["heads1"][name]["head"] == (54, 1), name


def _pipeline_setup():
    from actors.trainer import TrainerConfig
    from models.tiny import build_char_tokenizer
    from tests.test_megatron_convert import hf_model
    from tests.test_megatron_model import batch
    from training.config import MicroBatchConfig, OptimizerConfig

    tok = build_char_tokenizer()
    cfg = TrainerConfig(model="x", workers=["w"], micro_batches=MicroBatchConfig(size=3),
                        optimizer=OptimizerConfig(grad_clip=0.5))
    return hf_model("qwen2-untied"), tok, batch(tok), cfg


# the step's options that need a second model, each through the pipeline: (config changes,
# reference?, critic?); the reference and the critic are whole transformers models
PIPELINE_CASES = {
    "kl_loss": (dict(kl={"coef": 0.5, "use_kl_loss": True, "estimator": "k3"}), True, False),
    "ppo_kl_reward": (dict(loss={"advantage_estimator": "ppo", "gae_lambda": 1.0},
                           critic={"lr": 1e-2}, kl={"coef": 0.5, "in_reward": True}),
                      True, True),
    # a distribution OPD loss term (the response logits through the schedule): a teacher
    # server's top-k replies, taken from another random model
    "opd_top_k": (dict(opd={"mode": "top_k", "top_k": 5, "kl_coef": 1.0,
                            "top_k_from": "teacher"}), False, False),
}


def _case_setup(name: str, model, backend: str = "megatron"):
    """(state, cfg, samples) of PIPELINE_CASES[name] around `model` (a megatron stage, or the
    whole hf model with backend "torch"): a reference with other weights than the policy (else
    every KL is 0), a fresh critic, teacher top-k replies on the samples for OPD, SGD (lr 1)
    behind master weights."""
    import msgspec

    from tests.test_megatron_convert import hf_model
    from training.aux_models import AuxModel, CriticModel
    from training.backends import get_backend
    from training.master_weights import MasterWeightOptimizer
    from training.step import TrainState

    _, tok, samples, base = _pipeline_setup()
    changes, with_ref, with_critic = PIPELINE_CASES[name]
    cfg = msgspec.convert(msgspec.to_builtins(base) | changes, type(base))
    ref = AuxModel.frozen_copy(hf_model("qwen2-untied", seed=7), "cpu") if with_ref else None
    critic = (CriticModel(hf_model("qwen2-untied"), "cpu", cfg.critic) if with_critic
              else None)
    if cfg.opd is not None:
        teacher = hf_model("qwen2-untied", seed=11)
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            with torch.no_grad():
                lp = torch.log_softmax(teacher(input_ids=ids).logits[0, :-1].float(), -1)
            top = lp[len(s.prompt_ids) - 1:].topk(cfg.opd.top_k, dim=-1)
            s.teacher = "t"
            s.teacher_topk_ids = top.indices.numpy().astype("int32")  # as parse_scores gives
            s.teacher_topk_logprobs = top.values.numpy().astype("float32")
    # through fp32 master weights (in fp32 they change nothing numerically)
    opt = MasterWeightOptimizer(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=1.0))
    return TrainState(model, tok, opt, ref, critic, get_backend(backend)), cfg, samples


def pipeline_ranks(rank: int, tmp: Path) -> dict:
    from backends.megatron.model import from_hf_model, initialize_parallel, parallel_state
    from backends.megatron.pipeline import PipelineRunner
    from training.backends import get_backend
    from training.batching import make_micro_batch
    from training.step import TrainState, train_on_batch

    import algos.loss_head as heads

    initialize_parallel(1, 2)
    hf, tok, samples, cfg = _pipeline_setup()
    model = from_hf_model(hf)
    layers = list(model.layers)
    runner = PipelineRunner(model)
    calls = []  # the last stage's passes through the loss head (rows of its output weight)
    real = heads.head_logprobs
    heads.head_logprobs = lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k)
    try:
        logprobs = runner.logprobs([make_micro_batch(samples, tok.pad_token_id)], 1.0)
        state = TrainState(model, tok, torch.optim.SGD(model.parameters(), lr=1.0),
                           backend=get_backend("megatron"))
        stats = train_on_batch(state, samples, cfg, runner=runner)
    finally:
        heads.head_logprobs = real
    weights = model.hf_state_dict()
    cases = {}
    for name in PIPELINE_CASES:
        stage = from_hf_model(hf_model_fresh())
        case_state, case_cfg, case_samples = _case_setup(name, stage)
        case_stats = train_on_batch(case_state, case_samples, case_cfg,
                                    runner=PipelineRunner(stage))
        cases[name] = {"stats": case_stats, "weights": stage.hf_state_dict()}
    last = torch.empty(0) if logprobs is None else logprobs[0]
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, (layers, last, calls))
    parallel_state.destroy_model_parallel()
    return {"layers": [g[0] for g in gathered], "logprobs": gathered[1][1],
            "head_calls": [g[2] for g in gathered],
            "first_stage_logprobs": gathered[0][1], "stats": stats, "weights": weights,
            "cases": cases}


def hf_model_fresh():
    from tests.test_megatron_convert import hf_model

    return hf_model("qwen2-untied")


def test_pipeline_parallel_step_through_megatron_schedule_equals_torch_backend(reports):
    from training.batching import make_micro_batch
    from training.step import TrainState, forward, train_on_batch

    report = reports["pp"]
    assert report["layers"] == [[0], [1]]  # one layer per stage
    # the last stage's passes (log-probs, recompute, policy pass, after-step) through the head
    first, last = report["head_calls"]
    assert first == [] and len(last) >= 4 and set(last) == {54}
    hf, tok, samples, cfg = _pipeline_setup()
    state = TrainState(hf, tok, torch.optim.SGD(hf.parameters(), lr=1.0))
    mb = make_micro_batch(samples, tok.pad_token_id)
    with torch.no_grad():
        want_logprobs = forward(state, mb, 1.0)[0]
    assert report["first_stage_logprobs"].numel() == 0  # only the last stage has logits
    assert ((report["logprobs"] - want_logprobs).abs() * mb.mask).max() < 1e-5
    want = train_on_batch(state, samples, cfg)
    # rank 0 (the first stage) reports the statistics the last stage computed
    assert set(report["stats"]) == set(want)
    for key in ("train/loss", "train/grad_norm", "train/entropy", "train/policy_kl",
                "mismatch/abs_diff_mean"):
        assert report["stats"][key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert want["train/grad_norm"] > cfg.optimizer.grad_clip  # the clip was active on both
    for key, value in hf.state_dict().items():
        assert (report["weights"][key] - value).abs().max() < 1e-5, key


@pytest.mark.parametrize("name", sorted(PIPELINE_CASES))
def test_pipeline_step_with_a_reference_and_a_critic_equals_one_stage(reports, name):
    """The KL loss term (kl_loss), PPO with a critic and KL reward shaping (ppo_kl_reward), a
    top-k OPD loss term (opd_top_k): the PP=2 step equals the one-stage step on the
    transformers model."""
    from training.step import train_on_batch

    got = reports["pp"]["cases"][name]
    hf = hf_model_fresh()
    state, cfg, samples = _case_setup(name, hf, "torch")
    want = train_on_batch(state, samples, cfg)
    assert set(got["stats"]) == set(want)
    keys = ["train/loss", "train/grad_norm", "train/entropy", "train/policy_kl"]
    if cfg.kl.use_kl_loss:
        keys.append("train/kl_loss")
    if cfg.critic is not None:
        keys += ["train/value_loss", "train/critic_grad_norm"]
    if cfg.opd is not None:
        keys += ["opd/t/reverse_kl", "opd/t/tokens"]
        assert want["opd/t/tokens"] > 0
    for key in keys:
        # abs: a loss that cancels to ~0 (fp32 residue) has no relative precision
        assert got["stats"][key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    if cfg.kl.use_kl_loss:
        assert want["train/kl_loss"] > 1e-3  # the reference differs from the policy
    for key, value in hf.state_dict().items():
        assert (got["weights"][key] - value).abs().max() < 1e-5, key
