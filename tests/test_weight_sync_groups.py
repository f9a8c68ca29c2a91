"""Weight sync over process groups whatever the placement, and never stuck on a lost peer.

NCCL takes one rank per GPU in a communicator, so workers sharing a GPU go to different groups
(engine.weight_sync.plan_groups); the same grouping runs here on CPU over gloo with the
workers *declared* on one GPU. A collective that waits for a peer that is gone must hold up
neither the event loop (heartbeats) nor the next push: the push gives its groups up, forms
new ones and sends again; a worker's stuck receive does not hold up its next group either.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from actors.sglang_worker import SglangWorker, SglangWorkerConfig
from engine.client import SglangClient
from engine.errors import EngineHTTPError
from engine.weight_sync import SyncError, make_weight_sync, plan_groups
from launch.config import load
from runtime.devices import gpu_ids
from runtime.loading import ConfigError
from tests.fake_sglang_server import install
from tests.helpers import context, running
from tests.test_weight_sync import assert_same_weights, fetch_weights, trained
from transport.sockets import free_port

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["worker0", "worker1", "worker2"]


def test_gpu_ids_map_through_the_visible_devices_mask():
    assert gpu_ids(["cuda:1"], {}, "h") == ["h/gpu1"]
    assert gpu_ids(["cuda"], {}, "h") == ["h/gpu0"]
    assert gpu_ids(["cuda:1"], {"CUDA_VISIBLE_DEVICES": "2,3"}, "h") == ["h/gpu3"]
    assert gpu_ids(["cuda:0"], {"CUDA_VISIBLE_DEVICES": "GPU-ab12"}, "h") == ["h/gpuGPU-ab12"]
    assert gpu_ids(["cpu"], {}, "h") == []
    with pytest.raises(ValueError, match="shows only 1 device"):
        gpu_ids(["cuda:1"], {"CUDA_VISIBLE_DEVICES": "0"}, "h")


def test_workers_sharing_a_gpu_go_to_different_groups():
    assert plan_groups([["h/gpu1"], ["h/gpu2"]], ["h/gpu0"], NAMES) == [[0, 1]]
    assert plan_groups([["h/gpu1"], ["h/gpu1"]], ["h/gpu0"], NAMES) == [[0], [1]]
    assert plan_groups([["h/gpu1"], ["h/gpu1"], ["h/gpu2"]], ["h/gpu0"], NAMES) == [[0, 2], [1]]
    # a TP-2 server on GPUs 1-2 and a worker on GPU 2: not in one group
    assert plan_groups([["h/gpu1", "h/gpu2"], ["h/gpu2"]], [], NAMES) == [[0], [1]]
    assert plan_groups([[], []], [], NAMES) == [[0, 1]]  # CPU (gloo): no rule
    assert plan_groups([["a/gpu0"], ["b/gpu0"]], [], NAMES) == [[0, 1]]  # other hosts
    with pytest.raises(SyncError, match="worker1 runs on h/gpu0, the GPU the trainer sends"):
        plan_groups([["h/gpu1"], ["h/gpu0"]], ["h/gpu0"], NAMES)


async def test_nccl_refuses_cpu_workers_before_any_push():
    clients = [SglangClient("http://127.0.0.1:9") for _ in range(2)]
    with pytest.raises(SyncError, match="worker\\(s\\) worker1 run on the CPU"):
        await make_weight_sync("distributed", clients, "cuda:0", 1 << 20, names=NAMES[:2],
                               devices=[["h/gpu1"], []], own_devices=["h/gpu0"])
    with pytest.raises(SyncError, match="worker0 runs on h/gpu0"):
        await make_weight_sync("distributed", clients, "cuda:0", 1 << 20, names=NAMES[:2],
                               devices=[["h/gpu0"], ["h/gpu1"]], own_devices=["h/gpu0"])
    for c in clients:
        await c.close()


HOSTS = """
[run]
name = "placement"
[[hosts]]
name = "local"
[actors.worker0]
cls = "actors.inference:InferenceWorker"
config = {{ model = "examples/base-tiny", device = "{w0}" }}
env = {{ {w0_env} }}
[actors.worker1]
cls = "actors.inference:InferenceWorker"
config = {{ model = "examples/base-tiny", device = "{w1}" }}
[actors.buffer]
cls = "actors.buffer:BufferActor"
[actors.rollout]
cls = "actors.rollout:RolloutActor"
after = ["worker0", "buffer"]
config = {{ router = "worker0", group_size = 4, groups_per_batch = 4, envs = [
  {{ cls = "envs.builtin.arith:ArithEnv" }}] }}
