"""Real subprocess clusters from a tmp hosts.toml on ipc:// endpoints under tmp_path."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.helpers import MessageReader, actor_processes
from transport.metrics import MetricsPublisher, MetricsSubscriber
from transport.sockets import Security, SocketFactory, make_curve_keys

ROOT = Path(__file__).resolve().parent.parent
RUN = """
[run]
name = "t"
shutdown_timeout_s = {shutdown_s}
term_timeout_s = {term_s}
heartbeat_interval_s = 0.2
progress_interval_s = 0.2
{extra_run}

[[hosts]]
name = "local"
"""


def write_hosts(tmp_path: Path, actors: str, extra_run: str = "", shutdown_s: float = 1.5,
                term_s: float = 1.5) -> Path:
    """hosts.toml for a test. Tests that assert which shutdown step ended an actor give bounds
    long enough for a loaded machine (an actor that obeys exits long before them)."""
    path = tmp_path / "hosts.toml"
    path.write_text(RUN.format(extra_run=extra_run, shutdown_s=shutdown_s, term_s=term_s)
                    + actors)
    return path


def launch(hosts: Path, run_dir: Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                           str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


def exit_info(run_dir: Path) -> dict:
    return json.loads((run_dir / "exit.json").read_text())


def demo(num_items: int) -> str:
    """The demo cluster: a producer sending `num_items` items through a scaler to a consumer."""
    return f"""
[actors.scaler]
cls = "examples.demo:Scaler"
[actors.consumer]
cls = "examples.demo:Consumer"
[actors.producer]
cls = "examples.demo:Producer"
after = ["scaler", "consumer"]
primary = true
config = {{ num_items = {num_items}, interval_s = 0.03 }}
"""


def test_demo_cluster_end_to_end_with_metrics_from_every_actor(tmp_path):
    hosts = write_hosts(tmp_path, demo(120), shutdown_s=15.0)  # steps asserted: loaded bounds
    run_dir = tmp_path / "run"
    jsonl = tmp_path / "watch.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    watch = None
    try:
        wait_for_file(run_dir / "endpoints.json", 40)
        # the watcher subscribes while the actors are still starting, and runs until Ctrl-C or
        # the run's end: it sees the run whatever the machine's load
        watch = subprocess.Popen([sys.executable, "-m", "launch.watch", str(run_dir), "--jsonl",
                                  str(jsonl), "--no-live"], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        seen = asyncio.run(collect_metrics(run_dir, {"scaler", "consumer", "producer"}))
        wait_for_file(jsonl, 30)  # opened when the watcher starts
        deadline = time.monotonic() + 30
        # a record of the producer or the consumer: the watcher is in its loop, and saw them
        while not any(f'"actor":"{a}"' in jsonl.read_text() for a in ("producer", "consumer")):
            assert time.monotonic() < deadline, "the watcher wrote no record of them"
            time.sleep(0.05)
        # Ctrl-C ends it (the run may have ended, and with it the watcher, already: code 0
        # too); a shell that starts the suite in the background without job control leaves
        # SIGINT ignored in it, and the watcher undoes that (tests/test_watch.py)
        watch.send_signal(signal.SIGINT)
        _, watch_err = watch.communicate(timeout=30)
        out, _ = proc.communicate(timeout=60)
    finally:
        for p in (proc, watch):
            if p is not None:
                p.kill()
                p.wait()
    assert proc.returncode == 0, out
    assert seen == {"scaler", "consumer", "producer"}
    assert watch.returncode == 0, watch_err
    assert "Traceback" not in watch_err, watch_err
    recorded = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {r["actor"] for r in recorded} & {"producer", "consumer"}
    assert "producer: step 120/120" in out
    info = exit_info(run_dir)
    assert info["exit_code"] == 0 and info["completed"] == "producer"
    assert "run complete: producer finished in " in out
    assert info["actors"]["producer"]["exit_code"] == 0
    assert info["actors"]["scaler"]["shutdown_step"] == "message"
    assert info["actors"]["scaler"]["exit_code"] == 0
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["start_order"] == ["scaler", "consumer", "producer"]
    assert resolved["actors"]["producer"]["config"]["num_items"] == 120
    for name in ("scaler", "consumer", "producer"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    # resuming a finished run starts nothing and says so
    again = subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), "--resume",
                            str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "is already complete (producer finished; exit.json)" in again.stdout
    assert exit_info(run_dir)["completed"] == "producer"  # untouched
    # watching the finished run: its last state and how it ended, at once
    after = subprocess.run([sys.executable, "-m", "launch.watch", str(run_dir)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert after.returncode == 0, after.stderr
    assert "run ended (exit 0)" in after.stdout
    assert (f"the run in {run_dir} has ended: exit code 0, producer completed; nothing more "
            f"will come") in " ".join(after.stderr.split())  # wrapped at 80 columns


def wait_for_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


async def collect_metrics(run_dir: Path, wanted: set[str], timeout_s: float = 40) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "endpoints.json").exists():
        assert time.monotonic() < deadline, "launcher never wrote endpoints.json"
        await asyncio.sleep(0.05)
    endpoint = json.loads((run_dir / "endpoints.json").read_text())["metrics"]
    factory = SocketFactory()
    sub = MetricsSubscriber(factory, endpoint)
    seen: set[str] = set()
    try:
        async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
            while seen != wanted:
                seen.add((await sub.recv()).actor)
    finally:
        sub.close()
        factory.close()
    return seen


def test_shutdown_escalation_steps(tmp_path):
    hosts = write_hosts(tmp_path, """
