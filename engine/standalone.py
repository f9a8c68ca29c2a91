"""`python -m engine.standalone --model-path M [--host H] [--port P] [--device D] [--dtype T]`: the
embedded engine as a standalone server process, outside any actor.

Role: the embedded counterpart of `python -m sglang.launch_server` (same names for the options
they share), for benchmarks and for tests that need a worker in its own process (a
torch.distributed group joins once per process). Invariant: it prints `serving <model> on
http://<host>:<port>` once the HTTP server answers, and on SIGTERM/SIGINT closes the server,
leaves every weight-update group, and stops the engine thread before exiting 0.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Callable

from engine.scheduler import Scheduler
from engine.server import EngineServer, start_server
from transport.dtypes import model_dtype
from transport.http import stop_http


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.standalone", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="HF checkpoint dir or tiny model name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 = any free port (printed)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda:1")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--batch-wait-ms", type=float, default=1.0)
    p.add_argument("--weights-cpu-backup", action=argparse.BooleanOptionalAction, default=True,
                   help="released weights keep a pinned host copy (engine/scheduler.py)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="a mixture-of-experts model returns the experts each token was routed "
                        "to when a request asks (return_routed_experts); refused for a dense "
                        "model")
    return p


async def serve(args: argparse.Namespace,
                add_routes: Callable[[EngineServer], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT; `add_routes` may add routes before the server starts."""
    scheduler = await Scheduler.create(args.model_path, device=args.device,
                                       dtype=model_dtype(args.dtype), seed=args.seed,
                                       max_batch_size=args.max_batch_size,
                                       batch_wait_ms=args.batch_wait_ms,
                                       weights_backup=getattr(args, "weights_cpu_backup", True),
                                       routed_experts=bool(getattr(
                                           args, "enable_return_routed_experts", False)))
    loop_task = asyncio.ensure_future(scheduler.run())
    server = EngineServer(scheduler, {"model_path": args.model_path, "host": args.host,
                                      "device": args.device, "dtype": args.dtype,
                                      "tp_size": 1, "dp_size": 1})
    if add_routes is not None:
        add_routes(server)
    runner = None
    try:
        runner, port = await start_server(server, args.host, args.port)
        server.info["port"] = port
        print(f"serving {args.model_path} on http://{args.host}:{port}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if runner is not None:
            await stop_http(runner)
        await server.weights.close()
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
        await scheduler.close()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(parser().parse_args(argv)))


if __name__ == "__main__":
    main()
