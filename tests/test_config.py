"""hosts.toml validation: every mistake names the file, the table and the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launch.config import ConfigError, load, start_order

ROOT = Path(__file__).resolve().parent.parent
GOOD = """
[run]
name = "t"

[[hosts]]
name = "local"

[actors.scaler]
cls = "examples.demo:Scaler"
config = { delay_s = 0.0 }

[actors.producer]
cls = "examples.demo:Producer"
after = ["scaler"]
primary = true
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    return message


def test_good_config_loads_with_defaults_and_order(tmp_path):
    cfg = load(write(tmp_path, GOOD))
    assert cfg.run.transport == "ipc" and cfg.run.dir == "runs"
    assert cfg.actors["producer"].restart.max_restarts == 2
    assert start_order(cfg) == ["scaler", "producer"]


@pytest.mark.parametrize("edit, table, field, words", [
    (("[actors.scaler]", "[actors.scaler]\ncolour = 3"), "actors.scaler", "colour",
     "unknown field"),
    (('name = "t"', "name = 5"), "run", "name", "Expected `str`, got `int`"),
    (('cls = "examples.demo:Scaler"', ""), "actors.scaler", "cls", "missing required field"),
    (("[[hosts]]", "[[hosts]]\naddress = 1"), "hosts.#1", "address", "Expected `str`"),
    (("primary = true", "primary = true\nrestart = { max_restarts = \"x\" }"),
     "actors.producer.restart", "max_restarts", "Expected `int`"),
])
def test_schema_errors_name_table_and_field(tmp_path, edit, table, field, words):
    message = error_of(tmp_path, GOOD.replace(*edit, 1))
    assert f"table [{table}], field `{field}`" in message, message
    assert words in message


@pytest.mark.parametrize("edit, expected", [
    (('after = ["scaler"]', 'after = ["nobody"]'),
     "table [actors.producer], field `after`: unknown actor 'nobody'"),
    (('primary = true', 'primary = true\nhost = "elsewhere"'),
     "table [actors.producer], field `host`: unknown host 'elsewhere'"),
    (('cls = "examples.demo:Scaler"', 'cls = "examples.nope:Scaler"'),
     "table [actors.scaler], field `cls`: cannot import 'examples.nope:Scaler'"),
    (('cls = "examples.demo:Scaler"', 'cls = "examples.demo.Scaler"'),
     "is not 'package.module:ClassName'"),
    (('cls = "examples.demo:Scaler"', 'cls = "examples.demo:ScalerConfig"'),
     "is not a subclass of runtime.actor.Actor"),
    (("delay_s = 0.0", "delay_seconds = 0.0"),
     "table [actors.scaler.config], field `delay_seconds`: Object contains unknown field"),
    (("delay_s = 0.0", 'delay_s = "fast"'),
     "table [actors.scaler.config], field `delay_s`: Expected `float`"),
    (("[[hosts]]\nname = \"local\"", "[[hosts]]\nname = \"local\"\nexec = [\"ssh\", \"n2\"]"),
     "table [hosts.#1], field `address`: '127.0.0.1' is loopback, but host 'local' is "
     "another machine"),
    (("[actors.scaler]", "[actors.scaler]\nafter = [\"producer\"]"),
     "dependency cycle"),
])
def test_semantic_errors(tmp_path, edit, expected):
    assert expected in error_of(tmp_path, GOOD.replace(*edit, 1))


def test_bad_toml_and_missing_file(tmp_path):
    assert "not valid TOML" in error_of(tmp_path, "[run\nname=")
    with pytest.raises(ConfigError, match="no such file"):
        load(tmp_path / "absent.toml")


