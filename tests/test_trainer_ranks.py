"""The trainer actor's data-parallel ranks: rank 0 (here, in the test process) with rank 1 as a
process (actors/trainer_rank.py, started by the launcher's recipe), both take the step, the
update equals one process's and the ranks stay identical, with and without colocated teachers;
and the launcher's restart group (a trainer and its ranks start, fail and restart together)."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.distributed as dist

from actors.trainer import TrainerConfig
from algos.opd import OpdConfig
from tests.test_dp_train import config, make_batch
from tests.test_mopd import TEACHERS, attach_topk, samples
from training.colocated_teachers import TeacherMemoryConfig
from training.config import LossConfig, MicroBatchConfig, OptimizerConfig, ParallelConfig
from actors.trainer_rank import start_standalone
from training.ranks import RankGroup, SingleRank, load_trainer, rank_device
from training.setup import load_train_state
from training.step import train_on_batch

TWO = ParallelConfig(dp=2)


@pytest.fixture(scope="module", autouse=True)
def gloo_transport():
    """The first tcp:// rendezvous of a process leaves one process-wide pipe behind (the TCP
    store's event loop); made once here so the per-test leak check sees only what the tests
    themselves leave."""
    from transport.sockets import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
                            rank=0, world_size=1)
    dist.destroy_process_group()


def test_rank_devices_count_from_the_trainers():
    assert rank_device("cpu", 3) == "cpu"
    assert rank_device("cuda", 1) == "cuda:1"
    assert rank_device("cuda:2", 1) == "cuda:3"


def group(cfg, tmp_path, resume=False):
    """Rank 0 here and ranks 1..N-1 as processes: (the group, the rank processes)."""
    from transport.sockets import free_port

    store = f"127.0.0.1:{free_port('127.0.0.1')}"
    procs = start_standalone(cfg, str(tmp_path), resume, tmp_path / "logs", store)
    try:
        ranks = load_trainer(cfg, str(tmp_path), resume, store)
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    assert isinstance(ranks, RankGroup)
    return ranks, procs


def stop(ranks, procs):
    ranks.stop()
    for p in procs:
        try:
            p.wait(60)
        except Exception:  # noqa: BLE001 - killed, and the test fails on its code
            p.kill()
            p.wait()


def dp_versus_one_process(cfg, samples_of, tmp_path):
    """One step on two ranks (rank 0 here) and on one process from the same initial state:
    (two-rank state, its stats, one-process state, its stats)."""
    one = load_train_state(msgspec.structs.replace(cfg, parallel=ParallelConfig(dp=1)),
                           str(tmp_path / "one"), False)
    ranks, procs = group(cfg, tmp_path)  # compared the weights
    state = ranks.state
    samples = samples_of(state.tokenizer)
    try:
        before = ranks.all_digests(state.model)
        stats = ranks.train(state, samples, cfg, ["arith"])
        after = ranks.all_digests(state.model)
        stats1 = train_on_batch(one, samples, cfg)
    finally:
        stop(ranks, procs)
        for s in (state, one):
            if s.teachers is not None:
                s.teachers.close()
    assert [p.returncode for p in procs] == [0], (tmp_path / "logs" / "trainer.rank1.log"
                                                  ).read_text()[-3000:]
    assert before[0] == before[1] and after[0] == after[1] and after[0] != before[0]
    for (name, p2), p1 in zip(state.model.named_parameters(), one.model.parameters()):
        torch.testing.assert_close(p2, p1, atol=1e-6, rtol=0, msg=name)
    assert stats["train/dp_size"] == 2
    return stats, stats1


@pytest.mark.timeout(180)
def test_two_ranks_take_the_one_process_step_and_stay_identical(tmp_path):
    """PPO with a critic, KL shaping, TIS and a token cap: every cross-rank reduction."""
    stats, stats1 = dp_versus_one_process(msgspec.structs.replace(config(), parallel=TWO),
                                          make_batch, tmp_path)
    for key in ("train/loss", "train/grad_norm", "train/critic_grad_norm", "train/tokens"):
        assert stats[key] == pytest.approx(stats1[key], rel=1e-5, abs=1e-7), key


@pytest.mark.timeout(180)
def test_colocated_teachers_on_two_ranks(tmp_path):
    """Each rank scores its own micro-batches with its own teacher memory (one slot, a host
    budget of one teacher, the other on its own NVMe directory); full-vocabulary OPD."""
    cfg = TrainerConfig(model="examples/base-tiny", workers=["w"],
                        loss=LossConfig(advantage_estimator="none"), opd=OpdConfig(mode="full"),
                        teachers=TEACHERS, optimizer=OptimizerConfig(lr=3e-3),
                        micro_batches=MicroBatchConfig(size=2), parallel=TWO,
                        teacher_memory=TeacherMemoryConfig(gpu_slots=1,
                                                           host_budget_bytes=400_000))
    stats, stats1 = dp_versus_one_process(cfg, samples, tmp_path)
    for key in ("opd/arith/reverse_kl", "opd/reverse/reverse_kl", "opd/arith/tokens",
                "opd/reverse/tokens", "train/grad_norm"):
        assert stats[key] == pytest.approx(stats1[key], rel=1e-5), key
    assert stats["opd/arith/tokens"] > 0 and stats["opd/reverse/tokens"] > 0
    assert (tmp_path / "teachers-nvme-rank1").is_dir()  # rank 1 spilled to its own directory


@pytest.mark.timeout(180)
def test_server_topk_on_two_ranks(tmp_path):
    """Server-mode top-k OPD: the samples' top-k arrays reach rank 1 in the broadcast command
    (inline in its msgpack) and both ranks' step equals one process's."""

    def with_topk(tok):
        batch = samples(tok)
        attach_topk(batch, k=5)
        return batch

    cfg = TrainerConfig(model="examples/base-tiny", workers=["w"],
                        loss=LossConfig(advantage_estimator="none"),
                        opd=OpdConfig(mode="top_k", top_k=5, kl_coef=1.0, top_k_from="teacher"),
                        optimizer=OptimizerConfig(lr=3e-3), micro_batches=MicroBatchConfig(size=2),
                        parallel=TWO)
    stats, stats1 = dp_versus_one_process(cfg, with_topk, tmp_path)
    for key in ("opd/arith/reverse_kl", "opd/reverse/reverse_kl", "opd/arith/tokens",
                "opd/reverse/tokens", "train/grad_norm"):
        assert stats[key] == pytest.approx(stats1[key], rel=1e-5), key
    assert stats["opd/arith/reverse_kl"] > 0 and stats["opd/reverse/tokens"] > 0


@pytest.mark.timeout(180)
def test_a_stuck_then_a_dead_rank_are_named(tmp_path):
    """A rank that stops answering (SIGSTOP) fails the step after parallel.timeout_s, naming it
    and where it was; once it is dead the next command fails naming it too (its exit code and
    log tail are the launcher's to say: test_a_rank_that_dies_restarts_its_whole_group)."""
    import signal
    import time

    cfg = msgspec.structs.replace(config(), parallel=ParallelConfig(dp=2, timeout_s=3))
    ranks, (rank1,) = group(cfg, tmp_path)
    state = ranks.state
    try:
        while not ranks.store.check(["at1"]):  # rank 1 has said it is ready for commands
            time.sleep(0.05)
        rank1.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"step command to the trainer's ranks failed: .*"
                                               r"not done with command 1: trainer rank 1 \(at: "
                                               r"command 0 ready\)"):
            ranks.train(state, make_batch(state.tokenizer), cfg)
        assert time.monotonic() - t0 < 30  # parallel.timeout_s, not the default 600 s
        rank1.kill()
        rank1.send_signal(signal.SIGCONT)
        rank1.wait()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"step command to the trainer's ranks failed: .*"
                                               r"trainer rank 1 \(at: command 0 ready\)"):
            ranks.train(state, make_batch(state.tokenizer), cfg)
        assert time.monotonic() - t0 < 30
    finally:
        rank1.kill()
        rank1.send_signal(signal.SIGCONT)
        rank1.wait()
        ranks.stop()  # the stop command fails (said in the log), the group is left


