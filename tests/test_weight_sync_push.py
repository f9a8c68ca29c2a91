"""engine/weight_sync_config.py + engine/weight_push.py: the trainer's one call per version.

`WeightSyncConfig.build` reads weight_sync.path once and gives an object whose
`push(version) -> PushReport` is the same call on every path: disk (written once under
<run_dir>/weights/v<N>, loaded by every worker, old versions pruned), the in-memory paths (a
fresh weight stream per version), and the disk fallback around them. Pushed to a real embedded
worker, whose weights are compared bit for bit. The placement checks the launcher runs take
plain data and raise the messages the trainer's checks raised."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest

from engine.client import SglangClient
from engine.weight_push import DiskPush, FallbackPush, PushReport, StreamPush
from engine.weight_sync import (DistributedSync, SplitSync, SyncError, TensorSync, WeightStream,
                                check_sync_device, check_weight_sync_placement, worker_paths)
from engine.weight_sync_config import WeightSyncConfig
from models.load import save_checkpoint
from tests.test_engine import serve
from tests.test_weight_sync import assert_same_weights, named, trained


def nbytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Trainer:
    """What a trainer hands `build`: a writer of one version's HF safetensors and a factory of
    weight streams, both over the model of the version being pushed."""

    def __init__(self):
        self.model = self.tok = None
        self.writes: list[tuple[str, int]] = []
        self.streams = 0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="gather")

    def at(self, seed: int):
        self.model, self.tok = trained(seed)
        return self.model

    async def write(self, directory: Path, shard_bytes: int) -> None:
        self.writes.append((directory.name, shard_bytes))
        await asyncio.to_thread(save_checkpoint, self.model, self.tok, str(directory))

    def stream(self) -> WeightStream:
        """Fresh copies, as a sharded trainer's gather makes them."""
        self.streams += 1
        model = self.model
        return WeightStream(lambda: ((n, t.clone()) for n, t in named(model)), self.pool,
                            copies=True)


async def build(cfg: WeightSyncConfig, clients, trainer: Trainer, run_dir: Path,
                device: str = "cpu"):
    return await cfg.build(clients, names=[f"worker{i}" for i in range(len(clients))],
                           worker_devices=[[] for _ in clients], own_devices=[], device=device,
                           run_dir=run_dir, write=trainer.write, stream=trainer.stream)


async def test_disk_push_writes_each_version_once_and_keeps_the_newest(ipc, tmp_path):
    trainer = Trainer()
    async with serve(ipc) as (worker, client):
        sync = await build(WeightSyncConfig(path="disk", keep_versions=2, bucket_mib=1),
                           [client], trainer, tmp_path)
        assert isinstance(sync, DiskPush)
        for version in (1, 2, 3):
            model = trainer.at(version)
            report = await sync.push(version)
            assert_same_weights(dict(worker.scheduler.model.named_parameters()), model)
            assert await client.get_weight_version() == str(version)
            files = (tmp_path / "weights" / f"v{version}").glob("*.safetensors")
            assert report.bytes == sum(f.stat().st_size for f in files) > nbytes(model)
            assert (report.version, report.path, report.fell_back, report.error,
                    report.peak_held_bytes, report.notice) == (version, "disk", False, "", 0, "")
            assert report.seconds > 0
        assert trainer.writes == [("v1", 1 << 20), ("v2", 1 << 20), ("v3", 1 << 20)]
        assert trainer.streams == 0  # the disk path never reads a stream
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2", "v3"]
        metrics = report.metrics()
        assert metrics["weight_sync/disk/push_s_per_gb"] == pytest.approx(
            report.seconds / (report.bytes / 1e9))
        assert metrics["weight_sync/weight_bytes"] == report.bytes
        assert "weight_sync/push_held_bytes" not in metrics
        await sync.close()


async def test_tensor_push_reads_one_fresh_stream_per_version(ipc, tmp_path):
    trainer = Trainer()
    async with serve(ipc) as (worker, client):
        sync = await build(WeightSyncConfig(path="tensor", bucket_mib=16 / 1024), [client],
                           trainer, tmp_path)
        assert isinstance(sync, FallbackPush) and isinstance(sync.primary, StreamPush)
        for version in (4, 5):
            model = trainer.at(version)
            report = await sync.push(version)
            assert_same_weights(dict(worker.scheduler.model.named_parameters()), model)
            assert trainer.streams == version - 3
            assert (report.path, report.bytes, report.fell_back) == ("tensor", nbytes(model),
                                                                     False)
            # gathered copies: one 16 KiB bucket and the tensor after it, never the version
            assert 0 < report.peak_held_bytes < report.bytes / 3
            assert report.metrics()["weight_sync/push_held_bytes"] == report.peak_held_bytes
            assert "weight_sync/tensor/push_s_per_gb" in report.metrics()
        assert not (tmp_path / "weights").exists()  # nothing went through disk
        assert trainer.writes == []


