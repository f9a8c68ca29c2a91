"""The run's front door, beyond the config: the environment contract at load, the console's
story (every domain, every evaluation, zero-by-construction explained once), the rollout's
no-signal warning."""

from __future__ import annotations

import asyncio
import collections
import types
from pathlib import Path
from typing import Iterator

import pytest

from actors import rollout as rollout_module
from actors.rollout import RolloutActor, RolloutConfig
from envs.base import SingleTurnEnv, Task
from envs.builtin.arith import ArithEnv
from envs.loader import check_at_load, load_envs
from launch.cluster import main
from launch.config import ConfigError, load
from launch.console import Story
from transport.schema import Metrics, Sample

ROOT = Path(__file__).resolve().parent.parent


class EmptyPrompt(SingleTurnEnv):
    """Its fourth task has an empty prompt."""
    domain = "empty"

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        for i in range(1000):
            yield Task(id=f"e{i}", prompt="" if i == 3 else f"{i}=", answer=str(i))

    def reward(self, task, response):
        return 0.0


class FewEvalNoAnswers(SingleTurnEnv):
    """20 eval tasks, answers left out (a reward that needs none)."""
    domain = "few"

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        n = 20 if split == "eval" else 10 ** 9
        return (Task(id=f"{split}{i}", prompt=f"{i}=") for i in range(n))

    def reward(self, task, response):
        return float(len(response) > 0)


def rl_file(tmp_path: Path, envs: str, eval_tasks: int = 100) -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(f"""
[run]
name = "t"
[rl]
model = "tiny-qwen2"
eval_tasks = {eval_tasks}
envs = [{envs}]
""")
    return path


def test_an_empty_prompt_fails_at_load_naming_the_env_and_task(tmp_path):
    with pytest.raises(ConfigError) as info:
        load(rl_file(tmp_path, '{ cls = "tests.test_front_door:EmptyPrompt" }'))
    message = str(info.value)
    assert ('[rl] envs[0] (cls = "tests.test_front_door:EmptyPrompt"): '
            "EmptyPrompt(domain='empty')") in message
    assert "train task #4 (id 'e3') has an empty prompt" in message


