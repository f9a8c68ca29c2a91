"""The prefetcher actor in its own process: it fills the shared pinned arena that the trainer's
WeightMemory reads; killed, the trainer falls back to reading synchronously and stays correct."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import msgspec
import pytest
import torch

from actors.prefetcher import RemoteReader
from memory.checksum import ChecksumError
from memory.layout import PAGE_BYTES, FlatLayout, pack
from memory.manager import WeightMemory
from memory.nvme import NvmeStore
from runtime.child import ChildSpec
from tests.helpers import context
from transport.rpc import RpcClient
from transport.sockets import SocketFactory


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(300, 40, generator=g), "b": torch.randn(17, generator=g).half()}


@pytest.fixture
def prefetcher(tmp_path, ipc):
    ctx = context("prefetcher", ipc)
    spec = tmp_path / "prefetcher.json"
    spec.write_bytes(msgspec.json.encode(ChildSpec(
        cls="actors.prefetcher:PrefetcherActor", context=ctx,
        config={"chunk_bytes": PAGE_BYTES, "num_readers": 2})))
    proc = subprocess.Popen([sys.executable, "-m", "runtime.child", str(spec)])
    factory = SocketFactory()
    yield ctx, proc, factory
    factory.close()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.wait(30)


async def test_prefetcher_fills_shared_memory_then_killed_falls_back(tmp_path, prefetcher):
    ctx, proc, factory = prefetcher
    nvme = tmp_path / "nvme"
    sets = {"teacher:a": weights(1), "teacher:b": weights(2)}
    for tag, sd in sets.items():  # on NVMe only
        lay = FlatLayout.from_state_dict(sd)
        buf = torch.zeros(lay.total_bytes, dtype=torch.uint8)
        pack(sd, buf, lay)
        NvmeStore(nvme, PAGE_BYTES).write(tag, buf, lay)
    one = FlatLayout.from_state_dict(sets["teacher:a"]).total_bytes
    client = RpcClient(factory, ctx.endpoints.rpc, "trainer", timeout_s=10)
    loop = asyncio.get_running_loop()
    mem = WeightMemory(gpu_slots=1, slot_bytes=one, host_budget_bytes=2 * one,
                       nvme_dir=str(nvme), chunk_bytes=PAGE_BYTES)
    mem.remote_read = RemoteReader(client, loop, mem.arena, str(nvme), timeout_s=3.0)
    try:
        await client.handshake(30)
        for tag, sd in sets.items():
            mem.register(tag, FlatLayout.from_state_dict(sd))
        await asyncio.wrap_future(mem.prefetch("teacher:a", "host"))  # read by the other process
        assert mem.counters["sync_fallbacks"] == 0
        assert all(torch.equal(mem.host_tensors("teacher:a")[k], v)
                   for k, v in sets["teacher:a"].items())
        os.kill(proc.pid, signal.SIGKILL)  # the prefetcher dies: the next read falls back
        proc.wait(10)
        await asyncio.wrap_future(mem.prefetch("teacher:b", "host"))
        assert mem.counters["sync_fallbacks"] == 1
        assert all(torch.equal(mem.host_tensors("teacher:b")[k], v)
                   for k, v in sets["teacher:b"].items())
    finally:
        await client.close()
        mem.close()


async def test_prefetcher_reports_a_bad_chunk_as_the_checksum_error(tmp_path, prefetcher):
    ctx, _, factory = prefetcher
    sd = weights(3)
    lay = FlatLayout.from_state_dict(sd)
    nvme = tmp_path / "nvme"
    buf = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    pack(sd, buf, lay)
    NvmeStore(nvme, PAGE_BYTES).write("teacher:t", buf, lay)
    with open(NvmeStore(nvme).data_path("teacher:t"), "r+b") as f:
        f.seek(2 * PAGE_BYTES + 1)
        f.write(b"\x00\x01\x02")
    client = RpcClient(factory, ctx.endpoints.rpc, "trainer", timeout_s=10)
    mem = WeightMemory(gpu_slots=1, slot_bytes=lay.total_bytes,
                       host_budget_bytes=2 * lay.total_bytes, nvme_dir=str(nvme),
                       chunk_bytes=PAGE_BYTES)
    try:
        await client.handshake(30)
        region = mem.arena.alloc("teacher:t", lay.total_bytes)
        reader = RemoteReader(client, asyncio.get_running_loop(), mem.arena, str(nvme))
        with pytest.raises(ChecksumError, match=f"'teacher:t': NVMe chunk at byte offset "
                                                f"{2 * PAGE_BYTES} \\({PAGE_BYTES} bytes\\)"):
            await asyncio.wrap_future(reader("teacher:t", region))
    finally:
        await client.close()
        mem.close()
