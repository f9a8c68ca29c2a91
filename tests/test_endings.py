"""Honest endings through the launcher, on the real RL loop: a verifier that raises on about a
quarter of the tasks (tests/faulty_envs.py SometimesBroken) lets every step run, and the run
still ends with exit code 1 and a summary of what failed (counts, the first error with its
environment and task); the rollout's samples of every batch and every evaluation response are
in samples/*.jsonl, and the console shows a sample per domain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_loop import HOSTS

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(300)
def test_failed_episodes_end_a_complete_run_with_exit_1_a_summary_and_their_samples(tmp_path):
    text = HOSTS.format(steps=STEPS, staleness=1, mode="decoupled", sync="disk", dp=1,
                        sync_opts="")
    text = text.replace('{ cls = "envs.builtin.arith:ArithEnv", options = { max_operand = 9 } },',
                        '{ cls = "tests.faulty_envs:SometimesBroken", options = { max_operand '
                        '= 9 } },')
    text = text.replace("eval_every = 0\n", "eval_every = 2\nsamples_per_batch = 3\n")
    text = text.replace("progress_interval_s = 1.0", "progress_interval_s = 1.0\n"
                        "show_samples_every = 1")
    assert "SometimesBroken" in text and "eval_every = 2" in text
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(text)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                           str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 1, out[-4000:] + proc.stderr[-2000:]
    flat = " ".join(out.split())
    done = json.loads((run_dir / "exit.json").read_text())
    failures = done["failures"]
    # every step ran: the trainer completed; the failures alone make it exit 1
    assert done["completed"] == "trainer" and done["exit_code"] == 1
    assert done["reason"] == (f"trainer completed, but {failures['env_failed']} episode(s) "
                              f"failed in their environment ([run] tolerate_failures = false)")
    records = jsonl(run_dir / "metrics.jsonl")
    batches = {r["step"]: r["values"] for r in records
               if r["actor"] == "rollout" and "rollout/failed" in r["values"]}
    assert failures["train_failed"] == sum(v["rollout/failed"] for v in batches.values()) > 0
    assert failures["by_domain"] == {"math": failures["train_failed"]}  # reverse never fails
    assert failures["generation_failed"] == 0 and failures["tolerated"] is False
    first = failures["first"]
    assert first["env"] == "SometimesBroken" and first["domain"] == "math"
    assert first["error"] == f"ZeroDivisionError: verifier bug on task {first['task']}"
    assert (f"failures: {failures['episodes_failed']} episode(s) failed "
            f"({failures['env_failed']} in their environment); {failures['train_failed']} in "
            f"training batches (math {failures['train_failed']})") in flat
    assert (f"first: SometimesBroken, math task '{first['task']}' ({first['kind']} episode "
            f"{first['episode']}): ZeroDivisionError: verifier bug on task") in flat
    assert "run ended with exit code 1: trainer completed every step, but" in flat
    assert "set [run] tolerate_failures = true to accept such a run" in flat
    assert "run complete" not in out
    # samples: each batch's 3 (one per domain in turn) and its first failed math episode
    rows = jsonl(run_dir / "samples" / "rollout.jsonl")
    assert {r["step"] for r in rows} == set(batches)
    for step, values in batches.items():
        mine = [r for r in rows if r["step"] == step]
        ok = [r for r in mine if r["status"] == "ok"]
        assert len(ok) == 3 and {r["domain"] for r in ok} == {"math", "reverse"}
        bad = [r for r in mine if r["status"] != "ok"]
        assert len(bad) == int(values["rollout/failed"] > 0)
        for r in bad:
            assert r["cause"] == "env" and r["env"] == "SometimesBroken"
            assert r["error"] == f"ZeroDivisionError: verifier bug on task {r['task']}"
        for r in ok:
            assert r["prompt"] and r["env"] in ("SometimesBroken", "ReverseEnv")
            assert r["prompt"].startswith("rev ") == (r["domain"] == "reverse")
    # every evaluation response: 8 tasks per domain, at the weight version it scored
    evals = jsonl(run_dir / "samples" / "eval.jsonl")
    scored = {r["step"]: r["values"] for r in records if "eval/math" in r["values"]}
    assert sorted({r["step"] for r in evals}) == sorted(scored) and scored
    for version, values in scored.items():
        mine = [r for r in evals if r["step"] == version]
        assert sorted(r["domain"] for r in mine) == ["math"] * 8 + ["reverse"] * 8
        for domain in ("math", "reverse"):
            rewards = [r["reward"] for r in mine if r["domain"] == domain]
            assert sum(rewards) / 8 == pytest.approx(values[f"eval/{domain}"])
    assert failures["eval_failed"] == sum(r["status"] != "ok" for r in evals)
    # the console: one sample per domain of a batch
    assert "rollout: samples of batch 0:" in out
    shown = out[out.index("rollout: samples of batch 0:"):].splitlines()[1:3]
    assert [ln.split(":")[0].strip() for ln in shown] == ["math", "reverse"], shown
