"""LoRA students on the megatron backend (backends/megatron/lora.py) against the torch backend's
peft adapters (models/lora.py): the same PEFT-named adapter gives the same log-probs, the
same train step (with a KL term to the adapters-off reference) and the same merged weights;
at TP=2 and PP=2 the step equals TP=1, the adapter's gather gives back what was loaded, the
adapters-off reference runs through the pipeline, and a checkpoint (a PEFT adapter directory
with the optimizer state, plain or distributed optimizer) resumes at its own and at another
layout; last, the trainer's own ranks (training/ranks.py) at TP=2: step, adapter and merged
gathers, checkpoint. Multi-rank cases run on gloo child processes
(tests/test_megatron_parallel.py's pattern): rank 0 reports tensors, the tests here assert.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest
import torch

with warnings.catch_warnings():  # megatron-core warns at import that Apex / TE are absent
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")
    from backends.megatron import model as mg

import tests.test_megatron_model as model_tests
from algos.logprobs import token_logprobs_and_entropy
from tests.test_megatron_convert import hf_model
from tests.test_megatron_model import batch, padded_batch
from tests.test_megatron_parallel import run_ranks as parallel_ranks
from training.config import LoraConfig

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")

SPAWN_TIMEOUT_S = 100
tp1 = model_tests.tp1  # one gloo rank with megatron's parallel state, once per module
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SOME = ["k_proj", "v_proj", "up_proj", "down_proj"]  # absent parts of fused layers stay zero


def random_adapter(model_name: str, targets: list[str], rank: int = 4, seed: int = 3
                   ) -> dict[str, torch.Tensor]:
    """A whole non-zero adapter under PEFT's names (peft's own layout, from a peft model)."""
    from models import lora

    peft_model = lora.attach(hf_model(model_name), LoraConfig(rank=rank, alpha=8.0,
                                                              target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=gen) * 0.3
            for n, t in lora.adapter_tensors(peft_model).items()}


def torch_student(model_name: str, targets: list[str], adapter: dict[str, torch.Tensor]):
    """The torch backend's LoRA student (transformers + peft) with `adapter` loaded."""
    from models import lora

    model = lora.attach(hf_model(model_name), LoraConfig(rank=4, alpha=8.0,
                                                         target_modules=targets))
    lora.load_adapter_tensors(model, adapter)
    return model


def megatron_student(model_name: str, targets: list[str], adapter: dict[str, torch.Tensor],
                     dropout: float = 0.0):
    """This rank's megatron LoRA student of the same base and adapter."""
    from backends.megatron import lora

    model = mg.from_hf_model(hf_model(model_name))
    lora.attach(model, LoraConfig(rank=4, alpha=8.0, target_modules=targets, dropout=dropout))
    lora.load_adapter(model, adapter)
    return model


# ---- one process, TP = PP = 1 ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("targets", [ALL, SOME], ids=["all", "some"])
def test_logprobs_equal_the_torch_backend_with_the_same_adapter(tp1, name, targets):
    from backends.megatron import lora

    adapter = random_adapter(name, targets)
    want_model = torch_student(name, targets, adapter)
    model = megatron_student(name, targets, adapter)
    ids, mask = padded_batch(want_model.config.vocab_size)
    real = (mask[:, 1:] * mask[:, :-1]).bool()
    with torch.no_grad():
        want = token_logprobs_and_entropy(want_model, ids, mask, 0.7)[0]
        got = token_logprobs_and_entropy(model, ids, mask, 0.7)[0]
        with lora.adapters_off(model):
            off = token_logprobs_and_entropy(model, ids, mask, 0.7)[0]
        base = token_logprobs_and_entropy(hf_model(name), ids, mask, 0.7)[0]
    assert (got - want).abs()[real].max() < 1e-5
    assert (off - base).abs()[real].max() < 1e-5  # adapters off: the base model
    assert (want - base).abs()[real].max() > 0.05  # the adapter changes the answer


