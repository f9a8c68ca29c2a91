"""The megatron trainer on several ranks (training/ranks.py): TP=2, PP=2 and DP=2 steps against
one rank, the weights a push gathers, checkpoints resumed at another layout, and a short RL run
through the launcher at TP=2, all on CPU over gloo.

Megatron-core runs on the CPU here only through the test-only torch.cuda stand-ins
(backends/megatron/cpu_shim.py), armed in every process started with tests/megatron_shim on
PYTHONPATH (the driver below, the launcher, the actors and the trainer's rank processes). One
driver process plays the trainer actor (rank 0) for every layout in turn (each layout starts its
own rank process) and reports to the parent, so one start-up serves every assertion.

Tolerance of "equal to the one-rank step": the sharded steps sum the same float32 products in
another order (TP: row-parallel matmuls reduce partial sums across ranks; DP: gradients summed
over ranks; PP: the same per-stage math), so gradients agree to ~1e-7 relative; compared at
rel 1e-5 (loss, gradient norm). AdamW's first update is lr * g / (|g| + eps), lr * sign(g) for
almost every weight; the few weights whose gradient is near eps (1e-8) turn that fp32 noise
into update differences of a few percent of lr. So: every weight within 5% of one update
(0.05 * lr = 5e-5) of the one-rank weight, and 99.9% of them within 1e-7 (a wrong shard, a
missing reduction or lost optimizer state moves whole tensors by about lr = 1e-3).
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import msgspec
import pytest
import torch

from tests.helpers import metric_records, trainer_steps

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parent.parent
SHIM_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    filter(None, [str(ROOT / "tests" / "megatron_shim"), os.environ.get("PYTHONPATH")]))}
LR = 1e-3
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "dp2": dict(dp=2),
           "dp2do": dict(dp=2, distributed_optimizer=True)}  # the distributed optimizer
pytestmark = pytest.mark.timeout(600)  # whichever test comes first waits for the module's runs


def driver(tmp: str) -> None:
    """Child entry (rank 0 of every layout): writes report.pt, or error.txt on failure."""
    warnings.simplefilter("ignore")
    try:
        torch.save(_drive(Path(tmp)), Path(tmp) / "report.pt")
    except BaseException:
        (Path(tmp) / "error.txt").write_text(traceback.format_exc())
        raise


def _drive(tmp: Path) -> dict:
    from safetensors.torch import load_file

    from bench.train_parallel import Trainer, at_layout, base_config, make_batch
    from models.load import load_tokenizer

    model = "examples/base-tiny"
    vocab = len(load_tokenizer(model))
    first, second = make_batch(8, vocab, seed=0), make_batch(8, vocab, seed=1)
    cfg = base_config(model, "cpu", "float32", timeout_s=60)
    report: dict = {}
    with Trainer(cfg, tmp / "one") as one:
        report["one"] = {"stats": one.step(first)[0], "weights": one.weights()}
        report["one_second"] = {"stats": one.step(second)[0], "weights": one.weights()}
    for name, layout in LAYOUTS.items():
        with Trainer(at_layout(cfg, **layout), tmp / name) as many:
            stats = many.step(first)[0]
            out = {"stats": stats, "weights": many.weights(),
                   "digests": many.ranks.all_digests(many.state.model)}
            if name != "dp2":  # the checkpoints every rank writes, resumed at one rank below
                many.ranks.save_checkpoint(many.state,
                                           tmp / name / "checkpoints" / "step_000001")
            if name in ("tp2", "pp2"):  # a streamed push's read, whole and left early
                out["stream"] = _read_streamed(many)
            if name == "dp2do":  # this replica's range of the optimizer state
                opt = many.state.optimizer
                out["optimizer"] = {"range": opt.master[0].numel(), "params": opt.numel,
                                    "moments": [v.numel() for v in opt.state[opt.master[0]]
                                                .values() if v.dim()]}
            if name == "tp2":  # the HF export a disk push writes, gathered from both shards
                many.ranks.save_weights(many.state, tmp / "push")
                out["pushed"] = load_file(tmp / "push" / "model.safetensors")
                # an export that cannot be written (its directory is a file): the error, and
                # the ranks finish the gather, so the next command still works
                (tmp / "bad.tmp").write_text("not a directory")
                try:
                    many.ranks.save_weights(many.state, tmp / "bad")
                    out["bad_export"] = ""
                except OSError as e:
                    out["bad_export"] = type(e).__name__
                out["digests_after_bad_export"] = many.ranks.all_digests(many.state.model)
            report[name] = out
    # colocated distillation at TP=2: each tensor rank holds its rows of the teacher
    from algos.opd import OpdConfig
    from logic.teachers import TeacherSpec

    distill = msgspec.structs.replace(cfg, teachers=[TeacherSpec(
        name="arith", model="examples/teacher-arith", domains=["d"])],
        opd=OpdConfig(mode="full", kl_coef=1.0))
    taught = [msgspec.structs.replace(x, teacher="arith") for x in first]
    for name, layout in (("one_opd", {}), ("tp2_opd", {"tp": 2})):
        with Trainer(at_layout(distill, **layout), tmp / name) as run:
            stats = run.step(taught)[0]
            teacher = run.state.teachers.memory.sets["teacher:arith"].layout.total_bytes
            report[name] = {"stats": stats, "weights": run.weights(), "teacher_bytes": teacher}
    for name in ("tp2", "pp2", "dp2do"):
        with Trainer(cfg, tmp / name, resume=True) as back:
            resumed = back.weights()
            step = back.state.step
            report[f"{name}_resumed"] = {"weights": resumed, "step": step,
                                         "stats": back.step(second)[0],
                                         "after": back.weights()}
    return report


STREAM_BUCKET = 16 << 10  # bytes: the tiny model (0.3 MB) in about 20 buckets


def _read_streamed(many) -> dict:
    """What an in-memory push reads from the sharded trainer (engine.weight_sync.WeightStream
    over training.ranks' stream, in a compute thread as the actor runs it): every tensor once,
    the most bytes of gathered tensors held at once, and a read stopped after two buckets (a
    failed push) after which the ranks still take commands in step."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from engine.weight_sync import WeightStream

    pool = ThreadPoolExecutor(1)
    stream = WeightStream(lambda: many.ranks.stream_weights(many.state), pool, copies=True)

    async def read(stop_after: int = 0) -> dict:
        got, n = {}, 0
        async with stream.buckets(STREAM_BUCKET) as parts:
            async for bucket, _ in parts:
                got.update({k: v.detach().float().clone() for k, v in bucket})
                del bucket
                n += 1
                if n == stop_after:
                    break
        return got

    weights = asyncio.run(read())
    held, total = stream.peak_held_bytes, stream.bytes_read
    asyncio.run(read(stop_after=2))
    digests = many.ranks.all_digests(many.state.model)
    pool.shutdown()
    return {"weights": weights, "held": held, "total": total, "digests_after": digests}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The launcher's RL run (test_rl_loop_from_hosts_toml_with_megatron_tp2) in the background
    while the driver runs: both leave a core idle much of the time. Both are over before any
    test of this module asserts."""
    tmp = tmp_path_factory.mktemp("parallel")
    hosts = tmp / "hosts.toml"
    hosts.write_text(HOSTS)
    with open(tmp / "launcher.out", "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts),
                                     "--run-dir", str(tmp / "run")], cwd=ROOT, env=SHIM_ENV,
                                    stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        code = f"from tests.test_trainer_parallel import driver; driver({str(tmp)!r})"
        driven = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=SHIM_ENV,
                                capture_output=True, text=True, timeout=240)
        launcher.wait(240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    return {"tmp": tmp, "driver": driven, "launcher": launcher.returncode}


@pytest.fixture(scope="module")
def report(runs) -> dict:
    tmp = runs["tmp"]
    error = tmp / "error.txt"
    assert not error.exists(), error.read_text() + "\n" + "\n".join(
        f"{p.name}:\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*/logs/*.log")))
    assert runs["driver"].returncode == 0, runs["driver"].stderr[-3000:]
    return torch.load(tmp / "report.pt", weights_only=False)


def assert_close_to_one_rank(got: dict, want: dict) -> None:
    """Within the module docstring's tolerance of the one-rank weights."""
    assert set(got) == set(want)
    close = total = 0
    for key, value in want.items():
        diff = (got[key] - value).abs()
        assert float(diff.max()) <= 0.05 * LR, (key, float(diff.max()))
        close += int((diff <= 1e-7).sum())
        total += diff.numel()
    assert close >= 0.999 * total, (close, total)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sharded_step_equals_the_one_rank_step(report, name):
    """TP=2 (each rank half of every layer), PP=2 (a layer per stage, megatron's 1F1B
    schedule), DP=2 (half the micro-batches each): the step, the gathered weights and the
    statistics rank 0 reports equal one rank's."""
    got, want = report[name], report["one"]
    assert got["stats"]["train/grad_norm"] == pytest.approx(want["stats"]["train/grad_norm"],
                                                            rel=1e-5)
    assert got["stats"]["train/grad_norm"] > 0.1
    for key in ("train/tokens", "train/samples", "train/entropy", "train/logprob_abs_diff"):
        assert got["stats"][key] == pytest.approx(want["stats"][key], rel=1e-5), key
    layout = LAYOUTS[name]
    assert got["stats"]["train/tp_size"] == layout.get("tp", 1)
    assert got["stats"]["train/pp_size"] == layout.get("pp", 1)
    assert got["stats"]["train/dp_size"] == layout.get("dp", 1)
    assert_close_to_one_rank(got["weights"], want["weights"])
    moved = max(float((want["weights"][k] - report["one_second"]["weights"][k]).abs().max())
                for k in want["weights"])
    assert moved > 0.5 * LR  # the steps did move the weights
    if layout.get("dp"):  # the two replicas hold identical weights
        assert len(set(got["digests"])) == 1
    else:  # two different shards
        assert len(set(got["digests"])) == 2


def test_the_pushed_export_is_the_gathered_model(report):
    """The HF directory a disk push writes at TP=2 holds exactly the weights gathered to rank
    0 (every HF tensor, the tied lm_head left out as save_pretrained does); an export that
    fails on rank 0 raises there and leaves the ranks in step."""
    assert report["tp2"]["bad_export"] == "FileExistsError"
    assert report["tp2"]["digests_after_bad_export"] == report["tp2"]["digests"]
    pushed, gathered = report["tp2"]["pushed"], report["tp2"]["weights"]
    assert set(pushed) == set(gathered) and "lm_head.weight" not in pushed
    for key, value in gathered.items():
        assert torch.equal(pushed[key].float(), value), key


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_a_push_streams_the_sharded_model_one_bucket_at_a_time(report, name):
    """A push from the sharded trainer reads exactly the gathered model, holding at most one
    bucket and the tensor after it (never the whole model, as the earlier gather-then-send did);
    a push that fails midway still finishes the ranks' gather, so the next command works."""
    got = report[name]["stream"]
    want = report[name]["weights"]
    assert set(got["weights"]) == set(want)
    for key, value in want.items():
        assert torch.equal(got["weights"][key], value), key
    largest = max(v.numel() * 4 for v in want.values())  # fp32
    assert got["total"] == sum(v.numel() * 4 for v in want.values())
    assert 0 < got["held"] <= max(STREAM_BUCKET, largest) + largest, got["held"]
    assert got["held"] < got["total"] / 3, (got["held"], got["total"])
    assert got["digests_after"] == report[name]["digests"]


def test_the_distributed_optimizer_gives_the_replicated_update_from_half_the_state(report):
    """DP=2 with the distributed optimizer: each replica steps its half of the flattened
    parameters (AdamW's moments and main weights for half the elements), its gradients
    reduce-scattered and clipped by a norm taken from the halves; the update is the replicated
    DP=2 update (AdamW is elementwise; two fp32 replicas sum to the same numbers, only the
    norm's summation order differs: within 1e-7, far inside the one-rank tolerance)."""
    got, want = report["dp2do"]["weights"], report["dp2"]["weights"]
    assert set(got) == set(want)
    for key, value in want.items():
        assert float((got[key] - value).abs().max()) <= 1e-7, key
    assert report["dp2do"]["stats"]["train/grad_norm"] == pytest.approx(
        report["dp2"]["stats"]["train/grad_norm"], rel=1e-6)
    opt = report["dp2do"]["optimizer"]
    assert opt["range"] == -(-opt["params"] // 2) and opt["params"] > 70_000
    assert opt["moments"] == [opt["range"], opt["range"]]  # exp_avg, exp_avg_sq: half each


def test_colocated_teachers_at_tp2_hold_half_their_layers_and_give_the_same_step(report):
    """Distillation from a colocated teacher at TP=2: each tensor rank keeps its rows of the
    teacher's linear layers (training/teacher_weights.py RowShard), and the step (full-vocabulary
    reverse KL to the teacher) equals the one-rank step within the module's tolerance."""
    one, tp2 = report["one_opd"], report["tp2_opd"]
    assert 0.5 * one["teacher_bytes"] < tp2["teacher_bytes"] < 0.75 * one["teacher_bytes"]
    keys = ["opd/arith/reverse_kl", "opd/arith/tokens"]
    assert one["stats"]["opd/arith/reverse_kl"] > 0.01 and one["stats"]["opd/arith/tokens"] > 0
    for key in keys:
        assert tp2["stats"][key] == pytest.approx(one["stats"][key], rel=1e-4, abs=1e-6), key
    assert_close_to_one_rank(tp2["weights"], one["weights"])


@pytest.mark.parametrize("name", ["tp2", "pp2", "dp2do"])
def test_a_sharded_checkpoint_resumes_at_one_rank(report, name):
    """Written by both ranks at TP=2 (PP=2), loaded at TP=PP=1: the same weights exactly, and
    the next step (AdamW moments resharded with the weights) equals one rank's second step."""
    back = report[f"{name}_resumed"]
    assert back["step"] == 1
    for key, value in report[name]["weights"].items():
        assert torch.equal(back["weights"][key], value), key
    assert back["stats"]["train/grad_norm"] == pytest.approx(
        report["one_second"]["stats"]["train/grad_norm"], rel=1e-4)
    assert_close_to_one_rank(back["after"], report["one_second"]["weights"])


HOSTS = """
[run]
name = "megatron-tp2"
progress_interval_s = 1.0
shutdown_timeout_s = 5.0
ready_timeout_s = 180.0  # the driver's ranks load the machine while the trainer starts

[[hosts]]
name = "local"

[actors.worker0]
cls = "actors.inference:InferenceWorker"
config = { model = "examples/base-tiny" }

[actors.buffer]
cls = "actors.buffer:BufferActor"
config = { max_staleness = 0 }

[actors.rollout]
cls = "actors.rollout:RolloutActor"
after = ["worker0", "buffer"]
[actors.rollout.config]
router = "worker0"
group_size = 4
groups_per_batch = 2
eval_every = 0
envs = [{ cls = "envs.builtin.arith:ArithEnv", options = { max_operand = 9 } }]

[actors.trainer]
cls = "actors.trainer:TrainerActor"
after = ["worker0", "buffer"]  # starts beside the rollout
primary = true
start_timeout_s = 150.0  # megatron's import took 16 s and the start 38 s in a loaded CI run
[actors.trainer.config]
model = "examples/base-tiny"
backend = "megatron"
workers = ["worker0"]
num_steps = 2
micro_batches = { size = 4 }
parallel = { tp = 2, timeout_s = 120 }
weight_sync = { path = "tensor", bucket_mib = 0.015625 }  # 16 KiB: streamed from the shards
"""


def test_rl_loop_from_hosts_toml_with_megatron_tp2(runs):
    """The launcher runs the trainer actor as rank 0 of TP=2; its rank 1 is a process it
    starts. The worker serves the pushed versions: its log-probs of version 1's samples equal
    the sharded trainer's, so the gathered push is the trained model."""
    run_dir = runs["tmp"] / "run"
    logs = run_dir / "logs"
    assert runs["launcher"] == 0, (runs["tmp"] / "launcher.out").read_text()[-3000:] + \
        "\n".join(p.read_text()[-2000:] for p in sorted(logs.glob("trainer*.log")))
    records = metric_records(run_dir)
    steps = trainer_steps(records)
    assert [v["version"] for v in steps] == [1, 2]
    for v in steps:
        assert v["train/tp_size"] == 2 and v["train/samples"] == 8
        assert v["train/fresh_tokens"] == v["train/tokens"] > 0
        assert v["train/engine_logprob_abs_diff"] < 1e-4, v  # fp32 megatron vs transformers
    pushes = [r["values"] for r in records if r["actor"] == "trainer"
              and "weight_sync/push_held_bytes" in r["values"]]
    assert pushes, "no streamed push recorded"
    for v in pushes:  # each version streamed from the shards: about one bucket held at a time
        assert v["weight_sync/weight_bytes"] > 250_000  # the tiny model in fp32
        assert v["weight_sync/push_held_bytes"] < v["weight_sync/weight_bytes"] / 3, v
    assert "rank1" in (logs / "trainer.rank1.log").read_text()
    checkpoint = run_dir / "checkpoints" / "step_000002"
    assert (checkpoint / "megatron" / "trainer_state.json").is_file()
    assert (checkpoint / "model.safetensors").is_file()  # the HF export


def test_the_example_resolves_to_a_tp2_megatron_trainer():
    from actors.trainer import TrainerActor, TrainerConfig
    from launch.config import load

    entry = load(ROOT / "examples" / "megatron-tp2.toml").actors["trainer"]
    cfg = msgspec.convert(entry.config, TrainerConfig)
    par = cfg.parallel
    assert (cfg.backend, par.tp, par.pp, par.dp, par.world_size) == ("megatron", 2, 1, 1, 2)
    assert [par.device(cfg.device, r) for r in range(2)] == ["cuda:0", "cuda:1"]
    TrainerActor.check_config(cfg)  # CUDA devices: accepted without the CPU stand-ins


@pytest.mark.parametrize("parallel, words", [
    ({"tp": 3}, r"parallel.tp = 3 does not fit examples/base-tiny: num_heads=4 is not divisible"),
    ({"pp": 3}, r"parallel.pp = 3 does not fit examples/base-tiny: its 2 layers do not split"),
])
def test_a_layout_the_model_cannot_take_is_refused_at_load(parallel, words):
    from actors.trainer import TrainerActor, TrainerConfig

    with pytest.raises(ValueError, match=words):
        TrainerActor.check_config(msgspec.convert(
            {"model": "examples/base-tiny", "workers": ["w"], "backend": "megatron",
             "device": "cuda:0", "parallel": parallel}, TrainerConfig))
