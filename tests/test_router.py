"""sglang-router (the real one) in front of two embedded workers, started by the router actor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import msgspec
import pytest

from actors.inference import InferenceWorker
from actors.router import Relay, RouterActor, RouterConfig, router_command
from engine.client import SglangClient
from engine.session import HttpSession
from models.tokenizer import build_char_tokenizer
from runtime.actor import Status
from tests.helpers import actor_processes, context, running
from tests.test_cluster import ROOT, wait_for_line, write_hosts

PROMPT = [1, 5, 6, 7]


def served(*workers) -> list[int]:
    return [sum(w.scheduler.wave_sizes) for w in workers]


async def test_router_fronts_two_workers_with_sticky_routing_keys(ipc):
    cfg = InferenceWorker.Config(model="tiny-qwen2", batch_wait_ms=1.0)
    w0 = InferenceWorker(context("w0", ipc), cfg)
    w1 = InferenceWorker(context("w1", ipc), cfg)
    async with running(w0, 30), running(w1, 30):
        # a worker slow to answer a health check on a loaded machine must not move the key
        router = RouterActor(context("router", ipc, peers={"w0": w0.bound, "w1": w1.bound}),
                             RouterConfig(router={"log_level": "warn",
                                                  "health_failure_threshold": 1000}))
        async with running(router, 60):
            client = SglangClient(router.bound.http)
            params = {"max_new_tokens": 2, "temperature": 0.0}
            try:
                for _ in range(6):
                    out = await client.generate(PROMPT, params, routing_key="episode-a")
                    assert len(out["output_ids"]) >= 1
                assert sorted(served(w0, w1)) == [0, 6]  # one key, one worker
                before = served(w0, w1)
                await asyncio.gather(*(client.generate(PROMPT, params, routing_key=f"k{i}")
                                       for i in range(40)))
                after = served(w0, w1)
                assert sum(after) - sum(before) == 40
                assert all(a > b for a, b in zip(after, before)), after  # both got work
            finally:
                await client.close()


def test_router_command_passes_options_through():
    cfg = RouterConfig(policy="consistent_hashing",
                       router={"health_check_interval_secs": 2, "log_level": "warn",
                                    "prometheus_port": 29123, "disable_retries": True})
    cmd = router_command(cfg, ["http://a:1", "http://b:2"], 30000)
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == \
        ["http://a:1", "http://b:2"]
    assert cmd[cmd.index("--then-policy") + 1] == "consistent_hashing"  # set after parsing
    assert "--policy" not in cmd
    assert cmd[cmd.index("--health-check-interval-secs") + 1] == "2"
    assert cmd[cmd.index("--prometheus-port") + 1] == "29123"
    assert "--disable-retries" in cmd
    rr = router_command(RouterConfig(policy="round_robin"), ["http://a:1"], 1)
    assert rr[rr.index("--policy") + 1] == "round_robin"
    empty = router_command(RouterConfig(router={"log_level": "warn", "retries": 2}), [], 1)
    assert "--worker-urls" not in empty  # workers register themselves later
    assert empty[empty.index("--log-level") + 1] == "warn" and empty.count("--log-level") == 1
    assert empty[empty.index("--retries") + 1] == "2"
    with pytest.raises(msgspec.ValidationError, match="router_args"):  # the old name is gone
        msgspec.convert({"router_args": {}}, RouterConfig)


def test_a_lone_worker_leaves_rotation_only_after_ten_failed_health_checks():
    """Two or more workers (or workers that register themselves): out of rotation after two
    failed checks; a lone listed worker, which no other can stand in for, after ten; the
    `router` table overrides either."""
    def threshold(cmd: list[str]) -> str:
        return cmd[cmd.index("--health-failure-threshold") + 1]

    assert threshold(router_command(RouterConfig(), ["http://a:1", "http://b:2"], 1)) == "2"
    assert threshold(router_command(RouterConfig(), ["http://a:1"], 1)) == "10"
    assert threshold(router_command(RouterConfig(dynamic_workers=True), ["http://a:1"], 1)) \
        == "2"
    own = RouterConfig(router={"health_failure_threshold": 3})
    assert threshold(router_command(own, ["http://a:1"], 1)) == "3"


def test_router_body_limit_is_the_workers_and_set_by_the_actor():
    default = router_command(RouterConfig(), ["http://a:1"], 1)
    assert default[default.index("--max-payload-size") + 1] == str(64 << 20)
    assert RouterConfig().max_body_bytes == InferenceWorker.Config().max_body_bytes
    small = router_command(RouterConfig(max_body_bytes=4096), ["http://a:1"], 1)
    assert small[small.index("--max-payload-size") + 1] == "4096"
    with pytest.raises(ValueError, match="set `max_body_bytes`"):
        RouterActor.check_config(RouterConfig(router={"max_payload_size": 1 << 30}))
    with pytest.raises(ValueError, match="max_body_bytes must be >= 1"):
        RouterActor.check_config(RouterConfig(max_body_bytes=0))


async def router_post(url: str, data: bytes, length: int | None = None) -> tuple[int, str]:
    """(status, body) of a raw POST /generate (Content-Length `length`, else the data's) on a
    connection of its own: the router answers a body it refuses before reading it and closes,
    so sending may fail midway (ignored). A plain blocking socket in a thread: what the router
    sent before it closed is read from the socket's queue even after the send broke (an asyncio
    stream would raise the transport's broken pipe instead of returning it)."""
    host, port = url.removeprefix("http://").split(":")
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (length or len(data)))

    def post() -> bytes:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(head + data)
            chunks = []
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(1 << 16):
                    chunks.append(chunk)
            return b"".join(chunks)

    raw = await asyncio.to_thread(post)
    head_bytes, _, body = raw.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), body.decode("utf-8", "replace")


