"""The launcher under faults: restarts that fail before READY, interrupted runs, a full disk,
mistakes found at load. Real launcher processes on tmp hosts.toml files (tests/test_cluster.py)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from launch.cluster import main, write_exit, write_plots
from launch.files import Reserved
from launch.config import ConfigError, load
from launch.plot import plot_run
from launch.sinks import JsonlSink, Sinks
from tests.test_plot import records, write_run
from tests.test_cluster import IDLE_PAIR, ROOT, exit_info, launch, wait_for_line, write_hosts
from transport.schema import Metrics


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


# ----------------------------------------------------------------------------- a full disk
@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted at tmp_path/disk (CI runs as root), unmounted at the end."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"a full disk is made by mounting a small tmpfs, which needs root "
                    f"(CAP_SYS_ADMIN): mount said {done.stderr.strip()!r}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)  # a straggler holds a file


def fill(disk: Path) -> Path:
    """Take every free byte of `disk` with one file (removed to free the disk again)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"x" * 65536)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return filler


def record(seq: int) -> Metrics:
    return Metrics(actor="a", seq=seq, time_s=0.0, values={"value": float(seq)}, step=seq)


def whole_records(path: Path) -> list[int]:
    """The seq of every record of a metrics.jsonl, which must end on a whole line."""
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), data[-80:]
    return [json.loads(line)["seq"] for line in data.decode().splitlines()]


def test_jsonl_sink_survives_a_full_disk_with_whole_lines_only(small_disk):
    said: list[str] = []
    path = small_disk / "metrics.jsonl"
    sink = JsonlSink(path, said.append)
    sinks = Sinks([sink], said.append)
    for seq in range(1, 4):
        sinks.write(record(seq))
    filler = fill(small_disk)
    for seq in range(4, 200):  # the first may fit in the file's last page, then the disk is full
        sinks.write(record(seq))
    assert sinks.active == [sink] and sink.dropped > 0
    written = whole_records(path)
    assert written == list(range(1, len(written) + 1)) and len(written) >= 3
    assert len(written) + sink.dropped == 199
    assert sum("failed ([Errno 28] No space left on device)" in t for t in said) == 1, said
    filler.unlink()
    sinks.write(record(200))
    assert whole_records(path) == [*written, 200]
    assert f"{sink.dropped_total} record(s) were lost while it failed" in said[-1]
    sinks.close()


def test_jsonl_sink_cuts_a_partial_last_line_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"actor":"a","seq":1}\n{"actor":"a","seq":2}\n{"actor":"a","se')
    said: list[str] = []
    sink = JsonlSink(path, said.append)
    sink.write(record(3))
    sink.close()
    assert whole_records(path) == [1, 2, 3]
    assert said == [f"{path}: cut a partial last record (16 bytes) left by an earlier launcher; "
                    f"appending after the last whole one"]


@pytest.fixture(scope="module")
def matplotlib_warm(tmp_path_factory):
    """matplotlib keeps the font files it used open (a cache): open them before the per-test
    leak check (conftest.py) takes its snapshot."""
    plot_run(write_run(tmp_path_factory.mktemp("warm-up"), records()))


def test_plots_on_a_full_disk_are_said_and_leave_no_part_of_a_file(matplotlib_warm, small_disk,
                                                                   capsys):
    run_dir = write_run(small_disk, records())
    fill(small_disk)
    write_plots(types.SimpleNamespace(run=types.SimpleNamespace(sinks=["jsonl"])), run_dir)
    out = capsys.readouterr().out
    assert "plots failed (OSError: [Errno 28] No space left on device" in out
    assert f"retry with python -m launch.plot {run_dir}" in out
    assert [p.name for p in (run_dir / "plots").iterdir()] == []


WAITS_FOR_GO = """
[actors.main]
cls = "tests.faulty_actors:WaitsForFile"
primary = true
config = {{ path = "{go}" }}
"""


def test_a_full_disk_at_the_end_of_a_run_keeps_its_exit_code_and_whole_files(tmp_path,
                                                                              small_disk):
    go = tmp_path / "go"
    hosts = write_hosts(tmp_path, WAITS_FOR_GO.format(go=go))
    run_dir = small_disk / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(proc, "main READY")
        deadline = time.monotonic() + 60
        while not (run_dir / "metrics.jsonl").stat().st_size:  # records before the disk fills
            assert time.monotonic() < deadline, "no metrics record reached metrics.jsonl"
            time.sleep(0.05)
        filler = fill(small_disk)
        lines = wait_for_line(proc, "metrics sink jsonl: writing")  # a record met the full disk
        go.touch()
        out, err = proc.communicate(timeout=60)
        out = "".join(lines) + out
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 0, out + err
    assert "Traceback" not in out + err and not err
    # exit.json is written into the room taken for it when the run started
    info = exit_info(run_dir)
    assert info["exit_code"] == 0 and info["reason"] == "main completed"
    assert not (run_dir / "exit.json.tmp").exists()
    assert (f"metrics sink jsonl: writing {run_dir / 'metrics.jsonl'} failed ([Errno 28] No "
            f"space left on device); records are counted and dropped") in out
    before = whole_records(run_dir / "metrics.jsonl")
    assert before
    # with room again, a resume (it is not complete: no exit.json) appends whole lines
    filler.unlink()
    again = subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), "--resume",
                            str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "is already complete (main finished; exit.json)" in again.stdout
    assert whole_records(run_dir / "metrics.jsonl") == before