def test_a_small_eval_split_and_missing_answers_are_said_at_load(tmp_path, capsys):
    hosts = rl_file(tmp_path, '{ cls = "envs.builtin.arith:ArithEnv" }, '
                              '{ cls = "tests.test_front_door:FewEvalNoAnswers" }')
    assert main([str(hosts), "--dry-run"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # notes are wrapped at 80 columns
    assert ("note: [actors.rollout]: FewEvalNoAnswers(domain='few'): eval_tasks = 100, but its "
            "eval split has 20 tasks; evaluations score those 20") in flat
    assert "20 of its first 20 train tasks have no answer" in flat
    assert max(len(line) for line in out.splitlines() if " note: " in line) <= 80
    assert "ArithEnv" not in out.split("actor configs")[0]  # a sound env gets no note


def test_check_at_load_reads_a_bounded_sample_of_endless_splits():
    mix = load_envs([{"cls": "tests.test_front_door:FewEvalNoAnswers"}])
    pulled = collections.Counter()
    env = mix.envs[0]
    original = env.tasks

    def counting(split="train", seed=0):
        for t in original(split, seed):
            pulled[split] += 1
            yield t
    env.tasks = counting
    check_at_load(mix, eval_tasks=5)
    assert pulled == {"train": 20, "eval": 6}


def test_the_env_options_error_names_where_options_live():
    with pytest.raises(ValueError) as info:
        load_envs([{"cls": "envs.builtin.arith:ArithEnv", "options": {"max_operandd": 3}}])
    assert "[env]" not in str(info.value)
    assert "`options` of this env in the rollout's `envs`" in str(info.value)


def record(actor: str, values: dict, step: int | None, total: int | None = None) -> Metrics:
    return Metrics(actor=actor, seq=0, time_s=0.0, values=values, step=step, total_steps=total)


TRAIN = {"reward/math": 0.5, "reward/reverse": 0.125, "train/loss": 1e-9, "train/clipfrac": 0.0,
         "train/ppo_kl": 0.0, "train/grad_norm": 0.25, "train/entropy": 1.5,
         "train/logprob_abs_diff": 2e-7, "time/step_s": 1.0, "time/wait_batch_s": 0.1,
         "time/train_s": 0.7, "time/weight_sync_s": 0.2}


def test_console_tells_every_domain_every_eval_and_explains_zero_clipfrac_once():
    lines: list[str] = []
    story = Story(lines.append, interval_s=3600)
    story.on_record(record("trainer", TRAIN, 1, 200))
    story.on_record(record("trainer", TRAIN, 2, 200))  # within the interval: no line
    story.on_record(record("rollout", {"rollout/reward/math": 0.5, "rollout/reward/reverse": 0.0,
                                       "rollout/tokens_per_s": 900.0,
                                       "rollout/trainer_version": 1}, 2))
    story.on_record(record("rollout", {"eval/math": 0.7, "eval/reverse": 0.14}, 50))
    story.on_record(record("rollout", {"eval/math": 0.8, "eval/reverse": 0.2}, 100))
    story.on_record(record("trainer", {**TRAIN, "train/clipfrac": 0.01, "train/ppo_kl": 1e-3},
                           200, 200))  # the last step: always shown, clipfrac moved: shown
    story.on_record(record("trainer", {"final_eval/math": 0.84, "final_eval/reverse": 0.2},
                           200, 200))
    story.on_record(record("rollout", {"eval/math": 0.9}, 201))
    story.on_record(record("trainer", {"final_eval/math": 0.9}, 201, 201))  # said just above
    story.on_record(record("buffer", {"buffer/added": 8.0, "buffer/dropped_stale": 0.0,
                                      "buffer/dropped_failed_group": 2.0}, 3))
    notes = [ln for ln in lines if ln.startswith("note: train/clipfrac and train/ppo_kl are 0")]
    assert len(notes) == 1
    first = next(ln for ln in lines if ln.startswith("trainer: step 1/200"))
    assert "reward math=0.5 reverse=0.125" in first and "clipfrac" not in first
    assert "step_s=1 (wait 0.1, train 0.7, sync 0.2)" in first
    assert not any(ln.startswith("trainer: step 2/") for ln in lines)
    assert "rollout: batch 2 reward math=0.5 reverse=0 tok/s=900 trainer_version=1" in lines
    assert "rollout: eval of weight version 50: math=0.7 reverse=0.14" in lines
    assert "rollout: eval of weight version 100: math=0.8 reverse=0.2" in lines
    last = next(ln for ln in lines if ln.startswith("trainer: step 200/200"))
    assert "clipfrac=0.01" in last and "ppo_kl=0.001" in last
    assert "trainer: final eval at step 200: math=0.84 reverse=0.2" in lines
    assert not any("final eval at step 201" in ln for ln in lines)
    assert "buffer: step 3 added=8 dropped_failed_group=2" in lines


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


def group(domain: str, rewards: list[float], gid: str) -> list[Sample]:
    return [Sample(group_id=gid, index=i, domain=domain, prompt_ids=[1, 2], response_ids=[3, 4],
                   loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0], reward=r)
            for i, r in enumerate(rewards)]


def test_a_domain_without_signal_is_named_with_two_responses_once_per_episode_of_it():
    said: list[str] = []
    rollout = types.SimpleNamespace(config=RolloutConfig(envs=[], no_signal_batches=2),
                                    no_signal=collections.Counter(), tokenizer=Tok(),
                                    notify=said.append, no_signal_said={})
    rollout.describe = types.MethodType(RolloutActor.describe, rollout)

    def batch(reverse_rewards: list[float]) -> list:
        return [group("math", [0.0, 1.0], "m0"), group("reverse", reverse_rewards, "r0"),
                group("reverse", [0.0, 0.0], "r1")]
    for i, rewards in enumerate([[0.0, 0.0]] * 3 + [[0.0, 1.0]] + [[0.0, 0.0]] * 2):
        RolloutActor.check_signal(rollout, i, batch(rewards))
    assert len(said) == 1  # after batches 0-1; when it comes back soon after, not again
    rollout.no_signal_said["reverse"] -= rollout_module.NO_SIGNAL_NOTICE_S  # ten minutes later
    for i, rewards in enumerate([[0.0, 1.0]] + [[0.0, 0.0]] * 2, start=6):
        RolloutActor.check_signal(rollout, i, batch(rewards))
    assert len(said) == 2
    assert "no learning signal in domain 'reverse' for 2 batches (up to batch 1)" in said[0]
    assert "every sample got the same reward (0)" in said[0]
    assert said[0].count("'ab' -> 'cd' (reward 0)") == 2
    assert "up to batch 8" in said[1]
    assert "math" not in said[0].split("two responses")[0]


async def test_the_rollout_evaluates_a_version_once():
    calls: list[int] = []

    class Fake:
        last_eval = None
        serving_version = 0
        eval_lock = asyncio.Lock()
        _evaluate = RolloutActor._evaluate
        config = RolloutConfig(envs=[], eval_tasks=2)
        metrics = None
        name = "rollout"

        class envs:
            @staticmethod
            def tasks(split, seed):
                return iter([Task(id="a", prompt="1+1=", answer="2", domain="math")])

            @staticmethod
            def env_for(task):
                return ArithEnv()

        async def play(self, task, sampling, gid, index):
            calls.append(1)
            return types.SimpleNamespace(reward=1.0)
    fake = Fake()
    first = await RolloutActor.evaluate(fake, 7)
    second = await RolloutActor.evaluate(fake, 7)
    third = await RolloutActor.evaluate(fake, 8)
    assert first == second == third == ({"math": 1.0}, {"math": 1})
    assert len(calls) == 2  # versions 7 and 8, not 7 twice
    # the final request and a periodic eval of one version at once: scored once, both answered
    both = await asyncio.gather(RolloutActor.evaluate(fake, 9), RolloutActor.evaluate(fake, 9))
    assert both[0] == both[1] and len(calls) == 3
