"""Mixture-of-experts on the megatron backend (tiny-qwen3-moe and a tiny GLM-4.5 layout: shared
experts, a dense first layer, sigmoid routing with a score correction bias; fp32, CPU over
gloo): HF <->
megatron conversion at every expert layout, logits against transformers, routing replay against
the torch backend's (models/moe.py `Routing`), one train step (routing replay and the
load-balancing loss on) at ep = 2, tp = 2 and pp = 2 against the torch backend's step, resuming
a checkpoint across expert layouts, and the placement errors.

The multi-rank parts run in child processes (tests/test_megatron_parallel.py `rank_main`), each
layout in turn on the same ranks; rank 0 reports tensors and the tests here assert on them.
tp = 2 x ep = 2 needs four processes: it runs in its own launch (`four_ranks`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")

from backends.megatron.convert import (
    hf_to_megatron,
    layout_from_hf,
    megatron_to_hf,
)
from models.moe import NO_ROUTE, Routing, checkpoint_tensors, moe_shape, routes_array
from models.tiny import build_char_tokenizer, tiny_config
from tests.helpers import trainer_steps
from tests.test_megatron_parallel import run_ranks as spawn_ranks

SPAWN_TIMEOUT_S = 540
# the first test of a module fixture runs its ranks' whole report: 32 s on a quiet 2-core machine,
# over the suite's 120 s beside two busy loops
pytestmark = pytest.mark.timeout(360)
NAME = "tiny-qwen3-moe"
ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# shared fixtures of the parent and the ranks
# ---------------------------------------------------------------------------------------------

def glm_config():
    """GLM-4.5's layout at tiny size: 4 layers (the first dense), 4 routed experts (top 2) and
    a shared one, sigmoid scores with a correction bias, scaled weights, q/k/v biases, RoPE on
    half of each head."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=54, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=False, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "rope_type": "default"})


def model_config(kind: str):
    return glm_config() if kind == "glm" else tiny_config(NAME)


