"""`[rl]`: the run in one table, the actors derived from it (launch/rl.py), through load()."""

from __future__ import annotations

import copy
from pathlib import Path

import msgspec
import pytest

from launch.cluster import main
from launch.config import ConfigError, load, parse_overrides

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def actors_of(cfg) -> dict:
    """Actor entries as plain data, `examples/<model>` written the same way on both sides."""
    def norm(node):
        if isinstance(node, dict):
            return {k: norm(v) for k, v in node.items()}
        if isinstance(node, list):
            return [norm(v) for v in node]
        if isinstance(node, str) and node.startswith("examples/"):
            return str((ROOT / node).resolve())
        return node
    return norm(msgspec.to_builtins(cfg.actors))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    return path


BASE = """
[run]
name = "t"

[rl]
model = "tiny-qwen2"
group_size = 4
groups_per_batch = 2
num_steps = 3
envs = [{ cls = "envs.builtin.arith:ArithEnv" }]
"""


def test_the_main_job_derives_exactly_its_former_per_actor_layout(monkeypatch):
    monkeypatch.chdir(ROOT)  # the per-actor layout names its models from the repository root
    short = load(EXAMPLES / "local.toml")
    assert actors_of(short) == actors_of(load(FIXTURES / "local_layout.toml"))
    assert len((EXAMPLES / "local.toml").read_text().splitlines()) < 30
    assert [h.name for h in short.hosts] == ["local"]


def test_the_mopd_demo_derives_its_former_layout_and_gives_the_pool_the_opd(monkeypatch):
    monkeypatch.chdir(ROOT)
    derived = actors_of(load(EXAMPLES / "mopd.toml"))
    layout = actors_of(load(FIXTURES / "mopd_layout.toml"))
    # the one difference: the pool gets the run's opd too (the former file left the pool's default)
    assert derived["teachers"]["config"].pop("opd") == {"mode": "full", "kl_coef": 1.0}
    assert derived == layout


def test_model_paths_are_read_next_to_the_file_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load(EXAMPLES / "local.toml")
    model = str((EXAMPLES / "base-tiny").resolve())
    assert {cfg.actors[n].config["model"] for n in ("worker0", "worker1", "trainer")} \
        == {model}
    assert cfg.facts["rollout"].model == model  # the rollout reads the run's model


def test_set_on_rl_reaches_every_actor_that_holds_the_value():
    cfg = load(EXAMPLES / "local.toml", None, parse_overrides(
        ["rl.group_size=4", "rl.workers=3", "rl.temperature=0.7",
         "actors.trainer.config.optimizer.grad_clip=0.5"]))
    a = cfg.actors
    assert a["rollout"].config["group_size"] == cfg.facts["buffer"].group_size == 4
    assert a["trainer"].config["workers"] == ["worker0", "worker1", "worker2"]
    assert a["router"].after == ["worker0", "worker1", "worker2"]
    assert a["worker2"].config["seed"] == 2
    assert a["rollout"].config["temperature"] == cfg.facts["trainer"].temperature == 0.7
    # an actor override merges into the derived table: lr from [rl] stays
    assert a["trainer"].config["optimizer"] == {"lr": 1e-4, "grad_clip": 0.5}


def test_the_files_own_actor_tables_merge_over_the_derived_ones_and_add_actors(tmp_path):
    cfg = load(write(tmp_path, BASE + """
[actors.trainer.config]
kl = { coef = 0.1, use_kl_loss = true }
optimizer = { weight_decay = 0.01 }

[actors.buffer]
restart = { max_restarts = 5 }

[actors.extra]
cls = "examples.demo:Scaler"
"""))
    a = cfg.actors
    assert a["trainer"].config["optimizer"] == {"lr": 1e-4, "weight_decay": 0.01}
    assert a["trainer"].config["kl"] == {"coef": 0.1, "use_kl_loss": True}
    assert a["trainer"].primary and a["buffer"].restart.max_restarts == 5
    assert a["buffer"].config == {"max_staleness": 1}  # its own knob; the batch shape is a fact
    assert "extra" in a and a["extra"].cls == "examples.demo:Scaler"


