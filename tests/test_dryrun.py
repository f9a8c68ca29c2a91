"""`--dry-run` (launch/dryrun.py): the plan in 80 columns, and the engines every actor runs,
looked for on the host that would run it (here, or through the host's exec prefix)."""

from __future__ import annotations

import importlib.util
import re
import textwrap
from pathlib import Path

import pytest

from launch.cluster import main
from launch.config import load, parse_overrides, processes
from launch.dryrun import Need, _names, plan_needs
from transport.addresses import local_addresses

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY = EXAMPLES / "base-tiny"
ACTOR = re.compile(r"^ *(\d+) (\S+) on (\S+?)(, primary)?: (\S+)$")


def dry_run(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, the printout from the plan on) of `launch.cluster ... --dry-run`."""
    code = main([*argv, "--dry-run"])
    out = capsys.readouterr().out
    return code, out[out.index("plan for"):]


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.mark.parametrize("example, processes_", [
    ("local.toml", ["worker0", "worker1", "router", "buffer", "rollout", "trainer"]),
    ("mopd.toml", ["worker0", "worker1", "router", "buffer", "teachers", "prefetcher",
                   "rollout", "trainer"]),
])
def test_the_examples_plans_fit_80_columns_with_every_process_and_its_command(
        example, processes_, capsys):
    code, plan = dry_run([str(EXAMPLES / example)], capsys)
    assert code == 0, plan
    assert widest(plan) <= 80, plan
    lines = plan.splitlines()
    rows = [(i, ACTOR.match(line)) for i, line in enumerate(lines) if ACTOR.match(line)]
    assert [m[2] for _, m in rows] == processes_
    assert [int(m[1]) for _, m in rows] == list(range(1, len(processes_) + 1))
    template = {}
    for i, m in rows:  # under each: who it waits for, its budget, its template, its command
        assert "max restarts 2" in lines[i + 1]
        forked = re.fullmatch(r" {5}forked from template (\d) \(\[run\] preload\), as:",
                              lines[i + 2])
        template[m[2]] = int(forked[1])
        assert lines[i + 3] == f"     $ python -m runtime.child <run_dir>/specs/{m[2]}.json"
    # [rl]'s model processes share their env table (threads): one template; the rest another
    assert template["worker0"] == template["worker1"] == template["trainer"] != \
        template["buffer"] == template["rollout"] == template["router"]
    trainer = next(m for _, m in rows if m[2] == "trainer")
    assert trainer.group(4) == ", primary" and trainer[5] == "actors.trainer:TrainerActor"
    assert "after worker0, worker1, buffer, rollout" in plan
    # every derived config and the run facts, whole (only broken after commas)
    configs = plan.split("actor configs")[1].split("run facts")[0]
    assert '"groups_per_batch": 16' in configs or '"groups_per_batch": 32' in configs
    assert '"max_staleness": 1' in configs
    assert "engines: all there (sglang_router on local)" in plan
    assert plan.rstrip().endswith("nothing was started (--dry-run)")


def test_a_two_host_plan_checks_each_host_through_its_prefix(tmp_path, capsys):
    """SGLang workers on a host reached through a plain local prefix (`env`): its check runs
    there and names sglang; a worker whose interpreter does not exist; a host whose prefix is
    no program: said in one line; the router's sglang_router is found on the launcher's
    host. Exit code 1, every line in 80 columns."""
    here = next((a for a in local_addresses() if "." in a and not a.startswith("127.")), None)
    if here is None:
        pytest.skip("needs a non-loopback IPv4 address")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(textwrap.dedent(f"""
        [run]
        name = "two"
        [[hosts]]
        name = "head"
        address = "{here}"
        [[hosts]]
        name = "near"
        address = "{here}"
        exec = ["env"]
        [[hosts]]
        name = "gone"
        address = "{here}"
        exec = ["rlx-no-such-prefix", "node9"]
        [rl]
        model = "{TINY}"
        engine = "sglang"
        workers = 4
        envs = [{{ cls = "envs.builtin.arith:ArithEnv" }}]
        [actors.worker0]
        config = {{ python = "/nonexistent/python3" }}
        [actors.worker1]
        host = "near"
        [actors.worker2]
        host = "near"
        [actors.worker3]
        host = "gone"
        """))
    code, plan = dry_run([str(hosts)], capsys)
    assert code == 1, plan
    assert widest(plan) <= 80, plan
    assert re.search(r"\n  near \(\S+\): started through\n    \$ env sh -c 'cd \"\$0\" && exec "
                     r"\"\$1\" -m launch\.agent' [^\n]+\n(      [^\n]+\n)?    runs worker1, "
                     r"worker2\n", plan), plan
    problems = plan.split("run facts")[1].splitlines()[1:]
    text = " ".join(" ".join(problems).split())
    assert "missing on near: sglang for worker1, worker2; pip install 'sglang[all]'" in text
    assert ("host head: /nonexistent/python3 (the interpreter of worker0) cannot be asked: it "
            "cannot be run:") in text
    assert ("host gone: cannot check it (rlx-no-such-prefix is not on PATH here); nothing of "
            "it is known") in text
    assert "3 problem(s) above" in text
    assert "missing on head" not in text  # the router's sglang_router is here
    assert "sglang_router" not in text


@pytest.fixture
def recipe_overrides() -> list[str]:
    """The recipe's model is a hub id; the test machine has no network: a local checkpoint."""
    return [f"rl.model='{TINY}'"]