def moe_model(seed: int = 0, kind: str = "qwen"):
    """A tiny MoE transformers model (kind "qwen": tiny-qwen3-moe, "glm": `glm_config`) with
    non-trivial norms, biases and score corrections, and decisive routers (router weights of
    std 1: no near-ties between experts, whose order float rounding could flip)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.normal_(1.0, 0.1)
            elif key.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif key.endswith("bias"):
                p.normal_(0.0, 0.1)
        for key, b in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model


def hf_checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint (per-expert) names, tied lm_head left out."""
    out = {k: v.clone() for k, v in checkpoint_tensors(model.state_dict().items())}
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of lengths 9, 6, 3, right-padded to 9 (as the trainer pads)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 9), generator=gen)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for row, n in enumerate((9, 6, 3)):
        mask[row, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def random_routes(shape, rows: int, width: int, seed: int) -> torch.Tensor:
    """[rows, width, layers, k] distinct random expert ids per token and layer."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, width, shape.num_layers, shape.num_experts, generator=gen)
    return scores.argsort(-1)[..., :shape.top_k].to(torch.int32)


def own_routes(hf, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The routes the transformers model chooses itself, NO_ROUTE on the padding."""
    shape = moe_shape(hf.config)
    routing = Routing(hf)
    routing.record = True
    with torch.no_grad():
        hf(input_ids=ids, attention_mask=mask)
    routing.close()
    out = routes_array(routing.recorded, shape).reshape(*ids.shape, shape.num_layers,
                                                        shape.top_k)
    return out.masked_fill(~mask.bool()[:, :, None, None], NO_ROUTE)


def samples_with_routes(tok, shape) -> list:
    """Two GRPO groups of two answers, each sample with engine routes for all but its last
    position (the last of the second group's samples without any)."""
    from tests.test_megatron_model import batch

    out = batch(tok)
    gen = np.random.default_rng(3)
    for i, s in enumerate(out):
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        scores = gen.random((n, shape.num_layers, shape.num_experts))
        if i < 3:
            s.routed_experts = scores.argsort(-1)[..., :shape.top_k].astype(np.uint8)
    return out


def step_config(micro_batch_size: int = 1):
    from actors.trainer import TrainerConfig
    from training.config import MicroBatchConfig, MoeConfig, OptimizerConfig

    return TrainerConfig(model="x", workers=["w"],
                         micro_batches=MicroBatchConfig(size=micro_batch_size),
                         optimizer=OptimizerConfig(grad_clip=0.0),
                         moe=MoeConfig(routing_replay="rollout", aux_loss_coef=0.05))


# ---------------------------------------------------------------------------------------------
# the ranks
# ---------------------------------------------------------------------------------------------

def run_ranks(target: str, tmp_path: Path, world: int) -> dict:
    """`target`(rank, tmp) of this module on `world` child processes; rank 0's report."""
    return spawn_ranks(target, tmp_path, world, __name__, SPAWN_TIMEOUT_S, weights_only=False)


def _layout_checks(hf, with_step: bool = True) -> dict:
    """At the current parallel state: the HF export, logits, routing replay, one train step."""
    from backends.megatron.model import MegatronRouting, from_hf_model

    model = from_hf_model(hf)
    out: dict = {"weights": model.hf_state_dict()}
    ids, mask = padded_batch(hf.config.vocab_size)
    shape = moe_shape(hf.config)
    routing = MegatronRouting(model)
    with torch.no_grad():
        out["logits"] = model(ids, attention_mask=mask).logits
        out["plain_stats"] = routing.take_stats()
        routing.replay = True
        routing.set_batch([(own_routes(hf, ids, mask), mask.bool())])
        out["own_logits"] = model(ids, attention_mask=mask).logits
        routing.clear()
        out["own_stats"] = routing.take_stats()
    routes = random_routes(shape, *ids.shape, seed=5)
    routing.set_batch([(routes, mask.bool())])
    logits = model(ids, attention_mask=mask).logits
    (logits * mask[:, :, None]).sum().backward()
    routing.clear()
    out["other_stats"] = routing.take_stats()
    routing.set_batch([(routes, mask.bool())])
    with torch.no_grad(), routing.select(torch.tensor([1, 2]), 6):  # a forward per length
        out["select_logits"] = model(ids[1:, :6], attention_mask=mask[1:, :6]).logits
    routing.clear()
    out["other_logits"] = logits.detach()
    out["router_grads"] = [float(layer.mlp.router.weight.grad.abs().sum())
                           for layer in model.core.decoder.layers if hasattr(layer.mlp, "router")]
    routing.close()
    if with_step:
        out["step"] = _train_step(hf)
    return out


def _train_step(hf) -> dict:
    """One train_on_batch (SGD, lr 1; routing replay and the load-balancing loss on) on this
    rank's shard, gradients summed over the data-parallel ranks expert-aware."""
    from backends.megatron.model import from_hf_model, parallel_state
    from backends.megatron.parallel import ExpertDataParallel
    from backends.megatron.pipeline import PipelineRunner
    from training.backends import get_backend, model_runner
    from training.moe import attach
    from training.step import TrainState, train_on_batch

    tok = build_char_tokenizer()
    cfg = step_config()
    model = from_hf_model(hf)
    backend = get_backend("megatron")
    attach(model, backend.routing(model))
    state = TrainState(model, tok, torch.optim.SGD(model.parameters(), lr=1.0), backend=backend)
    runner = PipelineRunner(model) if parallel_state.get_pipeline_model_parallel_world_size() \
        > 1 else model_runner(backend, cfg, model)
    dp = ExpertDataParallel()
    stats = train_on_batch(state, samples_with_routes(tok, moe_shape(hf.config)), cfg, dp,
                           runner)
    return {"stats": stats, "weights": model.hf_state_dict(), "model": model,
            "optimizer": state.optimizer}


def two_ranks(rank: int, tmp: Path) -> dict:
    """ep = 1 (dp = 2), ep = 2, tp = 2 and pp = 2 on the same two ranks; checkpoints saved at
    ep = 2 resumed at ep = 1 and the other way."""
    from backends.megatron import checkpoint
    from backends.megatron.model import from_hf_model, initialize_parallel, parallel_state
    from tests import megatron_moe_shim

    megatron_moe_shim.install()
    hf = moe_model()
    report: dict = {}
    for name, (tp, pp, ep) in {"ep1": (1, 1, 1), "ep2": (1, 1, 2), "tp2": (2, 1, 1),
                               "pp2": (1, 2, 1)}.items():
        initialize_parallel(tp, pp, expert_model_parallel_size=ep)
        if pp == 1:
            report[name] = _layout_checks(hf)
        else:
            report[name] = {"weights": from_hf_model(hf).hf_state_dict(),
                            "step": _train_step(hf)}
        if name == "tp2":  # the distributed optimizer completes q/k norm gradients too
            report[name]["distributed_optimizer"] = _optimizer_paths(hf)
        if name == "ep2":  # the experts' optimizer state sharded over their own group
            from backends.megatron.parallel import ExpertDataParallel
            report[name]["distributed_optimizer"] = _optimizer_paths(
                hf, {"dp": 2, "ep": 2}, ExpertDataParallel())
        if ep == 2:  # a checkpoint after the step, resumed at ep = 1 below
            step = report[name]["step"]
            checkpoint.save_distributed(step["model"], tmp / "ckpt-ep2", step["optimizer"],
                                        step=1, version=1)
            adam = _adam_state(step["model"])
            checkpoint.save_distributed(step["model"], tmp / "ckpt-adam-ep2", adam)
        if name == "ep1":
            step = report[name]["step"]
            checkpoint.save_distributed(step["model"], tmp / "ckpt-ep1", step["optimizer"],
                                        step=1, version=1)
            fresh = from_hf_model(moe_model(seed=7))
            report["ep1"]["unloaded"] = fresh.hf_state_dict()
        for part in report[name].get("step", {}), :
            part.pop("model", None)
            part.pop("optimizer", None)
        parallel_state.destroy_model_parallel()
    # context parallelism: each rank its two load-balanced chunks of every sequence, the
    # experts whole on both (cp2) or split over the two CP ranks (cp2ep2)
    for name, ep in {"cp2": 1, "cp2ep2": 2}.items():
        initialize_parallel(1, 1, expert_model_parallel_size=ep, context_parallel_size=2)
        report[name] = _layout_checks(hf)
        report[name]["step"].pop("model")
        report[name]["step"].pop("optimizer")
        parallel_state.destroy_model_parallel()
    # the GLM-4.5 layout: ep = 2 and pp = 2 (a dense and a MoE layer per stage)
    for name, (pp, ep) in {"glm_ep2": (1, 2), "glm_pp2": (2, 1)}.items():
        initialize_parallel(1, pp, expert_model_parallel_size=ep)
        glm = moe_model(kind="glm")
        report[name] = (_layout_checks(glm) if pp == 1 else
                        {"weights": from_hf_model(glm).hf_state_dict(), "step": _train_step(glm)})
        report[name]["step"].pop("model")
        report[name]["step"].pop("optimizer")
        parallel_state.destroy_model_parallel()
    # resume across expert layouts: ep = 2's checkpoint at ep = 1, ep = 1's at ep = 2
    for name, (ep, directory) in {"ep2_at_ep1": (1, "ckpt-ep2"),
                                  "ep1_at_ep2": (2, "ckpt-ep1")}.items():
        initialize_parallel(1, 1, expert_model_parallel_size=ep)
        model = from_hf_model(moe_model(seed=7))
        meta = checkpoint.load_distributed(model, tmp / directory)
        report[name] = {"weights": model.hf_state_dict(), "step": meta["step"]}
        if ep == 1:  # AdamW's moments follow their experts to the other layout
            adam = _adam_template(model)
            checkpoint.load_distributed(model, tmp / "ckpt-adam-ep2", adam)
            report[name]["adam_misfit"] = _adam_misfit(model, adam)
        parallel_state.destroy_model_parallel()
    return report


def _optimizer_paths(hf, parallel: dict | None = None, dp=None) -> dict:
    """One AdamW step through training/setup.py's optimizer (clipping on) replicated and with
    the distributed optimizer at `parallel` (default tp = 2, dp = 1), the gradients summed over
    `dp` on the replicated path: the weights after each, and each step's gradient norm."""
    import msgspec

    from backends.megatron.model import from_hf_model
    from training.backends import get_backend, model_runner
    from training.config import OptimizerConfig, ParallelConfig
    from training.moe import attach
    from training.setup import build_optimizer
    from training.step import TrainState, train_on_batch

    tok = build_char_tokenizer()
    backend = get_backend("megatron")
    out = {}
    for kind in ("replicated", "distributed"):
        cfg = msgspec.structs.replace(
            step_config(), backend="megatron", optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.5),
            parallel=ParallelConfig(**(parallel or {"tp": 2}),
                                    distributed_optimizer=kind == "distributed"))
        model = from_hf_model(hf)
        attach(model, backend.routing(model))
        state = TrainState(model, tok, build_optimizer(cfg, backend, model, torch.float32),
                           backend=backend)
        stats = train_on_batch(state, samples_with_routes(tok, moe_shape(hf.config)), cfg, dp,
                               model_runner(backend, cfg, model))
        out[kind] = model.hf_state_dict()
        out[f"{kind}_norm"] = stats["train/grad_norm"]
        out[f"{kind}_optimizer"] = type(state.optimizer).__name__
    return out


