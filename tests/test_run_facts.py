"""The run's facts: derived once at load from the whole plan, delivered to every actor, and the
facts that ride on data checked at admission (runtime/facts.py, launch/plan.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from actors.buffer import BufferActor
from actors.rollout import RolloutActor
from launch.config import ConfigError, load
from logic.buffer import BufferConfig
from runtime.actor import Actor
from runtime.facts import RunFacts, TeacherFact
from tests.helpers import context, running
from transport.rpc import RpcClient
from transport.schema import Ack, GetBatch, Sample, SampleGroup, TrainBatch, VersionUpdate
from transport.sockets import SocketFactory
from transport.streams import StreamSender

ROOT = Path(__file__).resolve().parent.parent

RL = """
[run]
name = "t"

[rl]
model = "tiny-qwen2"
group_size = 4
groups_per_batch = 2
temperature = 0.7
top_p = 0.9
max_staleness = 2
num_steps = 3
envs = [{ cls = "envs.builtin.arith:ArithEnv" }]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    return path


def test_facts_are_derived_once_from_rl_and_reach_every_actor_spec(tmp_path):
    cfg = load(write(tmp_path, RL))
    assert set(cfg.facts) == set(cfg.actors)  # one pipeline: every actor gets the same facts
    for facts in cfg.facts.values():
        assert facts == RunFacts(model="tiny-qwen2", group_size=4, groups_per_batch=2,
                                 temperature=0.7, top_p=0.9, max_staleness=2)


def test_facts_of_a_distillation_run_name_its_teachers_and_opd(tmp_path):
    text = RL + ('teachers = [{ name = "t", model = "tiny-qwen2", domains = ["math", "a"] }]\n'
                 'opd = { mode = "sampled" }\n')
    facts = load(write(tmp_path, text)).facts["teachers"]
    assert facts.teachers == [TeacherFact("t", "tiny-qwen2", ["a", "math"])]
    assert (facts.opd_mode, facts.opd_top_k) == ("sampled", 0)


def test_facts_of_a_per_actor_layout_come_from_the_deciding_actors(monkeypatch):
    monkeypatch.chdir(ROOT)
    facts = load(ROOT / "tests" / "fixtures" / "mopd_layout.toml").facts["buffer"]
    assert facts.group_size > 0 and facts.groups_per_batch > 0
    assert facts.opd_mode == "full"
    assert sorted(t.name for t in facts.teachers) == ["arith", "reverse"]
    assert facts.model.endswith("base-tiny")
    # the policy's vocabulary, read from its config.json: the buffer refuses ids beyond it
    config = json.loads((Path(facts.model) / "config.json").read_text())
    assert facts.vocab_size == config["vocab_size"] > 0


def test_facts_are_not_written_in_the_file(tmp_path):
    with pytest.raises(ConfigError, match="`facts` is derived from the actors at load"):
        load(write(tmp_path, RL + "\n[facts]\ntemperature = 2.0\n"))


def test_the_run_facts_say_what_differs():
    facts = RunFacts(temperature=0.7, top_p=0.9)
    assert facts.sampled_as(0.7, 0.9) == ""
    assert facts.sampled_as(None, None) == ""
    assert facts.sampled_as(1.0, 0.9) == "temperature 1.0 (the run's is 0.7)"
    assert "top_p 1.0 (the run's is 0.9)" in facts.sampled_as(0.7, 1.0)


@pytest.fixture
def factory():
    f = SocketFactory()
    yield f
    f.close()


def sample(gid: str, index: int) -> Sample:
    return Sample(group_id=gid, index=index, domain="math", prompt_ids=[1, 2],
                  response_ids=[3, 4], loss_mask=[1, 1], rollout_logprobs=[-0.1, -0.2])


async def test_the_buffer_admits_only_groups_sampled_at_the_runs_settings(ipc, factory):
    facts = RunFacts(temperature=0.7, top_p=1.0, group_size=2, groups_per_batch=1)
    actor = BufferActor(context("buffer", ipc, facts=facts), BufferConfig())
    async with running(actor):
        sender = StreamSender(factory, actor.bound.inbox)
        client = RpcClient(factory, actor.bound.rpc, "trainer", timeout_s=3.0, role="trainer")
        try:
            await sender.send(SampleGroup(samples=[sample("hot", 0), sample("hot", 1)],
                                          temperature=1.0, top_p=1.0))
            await sender.send(SampleGroup(samples=[sample("ok", 0), sample("ok", 1)],
                                          temperature=0.7, top_p=1.0))
            assert isinstance(await client.call(VersionUpdate(version=0, step=0)), Ack)
            batch = await client.call(GetBatch(step=0, trainer_version=0))
            assert isinstance(batch, TrainBatch)
            assert {s.group_id for s in batch.samples} == {"ok"}
            assert actor.counters["inbox.refused_invalid"] == 1
            assert actor.logic.counters["added"] == 2
        finally:
            sender.close()
            await client.close()


def test_each_fact_is_written_once_and_read_by_the_others_from_their_facts(tmp_path):
    from launch.rl import RLConfig, derive

    text = RL + 'teachers = [{ name = "t", model = "tiny-qwen2", domains = ["math"] }]\n'
    derived = derive(RLConfig(model="tiny-qwen2", envs=[], group_size=4, temperature=0.7,
                              teachers=[{"name": "t", "model": "tiny-qwen2"}]))
    assert "group_size" not in derived["buffer"]["config"]  # said once: to the rollout
    assert "temperature" not in derived["teachers"]["config"]
    assert "model" not in derived["rollout"]["config"]
    assert "loss" not in derived["trainer"]["config"]
    cfg = load(write(tmp_path, text))
    for name, field in (("buffer", "group_size"), ("teachers", "temperature"),
                        ("teachers", "student"), ("rollout", "model")):
        assert field not in cfg.actors[name].config  # no copies at load either
    for name in ("buffer", "teachers", "trainer", "rollout"):  # they read the facts instead
        facts = cfg.facts[name]
        assert (facts.group_size, facts.groups_per_batch, facts.temperature, facts.model) == \
            (4, 2, 0.7, "tiny-qwen2")


