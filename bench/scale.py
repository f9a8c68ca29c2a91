"""Scale simulation: 1,000 rollout workers against one buffer, the metrics proxy and the router.

`python -m bench.scale [--workers 1000] [--procs 4] [--duration-s 20] [--episodes 10000]`

Part 1, the control plane (tcp:// on 127.0.0.1, as between hosts; CURVE on with `--curve`):
- one real buffer actor process (`python -m runtime.child`, actors/buffer.py, journal on);
- `--workers` simulated rollout workers, spread over `--procs` processes (rollout shards) as
  asyncio tasks, each its own ZMQ peer: a PUSH into the buffer's inbox for SampleGroups of
  realistic size (group of 8, prompts of 64-256 tokens, responses of 64-512 with log-probs and
  loss masks) and a metrics publisher (so the proxy has `--workers` publishers). Each shard asks
  the buffer for its batches' permits (RolloutPermit, as the rollout actor does) and hands the
  256 groups of a batch to its workers; a worker "generates" for a random 0.5-1.5 s per group
  (`--episode-s`) with the newest weight version its shard heard of, then sends it;
- a trainer stand-in here: GetBatch (timed: its p50/p99 latency), then VersionUpdate at once, as
  fast as the buffer hands out batches (256 groups = 2,048 samples, staleness 2);
- the launcher's metrics proxy here, with a subscriber counting records and gaps.
Then a metrics burst: every publisher sends `--burst` records back to back; records/s through the
proxy, what publishers dropped (XPUB queue full) and what the subscriber missed.

Part 2, the data plane: sglang-router (the real one, as actors/router.py starts it) in front of a
stub worker (SGLang's /generate shape, answering after `--stub-latency-s`), and `--episodes`
concurrent episodes (two turns each, sticky by X-SMG-Routing-Key) from one client process.

Reported: buffer throughput (groups/s received and trained), GetBatch p50/p99, buffer and
router RSS, metrics records/s and dropped counts, episodes/s and turn latency through the router.
Last line: RESULT workers=... groups_per_s=... getbatch_p99_ms=... buffer_rss_mib=...
metrics_dropped=... (and the router's numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import zmq

from actors.router import RouterConfig, router_command
from engine.client import wait_for_health
from transport.metrics import MetricsProxy, MetricsPublisher, MetricsSubscriber
from transport.rpc import DeadlineExceeded, RpcClient
from transport.schema import (
    GetBatch,
    Permit,
    RolloutPermit,
    Sample,
    SampleGroup,
    StatsRequest,
    TrainBatch,
    VersionUpdate,
)
from transport.sockets import Security, SocketFactory, free_port, make_curve_keys
from transport.streams import StreamSender

GROUP_SIZE = 8
GROUPS_PER_BATCH = 256  # 2,048 samples a step: 1,000 workers keep (staleness + 1) batches going
MAX_STALENESS = 2


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (1,000 peers and 10,000 connections need it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def rss_mib(pid: int, tree: bool = False) -> float:
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)] if tree else [p]
        return sum(x.memory_info().rss for x in procs) / 2**20
    except psutil.NoSuchProcess:
        return float("nan")


# ----------------------------------------------------------------------------- workers
def make_group(rng: random.Random, gid: str, version: int) -> SampleGroup:
    """One realistic GRPO group: 8 samples of one prompt, responses with log-probs."""
    prompt = [rng.randrange(32000) for _ in range(rng.randint(64, 256))]
    samples = []
    for i in range(GROUP_SIZE):
        n = rng.randint(64, 512)
        samples.append(Sample(group_id=gid, index=i, domain="math", prompt_ids=prompt,
                              response_ids=[rng.randrange(32000) for _ in range(n)],
                              loss_mask=[1] * n,
                              rollout_logprobs=[-rng.random() * 3 for _ in range(n)],
                              reward=float(rng.random() < 0.5), weight_version=version))
    return SampleGroup(samples=samples)


async def run_workers(args: argparse.Namespace) -> None:
    """One worker process: a rollout shard. Its coordinator asks the buffer for the permits of
    this shard's batches (b = index, index + procs, ...), one batch after another as a rollout
    actor does, and hands each batch's groups to `count` workers (asyncio tasks, each its own
    ZMQ peer of the buffer's inbox and of the metrics proxy); it asks for the next permit once
    every group of the current batch has started. Prints a JSON summary."""
    security = Security(curve=True, keys_dir=args.keys_dir) if args.keys_dir else Security()
    factory = SocketFactory(security=security)
    ep = json.loads(args.endpoints)
    rng = random.Random(args.index)
    templates = [make_group(rng, "t", 0) for _ in range(8)]  # payloads reused with new ids
    stop_at = time.monotonic() + args.duration_s
    stats = collections.Counter()
    publishers: list[MetricsPublisher] = []
    jobs: asyncio.Queue = asyncio.Queue(maxsize=1)  # group ids of permitted batches
    # the newest trainer version this shard heard of (permits carry it): the weights a worker
    # generates with, as the trainer pushes every version to every worker
    served = [0]
    all_ready = asyncio.Event()

    async def coordinator() -> None:
        client = RpcClient(factory, ep["rpc"], f"rollout{args.index}", timeout_s=60.0)
        try:
            await client.handshake(timeout_s=120.0)
            await all_ready.wait()
            batch = args.index
            while time.monotonic() < stop_at:
                try:
                    permit = await client.call(RolloutPermit(batch_index=batch),
                                               max(0.1, stop_at - time.monotonic()))
                except DeadlineExceeded:
                    break
                assert isinstance(permit, Permit)
                stats["permits"] += 1
                served[0] = max(served[0], permit.trainer_version)
                for g in range(GROUPS_PER_BATCH):
                    await jobs.put(f"b{batch}-g{g}")
                batch += args.procs
        finally:
            await client.close()

    async def worker(w: int) -> None:
        name = f"w{args.index}-{w}"
        sender = StreamSender(factory, ep["inbox"], hwm=4)
        pub = MetricsPublisher(factory, ep["metrics_in"], name)
        publishers.append(pub)
        wrng = random.Random(f"{args.index}-{w}")
        try:
            await pub.wait_subscribed(60.0)
            stats["ready"] += 1
            if stats["ready"] == args.count:
                all_ready.set()
                print(json.dumps({"ready": args.count}), flush=True)
            while time.monotonic() < stop_at:
                try:
                    async with asyncio.timeout(max(0.1, stop_at - time.monotonic())):
                        gid = await jobs.get()
                except TimeoutError:
                    break
                version = served[0]
                await asyncio.sleep(wrng.uniform(0.5, 1.5) * args.episode_s)
                tpl = templates[wrng.randrange(len(templates))]
                group = SampleGroup(samples=[
                    Sample(group_id=gid, index=s.index, domain=s.domain, prompt_ids=s.prompt_ids,
                           response_ids=s.response_ids, loss_mask=s.loss_mask,
                           rollout_logprobs=s.rollout_logprobs, reward=s.reward,
                           weight_version=version) for s in tpl.samples])
                await sender.send(group, timeout_s=60.0)
                stats["groups"] += 1
                pub.publish({"rollout/groups": stats["groups"]}, step=stats["groups"])
        finally:
            sender.close()

    coordinating = asyncio.ensure_future(coordinator())
    tasks = [asyncio.ensure_future(worker(w)) for w in range(args.count)]
    await asyncio.gather(*tasks)
    coordinating.cancel()
    await asyncio.gather(coordinating, return_exceptions=True)
    # the burst: every publisher sends `burst` records back to back, then waits a moment
    burst_started = time.monotonic()
    for i in range(args.burst):
        for pub in publishers:
            pub.publish({"burst": float(i)}, step=i)
        if i % 10 == 9:
            await asyncio.sleep(0)  # let the zmq io thread drain
    sent = len(publishers) * args.burst
    dropped = sum(p.dropped for p in publishers)
    burst_s = time.monotonic() - burst_started
    await asyncio.sleep(3.0)  # queued records leave before the sockets close
    for pub in publishers:
        pub.close()
    factory.close()
    print(json.dumps({"groups": stats["groups"], "ready": stats["ready"],
                      "burst_sent": sent, "burst_dropped": dropped, "burst_s": burst_s}),
          flush=True)


# ----------------------------------------------------------------------------- the buffer
def start_buffer(work: Path, security: Security, proxy_in: str) -> tuple[subprocess.Popen, dict]:
    shutil.rmtree(work / "buffer", ignore_errors=True)  # no journal of an earlier run
    port = free_port("127.0.0.1")
    eps = {"control": f"tcp://127.0.0.1:{free_port('127.0.0.1')}",
           "rpc": f"tcp://127.0.0.1:{port}", "inbox": f"tcp://127.0.0.1:{free_port('127.0.0.1')}"}
    spec = {"cls": "actors.buffer:BufferActor",
            "config": {"group_size": GROUP_SIZE, "groups_per_batch": GROUPS_PER_BATCH,
                       "max_staleness": MAX_STALENESS, "max_pending_groups": 4096},
            "context": {"name": "buffer", "endpoints": eps, "metrics": proxy_in,
                        "security": {"curve": bool(security.curve),
                                     "keys_dir": security.keys_dir},
                        "run_dir": str(work), "start_timeout_s": 60.0}}
    (work / "buffer.json").write_text(json.dumps(spec))
    log = open(work / "buffer.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([sys.executable, "-m", "runtime.child", str(work / "buffer.json")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, eps


async def trainer(client: RpcClient, epoch: str, stop_at: float,
                  latencies: list[float], trained: collections.Counter) -> None:
    """GetBatch, timed, then VersionUpdate: one optimizer step per batch, no compute."""
    try:
        step = 0
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            try:
                batch = await client.call(GetBatch(step=step, trainer_version=step,
                                                   trainer_epoch=epoch),
                                          max(0.1, stop_at - time.monotonic()))
            except DeadlineExceeded:
                break
            latencies.append(time.perf_counter() - t0)
            assert isinstance(batch, TrainBatch)
            trained["samples"] += len(batch.samples)
            trained["groups"] += len(batch.samples) // GROUP_SIZE
            step += 1
            await client.call(VersionUpdate(version=step, step=step, trainer_epoch=epoch))
        trained["steps"] = step
    finally:
        await client.close()


async def count_metrics(sub: MetricsSubscriber, seen: collections.Counter,
                        times: dict[str, float]) -> None:
    while True:
        m = await sub.recv()
        seen["records"] += 1
        if "burst" in m.values:
            seen["burst"] += 1
            times.setdefault("burst_first", time.monotonic())
            times["burst_last"] = time.monotonic()


async def control_plane(args: argparse.Namespace, work: Path) -> dict:
    security = Security()
    if args.curve:
        make_curve_keys(work / "keys")
        security = Security(curve=True, keys_dir=str(work / "keys"))
    factory = SocketFactory(security=security)
    proxy = MetricsProxy(factory, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    sub = MetricsSubscriber(factory, proxy.backend)
    seen: collections.Counter = collections.Counter()
    times: dict[str, float] = {}
    counting = asyncio.ensure_future(count_metrics(sub, seen, times))
    buffer, eps = start_buffer(work, security, proxy.frontend)
    out: dict = {}
    procs: list[subprocess.Popen] = []
    try:
        ready = RpcClient(factory, eps["rpc"], "probe")
        await ready.handshake(timeout_s=90.0)  # the rpc socket is bound once it started
        await ready.close()
        probe = RpcClient(factory, eps["control"], "probe")
        await probe.handshake(timeout_s=30.0)
        per = [args.workers // args.procs + (i < args.workers % args.procs)
               for i in range(args.procs)]
        started = time.monotonic()
        for i, count in enumerate(per):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.scale", "--role", "workers", "--index", str(i),
                 "--count", str(count), "--procs", str(args.procs),
                 "--duration-s", str(args.duration_s + 15), "--episode-s", str(args.episode_s),
                 "--burst", str(args.burst), "--endpoints",
                 json.dumps({**eps, "metrics_in": proxy.frontend}),
                 "--keys-dir", security.keys_dir if security.curve else ""],
                stdout=subprocess.PIPE, text=True))
        # every worker connected (handshake with the buffer, subscription of its publisher)
        for p in procs:
            line = await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), 120)
            if "ready" not in line:
                raise RuntimeError(f"a worker process did not get ready: {line!r}")
        connect_s = time.monotonic() - started
        # the trainer announces version 0 (permits wait for it); measure from the first batch
        train = RpcClient(factory, eps["rpc"], "trainer", timeout_s=60.0)
        await train.handshake(timeout_s=60.0)
        epoch = uuid.uuid4().hex
        await train.call(VersionUpdate(version=0, step=0, trainer_epoch=epoch))
        before = await stats_of(probe)
        latencies: list[float] = []
        trained: collections.Counter = collections.Counter()
        cpu0 = sum(psutil.Process(buffer.pid).cpu_times()[:2])
        t0 = time.monotonic()
        await trainer(train, epoch, t0 + args.duration_s, latencies, trained)
        measured_s = time.monotonic() - t0
        buffer_cpu_s = sum(psutil.Process(buffer.pid).cpu_times()[:2]) - cpu0
        after = await stats_of(probe)
        buffer_rss = rss_mib(buffer.pid)
        received = after.get("inbox.received", 0) - before.get("inbox.received", 0)
        records_before_burst = seen["records"]
        results = []
        for p in procs:
            text, _ = await asyncio.to_thread(p.communicate, timeout=args.duration_s + 120)
            results.append(json.loads(text.strip().splitlines()[-1]))
        await asyncio.sleep(1.0)
        await probe.close()
        burst_sent = sum(r["burst_sent"] for r in results)
        burst_dropped = sum(r["burst_dropped"] for r in results)
        burst_span = max(times.get("burst_last", 0) - times.get("burst_first", 0), 1e-9)
        out = {"workers": args.workers, "ready_workers": sum(r["ready"] for r in results),
               "connect_s": connect_s, "measured_s": measured_s,
               "received_groups_per_s": received / measured_s,
               "groups_per_s": trained["groups"] / measured_s, "steps": trained["steps"],
               "buffer_cpu_share": buffer_cpu_s / measured_s,
               # the buffer's CPU per group received (decode, checks, journal, batching and
               # the share of GetBatch replies: one 2,048-sample batch every 256 groups)
               "buffer_cpu_ms_per_group": buffer_cpu_s / max(received, 1) * 1e3,
               "getbatch_p50_ms": percentile(latencies, 0.5) * 1e3,
               "getbatch_p99_ms": percentile(latencies, 0.99) * 1e3,
               "buffer_rss_mib": buffer_rss,
               "buffer_counters": {k: v for k, v in after.items() if k.startswith("buffer.")},
               "metrics_records_run": records_before_burst,
               "metrics_records_per_s_run": records_before_burst / (time.monotonic() - started),
               "burst_sent": burst_sent, "burst_received": seen["burst"],
               "burst_records_per_s": seen["burst"] / burst_span,
               "metrics_dropped": burst_dropped,
               "metrics_missed": burst_sent - burst_dropped - seen["burst"],
               "subscriber_gaps": sum(sub.gaps.values())}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()
        buffer.send_signal(signal.SIGTERM)
        try:
            buffer.wait(20)
        except subprocess.TimeoutExpired:
            buffer.kill()
            buffer.wait()
        counting.cancel()
        await asyncio.gather(counting, return_exceptions=True)
        sub.close()
        proxy.close()
        factory.close()
    return out


async def stats_of(control: RpcClient) -> dict[str, int]:
    """The buffer's counters (StatsRequest on its control socket)."""
    reply = await control.call(StatsRequest(), 30.0)
    return dict(reply.counters)


