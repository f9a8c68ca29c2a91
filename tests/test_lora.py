"""LoRA students: adapters trained on the frozen base, the reference with adapters off, PEFT
checkpoints, the merged export, and the embedded worker serving pushed adapters by name while
its base weights never move."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from actors.trainer import TrainerActor, TrainerConfig
from algos.logprobs import token_logprobs
from engine.adapters import base_named_tensors
from engine.weight_push import AdapterPush, adapter_name
from models import lora
from models.load import load_model
from tests.test_engine import post, serve
from tests.test_train_step import batch
from training.config import KlConfig, LoraConfig, TrainConfig
from training.setup import load_train_state
from training.step import train_on_batch

ROOT = Path(__file__).resolve().parent.parent
BASE = "examples/base-tiny"
pytestmark = pytest.mark.usefixtures("one_thread")


def lora_cfg(**kw) -> TrainerConfig:
    fields = {"model": BASE, "workers": ["w"], "lora": LoraConfig(rank=4, alpha=8),
              "optimizer": {"lr": 1e-2}, **kw}
    import msgspec

    return msgspec.convert(fields, TrainerConfig, from_attributes=True)


def base_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in model.state_dict().items() if not lora.is_adapter_name(n)}


def randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Non-zero A and B in every adapter (a fresh adapter's B is 0: the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.trainable(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_config_refuses_what_lora_does_not_cover():
    for kw, words in [({"true_on_policy": True}, "true_on_policy"),
                      ({"kl": KlConfig(coef=0.1, use_kl_loss=True, ref_update_interval=2)},
                       "ref_update_interval"),
                      ({"mismatch": {"proximal": "rollout_version", "correction": "tis"}},
                       "rollout_version")]:
        with pytest.raises(ValueError, match=words):
            lora_cfg(**kw)
    for bad, words in [({"rank": 0}, "lora.rank"), ({"alpha": 0}, "lora.alpha"),
                       ({"dropout": 1.0}, "lora.dropout"), ({"target_modules": []}, "empty")]:
        with pytest.raises(ValueError, match=words):
            LoraConfig(**bad)
    with pytest.raises(ValueError, match="weight_sync.path = .distributed."):
        TrainerActor.check_config(lora_cfg(weight_sync={"path": "distributed"}))
    model, _ = load_model(BASE, "cpu", torch.float32, 0)
    with pytest.raises(ValueError, match="match no layer.*q_proj"):
        lora.attach(model, LoraConfig(target_modules=["qkv"]))


def test_a_step_trains_the_adapters_only_and_the_reference_is_the_base(tmp_path):
    cfg = lora_cfg(kl=KlConfig(coef=0.5, use_kl_loss=True))
    state = load_train_state(cfg, str(tmp_path), False)
    frozen = base_tensors(state.model)
    before = {n: t.clone() for n, t in lora.adapter_tensors(state.model).items()}
    assert before and all(".lora_A." in n or ".lora_B." in n for n in before)
    assert state.optimizer.optimizer.param_groups[0]["params"] == lora.trainable(state.model)
    for _ in range(2):  # the second step has a KL: the adapters moved the policy off the base
        stats = train_on_batch(state, batch(state.tokenizer), cfg)
    after = lora.adapter_tensors(state.model)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all(torch.equal(frozen[n], t) for n, t in base_tensors(state.model).items())
    assert stats["train/kl_loss"] > 0
    # the reference: exactly the base model's log-probs, no copy of its weights
    base, tok = load_model(BASE, "cpu", torch.float32, 0)
    ids = torch.tensor([[tok.bos_token_id, 5, 9, 7, 8, 6]])
    with lora.adapters_off(state.model):
        off = token_logprobs(state.model, ids)
    assert torch.equal(off, token_logprobs(base, ids))
    assert not torch.allclose(token_logprobs(state.model, ids), off)
    assert state.host_weight_sets_bytes() == 0


def test_checkpoint_is_a_peft_directory_and_resumes(tmp_path):
    cfg = lora_cfg()
    state = load_train_state(cfg, str(tmp_path), False)
    randomize(state.model)
    train_on_batch(state, batch(state.tokenizer), cfg)
    state.step, state.version = 1, 1
    path = tmp_path / "checkpoints" / "step_000001"
    state.save(path)
    names = {p.name for p in path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= names
    assert not any(n.startswith("model") for n in names)  # no base weights in a checkpoint
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    # peft loads it as it is, onto the base, and computes what the trainer computes
    from peft import PeftModel

    base, tok = load_model(BASE, "cpu", torch.float32, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft on transformers 5: a deprecation notice
        peft_model = PeftModel.from_pretrained(base, str(path))
    ids = torch.tensor([[tok.bos_token_id, 5, 9, 7, 8, 6]])
    with torch.no_grad():
        assert torch.equal(peft_model(ids).logits, state.model(ids).logits)
    # resume: the adapter and the optimizer's moments come back
    resumed = load_train_state(cfg, str(tmp_path), True)
    assert resumed.step == 1
    for n, t in lora.adapter_tensors(state.model).items():
        assert torch.equal(lora.adapter_tensors(resumed.model)[n], t)
    want = state.optimizer.state_dict()["state"]
    got = resumed.optimizer.state_dict()["state"]
    assert want.keys() == got.keys() and all(
        torch.equal(want[k]["exp_avg"], got[k]["exp_avg"]) for k in want)
    # a full-weight checkpoint is refused by a LoRA trainer, naming the way out
    full = tmp_path / "full"
    load_train_state(TrainConfig(model=BASE), str(tmp_path / "x"), False).save(full)
    with pytest.raises(ValueError, match="full weights, not a LoRA adapter"):
        resumed.load(full, "cpu")


def test_merged_export_computes_what_the_adapter_does(tmp_path):
    state = load_train_state(lora_cfg(), str(tmp_path), False)
    randomize(state.model)
    state.save_merged(tmp_path / "merged")
    merged, tok = load_model(str(tmp_path / "merged"), "cpu", torch.float32, 0)
    assert not lora.has_adapters(merged)
    ids = torch.tensor([[tok.bos_token_id, 5, 9, 7, 8, 6]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, state.model(ids).logits, atol=1e-5,
                                   rtol=0)


def adapter_payload(model) -> str:
    return base64.b64encode(save({n: t.contiguous() for n, t in
                                  lora.adapter_tensors(model).items()})).decode()


async def test_worker_serves_each_adapter_by_name_and_never_moves_its_base(ipc, tmp_path):
    trained, tok = load_model(BASE, "cpu", torch.float32, 0)
    lora.attach(trained, LoraConfig(rank=4, alpha=8))
    randomize(trained, seed=3)
    config = lora.config_dict(LoraConfig(rank=4, alpha=8), BASE)
    prompt = [tok.bos_token_id] + tok.encode("3+4=", add_special_tokens=False)
    params = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7}
    async with serve(ipc, model=BASE) as (worker, client):
        engine_model = worker.scheduler.model
        original = {n: t.clone() for n, t in engine_model.state_dict().items()}
        base_out = await client.generate(prompt, params)
        answer = await client.load_lora_adapter_from_tensors("a1", config,
                                                             adapter_payload(trained))
        assert answer["success"] and set(answer["loaded_adapters"]) == {"a1"}
        out = await client.generate(prompt, params, lora_path="a1")
        ids = out["output_ids"]
        lps = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        with torch.no_grad():
            want = token_logprobs(trained, torch.tensor([prompt + ids]))[0, len(prompt) - 1:]
        torch.testing.assert_close(torch.tensor(lps), want, atol=1e-5, rtol=0)
        # the base still answers for requests naming no adapter, token for token
        again = await client.generate(prompt, params)
        assert again["output_ids"] == base_out["output_ids"]
        assert [e[0] for e in again["meta_info"]["output_token_logprobs"]] == \
            [e[0] for e in base_out["meta_info"]["output_token_logprobs"]]
        # a second adapter from a PEFT directory; both stay loaded and each request gets its own
        other, _ = load_model(BASE, "cpu", torch.float32, 0)
        lora.attach(other, LoraConfig(rank=4, alpha=8))
        randomize(other, seed=4)
        lora.save_adapter(other, LoraConfig(rank=4, alpha=8), tmp_path / "a2", BASE)
        assert (await client.load_lora_adapter("a2", str(tmp_path / "a2")))["success"]
        both = await client.generate([prompt, prompt], params, lora_path=["a1", "a2"])
        assert both[0]["output_ids"] == ids  # a1 again (same seed), beside a2 in one request
        with torch.no_grad():
            want2 = token_logprobs(other, torch.tensor([prompt + both[1]["output_ids"]]))[
                0, len(prompt) - 1:]
        torch.testing.assert_close(
            torch.tensor([e[0] for e in both[1]["meta_info"]["output_token_logprobs"]]), want2,
            atol=1e-5, rtol=0)
        # refusals change nothing: an unknown adapter, another rank, a duplicate name
        status, body = await post(client, "/generate", {"input_ids": prompt, "lora_path": "nope"})
        assert status == 400 and "not loaded" in body["error"]["message"]
        status, body = await post(client, "/load_lora_adapter_from_tensors", {
            "lora_name": "bad", "config_dict": config, "serialized_tensors": "eA=="})
        assert status == 400 and "serialized_tensors is neither" in body["error_message"]
        status, body = await post(client, "/load_lora_adapter_from_tensors", {
            "lora_name": "bad", "config_dict": dict(config, r=2),
            "serialized_tensors": adapter_payload(other)})
        assert status == 400 and not body["success"] and "rank 2" in body["error_message"]
        status, body = await post(client, "/load_lora_adapter", {"lora_name": "a1",
                                                                 "lora_path": str(tmp_path)})
        assert status == 400 and set(body["loaded_adapters"]) == {"a1", "a2"}
        assert (await client.unload_lora_adapter("a1"))["loaded_adapters"].keys() == {"a2"}
        status, _ = await post(client, "/generate", {"input_ids": prompt, "lora_path": "a1"})
        assert status == 400
        # the base weights are bit-identical after loads, uses and unloads
        now = base_named_tensors(engine_model)  # the LoRA layers' base weights by HF name
        assert now.keys() == original.keys()
        assert all(torch.equal(now[name], t) for name, t in original.items())


async def test_adapter_push_keeps_the_newest_versions_loaded(ipc, tmp_path):
    state = load_train_state(lora_cfg(), str(tmp_path), False)
    async with serve(ipc, model=BASE) as (worker, client):
        for path in ("tensor", "disk"):
            async def write(directory: Path) -> int:
                return state.save_adapter(directory)

            async def tensors():
                return state.adapter_tensors()

            push = AdapterPush([client], ["w0"], path, tmp_path / path,
                               lora.config_dict(state.lora, BASE), write, tensors, keep=2)
            for version in range(3):
                randomize(state.model, seed=version)
                report = await push.push(version)
                assert report.bytes == sum(t.numel() * 4 for t in state.adapter_tensors()
                                           .values())
            loaded = set(worker.scheduler.adapters.adapters)
            assert {adapter_name(1), adapter_name(2)} <= loaded
            assert adapter_name(0) not in loaded
            if path == "disk":
                assert sorted(p.name for p in (tmp_path / path / "weights").iterdir()) == \
                    ["v1", "v2"]
        # the tensor pushes loaded v0..v2, then the disk pushes loaded the same names again
        # (a resumed trainer pushing its version anew): replaced, not refused
        served = worker.scheduler.adapters.adapters[adapter_name(2)]
        assert served.path.endswith("v2")
        for n, t in lora.adapter_tensors(state.model).items():
            key = n[len(lora.PEFT_PREFIX):].replace(".weight", ".default.weight")
            assert torch.equal(served.tensors[key], t)


HOSTS = """
[run]
name = "lora-test"
shutdown_timeout_s = 5.0

