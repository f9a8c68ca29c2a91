"""sglang-router (the real one) in front of two embedded workers, started by the router actor."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.inference import InferenceWorker
from actors.router import RouterActor, RouterConfig, router_command
from engine.client import SglangClient
from engine.session import HttpSession
from models.tokenizer import build_char_tokenizer
from tests.helpers import context, running

PROMPT = [1, 5, 6, 7]


def served(*workers) -> list[int]:
    return [sum(w.scheduler.wave_sizes) for w in workers]


async def test_router_fronts_two_workers_with_sticky_routing_keys(ipc):
    cfg = InferenceWorker.Config(model="tiny-qwen2", batch_wait_ms=1.0)
    w0 = InferenceWorker(context("w0", ipc), cfg)
    w1 = InferenceWorker(context("w1", ipc), cfg)
    async with running(w0, 30), running(w1, 30):
        router = RouterActor(context("router", ipc, peers={"w0": w0.bound, "w1": w1.bound}),
                             RouterConfig(router={"log_level": "warn"}))
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