# ----------------------------------------------------------------------------- the router
STUB_REPLY = {"text": " 42", "output_ids": [19, 17], "meta_info": {
    "id": "", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 8,
    "completion_tokens": 2, "cached_tokens": 0, "weight_version": "0",
    "output_token_logprobs": [[-0.5, 19, None], [-0.7, 17, None]]}}


async def run_stub(args: argparse.Namespace) -> None:
    """A stand-in SGLang worker: /health, /get_model_info, /get_server_info and /generate (after
    `stub_latency_s`), enough for sglang-router to route to it."""
    import logging

    from aiohttp import web

    # the router probes for gRPC first (an HTTP/2 preface); aiohttp refuses it, which is fine
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    counts = collections.Counter()

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        counts["generate"] += 1
        await asyncio.sleep(args.stub_latency_s)
        return web.json_response(STUB_REPLY)

    async def ok(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"is_generation": True, "weight_version": "0",
                                  "max_running_requests": 100000})

    app = web.Application()
    app.router.add_post("/generate", generate)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, ok)
    for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
        app.router.add_get(path, info)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port, backlog=16384).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def run_client(args: argparse.Namespace) -> None:
    """`episodes` concurrent episodes of `turns` /generate calls each, sticky per episode."""
    import aiohttp

    latencies: list[float] = []
    errors = collections.Counter()
    body = {"input_ids": list(range(8)), "sampling_params": {"max_new_tokens": 2},
            "return_logprob": True}
    gate = asyncio.Event()

    async def episode(session: aiohttp.ClientSession, i: int) -> None:
        await gate.wait()
        for _ in range(args.turns):
            t0 = time.perf_counter()
            try:
                async with session.post(f"{args.url}/generate", json=body,
                                        headers={"X-SMG-Routing-Key": f"ep-{i}"}) as r:
                    await r.read()
                    if r.status != 200:
                        errors[f"http_{r.status}"] += 1
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                errors[type(e).__name__] += 1
                return
            latencies.append(time.perf_counter() - t0)

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.ensure_future(episode(session, i)) for i in range(args.episodes)]
        await asyncio.sleep(0)
        t0 = time.monotonic()
        gate.set()
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
    print(json.dumps({"turns_ok": len(latencies), "errors": dict(errors), "wall_s": wall,
                      "p50_ms": percentile(latencies, 0.5) * 1e3,
                      "p99_ms": percentile(latencies, 0.99) * 1e3}), flush=True)