def test_exit_json_that_cannot_be_written_is_said_on_stderr_with_the_runs_code(tmp_path,
                                                                              capsys):
    room = Reserved(tmp_path / "exit.json")
    (tmp_path / "exit.json.tmp").unlink()  # its room is gone: the rename fails
    write_exit(room, {"exit_code": 143, "reason": "interrupted by SIGTERM"})
    assert capsys.readouterr().err == (
        f"error: cannot write {tmp_path / 'exit.json'} ([Errno 2] No such file or directory: "
        f"'{tmp_path / 'exit.json.tmp'}' -> '{tmp_path / 'exit.json'}'); the run's exit code is "
        f"143 (interrupted by SIGTERM)\n")
    assert not (tmp_path / "exit.json").exists()


def test_reserved_room_gets_its_file_whole_on_a_full_disk(small_disk):
    room = Reserved(small_disk / "exit.json", size=64 << 10)
    fill(small_disk)
    text = json.dumps({"exit_code": 0, "actors": {f"a{i}": {"pid": i} for i in range(500)}})
    assert 10_000 < len(text) < 64 << 10
    room.write(text)
    assert (small_disk / "exit.json").read_text() == text
    assert not (small_disk / "exit.json.tmp").exists()


# ----------------------------------------------------------------------------- found at load
RL = f"""
[run]
name = "t"
[rl]
model = "{ROOT / 'examples' / 'base-tiny'}"
envs = [{{ cls = "envs.builtin.arith:ArithEnv" }}, {{ ENV }}]
"""


def dry_run(path: Path, capsys) -> tuple[int, str]:
    code = main([str(path), "--dry-run"])
    return code, capsys.readouterr().err


def test_an_env_that_raises_when_constructed_is_named_by_its_rl_entry(tmp_path, capsys):
    path = tmp_path / "hosts.toml"
    path.write_text(RL.replace("{ ENV }", '{ cls = "tests.faulty_actors:MissingDataset", '
                                          'options = { path = "/data/t.jsonl" } }'))
    assert dry_run(path, capsys) == (2, f'error: {path}: [rl] envs[1] (cls = '
                                        f'"tests.faulty_actors:MissingDataset"): MissingDataset('
                                        f"path='/data/t.jsonl') raised FileNotFoundError: dataset "
                                        f"/data/t.jsonl does not exist\n")


def test_an_actor_config_that_raises_when_constructed_names_its_table(tmp_path):
    path = write_hosts(tmp_path, """
[actors.a]
cls = "tests.faulty_actors:Strict"
config = { limit = -1 }
""")
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value) == f"{path}: table [actors.a.config]: limit = -1: use 0 or more"
    path.write_text(path.read_text().replace("limit = -1", "limit = -2"))
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value) == (f"{path}: table [actors.a.config]: StrictConfig raised "
                               f"RuntimeError: the limit service is down")


@pytest.fixture
def taken_port():
    """A port some other process listens on, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_fixed_port_in_use_is_refused_at_load_naming_table_and_field(tmp_path, capsys,
                                                                        taken_port):
    path = tmp_path / "hosts.toml"
    rl = RL.replace(", { ENV }", "")
    path.write_text(f"{rl}\n[actors.router.config]\nport = {taken_port}\n")
    assert dry_run(path, capsys) == (2, f"error: {path}: [actors.router.config] port = "
                                        f"{taken_port} is in use on 127.0.0.1: pick another or "
                                        f"0\n")
    path.write_text(f"{rl}\n[actors.router.config]\nrouter = {{ prometheus_port = "
                    f"{taken_port} }}\n")
    assert dry_run(path, capsys) == (2, f"error: {path}: [actors.router.config.router] "
                                        f"prometheus_port = {taken_port} is in use on 0.0.0.0: "
                                        f"pick another or 0\n")


def test_one_fixed_port_for_two_actors_is_refused_at_load(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free again once closed
    path = tmp_path / "hosts.toml"
    path.write_text(RL.replace(", { ENV }", "") + "".join(
        f"\n[actors.worker{i}.config]\nport = {port}\n" for i in range(2)))
    assert dry_run(path, capsys) == (2, f"error: {path}: [actors.worker1.config] port = {port} "
                                        f"is also [actors.worker0.config] port on 127.0.0.1: "
                                        f"pick another or 0\n")
