"""The run's front door: `--set` overrides, `[run] python_path`, model paths next to hosts.toml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.config import ConfigError, load, parse_overrides
from launch.resume import check_same_run, resume_overrides

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ROOT / "examples" / "local.toml"


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples name their models relative to the repository


def error_of(path: Path, *sets: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(path, None, parse_overrides(list(sets)))
    return str(info.value)


def test_values_parse_as_toml_else_as_strings():
    values = {o.text: o.value for o in parse_overrides([
        "a.b=16", "a.c=3e-5", "a.d=[1,2]", 'a.e="text"', "a.f=true", "a.g=bare-word",
        "a.h={ x = 1 }", "a.i=1=2"])}
    assert values == {"a.b=16": 16, "a.c=3e-5": 3e-5, "a.d=[1,2]": [1, 2], 'a.e="text"': "text",
                      "a.f=true": True, "a.g=bare-word": "bare-word", "a.h={ x = 1 }": {"x": 1},
                      "a.i=1=2": "1=2"}
    assert parse_overrides(["actors.trainer.config.optimizer.lr=3e-5"])[0].keys == \
        ["actors", "trainer", "config", "optimizer", "lr"]
    for bad in ("no-equals-sign", "a..b=1", "=1"):
        with pytest.raises(ConfigError, match=f"--set {bad}: expected PATH=VALUE"):
            parse_overrides([bad])


def test_overrides_apply_before_validation_and_create_allowed_tables():
    cfg = load(LOCAL, None, parse_overrides([
        "actors.trainer.config.optimizer.lr=3e-5", "run.name=x",
        "actors.buffer.config.max_pending_groups=16", "actors.rollout.config.group_size=16",
        # [actors.trainer.config] has no `kl` table in the file: created, the schema has one
        "actors.trainer.config.kl.coef=0.1", "actors.trainer.config.kl.use_kl_loss=true",
        "actors.router.config.router.log_level=info", "run.sinks=['jsonl']"]))
    assert cfg.run.name == "x" and cfg.run.sinks == ["jsonl"]
    trainer = cfg.actors["trainer"].config
    assert trainer["optimizer"] == {"lr": 3e-5}
    assert trainer["kl"] == {"coef": 0.1, "use_kl_loss": True}
    assert trainer["micro_batches"] == {"size": 64}  # the rest of the file is kept
    assert cfg.actors["buffer"].config["max_pending_groups"] == 16
    assert cfg.actors["rollout"].config["group_size"] == 16
    assert cfg.facts["buffer"].group_size == 16  # said once, by the rollout
    assert cfg.actors["router"].config["router"] == {"log_level": "info"}


def test_override_errors_name_the_set_and_the_path():
    message = error_of(LOCAL, "rl.group_sise=16")
    assert "--set rl.group_sise=16: table [rl] has no field `group_sise`" in message
    assert "groups_per_batch" in message
    message = error_of(LOCAL, "runs.name=x")
    assert "--set runs.name=x: the top level of hosts.toml has no field `runs`" in message
    assert "actors, hosts, limits, rl, run, security, shm" in message
    message = error_of(LOCAL, "actors.trainer.config.optimizr.lr=1e-5")
    assert "--set actors.trainer.config.optimizr.lr=1e-5: table [actors.trainer.config] has no " \
           "field `optimizr`" in message and "optimizer" in message
    message = error_of(LOCAL, "actors.trainer.config.optimizer.lrate=1e-5")
    assert "table [actors.trainer.config.optimizer] has no field `lrate`" in message
    message = error_of(LOCAL, "actors.trainer.config.optimizer.lr=fast")
    assert "table [actors.trainer.config], field `optimizer.lr`: Expected `float`, got " \
           "`str`" in message
    assert "(set on the command line by --set actors.trainer.config.optimizer.lr=fast)" in message
    message = error_of(LOCAL, "run.name.first=x")
    assert "--set run.name.first=x: `run.name` is a value in local.toml, not a table" in message
    message = error_of(LOCAL, "hosts.name=x")
    assert "`hosts` is an array in local.toml" in message and "--set hosts=VALUE" in message
    # a cross-field check failing on an overridden value says which --set did it
    message = error_of(LOCAL, "actors.trainer.config.kl.coef=0.1")
    assert "needs use_kl_loss = true" in message
    assert "set on the command line by --set actors.trainer.config.kl.coef=0.1" in message
    # a fact set where it is only read: where to set it instead
    message = error_of(LOCAL, "actors.buffer.config.group_size=16")
    assert "--set actors.buffer.config.group_size=16: table [actors.buffer.config] has no field " \
           "`group_size`; group_size is a fact of the run, said once (in [rl], or as " \
           "`group_size` of the rollout)" in message
    # a new actor table is created, then the schema says what it lacks
    message = error_of(LOCAL, "actors.extra.config.x=1")
    assert "table [actors.extra], field `cls`: Object missing required field `cls`" in message
    assert "--set actors.extra.config.x=1" in message


def test_resume_reuses_the_recorded_overrides_with_the_given_ones_over_them(tmp_path):
    recorded = ["actors.trainer.config.optimizer.lr=3e-5", "run.name=x"]
    (tmp_path / "config.json").write_text(json.dumps({"overrides": recorded}))
    assert resume_overrides(tmp_path, []) == recorded
    assert resume_overrides(tmp_path, ["rl.num_steps=400", "run.name=y"]) == \
        ["actors.trainer.config.optimizer.lr=3e-5", "run.name=y", "rl.num_steps=400"]
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match="its config.json is not a JSON object"):
        resume_overrides(tmp_path, [])


def test_a_config_that_is_not_the_runs_is_refused_with_what_changed(tmp_path):
    run = {"source": "/a/hosts.toml", "start_order": ["t"], "overrides": [],
           "run": {"name": "r", "progress_interval_s": 5.0},
           "security": {"keys_dir": "/run/keys"},
           "rl": {"num_steps": 10, "lr": 1e-5, "envs": [{"cls": "a:B"}]},
           "actors": {"t": {"host": "a", "config": {"num_steps": 10, "optimizer": {"lr": 1e-5},
                                                    "parallel": {"dp": 1}}}}}
    (tmp_path / "config.json").write_text(json.dumps(run))
    same = {k: v for k, v in run.items() if k not in ("source", "start_order", "overrides")}
    assert check_same_run(tmp_path, same) == []
    # how far, where and how it runs may change; each change is returned to be said
    longer = json.loads(json.dumps(same))
    longer["rl"]["num_steps"] = longer["actors"]["t"]["config"]["num_steps"] = 20
    longer["actors"]["t"]["config"]["parallel"] = {"dp": 2, "shard": "fsdp2"}
    longer["run"]["progress_interval_s"], longer["security"]["keys_dir"] = 1.0, ""
    longer["actors"]["t"]["host"] = "b"
    assert [c[0] for c in check_same_run(tmp_path, longer)] == [
        "actors.t.config.num_steps", "actors.t.config.parallel.dp",
        "actors.t.config.parallel.shard", "actors.t.host", "rl.num_steps",
        "run.progress_interval_s"]  # the launcher's new keys are no change
    # what it trains may not, unless allowed
    other = json.loads(json.dumps(longer))
    other["rl"]["lr"] = other["actors"]["t"]["config"]["optimizer"]["lr"] = 3e-5
    other["rl"]["envs"] = [{"cls": "a:C"}]
    other["actors"]["u"] = {"config": {}}
    with pytest.raises(ConfigError) as info:
        check_same_run(tmp_path, other)
    assert ("this config is not the run's (actors.t.config.optimizer.lr: 1e-05 -> 3e-05; "
            "actors.u: (absent) -> {\"config\": {}}; rl.envs: [{\"cls\": \"a:B\"}] -> "
            "[{\"cls\": \"a:C\"}]; rl.lr: 1e-05 -> 3e-05; recorded -> given)") in str(info.value)
    assert "--allow-changes" in str(info.value)
    assert len(check_same_run(tmp_path, other, allow_changes=True)) == 10


def test_help_documents_set_and_the_pass_through_flags():
    result = subprocess.run([sys.executable, "-m", "launch.cluster", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for words in ("--set PATH=VALUE", "--sglang-<option> [VALUE]", "--router-<option> [VALUE]",
                  "--megatron-<option> [VALUE]", "--resume RUN_DIR"):
        assert words in result.stdout, words


PROBE = '''
import json, os, sys
from pathlib import Path
import msgspec
from runtime.actor import Actor
import myenv  # importable only through [run] python_path


class ProbeConfig(msgspec.Struct, forbid_unknown_fields=True):
    out: str
    model: str


class Probe(Actor):
    Config = ProbeConfig

    async def run(self):
        Path(self.config.out).write_text(json.dumps({
            "model": self.config.model, "env": myenv.Capitals.__module__,
            "pythonpath": os.environ.get("PYTHONPATH", "")}))
'''

MYENV = '''
from envs.base import SingleTurnEnv, Task


class Capitals(SingleTurnEnv):
    domain = "geo"
    max_new_tokens = 8

    def tasks(self, split="train", seed=0):
        for i in range(4):
            yield Task(id=f"{split}-{i}", prompt="capital of peru:", answer="lima")

    def reward(self, task, response):
        return float(response.strip() == task.answer)
'''


def write_project(tmp_path: Path) -> Path:
    """hosts.toml in its own folder with its environment module, a probe actor and a model
    checkpoint beside it, all named by relative paths."""
    project = tmp_path / "project"
    (project / "lib").mkdir(parents=True)
    (project / "lib" / "myenv.py").write_text(MYENV)
    (project / "lib" / "probe_actor.py").write_text(PROBE)
    (project / "ckpt").mkdir()
    (project / "ckpt" / "config.json").write_text("{}")  # what makes a checkpoint directory
    out = tmp_path / "probe.json"
    hosts = project / "hosts.toml"
    hosts.write_text(f"""