def test_attach_freezes_the_base_and_starts_as_the_base(tp1):
    from backends.megatron import lora

    model = mg.from_hf_model(hf_model("qwen2"))
    before = model.hf_state_dict()
    ids, mask = padded_batch(54)
    with torch.no_grad():
        plain = token_logprobs_and_entropy(model, ids, mask)[0]
    lora.attach(model, LoraConfig(rank=4, alpha=8.0, target_modules=ALL))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in model.lora.named_parameters(prefix="lora")}
    assert len(trained) == 2 * len(ALL) * 2  # A and B of seven modules on two layers
    adapter = lora.adapter_tensors(model)
    a = adapter[lora.peft_name(1, "q_proj", "A")]
    assert a.shape == (4, 64) and a.abs().max() <= 1 / 8 and a.std() > 0.02  # kaiming(sqrt 5)
    assert all(adapter[lora.peft_name(i, t, "B")].abs().max() == 0 for i in (0, 1) for t in ALL)
    with torch.no_grad():
        assert torch.equal(token_logprobs_and_entropy(model, ids, mask)[0], plain)
    after = model.hf_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    with pytest.raises(ValueError, match=r"'qkv_proj'.*allowed.*'q_proj'"):
        lora.attach(mg.from_hf_model(hf_model("qwen2")),
                    LoraConfig(target_modules=["q_proj", "qkv_proj"]))
    wrong = dict(adapter)
    wrong.pop(lora.peft_name(0, "v_proj", "B"))
    with pytest.raises(ValueError, match="missing.*v_proj.lora_B"):
        lora.load_adapter(model, wrong)


def test_adapter_dropout_acts_only_while_training(tp1):
    adapter = random_adapter("qwen2", ALL)
    plain = megatron_student("qwen2", ALL, adapter)
    dropped = megatron_student("qwen2", ALL, adapter, dropout=0.5)
    ids, mask = padded_batch(54)
    real = (mask[:, 1:] * mask[:, :-1]).bool()
    with torch.no_grad():
        want = token_logprobs_and_entropy(plain.eval(), ids, mask)[0]
        assert torch.equal(token_logprobs_and_entropy(dropped.eval(), ids, mask)[0], want)
        trained = token_logprobs_and_entropy(dropped.train(), ids, mask)[0]
    assert (trained - want).abs()[real].max() > 1e-3


def test_config_checks_name_what_the_backend_cannot_train(tp1):
    import msgspec

    from actors.trainer import TrainerConfig
    from training.backends import get_backend

    def check(**changes):
        base = dict(model="tiny-qwen2", workers=["w"], backend="megatron", device="cuda",
                    lora={"rank": 4, "target_modules": ALL})
        get_backend("megatron").check_config(msgspec.convert(base | changes, TrainerConfig))

    check()  # accepted (a LoRA student used to be refused here)
    check(parallel={"pp": 2}, kl={"coef": 0.1, "use_kl_loss": True, "ref_model": "tiny-qwen2"})
    with pytest.raises(ValueError, match=r"\['qkv'\].*allowed.*'gate_proj'"):
        check(lora={"target_modules": ["q_proj", "qkv"]})
    with pytest.raises(ValueError, match="sequence_parallel"):
        check(megatron={"sequence_parallel": True})
    with pytest.raises(ValueError, match="KL reference.*pp = 1"):
        check(parallel={"pp": 2}, kl={"coef": 0.1, "use_kl_loss": True})


def test_merged_tensors_equal_the_torch_backends(tp1):
    from backends.megatron import lora
    from models import lora as torch_lora

    adapter = random_adapter("qwen2-untied", SOME)
    want = dict(torch_lora.merged_tensors(torch_student("qwen2-untied", SOME, adapter)))
    model = megatron_student("qwen2-untied", SOME, adapter)
    got = dict(lora.merged_tensors(model))
    assert sorted(got) == sorted(want)
    base = hf_model("qwen2-untied").state_dict()
    for key, value in want.items():
        assert (got[key] - value).abs().max() < 1e-6, key
    assert (got["model.layers.1.mlp.down_proj.weight"]
            - base["model.layers.1.mlp.down_proj.weight"]).abs().max() > 0.1
    assert torch.equal(got["model.layers.1.self_attn.q_proj.weight"],
                       base["model.layers.1.self_attn.q_proj.weight"])  # not a target


def _lora_state(backend: str, adapter: dict[str, torch.Tensor]):
    """(state, cfg) of one LoRA student step with a KL loss term to its adapters-off reference,
    SGD (lr 1: the adapters move by their clipped gradients) through fp32 masters."""
    import msgspec

    from actors.trainer import TrainerConfig
    from models.tiny import build_char_tokenizer
    from training.aux_models import AdaptersOffReference
    from training.backends import get_backend
    from training.config import MicroBatchConfig, OptimizerConfig
    from training.master_weights import MasterWeightOptimizer
    from training.step import TrainState

    cfg = TrainerConfig(model="x", workers=["w"], micro_batches=MicroBatchConfig(size=3),
                        optimizer=OptimizerConfig(grad_clip=0.5))
    cfg = msgspec.convert(msgspec.to_builtins(cfg) | dict(
        kl={"coef": 0.5, "use_kl_loss": True, "estimator": "k3"}), type(cfg))
    model = (torch_student("qwen2-untied", ALL, adapter) if backend == "torch"
             else megatron_student("qwen2-untied", ALL, adapter))
    impl = get_backend(backend)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = MasterWeightOptimizer(params, lambda ps: torch.optim.SGD(ps, lr=1.0))
    ref = AdaptersOffReference(model, impl.adapters_off)
    return TrainState(model, build_char_tokenizer(), opt, ref, backend=impl), cfg