[actors.trainer]
cls = "actors.trainer:TrainerActor"
after = ["worker0", "worker1", "buffer"]
primary = true
env = {{ {t_env} }}
[actors.trainer.config]
model = "examples/base-tiny"
workers = ["worker0", "worker1"]
device = "{t}"
weight_sync = {{ path = "{path}" }}
"""


def hosts(tmp_path: Path, t="cuda:0", w0="cuda:1", w1="cuda:1", path="distributed",
          t_env="", w0_env="") -> Path:
    file = tmp_path / "hosts.toml"
    file.write_text(HOSTS.format(t=t, w0=w0, w1=w1, path=path, t_env=t_env, w0_env=w0_env))
    return file


def test_launcher_refuses_a_placement_no_group_can_serve(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    load(hosts(tmp_path))  # two workers on one GPU: two groups, accepted
    load(hosts(tmp_path, w0="cuda:0", path="disk"))  # disk serves any placement
    with pytest.raises(ConfigError) as err:
        load(hosts(tmp_path, w0="cuda:0"))
    text = str(err.value)
    assert "[actors.trainer.config]" in text and "[actors.worker0]" in text
    assert "local/gpu0" in text and "weight_sync.path = 'cuda_ipc'" in text
    # the same GPU under two names: the trainer's cuda:0 is physical GPU 1 here
    with pytest.raises(ConfigError, match="worker1.*local/gpu1"):
        load(hosts(tmp_path, w0="cuda:2", t_env='CUDA_VISIBLE_DEVICES = "1"'))
    load(hosts(tmp_path, w0="cuda:0", w1="cuda:0", t_env='CUDA_VISIBLE_DEVICES = "1"',
               w0_env='CUDA_VISIBLE_DEVICES = "2"'))  # worker1 (GPU 0), worker0 (GPU 2)
    with pytest.raises(ConfigError, match="worker\\(s\\) \\[actors.worker1\\] run on the CPU"):
        load(hosts(tmp_path, w1="cpu"))
    typo = tmp_path / "typo.toml"
    typo.write_text(hosts(tmp_path, "cpu", "cpu", "cpu", "disk").read_text().replace(
        '"worker0", "worker1"]\ndevice', '"worker0", "wroker1"]\ndevice'))
    with pytest.raises(ConfigError,
                       match="`workers\\[1\\]` = 'wroker1' is not an actor of this run"):
        load(typo)


def test_launcher_checks_cuda_ipc_and_auto_placements(tmp_path, monkeypatch):
    """cuda_ipc reaches workers on the trainer's own GPU only; auto sends CUDA IPC there and
    NCCL to the others, and each part is checked as its own path would be."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    load(hosts(tmp_path, w0="cuda:0", w1="cuda:0", path="cuda_ipc"))  # colocated: accepted
    with pytest.raises(ConfigError) as err:
        load(hosts(tmp_path, w0="cuda:0", w1="cuda:1", path="cuda_ipc"))
    text = str(err.value)
    assert "[actors.worker1] CUDA IPC handles" in text and "local/gpu1" in text
    assert "weight_sync.path = 'auto'" in text
    with pytest.raises(ConfigError, match="runs on the CPU"):
        load(hosts(tmp_path, w0="cuda:0", w1="cpu", path="cuda_ipc"))
    with pytest.raises(ConfigError, match="device = 'cpu'.*'tensor'"):
        load(hosts(tmp_path, t="cpu", w0="cpu", w1="cpu", path="cuda_ipc"))
    # auto: worker0 on the trainer's GPU (CUDA IPC), worker1 on another (NCCL): accepted
    load(hosts(tmp_path, w0="cuda:0", w1="cuda:1", path="auto"))
    # ... but the NCCL part still refuses a CPU worker under a CUDA trainer
    with pytest.raises(ConfigError, match="worker\\(s\\) \\[actors.worker1\\] run on the CPU"):
        load(hosts(tmp_path, w0="cuda:0", w1="cpu", path="auto"))
    load(hosts(tmp_path, t="cpu", w0="cpu", w1="cpu", path="auto"))  # all gloo from a CPU trainer


async def workers(stack: AsyncExitStack, ipc, tmp_path: Path, n: int) -> list[SglangWorker]:
    fake = install(tmp_path / "fake")
    env = {"PYTHONPATH": f"{fake}:{ROOT}", "OMP_NUM_THREADS": "1"}
    out = []
    for i in range(n):
        sg = SglangWorker(context(f"sg{i}", ipc, run_dir=str(tmp_path), start_timeout_s=60),
                          SglangWorkerConfig(model_path="tiny-qwen2", env=env))
        out.append(await stack.enter_async_context(running(sg, 60)))
    return out


async def spawn(stack: AsyncExitStack, *args: str) -> asyncio.subprocess.Process:
    """A process of the test's own (a trainer, a stand-in rank 0), killed at the end."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, cwd=ROOT, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})

    async def reap() -> None:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    stack.push_async_callback(reap)
    return proc


async def pushed(trainer: asyncio.subprocess.Process) -> dict[str, str]:
    """The trainer's next `pushed` line as {version, buckets, groups, reconnects, took, gap}."""
    line = (await asyncio.wait_for(trainer.stdout.readline(), 90)).decode()
    words = line.split()
    assert words[:1] == ["pushed"], line
    return {"version": words[1], "buckets": words[2], **dict(w.split("=") for w in words[3:])}


