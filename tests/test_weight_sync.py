"""engine/weight_sync.py end to end: the trainer-side client code pushes weights to embedded
workers from disk, over a gloo process group (workers in their own processes behind the
SGLang stand-in), and as serialized tensors (colocated, with memory release/resume); the
workers' weights are compared bit for bit and their generations and weight versions checked."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load as load_safetensors

from actors.sglang_worker import SglangWorker, SglangWorkerConfig
from algos.logprobs import token_logprobs
from engine.client import SglangClient
from engine.errors import EngineHTTPError
from engine.weight_push import release_to_train, wake_to_generate
from engine.weight_sync import DiskSync, TensorSync, WeightStream, buckets
from memory.device_usage import storage_bytes
from memory.safetensors_io import INDEX_FILE, load_safetensors as read_checkpoint, \
    write_safetensors_shards
from models.load import save_checkpoint
from models.tiny import build_tiny
from tests.fake_sglang_server import install
from tests.helpers import context, running
from tests.test_engine import serve

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 6, 41, 7, 44]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def trained(seed: int):
    """The tiny model with every parameter moved, as a trainer step would (seeded)."""
    model, tok = build_tiny("tiny-qwen2", seed=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, tok


def named(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


def assert_same_weights(got: dict[str, torch.Tensor], model) -> None:
    want = dict(model.named_parameters())
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name].detach()), name


async def assert_generates_with(client: SglangClient, model, version: str) -> None:
    out = await client.generate(PROMPT, GREEDY)
    assert out["meta_info"]["weight_version"] == version
    ids = torch.tensor([PROMPT + out["output_ids"]])
    with torch.no_grad():
        ref = token_logprobs(model, ids)[0, len(PROMPT) - 1:]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)
    assert out["output_ids"] == _greedy(model, GREEDY["max_new_tokens"])


def _greedy(model, n: int) -> list[int]:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def test_buckets_keep_order_and_bound_size():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([3, 3, 10, 1, 1, 1, 2, 4])]
    parts = list(buckets(tensors, bucket_bytes=6 * 4))
    assert [[n for n, _ in b] for b in parts] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5", "t6"],
                                                  ["t7"]]
    assert all(sum(t.numel() * 4 for _, t in b) <= 24 for b in parts if len(b) > 1)
    with pytest.raises(ValueError):
        list(buckets(tensors, 0))


async def test_a_stream_is_read_bucket_by_bucket_holding_one_bucket():
    """A gathered version (fresh copies) is bucketed as it is produced: the push never holds
    more than one bucket and the tensor after it, the last bucket is flagged, and a read left
    early still runs the producer to its end in the stream's thread (a sharded trainer's other
    ranks finish the same gather)."""
    from concurrent.futures import ThreadPoolExecutor

    import threading

    sizes = [40] * 10  # 10 x 160 bytes
    produced, threads, closed = [], set(), []

    def gather():
        for i, n in enumerate(sizes):
            threads.add(threading.current_thread().name)
            produced.append(i)
            yield f"t{i}", torch.full((n,), float(i))

    def produce():  # as training.ranks' stream: closed early, the gather still runs to its end
        it = gather()
        try:
            for item in it:
                yield item
        finally:
            for _ in it:
                pass
            closed.append(threading.current_thread().name)

    pool = ThreadPoolExecutor(1, thread_name_prefix="gather")
    stream = WeightStream(produce, pool, copies=True)
    seen, flags = [], []
    async with stream.buckets(2 * 160) as parts:
        async for bucket, last in parts:
            assert len(produced) <= len(seen) + len(bucket) + 1  # produced as it is wanted
            seen += [(n, float(t[0])) for n, t in bucket]
            flags.append(last)
            del bucket
    assert seen == [(f"t{i}", float(i)) for i in range(10)]
    assert flags == [False] * 4 + [True]
    assert stream.bytes_read == 1600
    assert stream.peak_held_bytes <= 2 * 160 + 160 < 1600  # one bucket + the next tensor
    assert threads == {"gather_0"}
    produced.clear()
    async with stream.buckets(160) as parts:
        async for bucket, last in parts:
            break  # a failed push: the rest is still produced (and dropped)
    assert produced == list(range(10)) and closed == ["gather_0", "gather_0"]
    pool.shutdown()


def test_streamed_export_writes_shards_with_an_index(tmp_path):
    tensors = [(f"w{i}", torch.randn(64, generator=torch.Generator().manual_seed(i)))
               for i in range(5)]
    assert write_safetensors_shards(iter(tensors), tmp_path / "many", 2 * 256) == 5 * 256
    files = sorted(p.name for p in (tmp_path / "many").glob("*.safetensors"))
    assert files == ["model-00001.safetensors", "model-00002.safetensors",
                     "model-00003.safetensors"] and (tmp_path / "many" / INDEX_FILE).is_file()
    back = read_checkpoint(tmp_path / "many")
    assert list(back) == [n for n, _ in tensors]
    assert all(torch.equal(back[n], t) for n, t in tensors)
    write_safetensors_shards(iter(tensors), tmp_path / "one", 1 << 20)
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["model.safetensors"]
    with pytest.raises(ValueError, match="given twice"):
        write_safetensors_shards(iter(tensors + tensors[:1]), tmp_path / "bad", 1 << 20)


async def test_distributed_sync_over_gloo_to_two_worker_processes(ipc, tmp_path):
    """Trainer process (rank 0) -> two worker processes (ranks 1, 2) over gloo, two versions."""
    fake = install(tmp_path / "fake")
    env = {"PYTHONPATH": f"{fake}:{ROOT}", "OMP_NUM_THREADS": "1"}
    async with AsyncExitStack() as stack:
        sgs = []
        for i in range(2):
            sg = SglangWorker(context(f"sg{i}", ipc, run_dir=str(tmp_path), start_timeout_s=60),
                              SglangWorkerConfig(model_path="tiny-qwen2", env=env))
            sgs.append(await stack.enter_async_context(running(sg, 60)))
        clients = [SglangClient(sg.bound.http, timeout_s=60) for sg in sgs]
        for c in clients:
            stack.push_async_callback(c.close)
        trainer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.weight_sync_trainer", *(sg.bound.http for sg in sgs),
            "--pushes", "5:5,6:6", "--bucket-bytes", str(16 << 10), cwd=ROOT,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            for version, seed in (("5", 5), ("6", 6)):  # two pushes over the same group
                line = (await asyncio.wait_for(trainer.stdout.readline(), 60)).decode()
                model, _ = trained(seed)
                assert line.split()[:3] == ["pushed", version,
                                            str(len(list(buckets(named(model), 16 << 10))))], line
                assert int(line.split()[2]) > 2  # several buckets
                for sg, client in zip(sgs, clients):
                    assert_same_weights(await fetch_weights(sg.bound.http), model)
                    await assert_generates_with(client, model, version)
                trainer.stdin.write(b"next\n")
                await trainer.stdin.drain()
            assert await asyncio.wait_for(trainer.wait(), 60) == 0
        finally:
            if trainer.returncode is None:
                trainer.kill()
                await trainer.wait()


async def fetch_weights(url: str) -> dict[str, torch.Tensor]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/test/weights") as r:
            return load_safetensors(await r.read())


async def test_distributed_update_without_group_is_refused(ipc):
    async with serve(ipc) as (worker, client):
        with pytest.raises(EngineHTTPError) as err:
            await client.update_weights_from_distributed(["lm_head.weight"], ["float32"],
                                                         [[1]], weight_version="9")
        assert err.value.status == 400 and "/init_weights_update_group" in err.value.message
        with pytest.raises(EngineHTTPError) as err:  # nccl needs CUDA
            await client.init_weights_update_group("127.0.0.1", 1, 1, 2, backend="nccl")
        assert "use backend gloo" in err.value.message
        assert await client.get_weight_version() == "0"


async def test_colocated_tensor_sync_with_memory_release(ipc):
    """The colocated order on a real worker: to train, the worker releases everything before
    the trainer wakes; to generate, the trainer parks its state, the worker takes its weights
    back, the push fills them, the trainer parks its weights, and only then the worker takes
    its KV cache and CUDA graphs back."""
    async with serve(ipc) as (worker, client):
        model, _ = trained(11)
        sync = TensorSync([client], bucket_bytes=32 << 10)
        events: list[tuple[str, list[str], int, str]] = []

        def seen(what: str):
            async def record():
                events.append((what, sorted(worker.scheduler.released),
                               storage_bytes(worker.scheduler.model.parameters()),
                               worker.scheduler.weight_version))
                return what
            return record

        async def push():
            await seen("push")()
            await sync.push(named(model), "3")
            return "pushed"

        assert await release_to_train([client], seen("wake")) == "wake"  # trainer's turn
        assert events == [("wake", ["cuda_graph", "kv_cache", "weights"], 0, "0")]
        events.clear()
        assert await wake_to_generate([client], push, seen("park_state"),
                                      seen("park_weights")) == "pushed"
        assert [(e[0], e[1], e[3]) for e in events] == [
            ("park_state", ["cuda_graph", "kv_cache", "weights"], "0"),
            ("push", ["cuda_graph", "kv_cache"], "0"),
            ("park_weights", ["cuda_graph", "kv_cache"], "3")]  # pushed before it parks
        assert events[0][2] == 0 < events[1][2]  # the weights' memory came back for the push
        assert worker.scheduler.released == set()
        assert_same_weights(dict(worker.scheduler.model.named_parameters()), model)
        await assert_generates_with(client, model, "3")
        # a release keeps a host copy: resumed, the worker serves exactly version 3 again
        await client.release_memory_occupation(["weights"])
        await client.resume_memory_occupation(["weights"])
        assert_same_weights(dict(worker.scheduler.model.named_parameters()), model)


async def test_released_weights_without_host_copy_wait_for_the_push(ipc):
    async with serve(ipc, weights_cpu_backup=False) as (worker, client):
        model, _ = trained(12)
        await TensorSync([client]).push(named(model), "2")
        await client.release_memory_occupation()
        await client.resume_memory_occupation()
        assert worker.scheduler._parked.host is None  # nothing was copied out
        # pushed tensors have no checkpoint to reload: zeros until the trainer pushes again
        assert all(p.abs().sum() == 0 for p in worker.scheduler.model.parameters())


async def test_cpu_worker_never_unpickles_a_tensor_payload(ipc):
    async with serve(ipc) as (worker, client):
        before = {n: p.clone() for n, p in worker.scheduler.model.named_parameters()}
        evil = base64.b64encode(pickle.dumps([("lm_head.weight", torch.zeros(1))])).decode()
        with pytest.raises(EngineHTTPError) as err:
            await client.update_weights_from_tensor([evil], weight_version="1")
        assert err.value.status == 400 and "never unpickles" in err.value.message
        wrong = TensorSync([client]).serialize([("model.norm.weight", torch.ones(3))])
        with pytest.raises(EngineHTTPError) as err:  # checked before anything changes
            await client.update_weights_from_tensor([wrong], weight_version="1")
        assert "shape of model.norm.weight" in err.value.message
        after = dict(worker.scheduler.model.named_parameters())
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert await client.get_weight_version() == "0"


async def test_disk_sync_pauses_loads_and_checks_versions(ipc, tmp_path):
    async with serve(ipc) as (worker, client):
        model, tok = trained(21)
        save_checkpoint(model, tok, str(tmp_path))
        await DiskSync([client]).push(str(tmp_path), "4")
        assert worker.scheduler.paused is None  # continued after the update
        assert_same_weights(dict(worker.scheduler.model.named_parameters()), model)
        await assert_generates_with(client, model, "4")