def _adam_state(model):
    """An AdamW state whose first moment is 0.1 x each parameter: one step (lr 0) on gradients
    equal to the weights."""
    from training.master_weights import as_train_optimizer

    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    for p in model.parameters():
        p.grad = p.detach().clone()
    opt.step()
    return as_train_optimizer(opt)


def _adam_template(model):
    from training.master_weights import as_train_optimizer

    return as_train_optimizer(torch.optim.AdamW(model.parameters(), lr=0.0))


def _adam_misfit(model, adam) -> float:
    """max |exp_avg - 0.1 x parameter| over every rank's parameters (0: each moment came back
    with its own expert)."""
    worst = torch.zeros(())
    for p in model.parameters():
        moment = adam.optimizer.state[p]["exp_avg"]
        worst = torch.maximum(worst, (moment - 0.1 * p.detach()).abs().max())
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    return float(worst)


def four_ranks(rank: int, tmp: Path) -> dict:
    """tp = 2 x ep = 2 (dp = 2) on four ranks."""
    from backends.megatron.model import initialize_parallel, parallel_state
    from tests import megatron_moe_shim

    megatron_moe_shim.install()
    initialize_parallel(2, 1, expert_model_parallel_size=2)
    report = {"tp2ep2": _layout_checks(moe_model())}
    report["tp2ep2"]["step"].pop("model")
    report["tp2ep2"]["step"].pop("optimizer")
    parallel_state.destroy_model_parallel()
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    return run_ranks("two_ranks", tmp_path_factory.mktemp("moe2"), world=2)