@pytest.mark.parametrize("change, words", [
    ({"parallel": {"dp": 0}}, "dp >= 1"),
    ({"parallel": {"cp": 2}}, "parallel.cp = 2 needs backend = 'megatron'"),
    ({"parallel": {"tp": 2}}, "parallel.tp = 2, pp = 1 need backend = 'megatron'"),
    ({"parallel": {"tp": 2, "devices": ["cpu", "cpu", "cpu"]}, "backend": "megatron"},
     "lists 3 devices, not a multiple of tp \\* pp = 2"),
    ({"parallel": {"tp": 2, "dp": 2, "devices": ["cuda:0", "cuda:1"]}, "device": "cuda:0",
      "backend": "megatron"}, "lists 2 devices but tp \\* pp \\* dp"),
    ({"parallel": {"devices": ["cuda:1", "cuda:0"]}, "device": "cuda:0"},
     "parallel.devices\\[0\\] = 'cuda:1' but device = 'cuda:0'"),
    ({"parallel": {"tp": 2}, "backend": "megatron",
      "megatron": {"tensor_model_parallel_size": 4}},
     "tensor_model_parallel_size = 4 and parallel = { tp = 2, pp = 1 } conflict"),
    ({"parallel": {"pp": 2}, "backend": "megatron",
      "mismatch": {"proximal": "rollout_version", "correction": "decoupled"}},
     "parallel.pp = 2 and mismatch proximal"),
])
def test_bad_parallel_options_are_refused(change, words):
    with pytest.raises(ValueError, match=words):
        msgspec.convert({"model": "tiny-qwen2", "workers": ["w"], **change}, TrainerConfig)