[actors.polite]
cls = "tests.misbehaving:Idle"
[actors.deaf]
cls = "tests.misbehaving:NeverAnswersShutdown"
[actors.stubborn]
cls = "tests.misbehaving:IgnoresSigterm"
[actors.main]
cls = "tests.misbehaving:Finisher"
primary = true
config = { after_s = 0.5 }
""", shutdown_s=8.0, term_s=4.0)
    run_dir = tmp_path / "run"
    result = launch(hosts, run_dir, timeout_s=110)
    assert result.returncode == 0, result.stdout + result.stderr
    steps = {n: a["shutdown_step"] for n, a in exit_info(run_dir)["actors"].items()}
    assert steps == {"polite": "message", "deaf": "sigterm", "stubborn": "sigkill",
                     "main": "exited"}


def test_fails_on_start_stops_the_run_with_its_error(tmp_path):
    hosts = write_hosts(tmp_path, """
[actors.ok]
cls = "tests.misbehaving:Idle"
[actors.bad]
cls = "tests.misbehaving:FailsOnStart"
after = ["ok"]
""", shutdown_s=8.0)  # "ok" obeys the message at once; the bound is for a loaded machine
    run_dir = tmp_path / "run"
    result = launch(hosts, run_dir)
    assert result.returncode == 1
    assert "bad exited with code 1 during start" in result.stdout
    assert "deliberate start failure" in result.stdout
    info = exit_info(run_dir)
    assert info["actors"]["ok"]["shutdown_step"] == "message"
    assert info["actors"]["ok"]["exit_code"] == 0


def test_slow_start_within_and_past_its_deadline(tmp_path):
    hosts = write_hosts(tmp_path, """
[actors.slow]
cls = "tests.misbehaving:SlowStart"
config = { delay_s = 1.0 }
[actors.main]
cls = "tests.misbehaving:Finisher"
after = ["slow"]
primary = true
config = { after_s = 0.2 }
""")
    result = launch(hosts, tmp_path / "run")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "slow READY" in result.stdout
    hosts = write_hosts(tmp_path, """
[actors.slow]
cls = "tests.misbehaving:SlowStart"
start_timeout_s = 0.5
config = { delay_s = 5.0 }
""")
    result = launch(hosts, tmp_path / "run2")
    assert result.returncode == 1
    assert "took longer than start_timeout_s = 0.5" in result.stdout


def test_crash_is_restarted_then_run_completes(tmp_path):
    marker = tmp_path / "crashed-once"
    hosts = write_hosts(tmp_path, f"""