async def test_a_failed_push_goes_through_disk_only_with_fallback_disk(ipc, tmp_path):
    """192.0.2.1 (TEST-NET) is no address of this host: no group can form."""
    trainer = Trainer()
    failing = dict(path="distributed", master_address="192.0.2.1", retries=0)
    async with serve(ipc) as (worker, client):
        sync = await build(WeightSyncConfig(**failing), [client], trainer, tmp_path)
        assert isinstance(sync.primary.transport, DistributedSync)
        model = trainer.at(7)
        report = await sync.push(7)
        assert_same_weights(dict(worker.scheduler.model.named_parameters()), model)
        assert await client.get_weight_version() == "7"
        assert (report.path, report.configured, report.fell_back) == ("disk", "distributed", True)
        assert "master_address '192.0.2.1'" in report.error
        assert report.notice == (f"weight version 7 over distributed failed ({report.error}); "
                                 f"sent through disk instead (the next version tries "
                                 f"distributed again)")
        assert report.bytes == sum(f.stat().st_size
                                   for f in (tmp_path / "weights" / "v7").glob("*.safetensors"))
        assert "weight_sync/disk/push_s_per_gb" in report.metrics()
        assert trainer.streams == 1 and trainer.writes == [("v7", 512 << 20)]
        await sync.close()

        strict = await build(WeightSyncConfig(**failing, fallback="none"), [client], trainer,
                             tmp_path / "strict")
        assert isinstance(strict, StreamPush)
        trainer.at(8)
        with pytest.raises(SyncError, match="192.0.2.1"):
            await strict.push(8)
        assert not (tmp_path / "strict").exists() and len(trainer.writes) == 1
        assert await client.get_weight_version() == "7"


async def test_only_a_sync_error_falls_back(ipc, tmp_path):
    trainer = Trainer()

    def broken() -> WeightStream:
        raise RuntimeError("the gather lost a rank")

    async with serve(ipc) as (worker, client):
        sync = await build(WeightSyncConfig(path="tensor"), [client], trainer, tmp_path)
        sync.primary.stream = broken
        with pytest.raises(RuntimeError, match="lost a rank"):
            await sync.push(1)
        assert trainer.writes == [] and await client.get_weight_version() == "0"


async def test_build_reads_the_path_once_per_worker_placement(tmp_path):
    clients = [SglangClient(f"http://127.0.0.1:{9 + i}") for i in range(3)]
    trainer = Trainer()
    try:
        args = dict(names=["w0", "w1", "w2"], own_devices=["h/gpu0"], device="cuda:0",
                    run_dir=tmp_path, write=trainer.write, stream=trainer.stream)
        on_gpus = [["h/gpu0"], ["h/gpu1"], ["h/gpu0"]]
        sync = await WeightSyncConfig(path="auto").build(clients, worker_devices=on_gpus, **args)
        split = sync.primary.transport
        assert isinstance(split, SplitSync) and sync.path == "auto"
        ipc_part, nccl_part = split.parts
        assert isinstance(ipc_part, TensorSync) and ipc_part.serializer == "cuda_ipc"
        assert ipc_part.clients == [clients[0], clients[2]]
        assert isinstance(nccl_part, DistributedSync) and nccl_part.backend == "nccl"
        assert nccl_part.clients == [clients[1]] and nccl_part.names == ["w1"]
        assert sync.fallback.disk.clients == clients  # the fallback reaches every worker
        # unknown placement: every worker over one process group
        sync = await WeightSyncConfig(path="auto", fallback="none").build(
            clients, worker_devices=None, **args)
        assert isinstance(sync.transport, DistributedSync) and sync.transport.clients == clients
        with pytest.raises(SyncError, match="worker w0 runs on h/gpu0"):
            await WeightSyncConfig(path="distributed").build(clients, worker_devices=on_gpus,
                                                             **args)
        with pytest.raises(SyncError, match="this trainer runs on cpu"):
            await WeightSyncConfig(path="cuda_ipc").build(
                clients, worker_devices=None, **{**args, "device": "cpu"})
    finally:
        for c in clients:
            await c.close()