def test_the_sglang_megatron_recipe_loads_and_its_dry_run_names_sglang(recipe_overrides,
                                                                       capsys):
    path = EXAMPLES / "sglang-megatron.toml"
    cfg = load(path, overrides=parse_overrides(recipe_overrides))
    actors = cfg.actors
    assert actors["router"].cls == "actors.router:RouterActor"
    assert actors["router"].config["dynamic_workers"] is True
    for i in (0, 1):
        w = actors[f"worker{i}"]
        assert w.cls == "actors.sglang_worker:SglangWorker" and w.after == ["router"]
        assert w.config["register_with"] == "router"
        assert w.config["env"] == {"CUDA_VISIBLE_DEVICES": str(i)}
    trainer = actors["trainer"].config
    assert (trainer["backend"], trainer["device"], trainer["parallel"]["tp"]) == (
        "megatron", "cuda:2", 2)
    assert trainer["weight_sync"] == {"path": "distributed"}
    assert "trainer.rank1" in processes(cfg)
    assert sorted((n.actor, n.module) for n in plan_needs(cfg)) == [
        ("router", "sglang_router"), ("trainer", "megatron.core"),
        ("trainer.rank1", "megatron.core"), ("worker0", "sglang"), ("worker1", "sglang")]
    code, plan = dry_run([str(path), *(a for o in recipe_overrides for a in ("--set", o))],
                         capsys)
    assert widest(plan) <= 80, plan
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here: nothing to name")
    assert code == 1, plan
    missing = [line for line in plan.splitlines() if line.startswith("missing on")]
    expected = ["missing on local: sglang for worker0, worker1; pip install 'sglang[all]'"]
    if importlib.util.find_spec("megatron") is None:
        expected.append("missing on local: megatron.core for trainer, trainer.rank1; pip "
                        "install megatron-core==0.16.1")
    assert missing == expected, plan


def test_the_colocated_variant_of_the_recipe_loads(recipe_overrides):
    """What the recipe's comment says to change: the trainer's rank 0 shares worker0's GPU
    (CUDA IPC there, NCCL to worker1), the servers release their memory."""
    overrides = [*recipe_overrides, "rl.mode=colocated", "rl.device=cuda:0",
                 "rl.max_staleness=0", "actors.trainer.config.weight_sync.path=auto",
                 "actors.worker0.config.sglang.enable_memory_saver=true",
                 "actors.worker1.config.sglang.enable_memory_saver=true"]
    cfg = load(EXAMPLES / "sglang-megatron.toml", overrides=parse_overrides(overrides))
    assert cfg.actors["trainer"].config["mode"] == "colocated"
    assert cfg.facts["trainer"].max_staleness == 0


def test_needs_follow_the_trainers_ranks_and_the_interpreter_field():
    cfg = load(EXAMPLES / "megatron-tp2.toml")
    needs = plan_needs(cfg)
    assert Need("local", "trainer.rank1", "megatron.core", "megatron-core==0.16.1") in needs
    assert Need("local", "router", "sglang_router", "sglang-router==0.3.2") in needs
    assert not any(n.module == "sglang" for n in needs)  # embedded workers: nothing to install


def test_numbered_actor_names_are_shortened():
    assert _names(["worker0", "worker1", "worker2", "worker3", "router"]) == \
        "worker0..worker3, router"
    assert _names(["worker0", "worker1", "buffer", "worker1"]) == "worker0, worker1, buffer"
    assert _names(["trainer", "trainer.rank1"]) == "trainer, trainer.rank1"
