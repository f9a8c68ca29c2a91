"""runtime/procs.py: the one SIGTERM -> SIGKILL teardown, on real processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import psutil

from runtime.procs import log_tail, terminate, terminate_sync

IGNORES_TERM = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(60)")
OBEYS_TERM = "import sys, time; print('ready', flush=True); time.sleep(60)"
# starts a grandchild in its own session's group, prints its pid, then waits
WITH_GRANDCHILD = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                   "'import time; time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)")


async def _spawn(code: str, group: bool = False) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code,
                                                stdout=asyncio.subprocess.PIPE,
                                                start_new_session=group)
    first = (await proc.stdout.readline()).decode().strip()  # started and signals installed
    return proc, first


async def test_terminate_escalates_to_sigkill_only_when_sigterm_is_ignored():
    stubborn, _ = await _spawn(IGNORES_TERM)
    assert await terminate(stubborn, 0.5) == "sigkill"
    assert stubborn.returncode == -9
    polite, _ = await _spawn(OBEYS_TERM)
    assert await terminate(polite, 30) == "sigterm"
    assert polite.returncode == -15
    assert await terminate(polite, 30) == "exited"  # a second stop is a no-op


async def test_terminate_with_group_takes_the_grandchildren_too():
    proc, grandchild = await _spawn(WITH_GRANDCHILD, group=True)
    gc = psutil.Process(int(grandchild))
    assert gc.is_running()
    assert await terminate(proc, 30, group=True) == "sigterm"
    gc.wait(10)  # gone: the signal reached the whole group
    assert not psutil.pid_exists(gc.pid) or gc.status() == psutil.STATUS_ZOMBIE


def test_terminate_sync_on_popen():
    stubborn = subprocess.Popen([sys.executable, "-c", IGNORES_TERM], stdout=subprocess.PIPE)
    assert stubborn.stdout.readline().strip() == b"ready"
    assert terminate_sync(stubborn, 0.5) == "sigkill"
    assert terminate_sync(stubborn, 0.5) == "exited"
    stubborn.stdout.close()


def test_log_tail_reads_the_end_of_a_big_log(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert log_tail(log, 3) == "line 99997\nline 99998\nline 99999"
    assert log_tail(tmp_path / "missing.log", 3) == "(no log)"
    assert os.path.getsize(log) > 16384  # the tail came from the last 16 KiB only
