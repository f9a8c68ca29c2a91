"""A short real RL run: workers behind sglang-router, rollout, buffer, trainer; then a resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import console_messages

ROOT = Path(__file__).resolve().parent.parent
HOSTS = """
[run]
name = "loop-test"
progress_interval_s = 1.0
shutdown_timeout_s = 5.0
plots = false  # ~2 s of CPU per run (tests/test_sinks.py and test_mopd_cluster.py draw them)

[[hosts]]
name = "local"

[actors.worker0]
cls = "actors.inference:InferenceWorker"
config = {{ model = "examples/base-tiny", metrics_interval_s = 0.05 }}

[actors.router]
cls = "actors.router:RouterActor"
after = ["worker0"]
config = {{ router = {{ log_level = "warn" }} }}

[actors.buffer]
cls = "actors.buffer:BufferActor"
config = {{ max_staleness = {staleness} }}

[actors.rollout]
cls = "actors.rollout:RolloutActor"
after = ["router", "buffer"]
[actors.rollout.config]
group_size = 4
groups_per_batch = 4
eval_every = 0
eval_tasks = 8
envs = [
  {{ cls = "envs.builtin.arith:ArithEnv", options = {{ max_operand = 9 }} }},
  {{ cls = "envs.builtin.reverse:ReverseEnv", options = {{ partial = true }} }},
]