def test_step_with_a_kl_term_to_the_base_equals_the_torch_backend(tp1):
    from training.backends import get_backend
    from training.step import train_on_batch

    adapter = random_adapter("qwen2-untied", ALL)
    stats, after = {}, {}
    for backend in ("torch", "megatron"):
        state, cfg = _lora_state(backend, adapter)
        before = dict(state.backend.iter_hf_tensors(state.model)) if backend == "megatron" \
            else None
        stats[backend] = train_on_batch(state, batch(state.tokenizer), cfg)
        after[backend] = get_backend(backend).adapter_tensors(state.model)
        if before is not None:  # the base is frozen: bit for bit as it was
            now = dict(state.backend.iter_hf_tensors(state.model))
            assert all(torch.equal(now[k], v) for k, v in before.items())
    for key in ("train/loss", "train/grad_norm", "train/kl_loss", "train/policy_kl"):
        assert stats["megatron"][key] == pytest.approx(stats["torch"][key], rel=1e-5,
                                                       abs=1e-6), key
    assert stats["torch"]["train/kl_loss"] > 1e-3  # the reference is the base, not the student
    assert stats["torch"]["train/grad_norm"] > 0.5  # the clip was active
    for key, want in after["torch"].items():
        assert (after["megatron"][key] - want).abs().max() < 1e-5, key
        moved = (want - adapter[key]).abs().max()
        assert moved > 1e-3, key  # every adapter tensor was stepped


def test_torch_backend_checkpoint_resumes_at_one_rank(tp1, tmp_path):
    """A torch backend LoRA checkpoint (TrainState.write_files: the optimizer state per whole
    tensor, in peft's parameter order) resumes on the megatron backend at tp = pp = 1: the
    adapters are registered in that order."""
    from models.tiny import build_char_tokenizer
    from training.backends import get_backend
    from training.master_weights import make_optimizer
    from training.step import TrainState, train_on_batch

    adapter = random_adapter("qwen2-untied", ALL)
    states = {}
    for backend in ("torch", "megatron"):
        model = (torch_student if backend == "torch" else megatron_student)(
            "qwen2-untied", ALL, adapter)
        params = [p for p in model.parameters() if p.requires_grad]
        impl = get_backend(backend)
        opt = make_optimizer(params, torch.float32, False, 1e-2, 0.0, impl.grad_clip(model))
        states[backend] = TrainState(model, build_char_tokenizer(), opt, backend=impl)
        states[backend].lora = LoraConfig(rank=4, alpha=8.0, target_modules=ALL)
    torch_state, state = states["torch"], states["megatron"]
    train_on_batch(torch_state, batch(torch_state.tokenizer), _step_config())
    torch_state.step = 5
    (tmp_path / "ckpt").mkdir()
    torch_state.write_files(tmp_path / "ckpt")
    assert not state.backend.load_checkpoint(state, tmp_path / "ckpt")  # not its own format
    state.load(tmp_path / "ckpt", "cpu")
    assert state.step == 5
    want, got = get_backend("torch").adapter_tensors(torch_state.model), \
        state.backend.adapter_tensors(state.model)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert list(state.model.lora.by_name()) == list(want)  # peft's parameter order
    torch_inner, inner = torch_state.optimizer.optimizer, state.optimizer.optimizer
    for p, q in zip(torch_state.optimizer.params, state.optimizer.params):
        assert torch.equal(torch_inner.state[p]["exp_avg"], inner.state[q]["exp_avg"])
        assert torch_inner.state[p]["exp_avg"].abs().max() > 0


