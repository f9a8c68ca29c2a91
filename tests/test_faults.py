"""Faults that must not end or stall a run: a worker or the router killed and restarted (same
address, current weights), a worker unreachable during a weight push, an actor that gives up
(the run ends at once with its message), failing episodes on the console."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from actors.inference import InferenceWorker
from actors.rollout import RolloutActor, RolloutConfig
from engine.client import SglangClient
from engine.weight_sync import DiskSync
from models.load import save_checkpoint
from models.tokenizer import build_char_tokenizer
from runtime.actor import EndRun
from runtime.facts import RunFacts
from tests.helpers import actor_processes, context, running
from tests.misbehaving import Idle
from tests.test_cluster import exit_info, launch, write_hosts
from tests.test_weight_sync import assert_same_weights, trained
from transport.rpc import DeadlineExceeded
from transport.schema import Sample

ROOT = Path(__file__).resolve().parent.parent


async def test_a_restarted_worker_keeps_its_port_and_catches_up_to_the_newest_weights(
        ipc, tmp_path):
    run_dir = tmp_path / "run"
    model, tok = trained(3)
    save_checkpoint(model, tok, str(run_dir / "weights" / "v7"))
    (run_dir / "weights" / "v8").mkdir(parents=True)  # the trainer died while writing v8
    cfg = InferenceWorker.Config(model="tiny-qwen2")
    first = InferenceWorker(context("w0", ipc, run_dir=str(run_dir)), cfg)
    async with running(first, 30):
        url = first.bound.http
        assert first.scheduler.weight_version == "7"  # v8 is incomplete: the one before
        assert_same_weights(dict(first.scheduler.model.named_parameters()), model)
    again = InferenceWorker(context("w0", ipc, run_dir=str(run_dir)), cfg)
    async with running(again, 30):
        assert again.bound.http == url  # clients and the router reach the new process
    assert json.loads((run_dir / "ports" / "w0.json").read_text())["http"] == int(
        url.rsplit(":", 1)[1])


async def test_disk_push_skips_an_unreachable_worker_and_updates_the_others(ipc, tmp_path):
    worker = InferenceWorker(context("w1", ipc), InferenceWorker.Config(model="tiny-qwen2"))
    async with running(worker, 30):
        live = SglangClient(worker.bound.http, timeout_s=10)
        dead = SglangClient("http://127.0.0.1:9", timeout_s=2, retries=1, backoff_s=0.05)
        try:
            model, tok = trained(5)
            save_checkpoint(model, tok, str(tmp_path / "v1"))
            sync = DiskSync([live, dead])
            await sync.push(str(tmp_path / "v1"), "1")
            assert sync.unreachable == ["http://127.0.0.1:9"]
            assert await live.get_weight_version() == "1"
            assert_same_weights(dict(worker.scheduler.model.named_parameters()), model)
        finally:
            await live.close()
            await dead.close()


class HungServer:
    """A TCP server that takes connections and answers none, until `wake()`: then a request
    for /health gets 200 and the connection is closed (anything else just closed)."""

    def __init__(self):
        self.connections = 0
        self.awake = asyncio.Event()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader, writer) -> None:
        self.connections += 1
        line = await reader.readline()
        await self.awake.wait()
        if b"/health" in line:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        writer.close()

    def wake(self) -> None:
        self.awake.set()

    async def close(self) -> None:
        self.wake()
        self.server.close()
        await self.server.wait_closed()


async def test_disk_push_skips_a_hung_worker_until_it_answers_again(ipc, tmp_path):
    """A worker that takes connections but answers nothing (SIGSTOP) is skipped after the
    probe's timeout, and later pushes skip it without waiting (no new connection) until the
    probe left on it hears back; then it is pushed to again."""
    worker = InferenceWorker(context("w1", ipc), InferenceWorker.Config(model="tiny-qwen2"))
    hung = HungServer()
    async with running(worker, 30):
        live = SglangClient(worker.bound.http, timeout_s=10)
        stuck = SglangClient(await hung.start(), timeout_s=60, retries=0)
        try:
            model, tok = trained(5)
            save_checkpoint(model, tok, str(tmp_path / "v1"))
            sync = DiskSync([live, stuck], probe_timeout_s=0.3)
            for version in ("1", "2"):
                await sync.push(str(tmp_path / "v1"), version)
                assert sync.unreachable == [stuck.base_url]
                assert await live.get_weight_version() == version
            assert hung.connections == 1  # the second push did not wait on it again
            hung.wake()
            while not sync._silent[stuck.base_url].done():
                await asyncio.sleep(0.01)
            await sync.push(str(tmp_path / "v1"), "3")  # it answers: pushed to (and it fails)
            assert hung.connections > 1 and sync.unreachable == [stuck.base_url]
            assert await live.get_weight_version() == "3"
        finally:
            await live.close()
            await stuck.close()
            await hung.close()


def test_router_child_dies_with_a_killed_router_actor(tmp_path):
    """kill -9 of the router actor: its sglang-router process (own session) goes too."""
    hosts = write_hosts(tmp_path, """