@pytest.fixture(scope="module")
def reports4(tmp_path_factory) -> dict:
    return run_ranks("four_ranks", tmp_path_factory.mktemp("moe4"), world=4)


# ---------------------------------------------------------------------------------------------
# what the torch backend gives on the same weights
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def want() -> dict:
    return _want("qwen")


@pytest.fixture(scope="module")
def want_glm() -> dict:
    return _want("glm")


def _want(kind: str) -> dict:
    from training.backends import get_backend
    from training.moe import attach
    from training.step import TrainState, train_on_batch

    hf = moe_model(kind=kind)
    ids, mask = padded_batch(hf.config.vocab_size)
    shape = moe_shape(hf.config)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask).logits
        routing = Routing(hf)
        routing.replay = True
        routing.set_batch([(random_routes(shape, *ids.shape, seed=5), mask.bool())])
        other = hf(input_ids=ids, attention_mask=mask).logits
        other_stats = routing.take_stats()
        with routing.select(torch.tensor([1, 2]), 6):
            selected = hf(input_ids=ids[1:, :6], attention_mask=mask[1:, :6]).logits
        routing.close()
    tok = build_char_tokenizer()
    model = moe_model(kind=kind)
    backend = get_backend("torch")
    attach(model, backend.routing(model))
    state = TrainState(model, tok, torch.optim.SGD(model.parameters(), lr=1.0), backend=backend)
    stats = train_on_batch(state, samples_with_routes(tok, shape), step_config())
    return {"weights": hf_checkpoint_tensors(hf), "logits": logits, "other_logits": other,
            "select_logits": selected,
            "other_stats": other_stats, "mask": mask.bool(), "step_stats": stats,
            "step_weights": hf_checkpoint_tensors(model)}


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4)])
def test_conversion_round_trip_is_bit_exact(tp, ep):
    hf = hf_checkpoint_tensors(moe_model())
    layout = layout_from_hf(tiny_config(NAME))
    shards = [[hf_to_megatron(hf, layout, r, tp, ep_rank=q, ep=ep) for r in range(tp)]
              for q in range(ep)]
    assert len([k for k in shards[-1][0] if ".local_experts." in k and "fc1" in k]) == \
        layout.num_layers * layout.num_experts // ep
    back = megatron_to_hf(shards[0], layout, expert_shards=shards)
    assert sorted(back) == sorted(hf)
    for key, value in hf.items():
        assert torch.equal(back[key], value), key


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 2), (1, 4)])
def test_glm_layout_round_trip_is_bit_exact(tp, ep):
    """Shared experts, the expert score correction bias, a dense first layer, q/k/v biases."""
    hf = hf_checkpoint_tensors(moe_model(kind="glm"))
    layout = layout_from_hf(glm_config())
    assert layout.moe_layers == (1, 2, 3) and layout.shared_ffn_hidden_size == 32
    shards = [[hf_to_megatron(hf, layout, r, tp, ep_rank=q, ep=ep) for r in range(tp)]
              for q in range(ep)]
    assert "decoder.layers.0.mlp.linear_fc2.weight" in shards[0][0]  # the dense layer
    assert "decoder.layers.1.mlp.router.expert_bias" in shards[0][0]
    back = megatron_to_hf(shards[0], layout, expert_shards=shards)
    assert sorted(back) == sorted(hf)
    for key, value in hf.items():
        assert torch.equal(back[key], value), key