GROUP = """
[run]
name = "group"
heartbeat_interval_s = 0.3
plots = false
[actors.leader]
cls = "tests.rank_group_actors:Leader"
primary = true
config = {{ ranks = 3, fail = "{fail}" }}
restart = {{ max_restarts = {restarts} }}
"""


@pytest.mark.timeout(120)
def test_a_rank_that_dies_while_starting_fails_the_start_at_once(tmp_path):
    """The launcher starts a trainer's ranks as processes of the run, with it; a rank that
    exits before READY ends the start at once, with its exit code and log tail."""
    import time

    from tests.test_cluster import exit_info, launch

    hosts = tmp_path / "hosts.toml"
    hosts.write_text(GROUP.format(fail="start", restarts=0))
    t0 = time.monotonic()
    result = launch(hosts, tmp_path / "run", timeout_s=100)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "leader.rank1 exited with code 3 during start" in out, out
    assert "rank 1: no such checkpoint" in out, out  # its log tail
    assert time.monotonic() - t0 < 60
    info = exit_info(tmp_path / "run")
    assert set(info["actors"]) == {"leader", "leader.rank1", "leader.rank2"}
    assert all(a["exit_code"] is not None for a in info["actors"].values())
    assert "rank 1: no such checkpoint" in (tmp_path / "run" / "logs" / "leader.rank1.log"
                                            ).read_text()


@pytest.mark.timeout(120)
def test_a_rank_that_dies_restarts_its_whole_group(tmp_path):
    """Rank 1 dies after the group is READY: the launcher says so with its log tail, stops the
    trainer and rank 2, and starts all three again (the trainer's restart budget), each start
    with one store address given to every member; the run then completes."""
    from tests.test_cluster import exit_info, launch

    hosts = tmp_path / "hosts.toml"
    hosts.write_text(GROUP.format(fail="once", restarts=2))
    result = launch(hosts, tmp_path / "run", timeout_s=100)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "leader.rank1 failed (exit code 5)" in out, out
    assert "restart 1/2 of leader, leader.rank1, leader.rank2 together" in out, out
    assert "rank 1: lost" in out, out
    lines = (tmp_path / "run" / "starts.txt").read_text().splitlines()
    leaders = [line.split()[1] for line in lines if line.startswith("leader")]
    members = [(line.split()[1], line.split()[-1]) for line in lines if line.startswith("member")]
    assert len(leaders) == 2 and len(members) == 4, lines
    # every member of a start got that start's store
    assert sorted(members) == sorted([("1/3", leaders[0]), ("2/3", leaders[0]),
                                      ("1/3", leaders[1]), ("2/3", leaders[1])]), lines
    info = exit_info(tmp_path / "run")
    assert {n: a["restarts"] for n, a in info["actors"].items()} == {
        "leader": 1, "leader.rank1": 1, "leader.rank2": 1}
    assert info["completed"] == "leader"