async def test_router_refuses_oversized_and_malformed_bodies_and_keeps_serving(ipc):
    """Hostile HTTP at the router: a body over max_body_bytes gets 413 unread, malformed or too
    deep JSON 400, wrong types 422, each answered by sglang-router itself (its messages, not
    the worker's `{"error": ...}`); the router process and the actor keep running."""
    cfg = InferenceWorker.Config(model="tiny-qwen2", batch_wait_ms=1.0)
    w0 = InferenceWorker(context("w0", ipc), cfg)
    async with running(w0, 30):
        router = RouterActor(context("router", ipc, peers={"w0": w0.bound}),
                             RouterConfig(max_body_bytes=1 << 20, router={"log_level": "error"}))
        async with running(router, 60):
            url = router.bound.http
            t0 = time.perf_counter()
            over = b'{"input_ids": [' + b"1," * ((1 << 19) - 8) + b"1]}"  # 1 MiB + 2 bytes
            assert await router_post(url, over) == (413, "length limit exceeded")
            # declared too large: answered from Content-Length, before a byte of the body is sent
            assert await router_post(url, b'{"input_ids": [', 200 << 20) == \
                (413, "length limit exceeded")
            assert time.perf_counter() - t0 < 5.0  # ~10 ms: neither body was buffered
            # exactly at the limit: forwarded, and refused by the worker in its own words
            at_limit = b'{"input_ids": [' + b"1," * ((1 << 19) - 9) + b"1]}"
            assert len(at_limit) == 1 << 20
            status, text = await router_post(url, at_limit)
            assert status == 400 and "longer than the model's context" in text, text
            deep = b"[" * 2000 + b"]" * 2000
            cases = [(b'{"input_ids": [1, 2,', 400, "Failed to parse the request body as JSON"),
                     (b"\xff\xfe not json", 400, "Failed to parse the request body as JSON"),
                     (b'{"input_ids": ' + deep + b"}", 400, "recursion limit exceeded"),
                     (b"[" * 100_000 + b"]" * 100_000, 422, "invalid type: sequence"),
                     (b'{"input_ids": "abc", "sampling_params": 5}', 422,
                      "Failed to deserialize the JSON body")]
            for body, want_status, words in cases:
                status, text = await router_post(url, body)
                assert status == want_status and words in text, (body[:40], status, text[:200])
            assert router.proc.returncode is None and router.status == Status.RUNNING
            client = SglangClient(url)
            try:
                out = await client.generate(PROMPT, {"max_new_tokens": 2, "temperature": 0.0})
                assert len(out["output_ids"]) == 2
            finally:
                await client.close()


async def test_worker_dying_mid_generation_is_retried_on_the_other_worker(ipc):
    """In-flight turns on a worker that stops are retried through the router; none is lost."""
    cfg = InferenceWorker.Config(model="tiny-qwen2", batch_wait_ms=1.0)
    w0 = InferenceWorker(context("w0", ipc), cfg)
    w1 = InferenceWorker(context("w1", ipc), cfg)
    async with running(w0, 30), running(w1, 30):
        router = RouterActor(context("router", ipc, peers={"w0": w0.bound, "w1": w1.bound}),
                             RouterConfig(router={"log_level": "warn",
                                                       "health_check_interval_secs": 1}))
        async with running(router, 60):
            # shown with a failure: which server an unclosed connection's local port belongs to
            print(f"workers w0 {w0.bound.http} w1 {w1.bound.http}; relays "
                  f"{ {url: r.name for url, r in router.relays.items()} }")
            client = SglangClient(router.bound.http)
            tok = build_char_tokenizer()
            params = {"temperature": 1.0, "ignore_eos": True}
            sessions = [HttpSession(client, tok, "1+2=", params, f"k{i}", 48, retries=10)
                        for i in range(12)]
            try:
                turns = [asyncio.ensure_future(s.generate()) for s in sessions]
                while w0.scheduler.stats()["running"] == 0:  # w0 has turns in flight
                    await asyncio.sleep(0.005)
                in_flight = w0.scheduler.stats()["running"]
                w0.stop("killed mid-generation")
                await asyncio.gather(*turns)
            finally:
                await client.close()
    assert in_flight > 0
    # every turn completed in full exactly once: the router re-sent w0's failed requests to w1
    # (and a session re-sends a turn itself when the router cannot)
    assert all(len(s.response_ids) == 48 == len(s.logprobs) for s in sessions)
    assert all(len(s.versions) == 1 for s in sessions)