def test_conversion_round_trip_over_pipeline_stages():
    hf = hf_checkpoint_tensors(moe_model())
    layout = layout_from_hf(tiny_config(NAME))
    first = hf_to_megatron(hf, layout, layers=range(0, 1), first=True, last=False, ep_rank=1,
                           ep=2)
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight" in first
    back = {}
    for layers, first, last in ((range(0, 1), True, False), (range(1, 2), False, True)):
        shards = [[hf_to_megatron(hf, layout, 0, 1, layers, first, last, ep_rank=q, ep=2)]
                  for q in range(2)]
        back |= megatron_to_hf(shards[0], layout, layers, first, last, expert_shards=shards)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_expert_rows_of_each_rank():
    """Expert e of 4 at ep = 2 is local expert e mod 2 of rank e // 2; its fc1 is [gate; up]
    (split over the expert tensor ranks like a dense MLP's), its fc2 split by columns."""
    hf = hf_checkpoint_tensors(moe_model())
    layout = layout_from_hf(tiny_config(NAME))
    own = hf_to_megatron(hf, layout, 1, 2, ep_rank=1, ep=2)
    gate = hf["model.layers.1.mlp.experts.3.gate_proj.weight"]
    up = hf["model.layers.1.mlp.experts.3.up_proj.weight"]
    down = hf["model.layers.1.mlp.experts.3.down_proj.weight"]
    prefix = "decoder.layers.1.mlp.experts.local_experts.1."
    assert torch.equal(own[prefix + "linear_fc1.weight"], torch.cat([gate[32:], up[32:]]))
    assert torch.equal(own[prefix + "linear_fc2.weight"], down[:, 32:])
    assert torch.equal(own["decoder.layers.1.mlp.router.weight"],
                       hf["model.layers.1.mlp.gate.weight"])


LAYOUTS = ["ep1", "ep2", "tp2", "cp2", "cp2ep2"]


@pytest.mark.parametrize("name", LAYOUTS + ["pp2"])
def test_hf_export_is_bit_exact(reports, want, name):
    got = reports[name]["weights"]
    assert sorted(got) == sorted(want["weights"])
    for key, value in want["weights"].items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("name", LAYOUTS)
def test_logits_equal_transformers(reports, want, name):
    got, mask = reports[name], want["mask"]
    assert (got["logits"] - want["logits"]).abs()[mask].max() < 1e-5
    assert got["plain_stats"] == {}  # forwards outside set_batch are not counted


@pytest.mark.parametrize("name", LAYOUTS)
def test_replaying_own_routes_changes_nothing(reports, want, name):
    got, mask = reports[name], want["mask"]
    assert (got["own_logits"] - got["logits"]).abs()[mask].max() < 1e-6
    assert got["own_stats"]["moe/route_mismatch"] == 0.0
    assert got["own_stats"]["moe/route_mismatch_tokens"] == 0.0


