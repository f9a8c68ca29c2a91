"""Shared fixtures. Every test is checked for leaks: no new threads, child processes or file
descriptors (zmq contexts and sockets hold fds) may outlive it."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

# no test reaches the network: a hub id is read from the cache only (tests/test_hub_models.py
# serves its own stand-in hub and sets these itself)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one torch (OpenMP) thread in every test process and every process they start: the workers
# already keep the cores busy, and a second thread per process only spins waiting for a core
os.environ.setdefault("OMP_NUM_THREADS", "1")


MAX_WORKERS = 4  # test processes at most: each file may start a cluster of ~8 processes


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml): one worker per core, at most MAX_WORKERS."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


# The slowest test files, slowest first (seconds on a 2-core machine, one quiet run), so that the
# workers start on them: xdist hands out whole files in collection order (pyproject.toml:
# --no-loadscope-reorder; its default reorder puts files of few tests, the clusters, last), and
# a long file picked up last leaves the other workers idle until it ends. Files not listed
# follow in name order; a missing name is an error (tests/test_suite_order.py).
SLOWEST_FIRST = (
    "test_megatron_cp_trainer.py",  # 96
    "test_megatron_moe.py",  # 86
    "test_bench_checkers.py",  # 83
    "test_trainer_parallel.py",  # 76
    "test_loop.py",  # 70
    "test_megatron_lora.py",  # 56
    "test_cross_tokenizer.py",  # 53
    "test_cluster.py",  # 50
    "test_mopd_cluster.py",  # 47
    "test_multihost.py",  # 46
    "test_faults_cluster.py",  # 44
    "test_lora.py",  # 43
    "test_fsdp.py",  # 34
    "test_weight_sync_groups.py",  # 30
    "test_trainer_ranks.py",  # 29
    "test_moe.py",  # 29
    "test_megatron_parallel.py",  # 24
    "test_opd_stream.py",  # 24
    "test_endings.py",  # 22
    "test_router.py",  # 19
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest files first (SLOWEST_FIRST), each file's tests in their own order."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest stays


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def no_leaks():
    threads = set(threading.enumerate())
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    fds = _fds()
    yield
    deadline = time.monotonic() + 5
    while True:
        new_threads = [t for t in threading.enumerate() if t not in threads and t.is_alive()
                       and type(t).__name__ != "GarbageCollectorThread"]  # pyzmq: per process
        new_children = [p for p in psutil.Process().children(recursive=True)
                        if p.pid not in children and p.status() != psutil.STATUS_ZOMBIE
                        and not _process_helper(p)]
        new_fds = _fds() - fds - _helper_fds()
        if not (new_threads or new_children or len(new_fds) > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not new_threads, f"leaked threads: {new_threads}"
    assert not new_children, f"leaked processes: {[(p.pid, p.cmdline()) for p in new_children]}"
    leaked = {fd: _target(fd) for fd in new_fds}
    assert not leaked, f"leaked file descriptors: {leaked}"


def _process_helper(p: psutil.Process) -> bool:
    """multiprocessing's forkserver and resource tracker: started once by the first test that
    forks rank processes (tests/helpers.py `rank_context`), kept for the test process."""
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return "multiprocessing.forkserver" in cmd or "multiprocessing.resource_tracker" in cmd


def _helper_fds() -> set[str]:
    """This process's ends of those helpers' pipes."""
    from multiprocessing import forkserver, resource_tracker

    fds = (getattr(forkserver._forkserver, "_forkserver_alive_fd", None),
           getattr(resource_tracker._resource_tracker, "_fd", None))
    return {str(fd) for fd in fds if fd is not None}


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


@pytest.fixture
def ipc(tmp_path_factory):
    """Makes short ipc:// endpoints (socket paths must fit in 107 bytes)."""
    import tempfile

    base = tempfile.mkdtemp(prefix="rlx-t-")
    counter = iter(range(10**6))

    def make(name: str = "sock") -> str:
        return f"ipc://{base}/{name}-{next(counter)}"

    yield make
    import shutil

    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def one_thread():
    """One torch intra-op thread while a test runs (restored after it): tiny tensors on a busy
    machine; a thread count set for good would change other tests' in-process numbers."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