async def test_the_relay_cuts_and_closes_connections_still_connecting_to_their_worker(
        monkeypatch):
    """A connection accepted while the relay's own connect to the worker is still in progress
    (a dying worker) is aborted by `cut`, and by `close` with its task ended: none is left open
    (an unclosed transport would fail the test as a ResourceWarning)."""
    real = asyncio.open_connection
    connecting = asyncio.Queue()

    async def stalled(host, port, **kw):  # the relay's connect to the worker never completes
        if port != 9:
            return await real(host, port, **kw)
        await connecting.put(port)
        await asyncio.Event().wait()

    monkeypatch.setattr(asyncio, "open_connection", stalled)
    relay = Relay("w0", "http://127.0.0.1:9")
    url = await relay.start("127.0.0.1")
    port = int(url.rsplit(":", 1)[1])
    clients = []
    try:
        for closing in (False, True):
            reader, writer = await real("127.0.0.1", port)
            clients.append(writer)
            writer.write(b"POST /generate HTTP/1.1\r\n")
            await asyncio.wait_for(connecting.get(), 30)
            assert len(relay.links) == 1
            if closing:
                await asyncio.wait_for(relay.close(), 30)
            else:
                assert relay.cut() == 1
            with contextlib.suppress(ConnectionResetError):  # aborted: EOF or reset
                assert await asyncio.wait_for(reader.read(), 30) == b""
            while relay.links:  # the connection's task ends (at once after `close`)
                assert not closing
                await asyncio.sleep(0.01)
    finally:
        for writer in clients:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await relay.close()


HUNG_LAYOUT = """
[actors.worker0]
cls = "actors.inference:InferenceWorker"
config = { model = "tiny-qwen2", batch_wait_ms = 1.0 }
[actors.worker1]
cls = "actors.inference:InferenceWorker"
config = { model = "tiny-qwen2", batch_wait_ms = 1.0 }
[actors.router]
cls = "actors.router:RouterActor"
after = ["worker0", "worker1"]
config = { router = { log_level = "warn" } }
"""


async def generate_batch(url: str, keys: list[str], timeout_s: float) -> list[int]:
    """The status of one /generate per routing key, sent together through the router."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async def one(key: str) -> int:
            async with s.post(f"{url}/generate", json=body,
                              headers={"X-SMG-Routing-Key": key}) as r:
                await r.read()
                return r.status
        return await asyncio.gather(*(one(k) for k in keys))


def test_a_hung_worker_is_routed_around_and_its_requests_retried_on_the_other(tmp_path):
    """SIGSTOP one of two workers (the launcher would kill it only after 300 s): requests sent to
    it are cut once sglang-router finds it unhealthy and retried on the other; SIGCONT brings it
    back into rotation."""
    hosts = write_hosts(tmp_path, HUNG_LAYOUT, extra_run="heartbeat_timeout_s = 300",
                        shutdown_s=15.0)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    victim = None
    try:
        wait_for_line(proc, "router READY", timeout_s=90)
        while "actors" not in (doc := json.loads((run_dir / "endpoints.json").read_text())):
            time.sleep(0.05)
        url, hung = doc["actors"]["router"]["http"], doc["actors"]["worker0"]["http"]
        victim = actor_processes(proc.pid)["worker0"]
        keys = [f"episode-{i}" for i in range(16)]  # both workers hold some of these keys
        assert asyncio.run(generate_batch(url, keys, 60)) == [200] * 16
        victim.suspend()
        assert asyncio.run(generate_batch(url, keys, 60)) == [200] * 16
        wait_for_line(proc, f"worker0 ({hung}) stopped answering sglang-router's health checks: "
                            f"out of rotation")
        victim.resume()
        wait_for_line(proc, f"worker0 ({hung}) is healthy again: back in rotation")
        assert asyncio.run(generate_batch(url, keys, 60)) == [200] * 16
    finally:
        if victim is not None and victim.is_running():
            victim.resume()
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()
