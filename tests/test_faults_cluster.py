"""The RL loop under faults, as a user runs it (launcher, real processes): kill -9 of the buffer,
the trainer or a worker mid-run, and a verifier that raises. Each run must complete with every
step trained and the buffer's books balanced; a verifier that always raises must end the run
(exit 1) with the exception on the console instead of a silent hang."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import MessageReader, actor_processes
from tests.test_loop import HOSTS

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8


def start(tmp_path: Path, env: str = "envs.builtin.arith:ArithEnv", steps: int = STEPS,
          max_failed_batches: int = 3, only: bool = False, tolerate: bool = False
          ) -> tuple[subprocess.Popen, Path]:
    """The short loop of tests/test_loop.py (staleness 1, a checkpoint every 2 steps) with
    `env` for the arithmetic domain (`only`: no other domain; `tolerate`: [run]
    tolerate_failures, so failed episodes do not fail a run that completes)."""
    text = HOSTS.format(steps=steps, staleness=1, mode="decoupled", sync="disk", dp=1,
                        sync_opts="")
    if only:
        text = text.replace('  {{ cls = "envs.builtin.reverse:ReverseEnv", options = {{ partial = '
                            'true }} }},\n'.replace("{{", "{").replace("}}", "}"), "")
    text = text.replace('{ cls = "envs.builtin.arith:ArithEnv", options = { max_operand = 9 } },',
                        f'{{ cls = "{env}", options = {{ max_operand = 9 }} }},')
    text = text.replace("eval_every = 0\n", f"eval_every = 0\nmax_failed_batches = "
                        f"{max_failed_batches}\nfailure_notice_interval_s = 0.0\n")
    text = text.replace("progress_interval_s = 1.0", "progress_interval_s = 0.0\n"
                        f"request_retry_s = 3.0\ntolerate_failures = {str(tolerate).lower()}")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(text)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, run_dir


def read_until(proc: subprocess.Popen, pattern: str, lines: list[str],
               timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    reader = MessageReader()  # a message wrapped at 80 columns is matched whole
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if re.search(pattern, reader.add(line)):
            return
    raise AssertionError(f"never saw {pattern!r}:\n{''.join(lines[-60:])}")


def actor_process(proc: subprocess.Popen, name: str) -> psutil.Process:
    child = actor_processes(proc.pid).get(name)
    if child is None:
        raise AssertionError(f"no process for actor {name}")
    return child


def finish(proc: subprocess.Popen, lines: list[str], timeout_s: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()
        proc.wait()
    return "".join(lines) + out


def trainer_steps(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["actor"] == "trainer" and "version" in r["values"]]


def buffer_books(run_dir: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["actor"] == "buffer"][-1]["values"]


def assert_completed(proc_out: str, code: int, run_dir: Path) -> list[dict]:
    assert code == 0, proc_out[-4000:]
    steps = trainer_steps(run_dir)
    assert steps[-1]["values"]["version"] == STEPS
    assert json.loads((run_dir / "final_eval.json").read_text())["version"] == STEPS
    books = buffer_books(run_dir)
    dropped = sum(v for k, v in books.items() if k.startswith("buffer/dropped_"))
    assert books["buffer/added"] == books["buffer/emitted"] + books["buffer/pending"] + dropped
    return steps


@pytest.mark.timeout(420)
def test_kill_9_of_buffer_trainer_and_worker_with_a_flaky_verifier_and_the_run_completes(
        tmp_path):
    """One run, three faults in turn, while the verifier raises on about a quarter of the
    tasks: kill -9 of the buffer, then of the trainer between checkpoints, then of the only
    worker; the run completes every step and the buffer's books balance."""
    proc, run_dir = start(tmp_path, env="tests.faulty_envs:SometimesBroken", tolerate=True)
    lines: list[str] = []
    for victim, after_step in (("buffer", 2), ("trainer", 5), ("worker0", 6)):
        read_until(proc, rf"trainer: step {after_step}/", lines)
        actor_process(proc, victim).send_signal(signal.SIGKILL)
        read_until(proc, rf"{victim} failed .*restart 1/", lines)
    out = finish(proc, lines)
    steps = assert_completed(out, proc.returncode, run_dir)
    flat = " ".join(out.split())  # notices are wrapped at 80 columns
    assert "buffer: restored from its journal" in flat
    # the trainer resumed from its step-4 checkpoint and trained steps 4-5 again on the same
    # batches the buffer had handed out for them
    assert "trainer restarted at step 4" in flat
    assert max(r["values"].get("train/staleness_max", 0) for r in steps) <= 1
    assert re.search(r"rollout: \d+/16 episodes failed in batch \d+ \(math: \d+.*?\); last: "
                     r"math task '.*' .*ZeroDivisionError: verifier bug on task", flat), out[-3000:]
    # tolerated: the run exits 0 (assert_completed) and still says what failed, at the end
    assert re.search(r"failures: \d+ episode\(s\) failed \(\d+ in their environment", flat)
    assert json.loads((run_dir / "exit.json").read_text())["failures"]["env_failed"] > 0


@pytest.mark.timeout(300)
def test_a_verifier_that_always_raises_ends_the_run_with_its_error(tmp_path):
    proc, run_dir = start(tmp_path, env="tests.faulty_envs:AlwaysBroken", max_failed_batches=2,
                          only=True)
    out = finish(proc, [])
    assert proc.returncode == 1, out[-3000:]
    flat = " ".join(out.split())  # notices are wrapped at 80 columns
    assert "rollout ended the run: EndRun: every episode of 2 consecutive batches failed" in flat
    assert "RuntimeError: the verifier's service is down" in flat
