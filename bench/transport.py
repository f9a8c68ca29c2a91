"""Transport benchmark: this project's ZeroMQ transport vs Ray actor calls, side by side.

Measures, in one run, between two processes on one host (server in a subprocess):
- 1 KB request/reply round trips per second with 1 and with 64 calls in flight;
- tensor throughput for 4 MiB and 256 MiB tensors sent as a request whose handler reads the
  received tensor and answers with a small reply (the same work bench/ray_baseline.py gives Ray),
  through the shared-memory fast path (the default on ipc://) and through plain zmq frames;
- a single-process memcpy of 256 MiB into a preallocated buffer, the reference for the
  256 MiB ratio.
Usage: `python -m bench.transport [--duration-s 3]`. Ray is optional (`pip install ray`).
Final line: RESULT rpc_per_s=... rpc_vs_ray=... tensor_4m_gbps=... tensor_vs_ray=...
tensor_256m_vs_memcpy=...
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from transport.rpc import RpcClient, RpcServer
from transport.schema import Msg, Tensor, register_messages
from transport.shm import ShmConfig
from transport.sockets import SocketFactory


class Blob(Msg):
    """A named bag of tensors and bytes: what this benchmark sends (tests use it too)."""

    tensors: dict[str, Tensor] = {}
    arrays: dict[str, np.ndarray] = {}
    payload: bytes = b""


register_messages(Blob)

SIZES = {"4m": 4 << 20, "256m": 256 << 20}


async def serve(endpoint: str, shm: bool) -> None:
    factory = SocketFactory()

    def handle(msg: Blob) -> Blob:
        if msg.tensors:  # read the data that arrived, reply small
            t = next(iter(msg.tensors.values()))
            return Blob(payload=bytes([int(t[-1])]))
        return Blob(payload=msg.payload)

    server = RpcServer(factory, endpoint, "bench-server", {Blob: handle},
                       collections.Counter(), shm=ShmConfig(enabled=shm))
    print("ready", flush=True)
    await server.serve()


async def rpc_rate(client: RpcClient, duration_s: float, in_flight: int) -> float:
    payload = os.urandom(1024)
    count = 0
    deadline = time.perf_counter() + duration_s

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            reply = await client.call(Blob(payload=payload))
            assert reply.payload == payload
            count += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return count / (time.perf_counter() - t0)


async def tensor_gbps(client: RpcClient, nbytes: int, duration_s: float) -> float:
    t = torch.full((nbytes,), 7, dtype=torch.uint8)
    await client.call(Blob(tensors={"x": t}), timeout_s=60)  # warm-up (maps segments)
    calls, t0 = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - t0 < duration_s:
        reply = await client.call(Blob(tensors={"x": t}), timeout_s=60)
        assert reply.payload == b"\x07"
        calls += 1
    return calls * nbytes / (time.perf_counter() - t0) / 1e9


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    src = torch.full((nbytes,), 3, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


async def measure_ours(duration_s: float, shm: bool) -> dict:
    sock_dir = tempfile.mkdtemp(prefix="rlx-bench-")
    endpoint = f"ipc://{sock_dir}/server"
    server = subprocess.Popen([sys.executable, "-m", "bench.transport", "--serve", endpoint]
                              + ([] if shm else ["--no-shm"]), stdout=subprocess.PIPE, text=True)
    factory = SocketFactory()
    try:
        assert server.stdout.readline().strip() == "ready"
        client = RpcClient(factory, endpoint, "bench-client", shm=ShmConfig(enabled=shm))
        await client.handshake(timeout_s=30)
        out = {}
        if shm:
            out["rpc_per_s_1"] = await rpc_rate(client, duration_s, 1)
            out["rpc_per_s_64"] = await rpc_rate(client, duration_s, 64)
        for key, nbytes in SIZES.items():
            out[f"tensor_{key}_gbps"] = await tensor_gbps(client, nbytes, duration_s)
        await client.close()
        return out
    finally:
        server.terminate()
        server.wait()
        factory.close()
        os.rmdir(sock_dir) if not os.listdir(sock_dir) else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration-s", type=float, default=3.0)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--no-shm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    if args.serve:
        run(serve(args.serve, not args.no_shm))
        return
    ours = run(measure_ours(args.duration_s, shm=True))
    frames = run(measure_ours(args.duration_s, shm=False))
    memcpy = memcpy_gbps(SIZES["256m"])
    from bench.ray_baseline import measure_ray

    ray = measure_ray(args.duration_s, tuple(SIZES.values()))
    print(f"{'':28}{'this transport':>16}{'zmq frames only':>17}{'ray':>10}")
    print(f"{'1 KB rpc/s, 1 in flight':28}{ours['rpc_per_s_1']:16.0f}{'':>17}"
          f"{ray['rpc_per_s_1'] if ray else float('nan'):10.0f}")
    print(f"{'1 KB rpc/s, 64 in flight':28}{ours['rpc_per_s_64']:16.0f}{'':>17}"
          f"{ray['rpc_per_s_64'] if ray else float('nan'):10.0f}")
    for key, nbytes in SIZES.items():
        r = ray["tensor_gbps"][nbytes] if ray else float("nan")
        print(f"{key.upper() + 'iB tensor GB/s':28}{ours[f'tensor_{key}_gbps']:16.2f}"
              f"{frames[f'tensor_{key}_gbps']:17.2f}{r:10.2f}")
    print(f"{'256 MiB memcpy GB/s':28}{memcpy:16.2f}")
    if ray is None:
        print("ray is not installed (pip install ray): ratios to ray are nan")
    nan = float("nan")
    print("RESULT "
          f"rpc_per_s={ours['rpc_per_s_1']:.0f} "
          f"rpc64_per_s={ours['rpc_per_s_64']:.0f} "
          f"rpc_vs_ray={ours['rpc_per_s_1'] / ray['rpc_per_s_1'] if ray else nan:.2f} "
          f"rpc64_vs_ray={ours['rpc_per_s_64'] / ray['rpc_per_s_64'] if ray else nan:.2f} "
          f"tensor_4m_gbps={ours['tensor_4m_gbps']:.2f} "
          f"tensor_vs_ray={ours['tensor_4m_gbps'] / ray['tensor_gbps'][SIZES['4m']] if ray else nan:.2f} "
          f"tensor_256m_gbps={ours['tensor_256m_gbps']:.2f} "
          f"tensor_256m_vs_memcpy={ours['tensor_256m_gbps'] / memcpy:.2f}")


if __name__ == "__main__":
    main()