async def until_routed(url: str, timeout_s: float) -> None:
    """Wait until a /generate through the router is answered by the stub."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.post(f"{url}/generate", json={"input_ids": [1]}) as r:
                await r.read()
                if r.status == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the router did not route to the stub worker within {timeout_s:g} s")


async def data_plane(args: argparse.Namespace, work: Path) -> dict:
    stub_port, router_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    stub = subprocess.Popen([sys.executable, "-m", "bench.scale", "--role", "stub", "--port",
                             str(stub_port), "--stub-latency-s", str(args.stub_latency_s)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    log = open(work / "router.log", "wb")  # noqa: SIM115 - closed with the process
    options: dict = {"log_level": "warn"}
    if args.router_no_breaker:  # a burst of connections to one worker overflows its accept
        # queue; the failed connects (retried by the router) must not take the worker out
        options["disable_circuit_breaker"] = True
    cfg = RouterConfig(policy="consistent_hashing", router=options)
    router = subprocess.Popen(router_command(cfg, [f"http://127.0.0.1:{stub_port}"],
                                             router_port),
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    peak = [0.0]
    try:
        assert stub.stdout is not None and stub.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{router_port}"
        if not await wait_for_health(url, lambda: None if router.poll() is None else
                                     f"router exited {router.returncode}", 60.0):
            raise RuntimeError("sglang-router did not become healthy")
        await until_routed(url, 60.0)  # it registers its workers after /health answers
        idle_rss = rss_mib(router.pid, tree=True)

        async def sample_rss() -> None:
            while True:
                peak[0] = max(peak[0], rss_mib(router.pid, tree=True))
                await asyncio.sleep(0.2)

        sampler = asyncio.ensure_future(sample_rss())
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.scale", "--role", "client", "--url", url,
            "--episodes", str(args.episodes), "--turns", str(args.turns),
            stdout=asyncio.subprocess.PIPE)
        text, _ = await client.communicate()
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        result = json.loads(text.decode().strip().splitlines()[-1])
        return {"episodes": args.episodes, "turns": args.turns,
                "router_circuit_breaker": not args.router_no_breaker, **result,
                "episodes_per_s": args.episodes / result["wall_s"],
                "router_rss_idle_mib": idle_rss, "router_rss_peak_mib": peak[0]}
    finally:
        for p in (router, stub):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if stub.stdout:
            stub.stdout.close()


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--procs", type=int, default=4, help="processes the workers are spread over")
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--episode-s", type=float, default=1.0, help="mean generation time a group")
    p.add_argument("--burst", type=int, default=50, help="metrics records per publisher")
    p.add_argument("--curve", action="store_true", help="CURVE on every socket")
    p.add_argument("--episodes", type=int, default=10000)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--stub-latency-s", type=float, default=1.0)
    p.add_argument("--router-no-breaker", type=int, default=1,
                   help="1: sglang-router with disable_circuit_breaker (0: its default breaker)")
    p.add_argument("--skip-router", action="store_true")
    p.add_argument("--skip-buffer", action="store_true")
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep its logs")
    # internal roles (the bench's own subprocesses)
    p.add_argument("--role", default="main", choices=["main", "workers", "stub", "client"],
                   help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--endpoints", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--keys-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    raise_fd_limit()
    if args.role == "workers":
        asyncio.run(run_workers(args))
        return 0
    if args.role == "stub":
        asyncio.run(run_stub(args))
        return 0
    if args.role == "client":
        asyncio.run(run_client(args))
        return 0
    limit = raise_fd_limit()
    print(f"fd limit {limit}; {os.cpu_count()} CPUs; pyzmq {zmq.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlx-scale-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        control: dict = {}
        data: dict = {}
        if not args.skip_buffer:
            control = asyncio.run(control_plane(args, work))
            print("control plane: " + json.dumps(control, indent=1), flush=True)
        if not args.skip_router:
            data = asyncio.run(data_plane(args, work))
            print("data plane: " + json.dumps(data, indent=1), flush=True)
    parts = []
    if control:
        parts += [f"workers={control['workers']}", f"groups_per_s={control['groups_per_s']:.0f}",
                  f"received_groups_per_s={control['received_groups_per_s']:.0f}",
                  f"getbatch_p99_ms={control['getbatch_p99_ms']:.1f}",
                  f"buffer_rss_mib={control['buffer_rss_mib']:.0f}",
                  f"buffer_cpu_ms_per_group={control['buffer_cpu_ms_per_group']:.2f}",
                  f"metrics_records_per_s={control['burst_records_per_s']:.0f}",
                  f"metrics_dropped={control['metrics_dropped']}",
                  f"metrics_missed={control['metrics_missed']}"]
    if data:
        parts += [f"episodes={data['episodes']}", f"router_turns_ok={data['turns_ok']}",
                  f"router_errors={sum(data['errors'].values())}",
                  f"router_p99_ms={data['p99_ms']:.0f}",
                  f"router_rss_mib={data['router_rss_peak_mib']:.0f}"]
    print("RESULT " + " ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