def test_cli_exit_code_2_and_dry_run(tmp_path):
    bad = write(tmp_path, GOOD.replace('name = "t"', "name = 5"))
    result = subprocess.run([sys.executable, "-m", "launch.cluster", str(bad)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "table [run], field `name`" in result.stderr
    good = write(tmp_path, GOOD)
    result = subprocess.run([sys.executable, "-m", "launch.cluster", str(good), "--dry-run"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "examples.demo:Producer" in result.stdout and "nothing was started" in result.stdout
    assert not (tmp_path / "runs").exists()


LOOP = """
[run]
name = "t"

[[hosts]]
name = "local"

[actors.buffer]
cls = "actors.buffer:BufferActor"

[actors.w]
cls = "actors.inference:InferenceWorker"

[actors.router]
cls = "actors.router:RouterActor"
after = ["w"]

[actors.trainer]
cls = "actors.trainer:TrainerActor"
after = ["buffer", "w"]
config = { model = "MODEL", workers = ["w"] }

[actors.rollout]
cls = "actors.rollout:RolloutActor"
after = ["router", "buffer"]
[actors.rollout.config]
envs = [{ cls = "ENV" }]
group_size = 4
groups_per_batch = 2
"""


def test_missing_checkpoint_and_bad_env_fail_before_anything_starts(tmp_path):
    ok = LOOP.replace("MODEL", "examples/base-tiny").replace("ENV", "envs.builtin.arith:ArithEnv")
    load(write(tmp_path, ok))
    message = error_of(tmp_path, ok.replace('model = "examples/base-tiny", workers',
                                            'model = "ckpt/deep/nowhere", workers'))
    assert "table [actors.trainer.config]" in message and "'ckpt/deep/nowhere'" in message
    assert "config.json" in message  # says what a checkpoint directory must hold
    message = error_of(tmp_path, ok.replace("envs.builtin.arith:ArithEnv", "envs.nope:Env"))
    assert '[actors.rollout.config] envs[0] (cls = "envs.nope:Env"): module' in message


README_ENV = '''
import itertools, random
from envs.base import SingleTurnEnv, Task

class Capitals(SingleTurnEnv):
    domain = "geo"
    max_new_tokens = 8
    PAIRS = [("france", "paris"), ("italy", "rome"), ("spain", "madrid"), ("peru", "lima")]

    def tasks(self, split="train", seed=0):      # deterministic for (split, seed)
        rng = random.Random(f"{split}-{seed}")
        for i in itertools.count() if split == "train" else range(20):
            country, city = rng.choice(self.PAIRS)
            yield Task(id=f"{split}-{i}", prompt=f"capital of {country}:", answer=city)

    def reward(self, task, response):            # the verifier
        return float(response.strip() == task.answer)
'''


def test_the_readme_environment_passes_the_contract_check():
    """The README's example must keep working as written."""
    from envs.contract import check_env

    readme = (ROOT / "README.md").read_text()
    assert README_ENV.strip() in readme
    namespace: dict = {}
    exec(README_ENV, namespace)  # noqa: S102 - the README's own code
    report = check_env(namespace["Capitals"]())
    assert report.ok, report.format()


def test_incompatible_trainer_options_fail_at_load_naming_both(tmp_path):
    ok = LOOP.replace("MODEL", "examples/base-tiny").replace("ENV", "envs.builtin.arith:ArithEnv")
    bad = ok.replace('workers = ["w"] }',
                     'workers = ["w"], mismatch = { bypass = true, correction = "tis" } }')
    message = error_of(tmp_path, bad)
    assert "table [actors.trainer.config], field `mismatch`" in message, message
    assert "bypass = true and correction = 'tis' conflict" in message


OK_LOOP = LOOP.replace("MODEL", "examples/base-tiny").replace("ENV", "envs.builtin.arith:ArithEnv")


@pytest.mark.parametrize("edit, words", [
    (("config = { max_staleness = 1 }", "config = { group_size = 8, max_staleness = 1 }"),
     ["table [actors.buffer.config], field `group_size`", "group_size is a fact of the run, "
      "said once (in [rl], or as `group_size` of the rollout) and read by every other actor: "
      "remove `group_size` here"]),
    (("config = { max_staleness = 1 }", "config = { max_staleness = 1, max_pending_groups = 1 }"),
     ["table [actors.buffer.config]: max_pending_groups (1) must be >= the run's "
      "groups_per_batch (2)"]),
    (('workers = ["w"] }', 'workers = ["w"], mode = "colocated" }'),
     ["table [actors.trainer.config]: mode = 'colocated' here needs max_staleness = 0 in "
      "[actors.buffer.config] (it is 1)", "set max_staleness = 0 there, or mode = 'decoupled'"]),
    (('workers = ["w"] }', 'workers = ["w"], loss = { temperature = 0.7 } }'),
     ["table [actors.trainer.config], field `loss.temperature`",
      "temperature is a fact of the run, "
      "said once (in [rl], or as `temperature` of the rollout) and read by every other actor: "
      "remove `loss.temperature` here"]),
    (('after = ["router", "buffer"]', 'after = ["buffer"]'),
     ["table [actors.rollout.config]: `router` = 'router', but 'router' is missing from the "
      "`after` list of [actors.rollout]", "add it there"]),
    (('envs = [{', 'router = "gateway"\nenvs = [{'),
     ["table [actors.rollout.config]: `router` = 'gateway' is not an actor of this run",
      "add an [actors.gateway] table"]),
    (('workers = ["w"] }', 'workers = ["w"], rollout = "rollout" }'),
     ["table [actors.trainer.config]: `rollout` = 'rollout', but 'rollout' is missing from the "
      "`after` list of [actors.trainer]", "add it there"]),
])
def test_cross_actor_checks_name_both_tables_and_the_fix(tmp_path, monkeypatch, edit, words):
    monkeypatch.chdir(ROOT)
    staleness = OK_LOOP.replace('cls = "actors.buffer:BufferActor"\n',
                                'cls = "actors.buffer:BufferActor"\n'
                                'config = { max_staleness = 1 }\n')
    load(write(tmp_path, staleness))
    assert edit[0] in staleness
    message = error_of(tmp_path, staleness.replace(*edit, 1))
    for w in words:
        assert w in message, message


def mopd(edits: list[tuple[str, str]]) -> str:
    text = (ROOT / "tests" / "fixtures" / "mopd_layout.toml").read_text()  # per-actor tables
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


SERVER = [('mode = "colocated"', 'mode = "server"\nopd = { mode = "sampled" }'),
          ('{ name = "arith", model = "examples/teacher-arith", domains = ["math"] },',
           '{ name = "arith", model = "examples/teacher-arith", domains = ["math"], '
           'url = "http://127.0.0.1:1" },'),
          ('{ name = "reverse", model = "examples/teacher-reverse", domains = ["reverse"] },',
           '{ name = "reverse", model = "examples/teacher-reverse", domains = ["reverse"], '
           'url = "http://127.0.0.1:2" },'),
          ('opd = { mode = "full", kl_coef = 1.0 }\nteachers = [',
           'opd = { mode = "sampled", kl_coef = 1.0 }\nteachers_unused = [')]


@pytest.mark.parametrize("edits, words", [
    ([('[actors.teachers.config]\n', '[actors.teachers.config]\ntemperature = 1.0\n')],
     ["table [actors.teachers.config], field `temperature`", "temperature is a fact of the run"]),
    ([("opd = { mode = \"full\", kl_coef = 1.0 }\nteachers = [", "teachers_x = ["),
      ('loss = { advantage_estimator = "none" }', "")],
     ["table [actors.trainer.config]: [actors.teachers] (a teacher pool) routes samples into "
      "[actors.buffer.config]", "but opd is not set here: add opd ="]),
    ([('sink = "teachers"', 'sink = ""'),
      ('[actors.teachers]\ncls = "actors.teacher_pool:TeacherPool"\nafter = ["buffer"]',
       '[actors.buffer2]\ncls = "actors.buffer:BufferActor"\nconfig = { max_staleness = 1 '
       '}\n\n[actors.teachers]\ncls = "actors.teacher_pool:TeacherPool"'
       '\nafter = ["buffer2"]'),
      ('mode = "colocated"', 'mode = "colocated"\nbuffer = "buffer2"')],
     ["table [actors.trainer.config]: opd is set here, but no teacher pool",
      "sends its groups to [actors.buffer.config]", "make it the rollout's `sink`"]),
    ([('{ name = "reverse", model = "examples/teacher-reverse", domains = ["reverse"] },\n]\n\n'
       '[actors.prefetcher]',
       '{ name = "reverse", model = "examples/teacher-reverse", domains = ["rev"] },\n]\n\n'
       '[actors.prefetcher]')],
     ["table [actors.trainer.config]: `teachers` here and in [actors.teachers.config] differ",
      "examples/teacher-reverse', ('reverse',))", "give both the same list"]),
    ([('mode = "colocated"', 'mode = "server"'),
      ('domains = ["math"] },', 'domains = ["math"], worker = "worker0" },'),
      ('domains = ["reverse"] },', 'domains = ["reverse"], worker = "worker1" },')],
     ["table [actors.teachers.config]: `teachers['arith'].worker` = 'worker0', but 'worker0' is "
      "missing from the `after` list of [actors.teachers]", "add it there"]),
    (SERVER[:3] + [('opd = { mode = "full", kl_coef = 1.0 }\nteachers = [',
                    'opd = { mode = "sampled", kl_coef = 1.0 }\nteachers = [')],
     ["table [actors.trainer.config]: `teachers` here run colocated in the trainer, but "
      "[actors.teachers.config] has mode = 'server'", "set mode = 'colocated' there"]),
    ([('opd = { mode = "full", kl_coef = 1.0 }\nteachers = [',
       'opd = { mode = "sampled", kl_coef = 1.0 }\nteachers_unused = [')],
     ["table [actors.trainer.config]: opd without `teachers` here takes the teacher signal "
      "from teacher servers, but [actors.teachers.config] has mode = 'colocated'",
      "set mode = 'server' there"]),
    (SERVER[:3] + [('opd = { mode = "full", kl_coef = 1.0 }\nteachers = [',
                    'opd = { mode = "top_k", top_k = 4, top_k_from = "teacher" }\n'
                    'teachers_unused = [')],
     ["table [actors.trainer.config]: opd here (mode = 'top_k', top_k = 4) and in "
      "[actors.teachers.config] (mode = 'sampled', top_k = 0) differ",
      "set the same opd mode and top_k in both"]),
])
def test_distillation_checks_name_both_tables_and_the_fix(tmp_path, monkeypatch, edits, words):
    monkeypatch.chdir(ROOT)
    server_ok = mopd(SERVER).replace("teachers_unused = [", "teachers = [], unused = [")
    assert "teachers = [], unused" in server_ok
    text = mopd(edits).replace("teachers_unused = [", "teacher_list_unused = [") \
        .replace("teachers_x = [", "teacher_list_unused = [")
    # the unused teacher lists become a comment block, not a field
    text = _drop_block(text, "teacher_list_unused = [")
    message = error_of(tmp_path, text)
    for w in words:
        assert w in message, message


def _drop_block(text: str, start: str) -> str:
    """Remove a multi-line `key = [ ... ]` array starting with `start`."""
    if start not in text:
        return text
    at = text.index(start)
    end = text.index("]\n", text.index("\n]", at)) + 2
    return text[:at] + text[end:]


def test_server_mode_distillation_config_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    load(write(tmp_path, _drop_block(mopd(SERVER), "teachers_unused = [")))
