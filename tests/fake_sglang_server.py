"""A stand-in for `python -m sglang.launch_server` in tests (SGLang itself needs a GPU).

`install(folder)` writes a package `sglang` with a `launch_server` module into `folder`; with
`folder` first on PYTHONPATH, `python -m sglang.launch_server ARGS` runs `main()` here, which:
- parses ARGS with argparse the way SGLang's server does for the options declared below (an
  unknown option exits with code 2 and argparse's `error: unrecognized arguments: ...` line,
  exactly the failure a real SGLang gives for an option that does not exist);
- records its argv (then also the parsed options) as JSON in $FAKE_SGLANG_RECORD (when set);
- with `--fake-hang`, never answers (for health timeouts); otherwise serves the embedded engine
  (engine/server.py) for `--model-path` on `--host`/`--port`, plus `GET /test/weights` (the
  model's parameters as a safetensors blob) so tests compare weights bit for bit.
Its /generate answers are SGLang's in shape (the input log-prob window with null at its first
entry, finish reasons, meta_info keys: checked against tests/fixtures/sglang/ by
tests/test_sglang_conformance.py). One known difference: `weight_version` starts at "0" (the
engine's default) where SGLang reports "default" until its first weight update.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path


def install(folder: Path) -> Path:
    package = folder / "sglang"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(
        "from tests.fake_sglang_server import main\n\nif __name__ == '__main__':\n    main()\n")
    return folder


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch_server.py")
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--enable-torch-compile", action="store_true")
    p.add_argument("--cuda-graph-bs", type=int, nargs="+")
    p.add_argument("--json-model-override-args", type=str, default="{}")
    p.add_argument("--log-level", default="info")
    # LoRA serving (a LoRA student's workers): accepted; the engine takes adapters regardless
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-target-modules", nargs="+")
    p.add_argument("--max-loaded-loras", type=int)
    p.add_argument("--max-loras-per-batch", type=int)
    p.add_argument("--enable-return-routed-experts", action="store_true")  # MoE routes
    p.add_argument("--fake-hang", action="store_true")
    return p


def add_test_routes(server) -> None:
    """GET /test/weights: the model's parameters as one safetensors blob."""
    from aiohttp import web
    from safetensors.torch import save

    async def weights(request: web.Request) -> web.Response:
        state = {n: p.detach().contiguous()
                 for n, p in server.scheduler.model.named_parameters()}
        return web.Response(body=save(state), content_type="application/octet-stream")

    server.app.router.add_get("/test/weights", weights)


def main() -> None:
    record = os.environ.get("FAKE_SGLANG_RECORD")
    if record:  # argv first: argparse may exit on it
        Path(record).write_text(json.dumps({"argv": sys.argv[1:]}))
    args = parser().parse_args()
    if record:
        Path(record).write_text(json.dumps({"argv": sys.argv[1:], "parsed": vars(args)}))
    if args.fake_hang:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        print("loading the model (never finishes)", flush=True)
        signal.sigwait({signal.SIGTERM})
        return
    from engine.standalone import serve

    engine_args = argparse.Namespace(model_path=args.model_path, host=args.host, port=args.port,
                                     device="cpu", dtype="float32", seed=0, max_batch_size=64,
                                     batch_wait_ms=1.0,
                                     enable_return_routed_experts=args.enable_return_routed_experts)
    asyncio.run(serve(engine_args, add_test_routes))