@pytest.mark.timeout(120)
def test_a_leader_that_completes_while_its_group_starts_completes_the_run(tmp_path):
    """The leader runs (and completes) as soon as its own READY is in; members slower to start
    are still starting. Its exit (code 0, Stopped as completed) is no start failure: the group's
    start ends with the members' READY and the run completes with the leader."""
    from tests.test_cluster import exit_info, launch

    hosts = tmp_path / "hosts.toml"
    hosts.write_text(GROUP.format(fail="early", restarts=0))
    result = launch(hosts, tmp_path / "run", timeout_s=100)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "during start" not in out, out
    assert "leader completed" in out, out
    lines = (tmp_path / "run" / "starts.txt").read_text().splitlines()
    assert sum(line.startswith("member") for line in lines) == 2, lines
    info = exit_info(tmp_path / "run")
    assert info["completed"] == "leader"
    assert {n: a["restarts"] for n, a in info["actors"].items()} == {
        "leader": 0, "leader.rank1": 0, "leader.rank2": 0}


def test_rank_processes_are_placed_on_the_hosts_of_parallel_hosts(tmp_path):
    """parallel.hosts: the launcher places rank r on its host (ranks_per_host consecutive ranks
    each), with that host's address, and counts the hosts as the run's."""
    import textwrap

    from launch.config import is_distributed, load, placement, rank_entries, start_order
    from training.config import RankHost

    hosts = tmp_path / "hosts.toml"
    hosts.write_text(textwrap.dedent(f"""
        [run]
        name = "placed"
        [[hosts]]
        name = "head"
        address = "10.0.0.1"
        [[hosts]]
        name = "gpu1"
        address = "10.0.0.2"
        exec = ["ssh", "gpu1"]
        [rl]
        model = "examples/base-tiny"
        workers = 1
        envs = [{{ cls = "envs.builtin.arith:ArithEnv" }}]
        [actors.trainer.config]
        parallel = {{ dp = 4, hosts = ["head", "gpu1"] }}
        """))
    cfg = load(hosts)
    ranks = rank_entries(cfg)
    assert {n: (e.host, e.config["rank"], e.config["world_size"], e.config["address"])
            for n, e in ranks.items()} == {"trainer.rank1": ("head", 1, 4, "10.0.0.1"),
                                           "trainer.rank2": ("gpu1", 2, 4, "10.0.0.2"),
                                           "trainer.rank3": ("gpu1", 3, 4, "10.0.0.2")}
    assert all(e.cls == "actors.trainer_rank:TrainerRank" for e in ranks.values())
    assert ranks["trainer.rank2"].config["config"] == cfg.actors["trainer"].config
    assert placement(cfg)["gpu1"] == ["trainer.rank2", "trainer.rank3"]
    assert is_distributed(cfg)
    order = start_order(cfg)
    i = order.index("trainer")
    assert order[i:i + 4] == ["trainer", "trainer.rank1", "trainer.rank2", "trainer.rank3"]
    with pytest.raises(ValueError, match="leave placement out"):
        ParallelConfig(dp=2, hosts=["head", "gpu1"], placement=[RankHost(name="gpu1"),
                                                                RankHost(name="head")])


def test_one_rank_is_a_single_rank_group(tmp_path):
    """parallel.world_size = 1: load_trainer's group acts locally with the same methods."""
    cfg = config()
    one = load_trainer(cfg, str(tmp_path), False)
    assert isinstance(one, SingleRank)
    before = one.all_digests(one.state.model)
    stats = one.train(one.state, make_batch(one.state.tokenizer), cfg)
    assert "train/loss" in stats and one.all_digests(one.state.model) != before
    one.save_weights(one.state, tmp_path / "w")
    assert list((tmp_path / "w").glob("*.safetensors"))
    one.save_checkpoint(one.state, tmp_path / "ckpt")
    assert load_train_state(cfg, str(tmp_path), False) is not None
    assert [n for n, _ in one.stream_weights(one.state)] == [
        n for n, _ in one.state.iter_named_weights()]
    with pytest.raises(RuntimeError, match="the launcher starts ranks 1..N-1"):
        load_trainer(msgspec.structs.replace(cfg, parallel=TWO), str(tmp_path), False)
