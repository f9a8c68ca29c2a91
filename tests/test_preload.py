"""Actor processes forked from the launcher's pre-imported template (launch/preload.py,
runtime/template.py): they are the processes `python -m runtime.child` would start (their
title, log, restart after kill -9 with the exit code seen), a template killed takes its actors
with it and the launcher starts them the ordinary way, a template whose imports started a
thread is refused, and `[run] preload = false` starts no template."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil

from tests.helpers import actor_processes
from tests.test_cluster import ROOT, exit_info, launch, wait_for_line, write_hosts

RESTARTED_PAIR = """
[actors.a]
cls = "tests.misbehaving:Idle"
restart = { max_restarts = 3 }
[actors.b]
cls = "tests.misbehaving:Idle"
restart = { max_restarts = 3 }
after = ["a"]
"""


def test_actors_are_forks_of_one_template_that_restart_and_outlive_its_death(tmp_path):
    hosts = write_hosts(tmp_path, RESTARTED_PAIR)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_line(proc, "b READY")
        actors = actor_processes(proc.pid)
        template = psutil.Process(actors["a"].ppid())
        # both forked from one template, the launcher's child, which imported their class
        assert {p.ppid() for p in actors.values()} == {template.pid}
        assert template.ppid() == proc.pid
        assert template.cmdline()[-3:] == ["runtime.template", template.cmdline()[-2],
                                          "tests.misbehaving:Idle"]
        # named as `python -m runtime.child SPEC` is, in their own session, logging to their log
        assert " ".join(actors["a"].cmdline()).split()[-1] == str(run_dir / "specs" / "a.json")
        assert all(os.getsid(p.pid) == p.pid for p in actors.values())
        assert "a READY" not in (run_dir / "logs" / "a.log").read_text()  # its own log only
        # kill -9: the template reports the exit code, the restart is a fork again
        actors["a"].kill()
        wait_for_line(proc, "a failed (exit code -9)")
        wait_for_line(proc, "a READY")
        again = actor_processes(proc.pid)["a"]
        assert again.pid != actors["a"].pid and again.ppid() == template.pid
        # kill -9 of the template: its actors end with it, and start the ordinary way
        template.kill()
        wait_for_line(proc, "its processes start the ordinary way")
        deadline = time.monotonic() + 60
        while len(plain := {n: p for n, p in actor_processes(proc.pid).items()
                            if p.ppid() == proc.pid}) < 2:  # the launcher's own children
            assert time.monotonic() < deadline, "a and b were not started again"
            time.sleep(0.1)
        assert all(p.pid not in (actors["a"].pid, actors["b"].pid, again.pid)
                   for p in plain.values())
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, out
    assert exit_info(run_dir)["actors"]["a"]["restarts"] == 2
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                   for p in [*actors.values(), again, template, *plain.values()])


def test_a_template_whose_imports_start_a_thread_is_refused_and_preload_false_starts_none(
        tmp_path):
    pair = """
[actors.a]
cls = "tests.threads_at_import:FinisherWithThread"
primary = true
config = { after_s = 0.2, steps = 1 }
[actors.b]
cls = "tests.threads_at_import:FinisherWithThread"
config = { after_s = 0.2, steps = 1 }
"""
    refused = launch(write_hosts(tmp_path, pair), tmp_path / "run")
    assert refused.returncode == 0, refused.stdout + refused.stderr
    assert "template 0 (tests.threads_at_import:FinisherWithThread): importing " \
        "tests.threads_at_import:FinisherWithThread started a thread" in " ".join(
            refused.stdout.split())
    assert (tmp_path / "run" / "logs" / "template0.log").exists()
    (tmp_path / "off").mkdir()
    off = launch(write_hosts(tmp_path / "off", RESTARTED_PAIR.replace(
        'cls = "tests.misbehaving:Idle"\nrestart = { max_restarts = 3 }\nafter',
        'cls = "tests.misbehaving:Finisher"\nprimary = true\nafter'), "preload = false"),
        tmp_path / "off" / "run")
    assert off.returncode == 0, off.stdout + off.stderr
    assert sorted(p.name for p in (tmp_path / "off" / "run" / "logs").iterdir()) == [
        "a.log", "b.log"]


async def test_a_template_forks_relays_exit_codes_and_leaves_an_oversized_request_alone(tmp_path):
    """launch/preload.py Template on its own: a fork runs runtime.child (here on a spec that is
    not one: exit code 1, its error in the log given); a request too large for one message
    (an environment of megabytes) is not sent (None: that process starts anew) and the
    template serves on."""
    from launch.preload import Template
    from launch.supervisor import Supervisor
    from runtime.template import MAX_MESSAGE

    template = Template(sys.executable, Supervisor.local_env({}), ["tests.misbehaving:Idle"],
                        tmp_path / "template.log", say=lambda _: None)
    await template.start()
    try:
        spec = tmp_path / "bad.json"
        spec.write_text("{not json")
        env = Supervisor.local_env({})
        with open(tmp_path / "child.log", "ab") as log:
            assert await template.fork(spec, {**env, "BIG": "x" * MAX_MESSAGE}, str(tmp_path),
                                       log.fileno()) is None
            child = await template.fork(spec, env, str(tmp_path), log.fileno())
        assert child is not None and not template.unusable
        assert await asyncio.wait_for(child.wait(), 60) == 1
        assert "DecodeError" in (tmp_path / "child.log").read_text()
    finally:
        await template.close()
    assert template.proc.returncode == 0  # it left when its socket closed


async def test_a_ready_sent_before_the_start_knows_the_pid_is_taken():
    """A forked process can report READY before the template's answer with its pid has been
    read: the supervisor waits for its start to know the pid (it refused the READY, and the
    actor ran unrecognised until ready_timeout_s, before)."""
    from types import SimpleNamespace

    from launch.supervisor import ActorProcess, Supervisor
    from transport.schema import Endpoints, Ready

    sup = Supervisor.__new__(Supervisor)
    ap = ActorProcess("buffer", SimpleNamespace(), None, None, None)
    sup.actors = {"buffer": ap}
    ready = asyncio.ensure_future(sup._on_ready(
        Ready(actor="buffer", pid=4321, endpoints=Endpoints(control="ipc://x"))))
    await asyncio.sleep(0.05)
    assert not ready.done()  # the start is still waiting for the template's answer
    ap.pid = 4321
    ap.spawned.set()
    ack = await asyncio.wait_for(ready, 5)
    assert ack.ok and not ack.stop and ap.ready.is_set()
    stale = await sup._on_ready(Ready(actor="buffer", pid=99, endpoints=Endpoints(control="")))
    assert not stale.ok and stale.stop  # a READY of another process is still refused