def test_trainer_lora_student_checkpoint_resumes(tp1, tmp_path):
    """The trainer's path: load_train_state with lora on the megatron backend (AdamW, the
    adapters-off KL reference), a step, the one-rank checkpoint, a resume."""
    import msgspec

    from actors.trainer import TrainerConfig
    from backends.megatron import lora
    from training.aux_models import AdaptersOffReference
    from training.ranks import SingleRank
    from training.setup import load_train_state
    from training.step import train_on_batch

    cfg = msgspec.convert(dict(model="tiny-qwen2", workers=["w"], backend="megatron",
                               lora={"rank": 4, "alpha": 8.0, "target_modules": SOME},
                               kl={"coef": 0.1, "use_kl_loss": True}), TrainerConfig)
    state = load_train_state(cfg, str(tmp_path), resume=False)
    assert isinstance(state.ref, AdaptersOffReference)
    stats = train_on_batch(state, batch(state.tokenizer), cfg)
    assert stats["train/kl_loss"] >= 0.0 and stats["train/grad_norm"] > 0
    state.step, state.version = 1, 1
    SingleRank(state).save_checkpoint(state, tmp_path / "checkpoints" / "step_000001")
    ckpt = tmp_path / "checkpoints" / "step_000001"
    assert (ckpt / "adapter_config.json").is_file() and lora.is_checkpoint(ckpt)
    assert not list(ckpt.glob("model*.safetensors"))  # no base weights
    resumed = load_train_state(cfg, str(tmp_path), resume=True)
    assert (resumed.step, resumed.version) == (1, 1)
    want, got = lora.adapter_tensors(state.model), lora.adapter_tensors(resumed.model)
    assert want[lora.peft_name(0, "up_proj", "B")].abs().max() > 0  # B moved off zero
    assert all(torch.equal(got[k], v) for k, v in want.items())
    inner, back = state.optimizer.optimizer, resumed.optimizer.optimizer
    for p, q in zip(state.optimizer.params, resumed.optimizer.params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(inner.state[p][key], back.state[q][key])
        assert float(back.state[q]["step"]) == 1.0
    # the two students take the same next step
    for s in (state, resumed):
        train_on_batch(s, batch(s.tokenizer), cfg)
    after, resumed_after = lora.adapter_tensors(state.model), lora.adapter_tensors(resumed.model)
    assert all(torch.equal(resumed_after[k], v) for k, v in after.items())


# ---- two processes: TP = 2, PP = 2 -------------------------------------------------------------
def run_ranks(target: str, tmp_path: Path, world: int = 2) -> dict:
    """Run this module's `target`(rank, tmp_path) on `world` child processes (megatron on CPU
    over gloo, tests/test_megatron_parallel.py's launcher); rank 0's report."""
    return parallel_ranks(target, tmp_path, world, __name__)


def _one_step(adapter: dict[str, torch.Tensor], optimizer: str = "sgd") -> dict:
    """One train_on_batch of this rank's LoRA student (SGD lr 1, or AdamW), clip 0.5."""
    from actors.trainer import TrainerConfig
    from backends.megatron import lora
    from models.tiny import build_char_tokenizer
    from training.backends import get_backend
    from training.config import MicroBatchConfig, OptimizerConfig
    from training.master_weights import make_optimizer
    from training.step import TrainState, train_on_batch

    tok = build_char_tokenizer()
    model = megatron_student("qwen2-untied", ALL, adapter)
    base = model.hf_state_dict()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.SGD(params, lr=1.0) if optimizer == "sgd"
           else make_optimizer(params, torch.float32, False, 1e-2, 0.0, model.clip_grad_norm))
    state = TrainState(model, tok, opt, backend=get_backend("megatron"))
    state.lora = LoraConfig(rank=4, alpha=8.0, target_modules=ALL)
    cfg = TrainerConfig(model="x", workers=["w"], micro_batches=MicroBatchConfig(size=3),
                        optimizer=OptimizerConfig(grad_clip=0.5))
    stats = train_on_batch(state, batch(tok), cfg)
    after_base = model.hf_state_dict()
    return {"state": state, "loss": stats["train/loss"], "norm": stats["train/grad_norm"],
            "adapter": lora.adapter_tensors(model),
            "base_equal": all(torch.equal(after_base[k], v) for k, v in base.items())}


def two_ranks(rank: int, tmp: Path) -> dict:
    """TP=2 (step, gathers, checkpoint), then TP=1 x DP=2 (step, resume at another layout,
    the distributed optimizer's checkpoint)."""
    from backends.megatron import lora
    from backends.megatron.model import initialize_parallel, parallel_state
    from training.backends import get_backend

    backend = get_backend("megatron")
    adapter = random_adapter("qwen2-untied", ALL)
    report: dict = {}

    initialize_parallel(2, 1)
    model = megatron_student("qwen2-untied", SOME, random_adapter("qwen2-untied", SOME))
    report["tp2_round_trip"] = lora.adapter_tensors(model)
    report["tp2_merged"] = dict(lora.merged_tensors(model))
    report["tp2_split"] = model.lora.adapters["0_up_proj"].B.shape[0]  # rows of this rank
    tp2 = _one_step(adapter)
    adam = _one_step(adapter, "adamw")
    backend.save_checkpoint(adam["state"], tmp / "ckpt")
    fresh = _fresh_state(adapter)
    backend.load_checkpoint(fresh, tmp / "ckpt")
    same = torch.tensor(float(_moments(fresh) == _moments(adam["state"])))
    torch.distributed.all_reduce(same, op=torch.distributed.ReduceOp.MIN)  # every rank's
    report["tp2_resumed_moments"] = bool(same)
    report["adam_moments"] = _whole_moments(adam["state"])
    parallel_state.destroy_model_parallel()

    initialize_parallel(1, 1)  # the same two ranks as TP=1 x DP=2
    tp1 = _one_step(adapter)
    other = _fresh_state(adapter)
    backend.load_checkpoint(other, tmp / "ckpt")  # written at TP=2
    report["tp1_resumed"] = lora.adapter_tensors(other.model)
    report["tp1_resumed_moments"] = _whole_moments(other)
    report["dp2_distributed_optimizer"] = _distributed_optimizer_round_trip(adapter, tmp)
    parallel_state.destroy_model_parallel()
    report |= {"adam": adam["adapter"],
               "loss": torch.tensor([tp2["loss"], tp1["loss"]]),
               "norm": torch.tensor([tp2["norm"], tp1["norm"]]),
               "tp2": tp2["adapter"], "tp1": tp1["adapter"],
               "base_equal": tp2["base_equal"] and tp1["base_equal"]}
    return report


