"""Rollout sessions: retries, token alignment, failed episodes, and train/rollout log-prob
agreement through the trainer's own batching path."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from actors.inference import InferenceWorker
from actors.rollout import RolloutActor, RolloutConfig
from engine.client import SglangClient
from engine.session import HttpSession, SessionFailed
from envs.base import SingleTurnEnv, Task
from envs.loader import EnvMix
from models.load import load_model
from models.tokenizer import build_char_tokenizer
from runtime.facts import RunFacts
from tests.helpers import context, running
from training.batching import make_micro_batch
from training.step import TrainState, forward


def reply(ids: list[int], finish: str = "stop", version: str = "3") -> dict:
    return {"output_ids": ids, "meta_info": {
        "finish_reason": {"type": finish}, "weight_version": version,
        "output_token_logprobs": [[-0.5, t, None] for t in ids]}}


class ScriptedClient:
    """Answers /generate from a script of replies or exceptions (a test double)."""

    def __init__(self, script: list):
        self.script, self.calls = list(script), []

    async def generate(self, input_ids, params, return_logprob=True, routing_key=None):
        self.calls.append((list(input_ids), dict(params), routing_key))
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item


async def test_session_retries_connection_errors_and_aborts_then_aligns_tokens():
    tok = build_char_tokenizer()
    ids = tok.encode("19", add_special_tokens=False) + [tok.eos_token_id]
    client = ScriptedClient([aiohttp.ClientConnectionError("worker died"),
                             reply([5], finish="abort"), reply(ids)])
    s = HttpSession(client, tok, "12+7=", {"temperature": 1.0}, "key-1", max_new_tokens=4)
    assert await s.generate() == "19"
    assert s.retried == 2 and len(client.calls) == 3
    assert all(c[0] == s.prompt_ids for c in client.calls)  # the same turn, re-sent
    assert all(c[2] == "key-1" for c in client.calls)  # sticky routing key
    s.observe(" ok")
    sample = s.to_sample("g", 0, "math", 1.0)
    assert sample.response_ids == ids + tok.encode(" ok", add_special_tokens=False)
    assert sample.loss_mask == [1, 1, 1, 0, 0, 0]
    assert sample.rollout_logprobs == [-0.5, -0.5, -0.5, 0.0, 0.0, 0.0]
    assert sample.weight_version == 3


async def test_session_gives_up_after_its_retry_budget():
    client = ScriptedClient([aiohttp.ClientConnectionError("down")] * 3)
    s = HttpSession(client, build_char_tokenizer(), "1+1=", {}, "k", 4, retries=2)
    with pytest.raises(SessionFailed, match="after 3 attempts"):
        await s.generate()


class Exploding(SingleTurnEnv):
    domain = "boom"

    def tasks(self, split="train", seed=0):
        while True:
            yield Task(id="t", prompt="1+1=", answer="2")

    def reward(self, task, response):
        raise RuntimeError("verifier crashed")


async def test_env_that_raises_gives_a_failed_sample_and_the_rollout_goes_on(ipc):
    tok = build_char_tokenizer()
    actor = RolloutActor(context("rollout", ipc, facts=RunFacts(model="tiny-qwen2")),
                         RolloutConfig(envs=[]))
    actor.envs = EnvMix([Exploding()], [1.0])
    actor.tokenizer, actor.gate = tok, asyncio.Semaphore(4)
    actor.client = ScriptedClient([reply([tok.eos_token_id])] * 2)
    task = next(actor.envs.tasks())
    bad = await actor.play(task, {"temperature": 1.0}, "g0", 0)
    assert bad.status == "failed" and "verifier crashed" in bad.error
    assert actor.counters["episodes_failed"] == 1
    bad2 = await actor.play(task, {"temperature": 1.0}, "g0", 1)
    assert bad2.status == "failed" and actor.counters["episodes_failed"] == 2
    actor.factory.close()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_rollout_logprobs_equal_the_trainers_recompute(ipc, temperature):
    """Samples from a real worker, batched and padded the way the trainer batches them."""
    worker = InferenceWorker(context("w", ipc), InferenceWorker.Config(model="examples/base-tiny"))
    async with running(worker, 30):
        client = SglangClient(worker.bound.http)
        tok = build_char_tokenizer()
        try:
            sessions = [HttpSession(client, tok, p, {"temperature": temperature,
                                                     "sampling_seed": i}, f"k{i}", 6)
                        for i, p in enumerate(["12+7=", "rev abcd=", "3+4=", "rev xy="])]
            await asyncio.gather(*(s.generate() for s in sessions))
        finally:
            await client.close()
    samples = [s.to_sample(f"g{i}", 0, "d", 0.0) for i, s in enumerate(sessions)]
    model, tokenizer = load_model("examples/base-tiny")
    state = TrainState(model, tokenizer, torch.optim.AdamW(model.parameters()))
    mb = make_micro_batch(samples)
    with torch.no_grad():
        logp, _ = forward(state, mb, temperature)
    diff = ((logp - mb.rollout_logp).abs() * mb.mask).sum() / mb.mask.sum()
    assert mb.mask.sum() >= 8
    assert float(diff) < 1e-5


class Echo(SingleTurnEnv):
    domain = "echo"

    def tasks(self, split="train", seed=0):
        for i in range(1000):
            yield Task(id=f"e{i}", prompt=f"say {i}:", answer="")

    def reward(self, task, response):
        return 1.0


class Capture:
    """A metrics publisher that keeps what it was given."""

    def __init__(self):
        self.records = []

    def publish(self, values, step=None, total_steps=None, samples=None):
        self.records.append((values, step, samples or []))
        return True


async def test_a_batch_sends_its_samples_as_text_and_tells_env_failures_from_generation(ipc):
    """The record of a batch: samples_per_batch successful episodes one domain at a time, plus
    the first failed one of each domain with its error and cause; rollout/failed_env counts only
    the environment's failures (not a generation that failed on the workers)."""
    tok = build_char_tokenizer()
    actor = RolloutActor(context("rollout", ipc, facts=RunFacts(model="tiny-qwen2")),
                         RolloutConfig(envs=[], samples_per_batch=3, retries=0))
    actor.envs = EnvMix([Exploding(), Echo()], [1.0, 1.0])
    actor.tokenizer, actor.gate, actor.metrics = tok, asyncio.Semaphore(4), Capture()
    answer = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]
    down = aiohttp.ClientConnectionError("worker0 is down")
    actor.client = ScriptedClient([reply(answer)] * 2 + [down] + [reply(answer)] * 4)
    boom = Task(id="t", prompt="1+1=", answer="2", domain="boom")
    echo = [Task(id=f"e{i}", prompt=f"say {i}:", domain="echo") for i in range(3)]
    sampling = {"temperature": 1.0}
    groups = [[await actor.play(boom, sampling, "b0-g0", i) for i in range(2)],
              [await actor.play(echo[0], sampling, "b0-g1", i) for i in range(2)],
              [await actor.play(echo[1], sampling, "b0-g2", i) for i in range(2)],
              [await actor.play(echo[2], sampling, "b0-g3", 0)]]
    assert [s.status for g in groups for s in g] == ["failed", "failed", "failed", "ok", "ok",
                                                     "ok", "ok"]
    actor.report(0, 5, groups, 1.0, [boom, *echo])
    (values, step, samples), = actor.metrics.records
    assert step == 0 and values["rollout/failed"] == 3 and values["rollout/failed_env"] == 2
    assert values["rollout/failed/boom"] == 2 and values["rollout/failed/echo"] == 1
    first_boom, first_echo, *ok = samples
    assert (first_boom.domain, first_boom.status, first_boom.cause, first_boom.task,
            first_boom.env, first_boom.episode) == ("boom", "failed", "env", "t", "Exploding",
                                                    "b0-g0-0")
    assert first_boom.error.endswith("RuntimeError: verifier crashed")
    assert (first_echo.cause, first_echo.episode) == ("generation", "b0-g1-0")
    assert "worker0 is down" in first_echo.error
    assert [(s.kind, s.domain, s.prompt, s.response, s.reward, s.status) for s in ok] == [
        ("rollout", "echo", f"say {i}:", "hi", 1.0, "ok") for i in range(3)]
    assert actor.env_failed == set()  # forgotten once reported
    actor.factory.close()


def test_samples_per_batch_must_be_a_count():
    with pytest.raises(ValueError, match=r"samples_per_batch = -1: give a count >= 0"):
        RolloutActor.check_config(RolloutConfig(envs=[], samples_per_batch=-1))