[actors.main]
cls = "tests.misbehaving:CrashOnce"
primary = true
restart = {{ max_restarts = 1 }}
config = {{ marker = "{marker}" }}
""")
    run_dir = tmp_path / "run"
    result = launch(hosts, run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "main failed (exit code 7); restart 1/1" in result.stdout
    assert exit_info(run_dir)["actors"]["main"]["restarts"] == 1
    assert marker.exists()


def test_an_actor_leaving_with_os_exit_ends_the_multiprocessing_manager_it_started(tmp_path):
    """A process that leaves with os._exit (a trainer's rank) skips multiprocessing's exit
    handler: the Manager server it started (megatron-core's checkpoint writer starts one) was
    left running for good; runtime.child ends it first."""
    pid_file = tmp_path / "manager.pid"
    hosts = write_hosts(tmp_path, f"""
[actors.main]
cls = "tests.misbehaving:HardExitWithManager"
primary = true
config = {{ pid_file = "{pid_file}" }}
""")
    result = launch(hosts, tmp_path / "run")
    assert result.returncode == 0, result.stdout + result.stderr
    manager = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _running_pid(manager):
        assert time.monotonic() < deadline, "the Manager server outlived its actor"
        time.sleep(0.1)


def _running_pid(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_fatal_error_past_restart_budget_exits_nonzero_with_error(tmp_path):
    hosts = write_hosts(tmp_path, """
[actors.idle]
cls = "tests.misbehaving:Idle"
[actors.bad]
cls = "tests.misbehaving:Raises"
restart = { max_restarts = 1 }
""")
    run_dir = tmp_path / "run"
    result = launch(hosts, run_dir)
    assert result.returncode == 1
    assert "RUN FAILED: bad failed (exit code 1) after 1 restart(s)" in result.stdout
    assert "boom: deliberate failure in run()" in result.stdout
    info = exit_info(run_dir)
    assert info["actors"]["bad"]["restarts"] == 1
    assert info["actors"]["idle"]["shutdown_step"] == "message"


def test_silent_actor_is_killed_by_heartbeat_timeout(tmp_path):
    hosts = write_hosts(tmp_path, """
[actors.blocked]
cls = "tests.misbehaving:Blocks"
restart = { max_restarts = 0 }
""", extra_run="heartbeat_timeout_s = 1.0")
    result = launch(hosts, tmp_path / "run")
    assert result.returncode == 1
    assert "blocked sent no heartbeat for 1 s: killing it" in result.stdout
    assert "exit code -9" in result.stdout


def wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float = 40) -> list[str]:
    lines: list[str] = []
    reader = MessageReader()  # a message wrapped at 80 columns is matched whole
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in reader.add(line):
            return lines
    raise AssertionError(f"never saw {text!r}; output: {''.join(lines)}")


IDLE_PAIR = """
[actors.a]
cls = "tests.misbehaving:Idle"
[actors.b]
cls = "tests.misbehaving:Idle"
after = ["a"]
"""


def test_ctrl_c_stops_everything_with_exit_code_130(tmp_path):
    hosts = write_hosts(tmp_path, IDLE_PAIR, shutdown_s=15.0)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_line(proc, "b READY")
        children = list(actor_processes(proc.pid).values())
        assert len(children) == 2
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, out
    assert "interrupted" in out and "run complete" not in out
    assert f"--resume {run_dir}" in out
    info = exit_info(run_dir)
    assert info["exit_code"] == 130 and info["reason"] == "interrupted by SIGINT"
    assert info["completed"] is None  # a resume would continue it
    steps = {n: a["shutdown_step"] for n, a in exit_info(run_dir)["actors"].items()}
    assert steps == {"a": "message", "b": "message"}
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_children_exit_when_the_launcher_dies(tmp_path):
    """kill -9 of the launcher: every actor stops at once and exits within 5 s (it does not
    wait on reports to the dead launcher)."""
    hosts = write_hosts(tmp_path, IDLE_PAIR)
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(tmp_path / "run")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_line(proc, "b READY")
        children = list(actor_processes(proc.pid).values())
        assert len(children) == 2
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs(children, timeout=5)
        alive = [p for p in alive if _running(p)]  # a zombie has exited (nobody reaped it yet)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert not alive, f"children outlived the launcher by 5 s: {alive}"
    logs = [(tmp_path / "run" / "logs" / f"{n}.log").read_text() for n in ("a", "b")]
    assert all("stopping (launcher died)" in log or "signal SIGTERM" in log for log in logs), logs



async def _secured_metrics(endpoints: dict, keys: Path) -> tuple[set[str], int]:
    """(actors seen by a subscriber holding the keys while an intruder without them publishes,
    records a subscriber without keys got)."""
    good = SocketFactory(security=Security(curve=True, keys_dir=str(keys)))
    plain = SocketFactory()
    sub = MetricsSubscriber(good, endpoints["metrics"])
    snoop = MetricsSubscriber(plain, endpoints["metrics"])
    intruder = MetricsPublisher(plain, endpoints["metrics_in"], "intruder")
    seen: set[str] = set()
    snooped = 0
    try:
        deadline = time.monotonic() + 40
        while not {"scaler", "consumer", "producer"} <= seen and time.monotonic() < deadline:
            intruder.publish({"fake": 1.0}, step=1)
            try:
                seen.add((await asyncio.wait_for(sub.recv(), 0.2)).actor)
            except TimeoutError:
                pass
        for _ in range(10):  # the intruder keeps trying; the snooper keeps listening
            intruder.publish({"fake": 1.0}, step=1)
            try:
                seen.add((await asyncio.wait_for(sub.recv(), 0.1)).actor)
            except TimeoutError:
                pass
            try:
                await asyncio.wait_for(snoop.recv(), 0.05)
                snooped += 1
            except TimeoutError:
                pass
    finally:
        for s in (sub, snoop, intruder):
            s.close()
        good.close()
        plain.close()
    return seen, snooped


def test_curve_over_tcp_covers_the_metrics_stream(tmp_path):
    """With CURVE on, metrics of every actor arrive at a subscriber holding the cluster's keys;
    a publisher without them cannot inject records and a subscriber without them gets none."""
    keys = tmp_path / "keys"
    make_curve_keys(keys)
    hosts = write_hosts(tmp_path, demo(200) + f'\n[security]\ncurve = true\nkeys_dir = "{keys}"\n',
                        extra_run='transport = "tcp"')
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_file(run_dir / "endpoints.json", 40)
        endpoints = json.loads((run_dir / "endpoints.json").read_text())
        assert endpoints["metrics"].startswith("tcp://")
        seen, snooped = asyncio.run(_secured_metrics(endpoints, keys))
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, out
    assert seen == {"scaler", "consumer", "producer"}  # and never "intruder"
    assert snooped == 0
    assert (keys / "server.key_secret").stat().st_mode & 0o777 == 0o600


async def test_stop_all_stops_dependents_first_and_independent_actors_together():
    """stop_all: an actor stops only after the actors that name it in `after`; actors with no
    such relation stop at the same time (the shutdown takes the longest chain, not the sum)."""
    from types import SimpleNamespace

    from launch.supervisor import Supervisor
    after = {"w0": [], "w1": [], "router": ["w0", "w1"], "buffer": [],
             "rollout": ["router", "buffer"], "trainer": ["w0", "w1", "buffer", "rollout"],
             "idle": []}
    sup = Supervisor.__new__(Supervisor)
    sup.order = list(after)
    sup.actors = {n: n for n in after}
    sup.entries = {n: SimpleNamespace(after=a) for n, a in after.items()}
    sup.group_of = {}  # no trainer ranks here
    sup.templates = {}  # nor pre-imported templates
    events: list[tuple[str, str]] = []
    running: set[str] = set()
    most = 0
    gate = asyncio.Event()

    async def stop_one(name):
        nonlocal most
        events.append(("start", name))
        running.add(name)
        most = max(most, len(running))
        if len(running) >= 2:
            gate.set()
        await asyncio.wait_for(gate.wait(), 10)  # held until two stops overlap
        running.discard(name)
        events.append(("end", name))

    async def close_hosts():
        pass
    sup.stop_one, sup.close_hosts = stop_one, close_hosts
    await sup.stop_all()
    ended = {name: i for i, (kind, name) in enumerate(events) if kind == "end"}
    started = {name: i for i, (kind, name) in enumerate(events) if kind == "start"}
    assert set(ended) == set(after)
    for name, deps in after.items():
        for dep in deps:  # `name` depends on `dep`: name is stopped first
            assert ended[name] < started[dep], (name, dep, events)
    assert most >= 2  # trainer and idle (independent) were stopped at once