def pipeline_ranks(rank: int, tmp: Path) -> dict:
    """PP=2: the gather round trip, a step through megatron's schedule, the adapters-off
    reference through it."""
    from backends.megatron import lora
    from backends.megatron.model import initialize_parallel, parallel_state

    adapter = random_adapter("qwen2-untied", ALL)
    initialize_parallel(1, 2)
    staged = megatron_student("qwen2-untied", ALL, adapter)
    report = {"pp2_layers": list(staged.layers), "pp2_round_trip": lora.adapter_tensors(staged),
              "pp2_step": _pipeline_step(adapter), "pp2_reference": _pipeline_reference(staged)}
    parallel_state.destroy_model_parallel()
    return report


def _distributed_optimizer_round_trip(adapter: dict[str, torch.Tensor], tmp: Path) -> dict:
    """DP=2 with the distributed optimizer (each replica holds half of the adapters' AdamW
    state): a step, a checkpoint, a fresh state resumed from it; the whole views of both."""
    from backends.megatron.model import parallel_state
    from models.tiny import build_char_tokenizer
    from training.backends import get_backend
    from training.distributed_optimizer import DistributedOptimizer
    from training.step import TrainState, train_on_batch

    backend, views = get_backend("megatron"), {}
    for name in ("trained", "resumed"):
        model = megatron_student("qwen2-untied", ALL,
                                 adapter if name == "trained" else {k: v * 0 for k, v in
                                                                    adapter.items()})
        [(params, group, counted, norm_group)] = backend.optimizer_shards(
            list(model.parameters()))
        opt = DistributedOptimizer(params, group, 1e-2, counted=counted, norm_group=norm_group)
        state = TrainState(model, build_char_tokenizer(), opt, backend=backend)
        state.lora = LoraConfig(rank=4, alpha=8.0, target_modules=ALL)
        if name == "trained":
            train_on_batch(state, batch(state.tokenizer), _step_config())
            backend.save_checkpoint(state, tmp / "dp_ckpt")
        else:
            backend.load_checkpoint(state, tmp / "dp_ckpt")
        view = opt.full_view()  # collective over the replicas
        views[name] = {"ranges": opt.optimizer.state[opt.master[0]]["exp_avg"].clone(),
                       "moments": [view.optimizer.state[o]["exp_avg"] for o in view.master]}
    same = torch.tensor(float(torch.equal(views["trained"]["ranges"],
                                          views["resumed"]["ranges"])))
    torch.distributed.all_reduce(same, op=torch.distributed.ReduceOp.MIN)
    return {"dp": parallel_state.get_data_parallel_world_size(), "same_ranges": bool(same),
            "moments": [torch.stack([a.flatten().abs().max(), (a - b).abs().max()])
                        for a, b in zip(views["trained"]["moments"],
                                        views["resumed"]["moments"])]}