@pytest.mark.parametrize("name", LAYOUTS)
def test_replaying_other_routes_matches_the_torch_backend(reports, want, name):
    got, mask = reports[name], want["mask"]
    assert (got["other_logits"] - got["logits"]).abs()[mask].max() > 1e-2  # routes mattered
    assert (got["other_logits"] - want["other_logits"]).abs()[mask].max() < 1e-5
    for key, value in want["other_stats"].items():
        assert got["other_stats"][key] == pytest.approx(value, rel=1e-6), key
    assert all(g > 0 for g in got["router_grads"])  # weights recomputed from the logits
    # rows 1 and 2 cut to 6 tokens (`select`): the same routes at the same positions
    sel = mask[1:, :6]
    assert (got["select_logits"] - want["select_logits"]).abs()[sel].max() < 1e-5


@pytest.mark.parametrize("name", LAYOUTS + ["pp2"])
def test_train_step_equals_the_torch_backend(reports, want, name):
    """Routing replay and the load-balancing loss on: the weights after one SGD step."""
    got = reports[name]["step"]
    assert got["stats"]["train/loss"] == pytest.approx(want["step_stats"]["train/loss"],
                                                       rel=1e-5, abs=1e-6)
    assert _max_diff(got["weights"], want["step_weights"]) < 1e-5
    assert "moe/route_mismatch" in got["stats"] and "moe/aux_loss" in got["stats"]


def test_the_distributed_optimizer_completes_tensor_partial_gradients(reports):
    """At tp = 2 the q/k norms' gradients are partial per tensor rank: the distributed
    optimizer's step sums them as the replicated step does (same weights after AdamW)."""
    paths = reports["tp2"]["distributed_optimizer"]
    assert any("q_norm" in n for n in paths["replicated"])
    assert _max_diff(paths["replicated"], paths["distributed"]) < 1e-6


def test_the_distributed_optimizer_with_expert_parallelism(reports):
    """At dp = 2, ep = 2 the dense parameters' AdamW state is sharded over both ranks and each
    expert's over its expert data-parallel group (training/distributed_optimizer.py
    `DistributedOptimizers`): the same weights and the same global gradient norm (dense and
    expert squares together) as the replicated step."""
    paths = reports["ep2"]["distributed_optimizer"]
    assert paths["distributed_optimizer"] == "DistributedOptimizers"
    assert paths["replicated_norm"] > 0.5  # clipped: the norm decides the update's scale
    assert paths["distributed_norm"] == pytest.approx(paths["replicated_norm"], rel=1e-5)
    assert any(".experts." in n for n in paths["replicated"])
    assert _max_diff(paths["replicated"], paths["distributed"]) < 1e-6


def test_checkpoint_resumes_across_expert_layouts(reports):
    assert _max_diff(reports["ep1"]["unloaded"], reports["ep2"]["step"]["weights"]) > 1e-3
    for name, source in (("ep2_at_ep1", "ep2"), ("ep1_at_ep2", "ep1")):
        got, saved = reports[name]["weights"], reports[source]["step"]["weights"]
        assert sorted(got) == sorted(saved)
        assert all(torch.equal(got[k], saved[k]) for k in saved), name
        assert reports[name]["step"] == 1
    assert reports["ep2_at_ep1"]["adam_misfit"] < 1e-7


def test_tensor_and_expert_parallel_four_ranks(reports4, want):
    got, mask = reports4["tp2ep2"], want["mask"]
    assert all(torch.equal(got["weights"][k], v) for k, v in want["weights"].items())
    assert (got["logits"] - want["logits"]).abs()[mask].max() < 1e-5
    assert (got["own_logits"] - got["logits"]).abs()[mask].max() < 1e-6
    assert (got["other_logits"] - want["other_logits"]).abs()[mask].max() < 1e-5
    assert _max_diff(got["step"]["weights"], want["step_weights"]) < 1e-5


