"""An environment's own code has a time limit (`[rollout] env_timeout_s`), generation not
counted: a reward() that hangs fails its episode (counted like one that raises, named with its
environment and task) while the event loop stays free; a slow generation never times out an
episode whose environment is quick."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.rollout import RolloutActor, RolloutConfig
from envs.loader import load_envs
from models.load import load_tokenizer
from runtime.facts import RunFacts
from tests.faulty_envs import HangingVerifier
from tests.helpers import context

GENERATION_S = 0.6  # each turn's generation: longer than the limit below


class SlowServer:
    """/generate that answers "7" after GENERATION_S (SGLang's answer shape)."""

    def __init__(self, tokenizer):
        self.ids = tokenizer.encode("7", add_special_tokens=False)

    async def generate(self, input_ids, sampling_params=None, return_logprob=True, **_):
        await asyncio.sleep(GENERATION_S)
        return {"output_ids": self.ids, "meta_info": {
            "finish_reason": {"type": "stop"}, "weight_version": "0",
            "output_token_logprobs": [[-0.5, i, None] for i in self.ids]}}


def rollout(ipc, env: str, limit_s: float) -> RolloutActor:
    cfg = RolloutConfig(envs=[{"cls": env, "options": {"max_operand": 9}}],
                        env_timeout_s=limit_s, failure_notice_interval_s=0.0)
    actor = RolloutActor(context("rollout", ipc, facts=RunFacts(model="tiny-qwen2")), cfg)
    actor.envs = load_envs([{"cls": env, "options": {"max_operand": 9}}])
    actor.tokenizer = load_tokenizer(actor.facts.model)
    actor.client = SlowServer(actor.tokenizer)
    actor.gate = asyncio.Semaphore(4)
    return actor


async def play(actor: RolloutActor, n: int) -> list:
    task = next(iter(actor.envs.tasks("train", 0)))
    sampling = {"temperature": 1.0, "top_p": 1.0}
    return await asyncio.gather(*(actor.play(task, sampling, "b0-g0", i) for i in range(n)))


async def test_a_hung_reward_fails_its_episode_naming_the_environment_and_task(ipc):
    actor = rollout(ipc, "tests.faulty_envs:HangingVerifier", limit_s=0.3)
    ticks = 0

    async def tick():  # the event loop keeps running while the verifiers hang
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    try:
        t0 = time.monotonic()
        samples = await play(actor, 3)
        elapsed = time.monotonic() - t0
    finally:
        ticker.cancel()
        HangingVerifier.release.set()  # the abandoned threads end
        actor.factory.close()
    assert [s.status for s in samples] == ["failed"] * 3
    assert all("EpisodeTimeout" in s.error and "env_timeout_s = 0.3" in s.error
               for s in samples)
    assert actor.counters["episodes_failed"] == actor.counters["episodes_timed_out"] == 3
    assert actor.env_errors == 3  # counted as the environment's failure, like a raise
    assert "math task 'arith-" in actor.last_failure
    assert "HangingVerifier ran its own code" in actor.last_failure
    assert elapsed >= GENERATION_S + 0.3  # generation was not counted against the limit
    assert ticks >= 10


@pytest.mark.parametrize("limit_s", [0.3, 0.0])
async def test_slow_generation_never_times_out_a_quick_environment(ipc, limit_s):
    actor = rollout(ipc, "tests.faulty_envs:SlowVerifier", limit_s=limit_s)
    try:
        samples = await play(actor, 2)
    finally:
        actor.factory.close()
    assert [s.status for s in samples] == ["ok", "ok"]
    assert actor.counters["episodes_timed_out"] == 0