def _pipeline_step(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One SGD step of the LoRA student over two pipeline stages (megatron's schedule): the
    whole adapter after it, on rank 0."""
    from backends.megatron import lora
    from backends.megatron.pipeline import PipelineRunner
    from models.tiny import build_char_tokenizer
    from training.backends import get_backend
    from training.step import TrainState, train_on_batch

    model = megatron_student("qwen2-untied", ALL, adapter)
    params = [p for p in model.parameters() if p.requires_grad]
    state = TrainState(model, build_char_tokenizer(), torch.optim.SGD(params, lr=1.0),
                       backend=get_backend("megatron"))
    train_on_batch(state, batch(state.tokenizer), _step_config(), runner=PipelineRunner(model))
    return lora.adapter_tensors(model)


def _pipeline_reference(model) -> dict[str, torch.Tensor]:
    """The adapters-off reference's and the student's log-probs over two pipeline stages (every
    stage runs the passes; the last stage's, on rank 0)."""
    from backends.megatron.pipeline import PipelineRunner
    from models.tiny import build_char_tokenizer
    from training.aux_models import AdaptersOffReference
    from training.backends import get_backend
    from training.batching import make_micro_batch

    tok = build_char_tokenizer()
    runner = PipelineRunner(model)
    mbs = [make_micro_batch(batch(tok), tok.pad_token_id)]
    ref = AdaptersOffReference(model, get_backend("megatron").adapters_off)
    model.train()
    off, on = ref.runner_logprobs(runner, mbs, 1.0), runner.logprobs(mbs, 1.0)
    assert model.training and model.lora.enabled  # as they were
    gathered = [None, None]
    last = (off[0], on[0]) if off is not None else None
    torch.distributed.all_gather_object(gathered, last)
    return {"first_stage": gathered[0] is None, "off": gathered[1][0], "on": gathered[1][1]}


def _step_config():
    from actors.trainer import TrainerConfig
    from training.config import MicroBatchConfig, OptimizerConfig

    return TrainerConfig(model="x", workers=["w"], micro_batches=MicroBatchConfig(size=3),
                         optimizer=OptimizerConfig(grad_clip=0.5))


def _fresh_state(adapter: dict[str, torch.Tensor]):
    """A LoRA student whose adapter and AdamW state are not the saved ones."""
    from models.tiny import build_char_tokenizer
    from training.backends import get_backend
    from training.master_weights import make_optimizer
    from training.step import TrainState

    model = megatron_student("qwen2-untied", ALL, {k: v * 0 for k, v in adapter.items()})
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, torch.float32, False, 1e-2, 0.0, model.clip_grad_norm)
    state = TrainState(model, build_char_tokenizer(), opt, backend=get_backend("megatron"))
    state.lora = LoraConfig(rank=4, alpha=8.0, target_modules=ALL)
    return state


def _moments(state) -> list[list[float]]:
    """This rank's AdamW moments, as numbers (a comparison on this rank)."""
    inner = state.optimizer.optimizer
    return [[inner.state[p][k].sum().item() for k in ("exp_avg", "exp_avg_sq")]
            + [float(inner.state[p]["step"])] for p in state.optimizer.params]


def _whole_moments(state) -> dict[str, torch.Tensor]:
    """The whole AdamW moments under the adapter's names, on rank 0 (collective)."""
    from backends.megatron import lora

    inner = state.optimizer.optimizer
    local = {}
    for name, dim, _, owner in lora._optimizer_entries(state.model, state.optimizer):
        local[name] = (inner.state[owner]["exp_avg"], dim)
    return lora.whole_on_rank0(state.model, local)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return run_ranks("two_ranks", tmp_path_factory.mktemp("lora_ranks"))


@pytest.fixture(scope="module")
def pp_report(tmp_path_factory) -> dict:
    return run_ranks("pipeline_ranks", tmp_path_factory.mktemp("lora_pipeline"))


def test_tensor_parallel_step_equals_one_rank(report):
    tp2_loss, tp1_loss = report["loss"].tolist()
    assert tp2_loss == pytest.approx(tp1_loss, rel=1e-5)
    tp2_norm, tp1_norm = report["norm"].tolist()
    # each replicated adapter tensor counted once: a double count would raise the TP=2 norm
    assert tp2_norm == pytest.approx(tp1_norm, rel=1e-5) and tp1_norm > 0.5
    adapter = random_adapter("qwen2-untied", ALL)
    assert sorted(report["tp2"]) == sorted(adapter)
    for key, want in report["tp1"].items():
        assert (report["tp2"][key] - want).abs().max() < 1e-5, key
        assert (want - adapter[key]).abs().max() > 1e-4, key  # stepped
    assert report["base_equal"]  # the base weights bit for bit as loaded


def test_tensor_parallel_step_equals_the_torch_backend(report):
    """TP=2 against peft's gradients (SGD lr 1: the adapters move by the clipped gradient)."""
    from actors.trainer import TrainerConfig
    from models import lora
    from models.tiny import build_char_tokenizer
    from training.backends import get_backend
    from training.config import MicroBatchConfig, OptimizerConfig
    from training.step import TrainState, train_on_batch

    adapter = random_adapter("qwen2-untied", ALL)
    model = torch_student("qwen2-untied", ALL, adapter)
    params = [p for p in model.parameters() if p.requires_grad]
    state = TrainState(model, build_char_tokenizer(), torch.optim.SGD(params, lr=1.0),
                       backend=get_backend("torch"))
    cfg = TrainerConfig(model="x", workers=["w"], micro_batches=MicroBatchConfig(size=3),
                        optimizer=OptimizerConfig(grad_clip=0.5))
    stats = train_on_batch(state, batch(state.tokenizer), cfg)
    assert stats["train/grad_norm"] == pytest.approx(report["norm"][0].item(), rel=1e-5)
    for key, want in lora.adapter_tensors(model).items():
        assert (report["tp2"][key] - want).abs().max() < 1e-5, key


def test_adapter_gathers_give_back_what_was_loaded(report):
    some = random_adapter("qwen2-untied", SOME)
    assert report["tp2_split"] == 64  # up_proj's 128 rows over two ranks
    assert sorted(report["tp2_round_trip"]) == sorted(some)
    for key, want in some.items():
        assert torch.equal(report["tp2_round_trip"][key], want), key


def test_tensor_parallel_merged_tensors_equal_the_torch_backends(report):
    from models import lora

    some = random_adapter("qwen2-untied", SOME)
    want = dict(lora.merged_tensors(torch_student("qwen2-untied", SOME, some)))
    assert sorted(report["tp2_merged"]) == sorted(want)
    for key, value in want.items():
        assert (report["tp2_merged"][key] - value).abs().max() < 1e-6, key


def test_checkpoint_resumes_at_its_layout_and_another(report):
    """Saved at TP=2 after an AdamW step: read back at TP=2 (every rank's moments) and at
    TP=1 (adapter and moments whole); the adapter directory loads into peft as it is."""
    assert report["tp2_resumed_moments"]
    for key, want in report["adam"].items():
        assert torch.equal(report["tp1_resumed"][key], want), key
        assert torch.equal(report["tp1_resumed_moments"][key], report["adam_moments"][key]), key
    assert any(v.abs().max() > 0 for v in report["adam_moments"].values())


def test_checkpoint_is_a_peft_adapter_directory(report, tmp_path_factory):
    from peft import PeftModel

    ckpt = next(Path(p) for p in tmp_path_factory.getbasetemp().glob("lora_ranks*/ckpt"))
    assert (ckpt / "adapter_config.json").is_file()
    assert (ckpt / "adapter_model.safetensors").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(hf_model("qwen2-untied"), str(ckpt))
    named = dict(loaded.named_parameters())
    for key, want in report["adam"].items():
        own = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight")
        assert torch.equal(named[own], want), key


def test_distributed_optimizer_checkpoint_resumes(report):
    """DP=2, parallel.distributed_optimizer: the replicas' ranges of the AdamW state come back
    from the checkpoint's whole tensors."""
    got = report["dp2_distributed_optimizer"]
    assert got["dp"] == 2 and got["same_ranges"]
    assert len(got["moments"]) == 2 * len(ALL) * 2
    for size, diff in got["moments"]:
        assert size > 0 and diff == 0


# ---- the trainer's ranks (training/ranks.py): rank commands at TP=2 --------------------------
ROOT = Path(__file__).resolve().parent.parent
TRAINER_LR = 1e-3


def trainer_driver(tmp: str) -> None:
    """Child entry (the trainer's rank 0, the CPU shim armed for it and its rank processes):
    writes report.pt, or error.txt on failure."""
    warnings.simplefilter("ignore")
    try:
        torch.save(_drive_trainer(Path(tmp)), Path(tmp) / "report.pt")
    except BaseException:
        (Path(tmp) / "error.txt").write_text(traceback.format_exc())
        raise


def _drive_trainer(tmp: Path) -> dict:
    """One AdamW step of a LoRA student with a KL term to its base at one rank and at TP=2
    (rank processes: the step, `adapter`, `merged` and `save` commands), then the TP=2
    checkpoint resumed at one rank."""
    import msgspec

    from bench.train_parallel import Trainer, at_layout, base_config, make_batch, use_cpu_shim
    from models.load import load_tokenizer
    from training.config import KlConfig, OptimizerConfig

    use_cpu_shim()
    model = "examples/base-tiny"
    first = make_batch(8, len(load_tokenizer(model)), seed=0)
    cfg = msgspec.structs.replace(
        base_config(model, "cpu", "float32", timeout_s=60),
        optimizer=OptimizerConfig(lr=TRAINER_LR, grad_clip=1.0),
        lora=LoraConfig(rank=4, alpha=8.0, target_modules=ALL),
        kl=KlConfig(coef=0.1, use_kl_loss=True))
    report: dict = {}
    with Trainer(cfg, tmp / "one") as one:
        for _ in range(2):  # the second step: B is no longer 0, so A moves and KL > 0
            stats = one.step(first)[0]
        report["one"] = {"stats": stats, "adapter": one.ranks.adapter_tensors(one.state)}
    with Trainer(at_layout(cfg, tp=2), tmp / "tp2") as many:
        for _ in range(2):
            stats = many.step(first)[0]
        report["tp2"] = {"stats": stats, "adapter": many.ranks.adapter_tensors(many.state)}
        many.ranks.save_merged(many.state, tmp / "merged")
        many.ranks.save_checkpoint(many.state, tmp / "tp2" / "checkpoints" / "step_000002")
    with Trainer(cfg, tmp / "tp2", resume=True) as back:
        report["resumed"] = {"step": back.state.step,
                             "adapter": back.ranks.adapter_tensors(back.state)}
    return report


@pytest.fixture(scope="module")
def trainer_report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("lora_trainer")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT / "tests" / "megatron_shim"), os.environ.get("PYTHONPATH")]))}
    code = f"from tests.test_megatron_lora import trainer_driver; trainer_driver({str(tmp)!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=110)
    error = tmp / "error.txt"
    assert not error.exists(), error.read_text() + "\n" + "\n".join(
        f"{p.name}:\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*/logs/*.log")))
    assert done.returncode == 0, done.stderr[-3000:]
    return {"tmp": tmp} | torch.load(tmp / "report.pt", weights_only=True)