def test_placement_errors_name_the_numbers():
    import msgspec

    from actors.trainer import TrainerConfig
    from training.backends import get_backend

    def check(**changes):
        base = dict(model=NAME, workers=["w"], backend="megatron", device="cuda")
        get_backend("megatron").check_config(msgspec.convert(base | changes, TrainerConfig))

    check(parallel={"ep": 2, "dp": 2})  # accepted
    check(parallel={"ep": 4, "dp": 4, "tp": 2})
    with pytest.raises(ValueError, match=r"parallel.ep = 3 .*4 experts per layer do not split "
                                         r"evenly over ep = 3"):
        check(parallel={"ep": 3, "dp": 3})
    with pytest.raises(ValueError, match=r"ep = 2\) needs a mixture-of-experts model; this "
                                         r"one is dense"):
        check(model="tiny-qwen3", parallel={"ep": 2, "dp": 2})
    check(parallel={"ep": 2, "dp": 2, "distributed_optimizer": True})  # accepted now
    with pytest.raises(ValueError, match=r"lora on a mixture-of-experts model.*ep = 2"):
        check(parallel={"ep": 2, "dp": 2}, lora={"rank": 4, "target_modules": ["q_proj"]})
    check(lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]})
    with pytest.raises(ValueError, match=r"\['up_proj'\] are expert MLPs"):
        check(lora={"rank": 4, "target_modules": ["q_proj", "up_proj"]})
    with pytest.raises(ValueError, match="routing_replay with megatron recomputation"):
        check(parallel={"pp": 2}, moe={"routing_replay": "rollout"},
              megatron={"recompute_granularity": "full"})
    with pytest.raises(Exception, match=r"parallel.ep = 2 must divide dp \* cp = 1"):
        check(parallel={"ep": 2})
    with pytest.raises(ValueError, match="activation_checkpointing with a mixture-of-experts"):
        check(activation_checkpointing=True)


def test_unsupported_expert_layouts_and_options_are_refused():
    from transformers import Qwen2MoeConfig

    from backends.megatron.model import split_options

    config = glm_config()
    config.norm_topk_prob = False
    with pytest.raises(ValueError, match="norm_topk_prob = false with sigmoid routing"):
        layout_from_hf(config)
    config = glm_config()
    config.n_group, config.topk_group = 2, 2
    with pytest.raises(ValueError, match=r"n_group = 2, topk_group = 2, num_experts_per_tok = "
                                         r"2: megatron scores a group by its top"):
        layout_from_hf(config)
    other = Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, hidden_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"'qwen2_moe'.*Qwen3MoeForCausalLM"):
        layout_from_hf(other)
    for key in ("num_moe_experts", "moe_router_topk", "expert_model_parallel_size"):
        with pytest.raises(ValueError, match=f"{key}.*set from the HF config / parallel"):
            split_options({key: 2})


def test_glm_layout_on_two_ranks(reports, want_glm):
    """ep = 2: the HF export, logits, routing replay against the torch backend's, the train
    step; pp = 2 (a dense and a MoE layer per stage): the export and the train step."""
    mask = want_glm["mask"]
    for name in ("glm_ep2", "glm_pp2"):
        got = reports[name]
        assert sorted(got["weights"]) == sorted(want_glm["weights"])
        assert all(torch.equal(got["weights"][k], v) for k, v in want_glm["weights"].items())
        assert _max_diff(got["step"]["weights"], want_glm["step_weights"]) < 1e-5, name
    got = reports["glm_ep2"]
    assert (got["logits"] - want_glm["logits"]).abs()[mask].max() < 1e-5
    assert (got["own_logits"] - got["logits"]).abs()[mask].max() < 1e-6
    assert (got["other_logits"] - got["logits"]).abs()[mask].max() > 1e-2
    assert (got["other_logits"] - want_glm["other_logits"]).abs()[mask].max() < 1e-5
    for key, value in want_glm["other_stats"].items():
        assert got["other_stats"][key] == pytest.approx(value, rel=1e-6), key
    assert len(got["router_grads"]) == 3 and all(g > 0 for g in got["router_grads"])


