"""The trainer side of the process-group weight-sync test, as its own process (like a trainer
actor): `python -m tests.weight_sync_trainer URL [URL ...] --pushes 5:5,6:6 --bucket-bytes N`.

Joins the weight-update group as rank 0 with engine.weight_sync.DistributedSync (gloo), then for
each `version:seed` pushes `tests.test_weight_sync.trained(seed)`'s parameters, prints
`pushed <version> <buckets>` and waits for a line on stdin before the next push; leaves the group
at the end. Any failure is printed as `error <message>` and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from engine.client import SglangClient
from engine.weight_sync import DistributedSync, buckets


async def main(args: argparse.Namespace) -> int:
    from tests.test_weight_sync import named, trained

    clients = [SglangClient(url, timeout_s=60) for url in args.urls]
    sync = DistributedSync(clients, backend="gloo", bucket_bytes=args.bucket_bytes, timeout_s=60)
    try:
        await sync.connect()
        for item in args.pushes.split(","):
            version, seed = item.split(":")
            model, _ = trained(int(seed))
            await sync.push(named(model), version)
            print(f"pushed {version} {len(list(buckets(named(model), args.bucket_bytes)))}",
                  flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(f"error {e!r}", flush=True)
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
    sys.exit(asyncio.run(main(parser.parse_args())))