def test_worker_paths_and_device_check():
    gpus = [["h/gpu0"], ["h/gpu1"]]
    assert worker_paths("auto", gpus, ["h/gpu0"], "cuda:0", 2) == ["cuda_ipc", "distributed"]
    assert worker_paths("auto", gpus, [], "cpu", 2) == ["distributed"] * 2
    assert worker_paths("tensor", gpus, ["h/gpu0"], "cuda:0", 2) == ["tensor"] * 2
    with pytest.raises(ValueError, match="unknown weight_sync.path 'nccl'"):
        worker_paths("nccl", gpus, [], "cpu", 2)
    with pytest.raises(ValueError, match="device = 'cpu'.*'tensor'"):
        check_sync_device("cuda_ipc", "cpu")
    check_sync_device("cuda_ipc", "cuda:1")
    check_sync_device("tensor", "cpu")


def test_placement_checks_take_plain_data():
    workers = ["w0", "w1"]
    check = check_weight_sync_placement
    for path in ("disk", "tensor"):  # any placement
        check(path, workers, [["h/gpu0"], []], ["h/gpu0"], "cuda:0")
    check("cuda_ipc", workers, [["h/gpu0"], ["h/gpu0"]], ["h/gpu0"], "cuda:0")
    check("auto", workers, [["h/gpu0"], ["h/gpu1"]], ["h/gpu0"], "cuda:0")
    check("distributed", workers, [["h/gpu1"], ["h/gpu1"]], ["h/gpu0"], "cuda:0")  # 2 groups
    check("auto", workers, [[], []], [], "cpu")  # gloo from a CPU trainer
    with pytest.raises(ValueError) as err:
        check("cuda_ipc", workers, [["h/gpu0"], ["h/gpu1"]], ["h/gpu0"], "cuda:0")
    assert str(err.value).startswith(
        "weight_sync.path = 'cuda_ipc' hands [actors.w1] CUDA IPC handles of the trainer's GPU "
        "(h/gpu0), but it runs on h/gpu1: put it on the trainer's GPU")
    with pytest.raises(ValueError, match="but it runs on the CPU"):
        check("cuda_ipc", workers, [["h/gpu0"], []], ["h/gpu0"], "cuda:0")
    with pytest.raises(ValueError, match="worker\\(s\\) \\[actors.w1\\] run on the CPU"):
        check("auto", workers, [["h/gpu0"], []], ["h/gpu0"], "cuda:0")
    with pytest.raises(ValueError, match="worker \\[actors.w0\\] runs on h/gpu0, the GPU the "
                                         "trainer sends from"):
        check("distributed", workers, [["h/gpu0"], ["h/gpu1"]], ["h/gpu0"], "cuda:0")


def test_config_defaults_and_validation():
    cfg = WeightSyncConfig()
    assert (cfg.path, cfg.bucket_bytes, cfg.keep_versions, cfg.fallback, cfg.pause_mode,
            cfg.retries, cfg.timeout_s) == ("disk", 512 << 20, 2, "disk", "in_place", 1, 120.0)
    assert WeightSyncConfig(bucket_mib=0.5).bucket_bytes == 1 << 19
    for bad in ({"bucket_mib": 1 / 2048}, {"keep_versions": 0}):
        with pytest.raises(ValueError, match="bucket_mib >= 1/1024"):
            WeightSyncConfig(**bad)
    for bad in ({"timeout_s": 0}, {"retries": -1}):
        with pytest.raises(ValueError, match="timeout_s > 0 and retries >= 0"):
            WeightSyncConfig(**bad)
    assert msgspec.convert({"path": "auto", "bucket_mib": 64}, WeightSyncConfig) == \
        WeightSyncConfig(path="auto", bucket_mib=64)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"path": "nccl"}, WeightSyncConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"keep": 3}, WeightSyncConfig)  # unknown fields are refused


def test_report_metrics_are_per_gb_per_path():
    report = PushReport(3, "distributed", 2_000_000_000, 4.0, peak_held_bytes=10)
    assert report.metrics() == {"weight_sync/push_s": 4.0, "weight_sync/push_s_per_gb": 2.0,
                                "weight_sync/distributed/push_s_per_gb": 2.0,
                                "weight_sync/weight_bytes": 2e9,
                                "weight_sync/push_held_bytes": 10.0}
    assert report.notice == ""