[actors.trainer]
cls = "actors.trainer:TrainerActor"
after = ["worker0", "buffer", "rollout"]
primary = true
[actors.trainer.config]
model = "examples/base-tiny"
workers = ["worker0"]
rollout = "rollout"
num_steps = {steps}
mode = "{mode}"
checkpoint = {{ save_every = 2 }}
micro_batches = {{ size = 8 }}
weight_sync = {{ path = "{sync}"{sync_opts} }}
parallel = {{ dp = {dp} }}
"""


def run(tmp_path: Path, run_dir: Path, steps: int, resume: bool = False, staleness: int = 1,
        mode: str = "decoupled", sync: str = "disk", dp: int = 1, sync_opts: str = "",
        shard: str = "none") -> tuple[subprocess.CompletedProcess, list[dict]]:
    hosts = tmp_path / "hosts.toml"
    text = HOSTS.format(steps=steps, staleness=staleness, mode=mode, sync=sync, dp=dp,
                        sync_opts=sync_opts)
    hosts.write_text(text.replace(f"parallel = {{ dp = {dp} }}",
                                  f'parallel = {{ dp = {dp}, shard = "{shard}" }}'))
    cmd = [sys.executable, "-m", "launch.cluster", str(hosts)]
    cmd += ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, [r for r in records if r["actor"] == "trainer" and "version" in r["values"]]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> dict:
    """One run, resumed once, that the tests below read (two cluster runs instead of four):
    4 synchronous steps whose weights go over a process group that cannot form (master_address
    192.0.2.1, TEST-NET, is no address of this host: every version falls back to disk), then a
    resume to 6 steps, overlapped, on two data-parallel ranks that shard the model (FSDP2),
    whose weights go over a process group with the worker (gloo), then once more with nothing
    left to do."""
    tmp_path = tmp_path_factory.mktemp("loop")
    run_dir = tmp_path / "run"
    first, first_steps = run(tmp_path, run_dir, steps=4, staleness=0, sync="distributed",
                             sync_opts=', master_address = "192.0.2.1", retries = 0')
    weights_after_first = sorted(p.name for p in (run_dir / "weights").iterdir()) \
        if (run_dir / "weights").is_dir() else []
    final = json.loads((run_dir / "final_eval.json").read_text()) \
        if (run_dir / "final_eval.json").exists() else None
    if first.returncode != 0:
        return {"first": first, "first_steps": first_steps, "run_dir": run_dir}
    resumed, steps = run(tmp_path, run_dir, steps=6, resume=True, staleness=1, dp=2,
                         shard="fsdp2", sync="distributed")
    again = subprocess.run([sys.executable, "-m", "launch.cluster", str(tmp_path / "hosts.toml"),
                            "--resume", str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
    return {"first": first, "first_steps": first_steps, "weights_after_first": weights_after_first,
            "final": final, "resumed": resumed, "steps": steps, "again": again,
            "run_dir": run_dir}


def _first(short_run: dict) -> tuple[subprocess.CompletedProcess, list[dict]]:
    result = short_run["first"]
    assert result.returncode == 0, result.stdout[-3000:]
    return result, short_run["first_steps"]


def _resumed(short_run: dict) -> tuple[subprocess.CompletedProcess, list[dict]]:
    _first(short_run)
    result = short_run["resumed"]
    assert result.returncode == 0, result.stdout[-3000:]
    return result, short_run["steps"]


@pytest.mark.timeout(600)  # the fixture's two cluster runs of ~30-60 s each on 2 cores
def test_short_run_advances_versions_with_aligned_logprobs(short_run):
    _, steps = _first(short_run)
    run_dir = short_run["run_dir"]
    assert [r["values"]["version"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        v = r["values"]
        assert v["train/staleness_max"] == 0  # synchronous: every sample is fresh
        assert v["train/fresh_tokens"] == v["train/tokens"] > 0
        assert v["train/logprob_abs_diff"] < 1e-5, v  # fp32: worker and trainer agree
        assert v["train/engine_logprob_abs_diff"] < 1e-5, v  # disk carried the weights
        assert v["train/samples"] == 16
        assert {"reward/math", "reward/reverse"} <= set(v)
    final = short_run["final"]
    assert final["version"] == 4 and set(final["scores"]) == {"math", "reverse"}
    assert (run_dir / "checkpoints" / "step_000004" / "trainer_state.pt").exists()


@pytest.mark.timeout(600)
def test_a_failing_distributed_push_falls_back_to_disk(short_run):
    """No group can form, so every version goes through disk, said on the console with the
    cause, and the run completes."""
    result, steps = _first(short_run)
    # the first push (version 0) and one per step went through disk
    assert [r["values"]["weight_sync/fallbacks"] for r in steps] == [2, 3, 4, 5]
    assert short_run["weights_after_first"] == ["v3", "v4"]  # keep_versions = 2
    notices = [m for m in console_messages(result.stdout) if "sent through disk" in m]
    assert len(notices) == 5, result.stdout[-3000:]
    assert "weight version 4 over distributed failed" in notices[-1]
    assert "master_address '192.0.2.1'" in notices[-1]


@pytest.mark.timeout(600)
def test_a_resumed_run_continues_on_two_sharded_ranks(short_run):
    """The resume continues the run to 6 steps from the step-4 checkpoint, overlapped and on two
    data-parallel ranks that shard the model (FSDP2: both load the checkpoint, refuse to start
    if they differ, then shard it; each push gathers the whole model to rank 0)."""
    result, steps = _resumed(short_run)
    run_dir = short_run["run_dir"]
    assert [r["values"]["version"] for r in steps][-2:] == [5, 6]
    assert all(r["values"]["train/staleness_max"] <= 1 for r in steps[-2:])
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "resumed from" in trainer_log and "step_000004" in trainer_log
    assert "resumed from" in (run_dir / "logs" / "trainer.rank1.log").read_text()
    assert steps[-1]["values"]["train/samples"] == 16  # the whole batch, over both ranks
    assert steps[-1]["values"]["train/dp_size"] == 2
    # the sharded forward is the worker's function: the first batch after the resume was
    # generated wholly by the checkpoint's weights (later ones mix versions per token)
    first = steps[-2]["values"]
    assert first["train/fresh_tokens"] > 0 and first["train/engine_logprob_abs_diff"] < 1e-5
    assert any("resumed from the checkpoint of step 4 (weight version 4); 2 of 6 steps to go"
               in m for m in console_messages(result.stdout))  # said on the console
    # once more: nothing is left to do, and nothing starts
    again = short_run["again"]
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already complete (trainer finished at step 6 of num_steps = 6)" in again.stdout


@pytest.mark.timeout(600)
def test_weights_over_a_process_group(short_run):
    """The resumed run's versions (4, its checkpoint's, then 5 and 6) are broadcast to the
    worker over gloo, gathered from the two sharded ranks, never written to disk."""
    _, steps = _resumed(short_run)
    run_dir = short_run["run_dir"]
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == \
        short_run["weights_after_first"]  # nothing written since the first run
    assert [r["values"]["weight_sync/fallbacks"] for r in steps[-2:]] == [0, 0]
    # the worker generated with the trainer's broadcast weights: the first batch after the
    # resume was generated wholly by version 4 (trained weights, broadcast at the start), so a
    # missing or partial update would show as a mismatch of order 1e-2 or more against the
    # worker's own base-tiny (later batches mix versions per token: staleness 1)
    assert steps[-2]["values"]["train/engine_logprob_abs_diff"] < 1e-5, steps[-2]["values"]


@pytest.mark.timeout(300)
def test_colocated_synchronous_run(tmp_path):
    """Colocated, weights in the request body, the trainer on two data-parallel ranks."""
    run_dir = tmp_path / "run"
    result, steps = run(tmp_path, run_dir, steps=2, staleness=0, mode="colocated", sync="tensor",
                        dp=2)
    assert result.returncode == 0, result.stdout[-3000:]
    assert [r["values"]["version"] for r in steps] == [1, 2]
    # weights in the request body: nothing written per version, and the worker serves them exactly
    assert not (run_dir / "weights").exists()
    assert all(r["values"]["train/engine_logprob_abs_diff"] < 1e-5 for r in steps)
    assert all(r["values"]["train/staleness_max"] == 0 for r in steps)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    memory = {}
    for r in records:
        if r["actor"] == "trainer":
            for k, v in r["values"].items():
                if k.startswith("memory/"):
                    memory.setdefault(k, []).append(v)
    # asleep while the workers generate: every storage of the step's tensors parked (0 bytes on
    # the device), awake to train: all of them back, the same bytes each time; moved both ways
    assert set(memory["memory/generate/trainer_device_bytes"]) == {0.0}
    # (the first step wakes the parameters alone: AdamW makes its state and the gradients
    # appear in that step, so the second wake brings back more than twice as much)
    awake = memory["memory/train/trainer_device_bytes"]
    assert len(awake) == 2 and awake[1] > 2 * awake[0] > 0
    assert memory["memory/train/trainer_move/moved_bytes"] == awake
    assert min(memory["memory/generate/trainer_move/moved_bytes"]) > 0
    # the last step's checkpoint was written while awake, before the trainer slept
    assert (run_dir / "checkpoints" / "step_000002" / "trainer_state.pt").exists()
    worker = [r["values"] for r in records if r["actor"] == "worker0"]
    released = {v["memory/device_bytes"] for v in worker if v["memory/released"] == 1.0}
    held = {v["memory/device_bytes"] for v in worker if v["memory/released"] == 0.0}
    assert 0.0 in released  # the worker gave its weights up while the trainer trained
    assert held and min(held) > 0
