"""The trainer side of the process-group weight-sync tests, as its own process (like a trainer
actor): `python -m tests.weight_sync_trainer URL [URL ...] --pushes 5:5,6:6 --bucket-bytes N
[--devices "h/gpu1;h/gpu1" --own h/gpu0] [--timeout 60] [--retries 1] [--lose 6:1]`.

Forms the weight-update groups as rank 0 with engine.weight_sync.DistributedSync (gloo), the
workers declared on the GPUs `--devices` names (one `;`-separated entry per worker, `,` between
a worker's GPUs) and the trainer on `--own`. For each `version:seed` it pushes
`tests.test_weight_sync.trained(seed)`'s parameters and prints
`pushed <version> <buckets> groups=<n> reconnects=<n> took=<s> gap=<s>` (`gap`: the longest
the event loop went without running a 20 ms ticker during the push), then waits for a line on
stdin before the next push. `--lose V:W`: just before pushing version V, worker W's group is
destroyed on the worker (as when the worker restarted). Leaves the groups at the end. A failure
is printed as `error <message>` and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from engine.client import SglangClient
from engine.weight_sync import DistributedSync, buckets


async def ticker(gaps: list[float]) -> None:
    last = time.monotonic()
    while True:
        await asyncio.sleep(0.02)
        now = time.monotonic()
        gaps[0], last = max(gaps[0], now - last), now


async def main(args: argparse.Namespace) -> int:
    from tests.test_weight_sync import named, trained

    clients = [SglangClient(url, timeout_s=60) for url in args.urls]
    devices = [[d for d in w.split(",") if d] for w in args.devices.split(";")] \
        if args.devices else None
    sync = DistributedSync(clients, backend="gloo", bucket_bytes=args.bucket_bytes,
                           timeout_s=args.timeout, devices=devices,
                           own_devices=[args.own] if args.own else None, retries=args.retries)
    lose = dict(item.split(":") for item in args.lose.split(",")) if args.lose else {}
    try:
        await sync.connect()
        for item in args.pushes.split(","):
            version, seed = item.split(":")
            model, _ = trained(int(seed))
            if version in lose:
                worker = int(lose[version])
                group = next(g.name for g in sync.groups if worker in g.members)
                await clients[worker].destroy_weights_update_group(group)
            gaps = [0.0]
            tick = asyncio.ensure_future(ticker(gaps))
            t0 = time.monotonic()
            await sync.push(named(model), version)
            took = time.monotonic() - t0
            tick.cancel()
            print(f"pushed {version} {len(list(buckets(named(model), args.bucket_bytes)))} "
                  f"groups={len(sync.groups)} reconnects={sync.reconnects} took={took:.2f} "
                  f"gap={gaps[0]:.3f}", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(f"error {e}", flush=True)
        return 1
    finally:
        await sync.close()
        for c in clients:
            await c.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--pushes", required=True)
    parser.add_argument("--bucket-bytes", type=int, default=16 << 10)
    parser.add_argument("--devices", default="")
    parser.add_argument("--own", default="")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--retries", type=int, default=1)
    parser.add_argument("--lose", default="")
    sys.exit(asyncio.run(main(parser.parse_args())))