[run]
name = "paths"
python_path = ["lib"]
shutdown_timeout_s = 2.0
plots = false
[[hosts]]
name = "local"
[actors.buffer]
cls = "actors.buffer:BufferActor"
[actors.router]
cls = "actors.router:RouterActor"
[actors.rollout]
cls = "actors.rollout:RolloutActor"
after = ["router", "buffer"]
[actors.rollout.config]
envs = [{{ cls = "myenv:Capitals" }}]
group_size = 2
groups_per_batch = 2
[actors.w]
cls = "actors.inference:InferenceWorker"
config = {{ model = "tiny-qwen2" }}
[actors.trainer]
cls = "actors.trainer:TrainerActor"
after = ["buffer", "w"]
config = {{ model = "tiny-qwen2", workers = ["w"] }}
[actors.probe]
cls = "probe_actor:Probe"
primary = true
config = {{ out = "{out}", model = "ckpt" }}
""")
    return hosts


def test_python_path_and_model_paths_resolve_against_the_config_folder(tmp_path):
    hosts = write_project(tmp_path)
    project = hosts.parent
    assert str(project / "lib") not in sys.path
    cfg = load(hosts)  # imports myenv (the rollout's check) and probe_actor from lib/
    assert cfg.run.python_path == [str((project / "lib").resolve())]
    assert str((project / "lib").resolve()) in sys.path
    assert cfg.actors["probe"].config["model"] == str((project / "ckpt").resolve())
    assert cfg.actors["trainer"].config["model"] == "tiny-qwen2"  # a built-in name: untouched
    assert cfg.facts["rollout"].model == "tiny-qwen2"  # the trainer's, which the rollout reads
    # a path relative to the working directory is made absolute too
    text = hosts.read_text().replace('model = "ckpt"', 'model = "examples/base-tiny"')
    hosts.write_text(text)
    assert load(hosts).actors["probe"].config["model"] == str(ROOT / "examples" / "base-tiny")
    hosts.write_text(text.replace('python_path = ["lib"]', 'python_path = ["nowhere"]'))
    with pytest.raises(ConfigError) as info:
        load(hosts)
    assert "table [run], field `python_path`: 'nowhere' is not a folder" in str(info.value)
    assert str(project) in str(info.value)


@pytest.mark.timeout(120)
def test_actors_get_python_path_and_absolute_model_paths(tmp_path):
    """A real run of the probe alone: its process imports from lib/ (PYTHONPATH not exported)
    and sees the absolute model path; config.json records the --set for a resume."""
    hosts = write_project(tmp_path)
    text = hosts.read_text()
    hosts.write_text(text[:text.index("[actors.buffer]")] + text[text.index("[actors.probe]"):])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                             str(run_dir), "--set", "run.name=probe-run"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    seen = json.loads((tmp_path / "probe.json").read_text())
    lib = str((hosts.parent / "lib").resolve())
    assert seen["model"] == str((hosts.parent / "ckpt").resolve())
    assert seen["env"] == "myenv" and lib in seen["pythonpath"].split(os.pathsep)
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["overrides"] == ["run.name=probe-run"] and resolved["run"]["name"] == \
        "probe-run"
    assert resolved["run"]["python_path"] == [lib]
    # a resume that changes a setting of the run, by --set or in the file, is refused before
    # anything starts, naming what changed
    def resume(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), "--resume",
                               str(run_dir), *extra], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)

    result = resume("--set", "actors.probe.config.out=elsewhere")
    assert result.returncode == 2
    assert "this config is not the run's (actors.probe.config.out: " in result.stderr
    assert '-> "elsewhere"; recorded -> given)' in result.stderr
    text = hosts.read_text()
    hosts.write_text(text.replace("shutdown_timeout_s = 2.0", "shutdown_timeout_s = 3.0")
                     .replace("probe.json", "probe2.json"))
    result = resume()
    assert result.returncode == 2, result.stdout + result.stderr
    assert "this config is not the run's (actors.probe.config.out: " in result.stderr
    assert "probe2.json\"; recorded -> given)" in result.stderr  # only the one change: [run]'s
    assert "shutdown_timeout_s" not in result.stderr  # supervision fields may change
    result = resume("--allow-changes", "--dry-run")  # knowingly: said, then planned
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resume: continuing with changes (recorded -> given): actors.probe.config.out" in \
        " ".join(result.stdout.split())  # wrapped at 80 columns
    # the file as it was: the resume goes on (the run is complete, so nothing is left)
    hosts.write_text(text)
    result = resume("--set", "run.progress_interval_s=1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resume: applying the run's recorded --set run.name=probe-run" in result.stdout
    assert "already complete" in result.stdout
