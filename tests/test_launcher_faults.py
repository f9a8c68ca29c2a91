"""The launcher under faults: restarts that fail before READY, interrupted runs, a full disk,
mistakes found at load. Real launcher processes on tmp hosts.toml files (tests/test_cluster.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.test_cluster import IDLE_PAIR, ROOT, exit_info, launch, wait_for_line, write_hosts


def restarts_layout(marker_dir, max_restarts: int, failed_starts: int) -> str:
    return f"""
[actors.main]
cls = "tests.faulty_actors:FailingRestarts"
primary = true
restart = {{ max_restarts = {max_restarts} }}
config = {{ marker_dir = "{marker_dir}", failed_starts = {failed_starts} }}
"""


def test_restarts_that_fail_before_ready_spend_the_budget_and_are_retried(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    hosts = write_hosts(tmp_path, restarts_layout(markers, max_restarts=3, failed_starts=2))
    run_dir = tmp_path / "run"
    result = launch(hosts, run_dir, timeout_s=110)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "main failed (exit code 7); restart 1/3" in result.stdout
    assert "main exited with code 1 during restart; restart 2/3" in result.stdout
    assert "main exited with code 1 during restart; restart 3/3" in result.stdout
    assert "deliberate failure of start 1" in result.stdout
    assert len(list(markers.glob("start-*"))) == 4
    info = exit_info(run_dir)
    assert info["exit_code"] == 0 and info["completed"] == "main"
    assert info["actors"]["main"]["restarts"] == 3


def test_restarts_failing_past_the_budget_fail_the_run_naming_the_actor_and_its_error(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    hosts = write_hosts(tmp_path, restarts_layout(markers, max_restarts=2, failed_starts=5))
    run_dir = tmp_path / "run"
    result = launch(hosts, run_dir, timeout_s=110)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ("RUN FAILED: main exited with code 1 during restart after 2 restart(s); "
            "restart.max_restarts = 2") in result.stdout
    assert "deliberate failure of start 2" in result.stdout
    assert len(list(markers.glob("start-*"))) == 3
    info = exit_info(run_dir)
    assert info["exit_code"] == 1 and info["actors"]["main"]["restarts"] == 2


def test_sigterm_ends_an_unfinished_run_with_143_and_says_how_to_resume_it(tmp_path):
    hosts = write_hosts(tmp_path, IDLE_PAIR, shutdown_s=15.0)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_line(proc, "b READY")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == 143, out
    assert (f"run interrupted by SIGTERM, unfinished (exit code 143); continue it with: "
            f"python -m launch.cluster {hosts.resolve()} --resume {run_dir}") in out
    info = exit_info(run_dir)
    assert info["exit_code"] == 143 and info["reason"] == "interrupted by SIGTERM"
    assert info["completed"] is None
    assert {a["shutdown_step"] for a in info["actors"].values()} == {"message"}
    # the run is not complete: --resume takes it up (here only planned)
    again = subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), "--resume",
                            str(run_dir), "--dry-run"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already complete" not in again.stdout and "nothing was started" in again.stdout