def trainer_state_one_rank(rank: int, tmp: Path) -> dict:
    """The trainer's own setup (training/setup.py load_train_state) of a megatron MoE policy on
    one rank: its routing object, the weights it pushes, a checkpoint and its resume."""
    from actors.trainer import TrainerConfig
    from tests import megatron_moe_shim
    from training.moe import routing_of
    from training.setup import load_train_state

    megatron_moe_shim.install()
    cfg = TrainerConfig(model=NAME, workers=["w"], backend="megatron",
                        moe={"routing_replay": "rollout"})
    state = load_train_state(cfg, str(tmp), resume=False)
    routing = routing_of(state.model)
    named = dict(state.named_weights())
    with torch.no_grad():
        state.model.core.decoder.layers[1].mlp.experts.local_experts[3].linear_fc2.weight.add_(
            0.5)
    state.step = 2
    state.save(tmp / "checkpoints" / "step_000002")
    resumed = load_train_state(cfg, str(tmp), resume=True)
    return {"routing": type(routing).__name__, "named": named, "step": resumed.step,
            "resumed": dict(resumed.named_weights())}


def test_trainer_setup_routing_push_names_and_resume(tmp_path):
    from models.tiny import build_tiny

    report = run_ranks("trainer_state_one_rank", tmp_path, world=1)
    assert report["routing"] == "MegatronRouting"
    hf, _ = build_tiny(NAME, seed=0)
    want = hf_checkpoint_tensors(hf)
    assert sorted(report["named"]) == sorted(want)  # the per-expert checkpoint names
    assert all(torch.equal(report["named"][k], v) for k, v in want.items())
    assert report["step"] == 2
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert torch.equal(report["resumed"][key], want[key] + 0.5)


# ---------------------------------------------------------------------------------------------
# through the launcher
# ---------------------------------------------------------------------------------------------

MOE_HOSTS = """
[run]
name = "moe-parallel"
shutdown_timeout_s = 5.0
plots = false

[rl]
model = "{model}"
workers = 1
group_size = 8
groups_per_batch = 8
max_staleness = 0
num_steps = {steps}
lr = 3e-4
micro_batch_size = 64
save_every = {save_every}
eval_every = 1000
eval_tasks = 20
moe = {{ routing_replay = "rollout" }}
envs = [{{ cls = "envs.builtin.arith:ArithEnv", options = {{ max_operand = 9 }} }}]

[actors.trainer.config]
backend = "megatron"
parallel = {{ {parallel} }}
"""


def moe_run_and_resume(tmp_path: Path, first: tuple[int, str], then: tuple[int, str]
                       ) -> list[dict]:
    """examples/moe-tiny on the megatron backend from hosts.toml (routing replay on): `first`
    = (steps, the `parallel` table's fields) runs on two trainer ranks and checkpoints its
    last step, `then` resumes from it on one rank. Checks every step's worker log-probs equal
    the trainer's and the routes agree; returns the trainer's per-step values."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT / "tests" / "megatron_shim"), os.environ.get("PYTHONPATH")]))}
    hosts, run_dir = tmp_path / "hosts.toml", tmp_path / "run"
    for (steps, parallel), flag in ((first, "--run-dir"), (then, "--resume")):
        hosts.write_text(MOE_HOSTS.format(model=ROOT / "examples" / "moe-tiny", steps=steps,
                                          save_every=first[0], parallel=parallel))
        done = subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), flag,
                               str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-3000:]
    steps = trainer_steps(run_dir)
    assert [int(v["version"]) for v in steps] == list(range(1, then[0] + 1))
    for v in steps:
        assert v["train/logprob_abs_diff"] < 1e-5 and v["moe/route_mismatch"] < 0.01, v
    assert f"resumed from the checkpoint of step {first[0]}" in done.stdout
    assert (run_dir / "logs" / "trainer.rank1.log").is_file()  # the first run had two ranks
    return steps


@pytest.mark.timeout(400)
def test_expert_parallel_trainer_from_hosts_toml_resumes_at_another_expert_layout(tmp_path):
    """`parallel = { dp = 2, ep = 2, distributed_optimizer = true }` (two trainer ranks, each
    holding 2 of the 4 experts per layer, the optimizer state sharded): resumed with ep = 1 on
    one rank (the replicated optimizer) it continues from the ep = 2 checkpoint."""
    steps = moe_run_and_resume(tmp_path, (6, "dp = 2, ep = 2, distributed_optimizer = true"),
                               (8, "dp = 1, ep = 1"))
    assert [v.get("train/ep_size") for v in steps] == [2.0] * 6 + [None] * 2