def test_colocated_derives_staleness_zero_and_teachers_a_pool_and_a_prefetcher(tmp_path):
    cfg = load(write(tmp_path, BASE + 'mode = "colocated"\n'))
    assert cfg.actors["buffer"].config["max_staleness"] == 0
    assert cfg.actors["trainer"].config["mode"] == "colocated"
    text = BASE + ('teachers = [{ name = "t", model = "tiny-qwen2", domains = ["math"] }]\n'
                   'opd = { mode = "full" }\n')
    a = load(write(tmp_path, text)).actors
    assert a["rollout"].config["sink"] == "teachers" and "teachers" in a["rollout"].after
    assert a["trainer"].config["prefetcher"] == "prefetcher" and "prefetcher" in a
    assert a["trainer"].config["teachers"] == a["teachers"].config["teachers"]


def test_embedded_workers_on_cuda_get_cuda_ipc_or_nccl_pushes(tmp_path):
    """weight_sync "auto" on GPUs (CUDA IPC to a worker on the trainer's GPU, NCCL to the
    others); the CPU default stays disk; the file's own trainer table wins."""
    gpu = load(write(tmp_path, BASE + 'device = "cuda:0"\n')).actors["trainer"].config
    assert gpu["weight_sync"] == {"path": "auto"}
    assert "weight_sync" not in load(write(tmp_path, BASE)).actors["trainer"].config
    mine = load(write(tmp_path, BASE + 'device = "cuda:0"\n[actors.trainer.config]\n'
                      'weight_sync = { path = "disk" }\n')).actors["trainer"].config
    assert mine["weight_sync"] == {"path": "disk"}


def test_sglang_engine_derives_registering_servers_after_the_router(tmp_path):
    a = load(write(tmp_path, BASE + 'engine = "sglang"\nworkers = 1\n')).actors
    assert a["worker0"].cls == "actors.sglang_worker:SglangWorker"
    assert a["worker0"].config == {"model_path": "tiny-qwen2", "register_with": "router"}
    assert a["worker0"].after == ["router"] and a["router"].config["dynamic_workers"] is True
    # a server loads its model first (its own health wait: 600 s); the trainer loads its model
    # on the CPU (120 s), the buffer keeps the actor default
    assert a["worker0"].start_timeout_s == 900 and a["trainer"].start_timeout_s == 120
    assert a["buffer"].start_timeout_s == 30


def test_actors_loading_real_models_get_start_limits_the_launcher_waits_for(tmp_path):
    from types import SimpleNamespace

    from launch.supervisor import START_MARGIN_S, Supervisor

    cfg = load(write(tmp_path, BASE + 'device = "cuda"\n\n[actors.router]\nstart_timeout_s = 5\n'))
    a = cfg.actors
    assert a["worker0"].start_timeout_s == 600 and a["trainer"].start_timeout_s == 600
    assert a["router"].start_timeout_s == 5 and a["buffer"].start_timeout_s == 30
    sup = Supervisor(cfg, tmp_path, tmp_path, list(a), say=lambda _: None)
    try:
        limit = {n: sup.ready_limit(SimpleNamespace(entry=e)) for n, e in a.items()}
        words = sup.ready_words(SimpleNamespace(entry=a["trainer"]))
    finally:
        sup.factory.ctx.term()
    # the run's ready_timeout_s (60) where the actor's start fits in it, else its own + margin
    assert limit["worker0"] == limit["trainer"] == 600 + START_MARGIN_S
    assert limit["router"] == limit["buffer"] == 60
    assert "start_timeout_s = 600" in words and "630 s" in words


@pytest.mark.parametrize("edit, words", [
    ("workers = 0\n",
     ["table [rl], field `workers`: workers = 0: at least one inference worker"]),
    ("grup_size = 4\n", ["table [rl], field `grup_size`", "unknown field"]),
    ('mode = "colocated"\nmax_staleness = 1\n', ["max_staleness must be 0"]),
    ("lr = \"fast\"\n", ["table [rl], field `lr`: Expected `float`, got `str`"]),
    ('opd = { mode = "full" }\n', ["teachers is empty"]),
    ("\n[actors.buffer.config]\ngroup_size = 8\n",
     ["[actors.buffer.config], field `group_size`", "said once (in [rl], or as `group_size` of "
      "the rollout)", "derived from [rl]: change the value in [rl]"]),
    ("\n[actors.trainer.config]\noptimizr = { lr = 1 }\n",
     ["`optimizr`", "derived from [rl]"]),
])
def test_mistakes_in_rl_name_the_table_field_and_fix(tmp_path, edit, words):
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, BASE + edit))
    for w in words:
        assert w in str(info.value), str(info.value)


