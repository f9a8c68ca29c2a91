"""Processes that never touch a tensor do not import torch or transformers (~3 s of CPU each).

Every actor process imports its class's module (python -m runtime.child), and the launcher its
own modules; the buffer, the router and the launcher of a plan without a model run many times
per test run (tests/test_cluster.py starts a launcher per test). Each module is imported in a
fresh interpreter, which reports after each the heavy packages it loaded.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.names import TINY_NAMES
from models.tiny import TINY
from runtime.actor import Actor
from runtime.loading import import_actor

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ["torch", "transformers", "matplotlib"]
LIGHT = [
    "runtime.child",  # every actor process, before it imports its class
    "actors.buffer",
    "actors.router",
    "actors.rollout",  # in every run; it loads a tokenizer (transformers) only when started
    "actors.inference_config",  # plan classes (runtime/loading.py): what the launcher reads
    "actors.prefetcher_config",
    "actors.trainer_config",
    "actors.trainer_rank_config",
    "actors.rollout_config",
    "actors.teacher_pool_config",
    "models.moe_shape",
    "launch.cluster",  # the launcher
    "launch.supervisor",
    "launch.config",
    "launch.dryrun",
    "launch.watch",
    "launch.agent",  # the per-host agent of a remote host
    "examples.demo",  # the demo cluster's launcher and consumer (torch: its producer's run)
]


# imports each module in turn, printing after each the heavy packages loaded so far
PROBE = """
import importlib, json, sys
for module in sys.argv[1:]:
    importlib.import_module(module)
    print(json.dumps([module, [m for m in HEAVY if m in sys.modules]]))
"""


def test_light_processes_import_no_tensor_library():
    """One interpreter for all (each would pay its start-up): the first module that loads a heavy
    package is named."""
    out = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}" + PROBE, *LIGHT], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = [json.loads(line) for line in out.stdout.splitlines()]
    assert [m for m, _ in loaded] == LIGHT
    heavy = [(m, h) for m, h in loaded if h]
    assert not heavy, (f"importing {heavy[0][0]} loads {heavy[0][1]}: import it where it is "
                       f"used (python -X importtime -c 'import {heavy[0][0]}' shows who does)")


# the launcher of a training plan (trainer, rollout, workers), checked and printed by --dry-run;
# prints the actor modules it imported and the heavy packages, with who imported each first
LAUNCH = """
import json, sys, traceback
first = {}
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY and name not in first:
            first[name] = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()
                           if "importlib" not in f.filename and "<frozen" not in f.filename][-4:]
sys.meta_path.insert(0, Watch())
from launch.cluster import main
code = main([sys.argv[1], "--dry-run"])
print(json.dumps([code, sorted(m for m in sys.modules if m.startswith("actors.")), first]))
"""
# the actor modules a training plan names (torch at their tops), read from their plan classes
ACTORS = ["actors.trainer", "actors.rollout", "actors.inference", "actors.teacher_pool"]


@pytest.fixture(scope="module")
def training_launch() -> tuple[int, list[str], dict]:
    """(exit code, actor modules imported, {heavy package: where it was first imported}) of
    `launch.cluster examples/local.toml --dry-run`."""
    out = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}" + LAUNCH,
                          "examples/local.toml"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip(), out.stderr
    code, modules, first = json.loads(out.stdout.strip().splitlines()[-1])
    return code, modules, first


def test_the_launcher_of_a_training_plan_reads_the_actors_from_their_plan_classes(
        training_launch):
    """The launcher checks the plan (every table, every check across actors) with the actors'
    plan classes (runtime/loading.py) and never imports an actor's own module."""
    code, modules, _ = training_launch
    assert code == 0
    assert {"actors.trainer_config", "actors.rollout_config", "actors.inference_config"} <= set(
        modules), modules
    assert not set(ACTORS) & set(modules), modules


def test_the_launcher_of_a_training_plan_imports_no_tensor_library(training_launch):
    """~3 s of CPU per launch; the test suite launches tens of training plans. The checks read
    light modules (models/names.py, engine/drift.py, engine/weight_sync_plan.py,
    training/backend_checks.py, algos/*_config.py, algos/estimators.py); transformers comes only
    with a tokenizer a check loads (models/tokenizer_load.py: a plan with teachers)."""
    _, _, first = training_launch
    assert first == {}, f"imported first at: {json.dumps(first, indent=1)}"


def test_the_tiny_model_names_the_launcher_checks_are_the_models_built():
    """models/names.py lists models/tiny.py's names without building their configs."""
    assert TINY_NAMES == tuple(TINY)


def test_each_plan_class_is_the_base_of_its_actor_and_says_all_the_launcher_reads():
    """A plan class (actors/*_config.py `<Name>Plan`) is what the launcher sees of the actor
    `<Name>`: the actor subclasses it and overrides none of what the launcher reads."""
    read = {"Config", "role", "rank_cls", "store_path", "needs", "needs_python", "check_config",
            "check_facts", "gpus", "peers", "bound_ports", "ranks"}
    found = []
    for path in sorted((ROOT / "actors").glob("*_config.py")):
        config = importlib.import_module(f"actors.{path.stem}")
        actor = importlib.import_module(f"actors.{path.stem.removesuffix('_config')}")
        for name, plan in vars(config).items():
            if not (name.endswith("Plan") and isinstance(plan, type)
                    and issubclass(plan, Actor) and plan.__module__ == config.__name__):
                continue
            cls = getattr(actor, name.removesuffix("Plan"))
            assert issubclass(cls, plan) and import_actor(
                f"{actor.__name__}:{cls.__name__}", plan=True) is plan
            assert not read & set(vars(cls)), f"{cls.__name__} overrides {read & set(vars(cls))}"
            found.append(cls.__name__)
    assert {"TrainerActor", "RolloutActor", "InferenceWorker", "TeacherPool"} <= set(found)


def test_the_launcher_checks_a_megatron_plan_without_megatron_core():
    """A megatron plan's config check (its install, the checkpoint's config.json, the layout)
    runs in the launcher without importing megatron-core (~4 s of CPU per launch: its modules
    compile dozens of functions at import), backends/megatron/checks.py."""
    if importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (the check would refuse the plan)")
    probe = ("import json, sys\nfrom launch.cluster import main\n"
             "code = main([sys.argv[1], '--dry-run'])\n"
             "print(json.dumps([code, sorted(m for m in sys.modules if m.startswith("
             "'megatron.core'))]))")
    out = subprocess.run([sys.executable, "-c", probe, "examples/megatron-tp2.toml"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip(), out.stderr
    code, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert code == 0
    assert imported == [], imported[:5]