def test_trainer_ranks_at_tp2_step_gather_merge_and_checkpoint(trainer_report):
    from safetensors.torch import load_file

    from backends.megatron.lora import peft_name

    one, tp2 = trainer_report["one"], trainer_report["tp2"]
    for key in ("train/loss", "train/grad_norm", "train/kl_loss"):
        assert tp2["stats"][key] == pytest.approx(one["stats"][key], rel=1e-4, abs=1e-7), key
    assert one["stats"]["train/kl_loss"] > 0  # the adapters-off reference differs
    assert sorted(tp2["adapter"]) == sorted(one["adapter"])
    for key, want in one["adapter"].items():
        assert (tp2["adapter"][key] - want).abs().max() <= 0.05 * TRAINER_LR, key
    a_name = peft_name(1, "o_proj", "A")
    assert tp2["adapter"][peft_name(1, "o_proj", "B")].abs().max() > 0.5 * TRAINER_LR
    # the merged export: the base's weight plus B A alpha / r of the gathered adapter
    merged = load_file(trainer_report["tmp"] / "merged" / "model.safetensors")
    base = load_file(ROOT / "examples" / "base-tiny" / "model.safetensors")
    a, b = tp2["adapter"][a_name], tp2["adapter"][peft_name(1, "o_proj", "B")]
    key = "model.layers.1.self_attn.o_proj.weight"
    assert (merged[key] - (base[key] + b @ a * 2.0)).abs().max() < 1e-6
    assert (merged[key] - base[key]).abs().max() > 0
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])
    # the TP=2 checkpoint, resumed at one rank
    resumed = trainer_report["resumed"]
    assert resumed["step"] == 2
    for key, want in tp2["adapter"].items():
        assert torch.equal(resumed["adapter"][key], want), key