[actors.w]
cls = "actors.inference:InferenceWorker"
config = { model = "tiny-qwen2" }
[actors.router]
cls = "actors.router:RouterActor"
after = ["w"]
config = { router = { log_level = "warn" } }
""")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        router = wait_for_child(proc, "router READY", "runtime.child")
        children = router.children()
        assert children, "the router actor started no sglang-router process"
        router.kill()
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"sglang-router outlived its actor: {alive}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()


def wait_for_child(proc: subprocess.Popen, line: str, cmd_part: str,
                   timeout_s: float = 90) -> psutil.Process:
    """The launcher's child process whose spec names the actor in `line` ("<name> READY")."""
    name = line.split()[0]
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        text = proc.stdout.readline()
        seen.append(text)
        if line in text:
            child = actor_processes(proc.pid).get(name)
            if child is None or not any(cmd_part in part for part in child.cmdline()):
                raise AssertionError(f"no child process for {name}")
            return child
        if not text and proc.poll() is not None:
            break
    raise AssertionError(f"never saw {line!r}: {''.join(seen)}")


def test_an_actor_that_gives_up_ends_the_run_with_its_message(tmp_path):
    hosts = write_hosts(tmp_path, """
[actors.quitter]
cls = "tests.misbehaving:GivesUp"
primary = true
restart = { max_restarts = 5 }
""")
    result = launch(hosts, tmp_path / "run")
    assert result.returncode == 1, result.stdout
    assert "quitter: the data source is empty" in result.stdout  # the notice on the console
    assert "quitter ended the run: EndRun: nothing to train on" in result.stdout
    assert exit_info(tmp_path / "run")["actors"]["quitter"]["restarts"] == 0  # not restarted


def _groups(statuses: list[list[str]], domain: str = "math") -> list[list[Sample]]:
    return [[Sample(group_id=f"g{g}", index=i, prompt_ids=[1], response_ids=[2], loss_mask=[1],
                    rollout_logprobs=[-1.0], reward=0.0, domain=domain, status=s)
             for i, s in enumerate(group)] for g, group in enumerate(statuses)]