def test_dry_run_prints_the_derived_configs(capsys):
    assert main([str(EXAMPLES / "local.toml"), "--dry-run", "--set", "rl.group_size=4"]) == 0
    out = capsys.readouterr().out
    assert "actor configs (derived from [rl]" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("buffer:"))
    assert '"max_staleness": 1' in line
    assert '"group_size": 4' in out.split("run facts: ")[1]


def test_derivation_does_not_touch_the_document_it_was_given():
    from launch.rl import RLConfig, derive
    rl = RLConfig(model="m", envs=[{"cls": "x:Y", "options": {"a": 1}}],
                  teachers=[{"name": "t", "model": "m"}])
    before = copy.deepcopy(msgspec.to_builtins(rl))
    actors = derive(rl)
    actors["rollout"]["config"]["envs"][0]["options"]["a"] = 2
    actors["trainer"]["config"]["teachers"][0]["name"] = "u"
    assert msgspec.to_builtins(rl) == before


def test_true_on_policy_reaches_workers_and_trainer_and_must_agree(tmp_path):
    a = load(write(tmp_path, BASE + "true_on_policy = true\n")).actors
    assert a["worker0"].config["true_on_policy"] is a["trainer"].config["true_on_policy"] is True
    for edit, words in [
            ("\n[actors.worker1.config]\ntrue_on_policy = false\n",
             ["true_on_policy = true here but false in [actors.worker1.config]"]),
            ('\n[actors.worker0.config]\ndtype = "bfloat16"\n',
             ["dtype 'float32' on 'cpu' here but dtype 'bfloat16' on 'cpu' in "
              "[actors.worker0.config]"])]:
        with pytest.raises(ConfigError) as info:
            load(write(tmp_path, BASE + "true_on_policy = true\n" + edit))
        for w in words:
            assert w in str(info.value), str(info.value)
    with pytest.raises(ConfigError, match="is not an embedded inference worker"):
        load(write(tmp_path, BASE + 'true_on_policy = true\nengine = "sglang"\n'))


def test_top_p_distillation_makes_the_rollout_record_the_nucleus(tmp_path):
    text = BASE + ('top_p = 0.9\nteachers = [{ name = "t", model = "tiny-qwen2", domains = '
                   '["math"] }]\nopd = { mode = "top_p", top_p = 0.9 }\n')
    a = load(write(tmp_path, text)).actors
    assert a["rollout"].config["nucleus_top_logprobs"] == 64
    assert a["rollout"].config["top_p"] == 0.9
    full = BASE + 'teachers = [{ name = "t", model = "tiny-qwen2" }]\nopd = { mode = "full" }\n'
    assert "nucleus_top_logprobs" not in load(write(tmp_path, full)).actors["rollout"].config


def test_moe_makes_the_rollout_return_routed_experts_and_gives_the_trainer_the_table(tmp_path):
    text = BASE.replace('"tiny-qwen2"', '"tiny-qwen3-moe"') + \
        'moe = { routing_replay = "rollout", aux_loss_coef = 0.01 }\n'
    a = load(write(tmp_path, text)).actors
    assert a["rollout"].config["routed_experts"] is True
    assert a["worker0"].config["return_routed_experts"] is True  # the router drops the field
    assert a["trainer"].config["moe"] == {"routing_replay": "rollout", "aux_loss_coef": 0.01}
    plain = load(write(tmp_path, BASE)).actors
    assert "routed_experts" not in plain["rollout"].config and "moe" not in plain["trainer"].config
    assert "return_routed_experts" not in plain["worker0"].config
    with pytest.raises(ConfigError, match="routing_replay"):
        load(write(tmp_path, text.replace('"rollout"', '"always"')))
    # SGLang behind sglang-router 0.3.2 cannot be asked for routes: replay is refused, and
    # without it nothing asks for them
    with pytest.raises(ConfigError, match="drops /generate's return_routed_experts"):
        load(write(tmp_path, text + 'engine = "sglang"\n'))
    off = text.replace('"rollout"', '"off"') + 'engine = "sglang"\n'
    sglang = load(write(tmp_path, off)).actors
    assert "routed_experts" not in sglang["rollout"].config and "moe" in sglang["trainer"].config
