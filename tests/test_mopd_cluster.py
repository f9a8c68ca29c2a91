"""Short multi-teacher cluster runs: the teacher pool routes (colocated) or scores (server) every
sample, the trainer distills, versions advance, per-teacher metrics stream."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEACHERS = """[
  {{ name = "arith", model = "examples/teacher-arith", domains = ["math"]{arith_worker} }},
  {{ name = "reverse", model = "examples/teacher-reverse", domains = ["reverse"]{rev_worker} }},
]"""
HOSTS = """
[run]
name = "mopd-test"
progress_interval_s = 1.0
shutdown_timeout_s = 5.0

[[hosts]]
name = "local"

[actors.worker0]
cls = "actors.inference:InferenceWorker"
config = {{ model = "examples/base-tiny" }}
{teacher_workers}
[actors.router]
cls = "actors.router:RouterActor"
after = ["worker0"]
config = {{ router = {{ log_level = "warn" }} }}

[actors.buffer]
cls = "actors.buffer:BufferActor"
config = {{ max_staleness = 1 }}

[actors.teachers]
cls = "actors.teacher_pool:TeacherPool"
after = ["buffer"{pool_after}]
[actors.teachers.config]
mode = "{mode}"
opd = {{ mode = "{opd}", kl_coef = 1.0 }}
teachers = {pool_teachers}

[actors.rollout]
cls = "actors.rollout:RolloutActor"
after = ["router", "buffer", "teachers"]
[actors.rollout.config]
sink = "teachers"
group_size = 4
groups_per_batch = 4
eval_every = 0
envs = [
  {{ cls = "envs.builtin.arith:ArithEnv", options = {{ max_operand = 9 }} }},
  {{ cls = "envs.builtin.reverse:ReverseEnv", options = {{ partial = false }} }},
]

[actors.trainer]
cls = "actors.trainer:TrainerActor"
after = ["worker0", "buffer", "rollout"{trainer_after}]
primary = true
[actors.trainer.config]
model = "examples/base-tiny"
workers = ["worker0"]
num_steps = 3
micro_batches = {{ size = 8 }}
loss = {{ advantage_estimator = "none" }}
opd = {{ mode = "{opd}", kl_coef = 1.0 }}
teachers = {trainer_teachers}
teacher_memory = {{ gpu_slots = 1, host_budget_bytes = 400_000 }}
prefetcher = "{prefetcher}"
{prefetcher_actor}"""
PREFETCHER = """
[actors.prefetcher]
cls = "actors.prefetcher:PrefetcherActor"
"""
TEACHER_WORKERS = """
[actors.tworker_arith]
cls = "actors.inference:InferenceWorker"
config = { model = "examples/teacher-arith" }

[actors.tworker_reverse]
cls = "actors.inference:InferenceWorker"
config = { model = "examples/teacher-reverse" }
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["colocated", "server"])
def test_multi_teacher_run(tmp_path, mode):
    server = mode == "server"
    teachers = TEACHERS.format(
        arith_worker=', worker = "tworker_arith"' if server else "",
        rev_worker=', worker = "tworker_reverse"' if server else "")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(HOSTS.format(
        mode=mode, opd="sampled" if server else "full", pool_teachers=teachers,
        trainer_teachers="[]" if server else teachers,
        teacher_workers=TEACHER_WORKERS if server else "",
        pool_after=', "tworker_arith", "tworker_reverse"' if server else "",
        prefetcher="" if server else "prefetcher",
        trainer_after="" if server else ', "prefetcher"',
        prefetcher_actor="" if server else PREFETCHER))
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["values"] for r in records if r["actor"] == "trainer" and "version" in r["values"]]
    assert [v["version"] for v in steps] == [1, 2, 3]
    # the console tells a distillation run by its KL to the teachers, not by a loss of 0, in
    # 80 columns; its plots draw the KL per teacher
    out = result.stdout
    assert "trainer: step 3/3" in out and "distill_kl=" in out and "arith=" in out, out[-3000:]
    said_loss = re.search(r"(?<![a-z_])loss=0(?![.\d])", out)
    assert not said_loss, out[said_loss.start() - 400:said_loss.end() + 100]
    assert "clipfrac" not in out
    wide = [line for line in out.splitlines() if len(line) > 80 and " " in line.strip()]
    assert not wide, wide
    assert (run_dir / "plots" / "opd.png").stat().st_size > 0
    for v in steps:  # both teachers gave a signal on their own samples
        assert v["opd/arith/tokens"] > 0 and v["opd/reverse/tokens"] > 0
        assert v["opd/arith/reverse_kl"] >= 0 and v["opd/reverse/reverse_kl"] >= 0 or server
    if server:
        pool = [r["values"] for r in records if r["actor"] == "teachers"]
        last = pool[-1]
        assert last["opd/arith/tokens_scored"] > 0 and last["opd/reverse/tokens_scored"] > 0
        assert last["opd/arith/failed_samples"] == 0
        # sampled-token OPD without TIS: warned once, exactly when stale samples were trained on
        stale = any(v["train/staleness_max"] >= 1 for v in steps)
        warned = (run_dir / "logs" / "trainer.log").read_text().count("sampled-token OPD on")
        assert warned == int(stale)
    else:  # one device slot, a host budget of one teacher: both loaded in the first step, then
        # the one left in the slot goes first and only the other is swapped in; the one not on
        # the host is read back from NVMe by the prefetcher process, never by the trainer
        assert [v["opd/teacher_gpu_loads"] for v in steps] == [2, 3, 4]
        assert steps[-1]["opd/teacher_sync_fallbacks"] == 0
        reads = [r["values"] for r in records if r["actor"] == "prefetcher"]
        assert reads and reads[-1]["prefetch/bytes"] >= 315_392
