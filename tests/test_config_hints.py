"""Config mistakes say how to fix them: an unknown key names the closest fields of its table by
their dotted path (or lists the fields), a struct's own check names its field, an `[rl]` mistake
points at launch/rl.py, and a class that does not import points at `[run] python_path`."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.config import ConfigError, load, parse_overrides
from tests.test_rl_table import BASE as RL  # a small [rl] run

RL_DOCS = "(fields of [rl]: launch/rl.py RLConfig"
PYTHON_PATH = ("if it is your own module, put its folder in [run] python_path = [...] "
               "(relative to hosts.toml)")


def error_of(tmp_path: Path, text: str, *sets: str) -> str:
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load(path, None, parse_overrides(list(sets)))
    message = str(info.value)
    assert message.startswith(str(path)), message
    return message


@pytest.mark.parametrize("text, words", [
    (RL + "grup_size = 4\n",
     ["table [rl], field `grup_size`", "unknown field", "did you mean `group_size`?", RL_DOCS]),
    (RL.replace('ArithEnv" }', 'ArithEnv", optionz = {} }'),
     ["table [rl], field `envs[0].optionz`", "did you mean `envs[0].options`?", RL_DOCS,
      "actors.rollout_config.EnvSpec"]),
    (RL + "[actors.trainer.config]\noptimizer = { lrr = 1 }\n",
     ["table [actors.trainer.config], field `optimizer.lrr`", "did you mean `optimizer.lr`?",
      "derived from [rl]"]),
    (RL + "[actors.trainer.config]\nloss = { eps_clp = 0.2 }\n",
     ["field `loss.eps_clp`", "did you mean `loss.eps_clip`"]),
    (RL + "[actors.trainer.config]\nnum_stepz = 3\n",
     ["field `num_stepz`", "did you mean `num_steps`?"]),
    # an old flat name that moved into a table: the table's field is named first
    (RL + "[actors.trainer.config]\nlr = 1e-5\n",
     ["field `lr`", "did you mean `optimizer.lr`"]),
    (RL + "[actors.trainer.config]\nsave_every = 5\n",
     ["field `save_every`", "did you mean `checkpoint.save_every`?"]),
    (RL + "[actors.trainer.config]\nmicro_batch_size = 4\n",
     ["field `micro_batch_size`", "did you mean `micro_batches.size`"]),
    (RL + "[run.wandb]\nprojekt = 'x'\n",
     ["table [run.wandb], field `projekt`", "did you mean `project`?",
      "every field is listed in launch/config.py"]),
])
def test_an_unknown_key_names_the_closest_fields_by_their_path(tmp_path, text, words):
    message = error_of(tmp_path, text)
    for w in words:
        assert w in message, message


def test_no_close_field_lists_the_fields_of_that_table(tmp_path):
    message = error_of(tmp_path, RL + "zzzzq = 1\n")
    assert "table [rl], field `zzzzq`" in message and "did you mean" not in message
    assert "no field is close to it: the fields are algorithm, device" in message
    assert "group_size, groups_per_batch" in message and RL_DOCS in message
    message = error_of(tmp_path, RL + "[actors.trainer.config]\noptimizer = { qqqq = 1 }\n")
    assert "field `optimizer.qqqq`" in message
    assert "the fields of `optimizer` are grad_clip, lr, master_weights" in message


def test_a_run_fact_keeps_its_own_hint(tmp_path):
    message = error_of(tmp_path, RL + "[actors.buffer.config]\ngroup_size = 8\n")
    assert "group_size is a fact of the run, said once" in message
    assert "did you mean" not in message


def test_set_gets_the_same_suggestion_as_its_whole_path(tmp_path):
    message = error_of(tmp_path, RL, "rl.grup_size=3")
    assert "--set rl.grup_size=3: table [rl] has no field `grup_size` (did you mean " \
           "`rl.group_size`?)" in message and RL_DOCS in message
    message = error_of(tmp_path, RL, "actors.trainer.config.optimizer.lrr=3")
    assert "table [actors.trainer.config.optimizer] has no field `lrr` (did you mean " \
           "`actors.trainer.config.optimizer.lr`?)" in message
    message = error_of(tmp_path, RL, "actors.trainer.config.loss.eps_clp=0.1")
    assert "did you mean `actors.trainer.config.loss.eps_clip`" in message


@pytest.mark.parametrize("edit, words", [
    (("group_size = 4", "group_size = 0"),
     ["table [rl], field `group_size`: group_size = 0: use 1 or more", RL_DOCS]),
    (("groups_per_batch = 2", "groups_per_batch = -1"),
     ["table [rl], field `groups_per_batch`: groups_per_batch = -1: use 1 or more"]),
    (("num_steps = 3", "num_steps = 3\nworkers = 0"),
     ["table [rl], field `workers`: workers = 0: at least one inference worker", RL_DOCS]),
    (("num_steps = 3", "num_steps = 3\nopd = { mode = 'full' }"),
     ["table [rl], field `opd`: opd / teacher_memory / teacher_mode are set but teachers"]),
    (("num_steps = 3", "num_steps = 3\nlr = 'fast'"),
     ["table [rl], field `lr`: Expected `float`, got `str`", RL_DOCS]),
])
def test_a_check_of_the_whole_table_names_its_field(tmp_path, edit, words):
    message = error_of(tmp_path, RL.replace(*edit))
    for w in words:
        assert w in message, message


def test_a_struct_check_in_a_nested_table_names_its_field(tmp_path):
    message = error_of(tmp_path, RL + "[limits]\nmax_depth = 0\n")
    assert "table [limits], field `max_depth`: limits: max_depth must be >= 1" in message


@pytest.mark.parametrize("text, words", [
    (RL.replace("envs.builtin.arith:ArithEnv", "myenvs.tasks:MyEnv"),
     ["[rl] envs[0]", "module 'myenvs.tasks' not found", PYTHON_PATH]),
    (RL + "[actors.probe]\ncls = 'myactors.probe:Probe'\n",
     ["table [actors.probe], field `cls`: cannot import 'myactors.probe:Probe'", PYTHON_PATH]),
])
def test_a_class_that_does_not_import_points_at_python_path(tmp_path, text, words):
    message = error_of(tmp_path, text)
    for w in words:
        assert w in message, message


def test_a_missing_attribute_gets_no_python_path_hint(tmp_path):
    message = error_of(tmp_path, RL + "[actors.probe]\ncls = 'examples.demo:Nope'\n")
    assert "cannot import 'examples.demo:Nope'" in message and "python_path" not in message
