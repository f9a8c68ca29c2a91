"""Ray actor-call baseline for the transport benchmark.

This module measures how fast Ray moves requests and tensors between two
processes on one host: the driver (this process) calls methods of a Ray actor
that lives in its own worker process.  It reports small-message round trips
per second with 1 and with 64 calls in flight, and the throughput of sending a
large numpy array to the actor for a few sizes.  These numbers are the
reference point that bench/transport.py compares our ZeroMQ transport against
in the same run, so both sides do the same work: a 1 KB request answered by a
1 KB reply, and an array that is transferred anew on every call (Ray puts it
into its shared-memory object store implicitly; no ObjectRef is reused) and
read on the receiving side before a small int comes back.  Ray is only a
benchmark dependency, so it is imported inside the functions and its absence
makes measure_ray() return None.
"""

import logging
import os
import time

RPC_PAYLOAD_BYTES = 1024
RPC_WINDOW = 64
MIN_TENSOR_CALLS = 3
OBJECT_STORE_BYTES = 1536 << 20  # room for a few 256 MiB arrays in flight


def _make_actor_class(ray):
    """Define the remote actor class once ray has been imported."""

    @ray.remote
    class Peer:
        def echo(self, payload: bytes) -> bytes:
            return payload

        def touch(self, arr) -> int:
            return int(arr[-1])

    return Peer


def _start_ray(ray) -> None:
    """Start a quiet local Ray instance sized for this benchmark."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
        object_store_memory=OBJECT_STORE_BYTES,
    )


def _rpc_rate_serial(ray, peer, duration_s: float) -> float:
    """Round trips per second with one 1 KB call in flight at a time."""
    payload = b"x" * RPC_PAYLOAD_BYTES
    ray.get(peer.echo.remote(payload))  # warm-up
    calls = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration_s:
        reply = ray.get(peer.echo.remote(payload))
        assert len(reply) == RPC_PAYLOAD_BYTES
        calls += 1
    return calls / (time.perf_counter() - start)


def _rpc_rate_windowed(ray, peer, duration_s: float, window: int) -> float:
    """Round trips per second keeping `window` 1 KB calls outstanding."""
    payload = b"x" * RPC_PAYLOAD_BYTES
    ray.get([peer.echo.remote(payload) for _ in range(window)])  # warm-up
    pending = [peer.echo.remote(payload) for _ in range(window)]
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration_s:
        ready, pending = ray.wait(pending, num_returns=1)
        # Also collect whatever else has finished, without blocking.
        more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
        ready += more
        for reply in ray.get(ready):
            assert len(reply) == RPC_PAYLOAD_BYTES
        done += len(ready)
        pending += [peer.echo.remote(payload) for _ in ready]
    elapsed = time.perf_counter() - start
    ray.get(pending)  # drain outside the timed window
    return done / elapsed


def _tensor_gbps(ray, peer, size_bytes: int, duration_s: float) -> float:
    """GB/s for sending a fresh copy of a uint8 array to the actor per call."""
    import numpy as np

    arr = np.full(size_bytes, 7, dtype=np.uint8)
    ray.get(peer.touch.remote(arr))  # warm-up
    calls = 0
    start = time.perf_counter()
    while calls < MIN_TENSOR_CALLS or time.perf_counter() - start < duration_s:
        # Passing the array itself makes Ray put a new object on every call.
        assert ray.get(peer.touch.remote(arr)) == 7
        calls += 1
    elapsed = time.perf_counter() - start
    return calls * size_bytes / elapsed / 1e9


def measure_ray(duration_s: float = 3.0, sizes_bytes=(4 << 20, 256 << 20)) -> dict | None:
    """Return None if ray is not importable. Otherwise a dict:
    {
      "rpc_per_s_1": float,    # 1 KB request/reply round trips per second, 1 call in flight
      "rpc_per_s_64": float,   # same with 64 calls in flight
      "tensor_gbps": {size_bytes: float, ...},  # GB/s (1e9 bytes/s) per array size
    }
    """
    try:
        import ray
    except ImportError:
        return None

    _start_ray(ray)
    try:
        peer = _make_actor_class(ray).remote()
        return {
            "rpc_per_s_1": _rpc_rate_serial(ray, peer, duration_s),
            "rpc_per_s_64": _rpc_rate_windowed(ray, peer, duration_s, RPC_WINDOW),
            "tensor_gbps": {
                size: _tensor_gbps(ray, peer, size, duration_s) for size in sizes_bytes
            },
        }
    finally:
        ray.shutdown()


if __name__ == "__main__":
    result = measure_ray()
    print(result)
    if result is None:
        print("RESULT ray unavailable")
    else:
        tensor = result["tensor_gbps"]
        print(
            f"RESULT ray_rpc_per_s_1={result['rpc_per_s_1']:.1f}"
            f" ray_rpc_per_s_64={result['rpc_per_s_64']:.1f}"
            f" ray_tensor_4m_gbps={tensor.get(4 << 20, float('nan')):.3f}"
            f" ray_tensor_256m_gbps={tensor.get(256 << 20, float('nan')):.3f}"
        )