async def go_on(trainer: asyncio.subprocess.Process) -> None:
    trainer.stdin.write(b"next\n")
    await trainer.stdin.drain()


@pytest.mark.timeout(240)
async def test_two_workers_on_one_gpu_get_two_groups_and_a_lost_group_is_formed_again(
        ipc, tmp_path):
    async with AsyncExitStack() as stack:
        sgs = await workers(stack, ipc, tmp_path, 2)
        urls = [sg.bound.http for sg in sgs]
        # both workers declared on GPU 1: two groups. Before version 6 worker1 loses its group
        # (as after a restart): it refuses the bucket at once while the broadcast into that
        # group would wait for it (gloo: until the timeout, 20 s)
        trainer = await spawn(stack, "-m", "tests.weight_sync_trainer", *urls, "--pushes",
                              "5:5,6:6", "--devices", "h/gpu1;h/gpu1", "--own", "h/gpu0",
                              "--timeout", "20", "--lose", "6:1")
        first = await pushed(trainer)
        model, _ = trained(5)
        assert first["groups"] == "2" and first["reconnects"] == "0"
        assert int(first["buckets"]) > 2  # several buckets, each into both groups
        for sg in sgs:
            assert_same_weights(await fetch_weights(sg.bound.http), model)
        await go_on(trainer)
        second = await pushed(trainer)
        model, _ = trained(6)
        assert second["groups"] == "2" and second["reconnects"] == "1", second
        assert float(second["took"]) < 15, second  # gave the group up at once, not at 20 s
        assert float(second["gap"]) < 1.0, second  # the event loop never waited on it
        for sg in sgs:
            assert_same_weights(await fetch_weights(sg.bound.http), model)
            async with SglangClient(sg.bound.http) as client:
                assert await client.get_weight_version() == "6"
        await go_on(trainer)
        assert await asyncio.wait_for(trainer.wait(), 60) == 0

        # no second chance (retries = 0): the failure names the worker and the cause
        trainer = await spawn(stack, "-m", "tests.weight_sync_trainer", *urls, "--pushes",
                              "7:7", "--devices", "h/gpu1;h/gpu1", "--timeout", "20",
                              "--retries", "0", "--lose", "7:0")
        line = (await asyncio.wait_for(trainer.stdout.readline(), 90)).decode()
        assert line.startswith("error weight version 7, bucket 1 "), line
        assert f"{urls[0]}: HTTP 400" in line and "no weight update group" in line, line
        assert await asyncio.wait_for(trainer.wait(), 60) == 1
        async with SglangClient(urls[1]) as client:
            assert await client.get_weight_version() == "6"


STAND_IN = """
import sys
from engine import dist_group
group = dist_group.new_group("gloo", "127.0.0.1", int(sys.argv[1]), 0, 2, "stuck", 20)
print("joined", flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(180)
async def test_a_worker_stuck_in_a_receive_still_joins_its_next_group(ipc, tmp_path):
    async with AsyncExitStack() as stack:
        (sg,) = await workers(stack, ipc, tmp_path, 1)
        client = SglangClient(sg.bound.http, timeout_s=60)
        stack.push_async_callback(client.close)
        port = free_port("127.0.0.1")
        rank0 = await spawn(stack, "-c", STAND_IN, str(port))
        assert (await client.init_weights_update_group("127.0.0.1", port, 1, 2, "stuck",
                                                       "gloo"))["success"]
        assert (await asyncio.wait_for(rank0.stdout.readline(), 60)) == b"joined\n"
        # announced, never sent: the worker's receive waits for a sender that never comes
        receive = asyncio.ensure_future(client.update_weights_from_distributed(
            ["lm_head.weight"], ["float32"], [[2, 2]], "stuck"))
        await asyncio.sleep(0.5)
        assert not receive.done()
        t0 = time.monotonic()
        assert (await client.destroy_weights_update_group("stuck"))["success"]
        assert time.monotonic() - t0 < 12  # never waits for the stuck receive
        receive.cancel()
        # a new group forms and carries a whole version while that receive is still stuck
        trainer = await spawn(stack, "-m", "tests.weight_sync_trainer", sg.bound.http,
                              "--pushes", "8:8", "--timeout", "20")
        assert (await pushed(trainer))["version"] == "8"
        assert_same_weights(await fetch_weights(sg.bound.http), trained(8)[0])
        await go_on(trainer)
        assert await asyncio.wait_for(trainer.wait(), 60) == 0
        with pytest.raises(EngineHTTPError, match="no weight update group 'stuck'"):
            await client.update_weights_from_distributed(["lm_head.weight"], ["float32"],
                                                         [[2, 2]], "stuck")