[rl]
model = "base-tiny"
workers = 1
group_size = 8
groups_per_batch = 8
max_staleness = 0
num_steps = {steps}
lr = 1e-3
micro_batch_size = 64
save_every = 10
eval_every = 1000
eval_tasks = 100
lora = {{ rank = 16, alpha = 32, merge_export = true }}
envs = [{{ cls = "envs.builtin.arith:ArithEnv", options = {{ max_operand = 9 }} }}]
"""


@pytest.mark.timeout(400)
def test_lora_run_through_the_launcher_learns_pushes_adapters_and_resumes(tmp_path):
    """A LoRA GRPO run from [rl] (the main job's math domain): greedy math improves over the
    base, each push is the adapter only and the worker's log-probs of fresh samples equal the
    trainer's (fp32), checkpoints are PEFT directories, the run ends with a merged export, and
    a resumed run continues from the adapter it saved."""
    hosts = tmp_path / "hosts.toml"
    run_dir = tmp_path / "run"

    def run(steps: int, resume: bool) -> list[dict]:
        hosts.write_text(HOSTS.format(steps=steps))
        cmd = [sys.executable, "-m", "launch.cluster", str(hosts)]
        cmd += ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:]
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
                .splitlines()]

    records = run(45, False)  # 0.59-0.66 after 30 steps, 0.72-0.75 after 45
    steps = [r["values"] for r in records if r["actor"] == "trainer" and "version" in r["values"]]
    adapter = 2 * 7 * 16 * 2 * 64 * 4  # 2 layers x 7 modules x rank 16 x (in + out ~ 2 x 64)
    for v in steps:
        assert v["train/engine_logprob_abs_diff"] < 1e-5, v  # served with the version's adapter
        assert 0 < v["weight_sync/weight_bytes"] <= 2 * adapter, v  # kilobytes, not the model
    evals = {r["step"]: r["values"]["eval/math"] for r in records
             if "eval/math" in r["values"]}
    final = json.loads((run_dir / "final_eval.json").read_text())["scores"]["math"]
    assert final >= evals[0] + 0.08, (evals, final)  # 0.54 at the base, greedy on 100 tasks
    ckpt = run_dir / "checkpoints" / "step_000030"
    assert (ckpt / "adapter_config.json").is_file() and (ckpt / "adapter_model.safetensors") \
        .is_file()
    merged, _ = load_model(str(run_dir / "merged"), "cpu", torch.float32, 0)
    assert not lora.has_adapters(merged)
    records = run(47, True)
    steps = [r["values"] for r in records if r["actor"] == "trainer" and "version" in r["values"]]
    assert [v["version"] for v in steps][-2:] == [46, 47]
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()
    assert all(v["train/engine_logprob_abs_diff"] < 1e-5 for v in steps[-2:])


def test_auto_sends_adapters_over_cuda_ipc_only_to_workers_on_the_trainers_gpu():
    from engine.weight_push import adapter_paths

    assert adapter_paths("auto", [["0"], ["1"]], ["0"], "cuda:0", 2) == ["cuda_ipc", "tensor"]
    assert adapter_paths("auto", None, ["0"], "cuda:0", 2) == ["tensor", "tensor"]
    assert adapter_paths("auto", [["0"]], [], "cpu", 1) == ["tensor"]
    assert adapter_paths("disk", [["0"]], ["0"], "cuda:0", 1) == ["disk"]
    with pytest.raises(ValueError, match="'distributed'"):
        AdapterPush([], [], ["distributed"], ".", {}, None, None, keep=2)


def test_a_lora_student_distils_from_colocated_teachers(tmp_path):
    """MOPD with a LoRA student: the teachers are whole models in weight memory as before; the
    OPD term trains the adapters only and the reverse KL to each sample's teacher falls."""
    from tests.test_mopd import TEACHERS, samples

    cfg = lora_cfg(loss={"advantage_estimator": "none"}, teachers=TEACHERS,
                   opd={"mode": "full", "kl_coef": 1.0}, teacher_memory={
                       "nvme_dir": str(tmp_path / "nvme")}, optimizer={"lr": 5e-3},
                   micro_batches={"size": 4})
    state = load_train_state(cfg, str(tmp_path), False)
    try:
        frozen = base_tensors(state.model)
        batch = samples(state.tokenizer)
        kls = [train_on_batch(state, batch, cfg)["opd/arith/reverse_kl"] for _ in range(8)]
        assert kls[-1] < 0.8 * kls[0], kls
        assert all(torch.equal(frozen[n], t) for n, t in base_tensors(state.model).items())
    finally:
        state.teachers.close()


@pytest.mark.parametrize("with_lora", [False, True])
def test_activation_checkpointing_recomputes_to_the_same_step(tmp_path, with_lora):
    """activation_checkpointing: the backward recomputes each layer's activations; the step's
    loss, grad norm and updated weights equal the step that kept them (fp32), for a full and a
    LoRA student alike."""
    from training.setup import load_train_state as load

    results = []
    for ckpt in (False, True):
        cfg = lora_cfg(activation_checkpointing=ckpt, kl=KlConfig(coef=0.1, use_kl_loss=True),
                       **({} if with_lora else {"lora": None}))
        state = load(cfg, str(tmp_path / str(ckpt)), False)
        if with_lora:
            randomize(state.model)
        assert state.model.is_activation_checkpointing == ckpt
        calls = []  # each decoder layer's checkpointed forward in the pass with gradients
        for layer in state.model.model.layers:
            inner = getattr(layer, "_gradient_checkpointing_func", None)
            if inner is not None:
                layer._gradient_checkpointing_func = (
                    lambda *a, inner=inner, **k: calls.append(1) or inner(*a, **k))
        stats = train_on_batch(state, batch(state.tokenizer), cfg)
        assert (len(calls) > 0) == ckpt
        assert not state.model.model.layers[0].training  # eval mode again after the pass
        weights = {n: p.detach().clone() for n, p in state.model.named_parameters()
                   if p.requires_grad}
        results.append((stats, weights))
    (a, wa), (b, wb) = results
    for key in ("train/loss", "train/grad_norm", "train/kl_loss"):
        assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), key
    assert wa.keys() == wb.keys()
    assert all(torch.allclose(wa[n], wb[n], atol=1e-6, rtol=0) for n in wa)


def test_lora_dropout_acts_in_the_pass_with_gradients_only(tmp_path):
    """lora.dropout: the adapters' input dropout is on while the policy pass trains (the step
    keeps the rest of the model in eval mode), so it changes the update; off, the same seed
    gives the same update."""
    grads = {}
    for dropout in (0.0, 0.0, 0.5):
        cfg = lora_cfg(lora=LoraConfig(rank=4, alpha=8, dropout=dropout))
        torch.manual_seed(0)
        state = load_train_state(cfg, str(tmp_path), False)
        randomize(state.model)
        stats = train_on_batch(state, batch(state.tokenizer), cfg)
        grads.setdefault(dropout, []).append(stats["train/grad_norm"])
    assert grads[0.0][0] == grads[0.0][1]
    assert grads[0.5][0] != grads[0.0][0]