def test_pipeline_step_equals_one_rank_and_the_gather_spans_the_stages(report, pp_report):
    """PP=2 (after the TP=2 report: this test's setup starts only the pipeline's ranks)."""
    assert pp_report["pp2_layers"] == [0]  # rank 0 holds one of the two stages
    every = random_adapter("qwen2-untied", ALL)
    assert sorted(pp_report["pp2_round_trip"]) == sorted(every)  # both stages' layers
    for key, want in every.items():
        assert torch.equal(pp_report["pp2_round_trip"][key], want), key
    for key, want in report["tp1"].items():  # a step through megatron's schedule
        assert (pp_report["pp2_step"][key] - want).abs().max() < 1e-5, key


def test_adapters_off_reference_through_the_pipeline(pp_report):
    """At PP=2 the reference runs through megatron's schedule on both stages
    (AdaptersOffReference.runner_logprobs): the base model's log-probs; adapters on: the
    torch backend's student's."""
    from models.tiny import build_char_tokenizer
    from training.batching import make_micro_batch
    from training.step import TrainState, forward

    got = pp_report["pp2_reference"]
    assert got["first_stage"]  # only the last stage has log-probs
    tok = build_char_tokenizer()
    mb = make_micro_batch(batch(tok), tok.pad_token_id)
    adapter = random_adapter("qwen2-untied", ALL)
    want = {}
    for name, model in (("off", hf_model("qwen2-untied")),
                        ("on", torch_student("qwen2-untied", ALL, adapter))):
        with torch.no_grad():
            want[name] = forward(TrainState(model, tok, None), mb, 1.0)[0]
        assert ((got[name] - want[name]).abs() * mb.mask).max() < 1e-5, name
    assert ((want["on"] - want["off"]).abs() * mb.mask).max() > 0.05