def test_rollout_reports_failing_episodes_and_ends_the_run_after_dead_batches(ipc):
    cfg = RolloutConfig(envs=[], max_failed_batches=3, failure_notice_interval_s=0.0)
    actor = RolloutActor(context("rollout", ipc, facts=RunFacts(model="tiny-qwen2")), cfg)
    notes: list[str] = []
    actor.notify = notes.append
    actor.last_failure = "math task 't7' (episode b0-g0-1): ZeroDivisionError: division by zero"
    actor.check_failures(0, _groups([["ok", "failed"], ["failed", "failed"]]))
    assert notes == ["3/4 episodes failed in batch 0 (math: 3); last: math task 't7' (episode "
                     "b0-g0-1): ZeroDivisionError: division by zero"]
    assert actor.failed_batches == 0  # one group had a good episode
    dead = _groups([["failed", "failed"], ["failed", "aborted"]])
    actor.check_failures(1, dead)  # the workers were down (no environment error): not counted
    assert actor.failed_batches == 0
    actor.env_errors = 4
    actor.check_failures(1, dead)
    actor.env_errors = 4
    actor.check_failures(2, dead)
    actor.env_errors = 4
    try:
        with pytest.raises(EndRun, match="every episode of 3 consecutive batches failed "
                                         ".*task 't7'"):
            actor.check_failures(3, dead)
    finally:
        actor.factory.close()


async def test_a_long_wait_on_a_peer_is_reported_until_it_ends(ipc):
    actor = Idle(context("waiter", ipc, stall_report_s=0.1))
    notes: list[str] = []
    actor.notify = notes.append
    async with running(actor):
        async with actor.waiting_for("buffer's batch for step 3"):
            while len(notes) < 2:  # reported, and again while it lasts
                await asyncio.sleep(0.02)
        count = len(notes)
        await asyncio.sleep(0.3)
    assert len(notes) == count  # nothing once the wait ended
    assert notes[0].startswith("still waiting for buffer's batch for step 3 since ")


async def test_a_wait_past_its_limit_ends_the_run_naming_the_wait_and_the_setting(ipc):
    actor = Idle(context("waiter", ipc, stall_report_s=60))
    async with running(actor):
        with pytest.raises(EndRun, match="waiter waited 0 s for buffer's batch for step 3 "
                                         ".*limit 0.2 s, `batch_timeout_s`.*raise "
                                         "`batch_timeout_s`"):
            async with actor.waiting_for("buffer's batch for step 3", 0.2, "batch_timeout_s"):
                raise DeadlineExceeded("no reply in 0.2 s")
        with pytest.raises(TimeoutError):  # no limit named: the error is the caller's to handle
            async with actor.waiting_for("something"):
                raise TimeoutError


class _MalformedAnswers:
    """A /generate client whose every answer lacks the log-probs of its tokens."""

    async def generate(self, input_ids, params, **kw):
        return {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [[-1.0, 5, None]],
                                                    "finish_reason": {"type": "length"}}}


async def test_answers_the_rollout_cannot_use_end_the_run_after_dead_batches(ipc):
    """Workers that answer every turn unusably (here: fewer log-probs than tokens) are not
    down: asking again gets the same. Their episodes count toward max_failed_batches, so the
    run ends with the reason instead of failing episodes forever."""
    from envs.loader import load_envs

    cfg = RolloutConfig(envs=[], max_failed_batches=2, failure_notice_interval_s=0.0,
                        retries=0)
    actor = RolloutActor(context("rollout", ipc, facts=RunFacts(model="tiny-qwen2")), cfg)
    try:
        actor.envs = load_envs([{"cls": "envs.builtin.arith:ArithEnv"}])
        actor.tokenizer = build_char_tokenizer()
        actor.client, actor.agent, actor.moe = _MalformedAnswers(), None, None
        actor.gate = asyncio.Semaphore(4)
        task = next(iter(actor.envs.tasks("train", 0)))
        for batch in range(2):
            samples = [await actor.play(task, {"temperature": 1.0}, f"b{batch}", i)
                       for i in range(2)]
            assert all(s.status == "failed" and "log-probs" in s.error for s in samples)
            assert actor.answer_errors == 2 and actor.env_errors == 0
            if batch == 0:
                actor.check_failures(batch, [samples])
                assert actor.failed_batches == 1
        with pytest.raises(EndRun, match="every episode of 2 consecutive batches failed.*"
                                         "log-probs.*the workers' answers"):
            actor.check_failures(1, [samples])
    finally:
        actor.factory.close()