def test_a_per_actor_layout_states_a_fact_once_and_a_copy_is_refused_with_where_it_goes(
        monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    text = (ROOT / "tests" / "fixtures" / "mopd_layout.toml").read_text()
    once = "config = { max_staleness = 1 }"
    assert once in text
    cfg = load(write(tmp_path, text))
    assert (cfg.facts["buffer"].group_size, cfg.facts["buffer"].groups_per_batch) == (4, 32)
    for copy, table, fact, decider in [
            ("config = { group_size = 4, max_staleness = 1 }", "buffer", "group_size",
             "`group_size` of the rollout"),
            ('[actors.teachers.config]\nstudent = "examples/base-tiny"', "teachers", "model",
             "`model` of the trainer")]:
        anchor = once if table == "buffer" else "[actors.teachers.config]"
        with pytest.raises(ConfigError, match=rf"\[actors.{table}.config\].*{fact} is a fact of "
                                              rf"the run, said once \(in \[rl\], or as {decider}"):
            load(write(tmp_path, text.replace(anchor, copy)))


def test_an_actor_checks_its_own_settings_against_the_facts_at_load(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    text = (ROOT / "tests" / "fixtures" / "mopd_layout.toml").read_text()
    text = text.replace("config = { max_staleness = 1 }",
                        "config = { max_staleness = 1, min_ok_per_group = 5 }")
    with pytest.raises(ConfigError, match=r"\[actors.buffer.config\]: min_ok_per_group \(5\) "
                                          r"must be <= the run's group_size \(4\)"):
        load(write(tmp_path, text))


def test_each_pipeline_of_a_layout_has_its_own_facts(monkeypatch, tmp_path):
    """Two buffers, each with its rollout: each actor reads the facts of its own pipeline;
    the workers (no buffer) read the trainer's."""
    monkeypatch.chdir(ROOT)
    text = (ROOT / "tests" / "fixtures" / "local_layout.toml").read_text()
    text += ('\n[actors.buffer2]\ncls = "actors.buffer:BufferActor"\n'
             'config = { max_staleness = 1 }\n\n'
             '[actors.rollout2]\ncls = "actors.rollout:RolloutActor"\n'
             'after = ["router", "buffer2"]\n'
             'config = { buffer = "buffer2", group_size = 2, groups_per_batch = 4, envs = '
             '[{ cls = "envs.builtin.arith:ArithEnv" }] }\n')
    with pytest.raises(ConfigError, match=r"\[actors.rollout2.config\]: no trainer on this "
                                          r"rollout's buffer decides the run's model.*"
                                          r"buffer = 'buffer2'"):
        load(write(tmp_path, text))
    monkeypatch.setattr(RolloutActor, "check_facts", classmethod(lambda cls, c, f: None))
    facts = load(write(tmp_path, text)).facts
    assert (facts["buffer"].group_size, facts["rollout"].group_size) == (8, 8)
    assert (facts["buffer2"].group_size, facts["buffer2"].groups_per_batch) == (2, 4)
    assert facts["rollout2"] == facts["buffer2"] and facts["worker0"] == facts["trainer"]
    assert facts["rollout2"].model == "" and facts["trainer"].model.endswith("base-tiny")


class EchoConfig(msgspec.Struct, forbid_unknown_fields=True):
    max_staleness: int = 0


class FactsEcho(Actor):
    """Decides the staleness as a buffer would, and writes the facts its context brought."""

    Config = EchoConfig
    role = "buffer"

    async def run(self) -> None:
        Path(self.ctx.run_dir, "facts.json").write_bytes(msgspec.json.encode(self.ctx.facts))


def test_the_launcher_hands_every_actor_the_runs_facts(tmp_path, capsys):
    from launch.cluster import main

    hosts = write(tmp_path, '[run]\nname = "facts"\n\n[actors.echo]\n'
                            'cls = "tests.test_run_facts:FactsEcho"\nprimary = true\n'
                            'config = { max_staleness = 3 }\n')
    assert main([str(hosts), "--dry-run"]) == 0
    assert '"max_staleness": 3' in capsys.readouterr().out.split("run facts: ")[1]
    run = subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                          str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    facts = msgspec.json.decode((tmp_path / "run" / "facts.json").read_bytes(), type=RunFacts)
    assert facts == RunFacts(max_staleness=3)


def test_the_vocabulary_fact_is_read_from_a_checkpoints_config_or_left_unknown(tmp_path):
    from models.names import checkpoint_vocab_size

    for name, text in (("plain", '{"vocab_size": 151936}'),
                       ("multimodal", '{"vocab_size": 7, "text_config": {"vocab_size": 151936}}'),
                       ("broken", '{"vocab_size": '), ("none", '{"hidden_size": 8}'),
                       ("flag", '{"vocab_size": true}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    assert [checkpoint_vocab_size(str(tmp_path / n)) for n in
            ("plain", "multimodal", "broken", "none", "flag", "missing")] == [
        151936, 151936, 0, 0, 0, 0]
    assert checkpoint_vocab_size("tiny-qwen2") == 0
