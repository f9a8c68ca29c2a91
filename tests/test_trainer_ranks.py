"""The trainer actor's data-parallel ranks: rank 0 (here, in the test process) starts rank 1 as a
process, both take the step, the update equals one process's and the ranks stay identical, with
and without colocated teachers."""

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
from training.ranks import RankGroup, rank_device
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


def dp_versus_one_process(cfg, samples_of, tmp_path):
    """One step on two ranks (rank 0 here) and on one process from the same initial state:
    (two-rank state, its stats, one-process state, its stats)."""
    one = load_train_state(msgspec.structs.replace(cfg, parallel=ParallelConfig(dp=1)),
                           str(tmp_path / "one"), False)
    ranks = RankGroup(cfg, str(tmp_path), False, tmp_path / "logs")  # compared the weights
    state = ranks.state
    samples = samples_of(state.tokenizer)
    try:
        before = ranks.all_digests(state.model)
        stats = ranks.train(state, samples, cfg, ["arith"])
        after = ranks.all_digests(state.model)
        stats1 = train_on_batch(one, samples, cfg)
    finally:
        ranks.stop()
        for s in (state, one):
            if s.teachers is not None:
                s.teachers.close()
    assert [p.returncode for p in ranks.procs] == [0]
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
def test_a_stuck_then_a_dead_rank_are_reported_with_their_logs(tmp_path):
    """A rank that stops answering (SIGSTOP) fails the step after parallel.timeout_s, naming it
    and where it was; once it is dead the next command says so at once, with its exit code."""
    import signal
    import time

    cfg = msgspec.structs.replace(config(), parallel=ParallelConfig(dp=2, timeout_s=3))
    ranks = RankGroup(cfg, str(tmp_path), False, tmp_path / "logs")
    state = ranks.state
    rank1 = ranks.procs[0]
    try:
        while not ranks.store.check(["at1"]):  # rank 1 has said it is ready for commands
            time.sleep(0.05)
        rank1.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"step command to the trainer's ranks failed: .*"
                                               r"not done with command 1: trainer rank 1 \(at: "
                                               r"command 0 ready, log .*trainer\.rank1\.log\)"):
            ranks.train(state, make_batch(state.tokenizer), cfg)
        assert time.monotonic() - t0 < 30  # parallel.timeout_s, not the default 600 s
        rank1.kill()
        rank1.send_signal(signal.SIGCONT)
        rank1.wait()
        with pytest.raises(RuntimeError, match=r"trainer rank 1 exited with code -9, log .*"
                                               r"trainer\.rank1\.log"):
            ranks.train(state, make_batch(state.tokenizer), cfg)
    finally:
        ranks.stop()


@pytest.mark.parametrize("change, words", [
    ({"parallel": {"dp": 0}}, "dp >= 1"),
    ({"parallel": {"cp": 2}, "backend": "megatron"}, "parallel.cp = 2: context parallelism"),
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


@pytest.mark.timeout(120)
def test_a_rank_that_dies_while_loading_fails_the_start_at_once(tmp_path, monkeypatch):
    import subprocess
    import sys
    import time

    import training.ranks as trainer_ranks

    real = subprocess.Popen

    def popen(cmd, **kw):  # the rank process fails before it ever joins
        return real([sys.executable, "-c", "import sys; print('no such checkpoint'); sys.exit(3)"],
                    **kw)

    monkeypatch.setattr(trainer_ranks.subprocess, "Popen", popen)
    cfg = msgspec.structs.replace(config(), parallel=ParallelConfig(dp=2, start_timeout_s=300))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)trainer rank 1 exited with code 3, log .*"
                                           r"no such checkpoint"):
        RankGroup(cfg, str(tmp_path), False, tmp_path / "logs")
    assert time.monotonic() - t0 < 60  # not the 300 s rendezvous timeout


@pytest.mark.timeout(120)
def test_a_rank_host_that_cannot_be_reached_fails_the_start_with_its_words(tmp_path):
    """parallel.hosts: rank 1 starts through its host's exec prefix; a prefix that fails (an
    ssh that cannot connect, here a stand-in saying so) ends the start at once, naming the rank,
    its exit code and what the prefix said."""
    import time

    from training.config import RankHost

    ssh = ["sh", "-c", "echo 'ssh: connect to host gpu1 port 22: Connection refused' >&2; "
                       "exit 255"]
    parallel = ParallelConfig(dp=2, hosts=["head", "gpu1"], start_timeout_s=300, placement=[
        RankHost(name="head"), RankHost(name="gpu1", exec=ssh, shell=False)])
    cfg = msgspec.structs.replace(config(), parallel=parallel)
    assert parallel.ranks_per_host == 1 and parallel.rank_host(1).name == "gpu1"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)trainer rank 1 exited with code 255, log .*"
                                           r"connect to host gpu1 port 22"):
        RankGroup(cfg, str(tmp_path), False, tmp_path / "logs")
    assert time.monotonic() - t0 < 60
    with pytest.raises(ValueError, match="leave placement out"):
        ParallelConfig(dp=2, hosts=["head", "gpu1"], placement=[RankHost(name="gpu1"),
                                                                RankHost(name="head")])
