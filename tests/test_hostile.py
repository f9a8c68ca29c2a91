"""Hostile input against live actors and a live inference worker: no frame or body may crash them.

Covers the measured failures: (8) deeply nested frames raised RecursionError out of the codec's
untyped peek and killed the actor (or the launcher's supervisor socket); (9) a 16 MiB header of
empty maps blocked an actor for seconds and took GiBs, a huge JSON body blocked a worker, and
out-of-range or too deep JSON answered 500; (10) well-typed but wrong values (a sample index
outside the group, a trainer version far ahead) crashed or poisoned the buffer. Then a seeded,
bounded fuzz of the control and rpc sockets and of the HTTP API: every frame is answered with a
typed error or dropped and counted, and every bad body gets 400/413, never 500.
"""

from __future__ import annotations

import asyncio
import collections
import io
import json
import random
import time

import msgspec
import psutil
import pytest
import torch
import zmq

from actors.buffer import BufferActor
from examples.demo import Scale, Scaler
from logic.buffer import BufferConfig
from runtime.actor import Status
from runtime.facts import RunFacts
from tests.helpers import context, running
from tests.test_engine import PROMPT, serve
from transport.codec import Codec, Limits
from transport.rpc import RemoteError, RpcClient, RpcServer
from transport.schema import (
    PROTOCOL_VERSION,
    Ack,
    ErrorCode,
    ErrorReply,
    GetBatch,
    Hello,
    Kind,
    Ping,
    Pong,
    Sample,
    SampleGroup,
    StatsRequest,
    TrainBatch,
    VersionUpdate,
)
from transport.sockets import SocketFactory
from transport.streams import StreamSender

PAIRS = RunFacts(group_size=2, groups_per_batch=1)  # the run of the buffers here: groups of two
SMALL = Limits(max_frames=8, max_message_bytes=1 << 20, max_header_bytes=64 << 10, max_depth=16,
               max_container_len=4096, max_header_items=1 << 16)
enc = msgspec.msgpack.encode


@pytest.fixture
def factory():
    f = SocketFactory()
    yield f
    f.close()


def header(body: bytes, req_id: int, v: int = PROTOCOL_VERSION, kind: int = Kind.REQUEST) -> bytes:
    """A header frame around hand-made body bytes."""
    return b"\x94" + enc(v) + enc(int(kind)) + enc(req_id) + body


def with_field(type_name: str, field: str, value: bytes) -> bytes:
    """A body map {"type": type_name, field: <value bytes>}."""
    return b"\x82" + enc("type") + enc(type_name) + enc(field) + value


class Peer:
    """A bare DEALER sending raw frames, collecting every answer as a typed message."""

    def __init__(self, factory: SocketFactory, endpoint: str):
        self.sock = factory.connect(zmq.DEALER, endpoint)
        self.codec = Codec()
        self.answers: dict[int, object] = {}

    async def send(self, frames: list[bytes]) -> None:
        # copied: zero-copy sends of big frames would start pyzmq's gc thread (and its fds)
        await self.sock.send_multipart(frames, copy=True)

    async def drain_until(self, req_id: int, timeout_s: float = 10.0) -> object:
        """Collect answers until the one to `req_id` arrives; every answer must decode."""
        async with asyncio.timeout(timeout_s):
            while req_id not in self.answers:
                msg = self.codec.decode(await self.sock.recv_multipart(copy=False))
                assert msg.kind in (Kind.REPLY, Kind.ERROR)
                assert msg.kind == Kind.REPLY or isinstance(msg.body, ErrorReply)
                self.answers[msg.req_id] = msg.body
        return self.answers[req_id]

    def close(self) -> None:
        self.sock.close(linger=0)


def handled(counters: collections.Counter, prefix: str) -> int:
    """Frames a server accounted for: dispatched requests plus every kind of refusal."""
    return sum(v for k, v in counters.items()
               if k == f"{prefix}.requests" or k.startswith(f"{prefix}.refused_"))


async def probe(peer: Peer, req_id: int, msg=None) -> object:
    await peer.send(Codec().encode(Kind.REQUEST, req_id, msg or Ping(payload=b"alive")))
    return await peer.drain_until(req_id)


# ------------------------------------------------------------------------------------ failure 8
@pytest.mark.parametrize("socket", ["control", "rpc"])
async def test_deeply_nested_frame_does_not_kill_the_actor(ipc, factory, socket):
    actor = Scaler(context("scaler", ipc))
    async with running(actor):
        peer = Peer(factory, getattr(actor.bound, socket))
        try:
            frames = [b"\x91" * 2000 + b"\xc0", header(b"\x91" * 2000 + b"\xc0", 11),
                      header(with_field("Ping", "payload", b"\x91" * 100_000 + b"\xc0"), 12)]
            for frame in frames:
                await peer.send([frame])
            final = Hello(protocol=PROTOCOL_VERSION, actor="t") if socket == "rpc" else None
            assert not isinstance(await probe(peer, 99, final), ErrorReply)
            assert peer.answers[12].code == ErrorCode.TOO_LARGE  # attributable: answered
            assert "max_depth" in peer.answers[12].message
            assert handled(actor.counters, socket) == len(frames) + 1
            assert actor.status == Status.RUNNING
        finally:
            peer.close()


async def test_deeply_nested_frame_to_a_supervisor_socket(ipc, factory):
    """The launcher's supervisor socket is an RpcServer too: its serve task must survive."""
    counters: collections.Counter = collections.Counter()
    server = RpcServer(factory, ipc("sup"), "launcher", {Ping: lambda m: Pong(actor="l",
                                                                               status="ok")},
                       counters, Limits(), prefix="supervisor")
    task = asyncio.ensure_future(server.serve())
    peer = Peer(factory, server.sock.last_endpoint.decode())
    try:
        await peer.send([b"\x91" * 2000 + b"\xc0"])
        await peer.send([header(b"\x91" * 2000, 5)])
        assert isinstance(await probe(peer, 6), Pong)
        assert not task.done()
        assert counters["supervisor.refused_too_large"] == 2
    finally:
        peer.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()


# ------------------------------------------------------------------------------------ failure 9
async def test_16_mib_header_is_refused_fast_without_memory_growth(ipc, factory):
    actor = Scaler(context("scaler", ipc))
    async with running(actor):
        peer = Peer(factory, actor.bound.control)
        proc = psutil.Process()
        try:
            n = 16 << 20
            quarter = b"\xdd" + (n // 4).to_bytes(4, "big") + b"\x80\x90" * (n // 8)
            rows = b"\xdd" + (n // 8).to_bytes(4, "big") + b"\x91\x00" * (n // 8)  # [0], [0]...
            for i, frame in enumerate([b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n,
                                       header(with_field("Ping", "payload",
                                                         b"\x94" + quarter * 4), 7),
                                       header(with_field("Sample", "teacher_topk_ids",
                                                         b"\x94" + rows * 4), 8)]):
                rss, t0 = proc.memory_info().rss, time.perf_counter()
                await peer.send([frame])
                assert isinstance(await probe(peer, 100 + i), Pong)
                elapsed = time.perf_counter() - t0
                grown = proc.memory_info().rss - rss
                del frame
                assert elapsed < 3.0, elapsed  # typically ~0.05 s (16 MiB over ipc)
                assert grown < 100 << 20, grown
            assert actor.counters["control.refused_too_large"] == 3
            assert peer.answers[7].code == ErrorCode.TOO_LARGE
            assert peer.answers[8].code == ErrorCode.TOO_LARGE
            assert "limits.max_header_items" in peer.answers[8].message
        finally:
            peer.close()


async def test_huge_json_body_gets_413_quickly_and_the_worker_keeps_serving(ipc):
    async with serve(ipc) as (worker, client):
        url = worker.bound.http.removeprefix("http://")
        host, port = url.split(":")
        # declared too large: refused from Content-Length, before a byte of the body is read
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{\"input_ids\": [" % (200 << 20))
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        await writer.wait_closed()
        assert b" 413 " in status_line, status_line
        assert time.perf_counter() - t0 < 3.0  # ~1 ms: refused before the body is read
        # within the byte limit but too many values to parse quickly: 413 without parsing
        status, body = await post(client, "/generate",
                                  data=b"[" + b"0," * ((1 << 22) + 1) + b"0]")
        assert status == 413 and "commas" in body["error"]["message"]
        # just within every limit: refused (too long for the context) without stalling the loop
        lag = asyncio.ensure_future(loop_lag(3.0))
        t0 = time.perf_counter()
        status, body = await post(client, "/generate",
                                  data=b'{"input_ids": [' + b"1," * ((1 << 22) - 1) + b"1]}")
        assert status == 400 and "longer than the model's context" in body["error"]["message"]
        assert time.perf_counter() - t0 < 5.0 and await lag < 5.0  # the heartbeat allows 30 s
        # streamed without a length: refused once the limit is passed while reading
        worker.server.max_body_bytes = worker.server.weights.max_body_bytes = 4 << 20

        async def chunks():
            yield b'{"input_ids": ['
            for _ in range(128):
                yield b"1," * (32 << 10)

        t0 = time.perf_counter()
        session = client._get_session()
        async with session.post(client.base_url + "/generate", data=chunks()) as resp:
            assert resp.status == 413
            assert "over 4194304 bytes" in (await resp.json())["error"]["message"]
        assert time.perf_counter() - t0 < 2.0
        status, _ = await post(client, "/update_weights_from_disk", data=b" " * (5 << 20))
        assert status == 413
        await check_worker(client)


async def post(client, path: str, body=None, data: bytes | None = None):
    """Raw POST (status, parsed body); a big `data` goes as a stream, not one write."""
    session = client._get_session()
    kwargs = {"data": io.BytesIO(data)} if data is not None else {"json": body}
    async with session.post(client.base_url + path, **kwargs) as resp:
        raw = await resp.read()
        return resp.status, json.loads(raw) if raw.strip() else None


async def loop_lag(duration_s: float, tick_s: float = 0.01) -> float:
    """The longest the event loop (the worker's: it runs in this process) was stalled."""
    worst, end = 0.0, time.perf_counter() + duration_s
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        await asyncio.sleep(tick_s)
        worst = max(worst, time.perf_counter() - t0 - tick_s)
    return worst


async def check_worker(client) -> None:
    """The worker answers /health and a valid /generate."""
    session = client._get_session()
    async with session.get(client.base_url + "/health") as resp:
        assert resp.status == 200
    out = await client.generate(PROMPT, {"max_new_tokens": 2, "temperature": 0.0})
    assert len(out["output_ids"]) == 2


async def test_out_of_range_and_deep_json_get_400_not_500(ipc):
    async with serve(ipc) as (worker, client):
        def gen(**sp):
            return {"input_ids": PROMPT, "sampling_params": sp}

        cases = [(gen(sampling_seed=2**64), "sampling_seed"),
                 (gen(sampling_seed=2**63), "sampling_seed"),
                 (gen(max_new_tokens=-1), "max_new_tokens"),
                 (gen(max_new_tokens=10**30), "max_new_tokens"),
                 (gen(temperature=10**400), "temperature"),
                 (gen(top_k=2**70), "top_k"),
                 (gen(stop_token_ids=[2**64]), "stop_token_ids"),
                 ({"input_ids": PROMPT, "top_logprobs_num": 2**65, "return_logprob": True},
                  "top_logprobs_num"),
                 ({"input_ids": [2**64]}, "input_ids"),
                 ({"text": "x" * (worker.scheduler.context_len * 64 + 1)}, "characters")]
        for body, word in cases:
            status, answer = await post(client, "/generate", body)
            assert status == 400 and word in answer["error"]["message"], (body, answer)
        for depth in (1000, 100_000):
            status, answer = await post(client, "/generate", data=b"[" * depth + b"]" * depth)
            assert status == 400 and "nested too deeply" in answer["error"]["message"]
        status, answer = await post(client, "/update_weights_from_disk",
                                    data=b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and answer["success"] is False
        assert (await post(client, "/generate", gen(sampling_seed=2**63 - 1)))[0] == 200
        await check_worker(client)


# ------------------------------------------------------------------------------------ failure 10
def sample(gid: str, index: int, w: int = 0) -> Sample:
    return Sample(group_id=gid, index=index, domain="math", prompt_ids=[1, 2],
                  response_ids=[3, 4], loss_mask=[1, 1], rollout_logprobs=[-0.1, -0.2],
                  weight_version=w)


async def test_buffer_refuses_bad_samples_and_versions_without_changing_state(ipc, factory):
    actor = BufferActor(context("buffer", ipc, facts=PAIRS), BufferConfig())
    async with running(actor):
        sender = StreamSender(factory, actor.bound.inbox)
        client = RpcClient(factory, actor.bound.rpc, "trainer", timeout_s=3.0, role="trainer")
        try:
            await sender.send(SampleGroup(samples=[sample("bad", 99), sample("bad", 0)]))
            await sender.send(SampleGroup(samples=[sample("g", 0), sample("g", 1)]))
            assert isinstance(await client.call(VersionUpdate(version=0, step=0)), Ack)
            with pytest.raises(RemoteError) as err:
                await client.call(GetBatch(step=0, trainer_version=10**9))
            assert err.value.code == ErrorCode.INVALID_VALUE
            assert "trainer_version = 1000000000" in err.value.message
            assert "last saw version 0" in err.value.message
            with pytest.raises(RemoteError, match="version = -1"):
                await client.call(VersionUpdate(version=-1, step=0))
            assert actor.trainer_version == 0 and actor.logic.trainer_version == 0
            batch = await client.call(GetBatch(step=0, trainer_version=0))
            assert isinstance(batch, TrainBatch)
            assert [(s.group_id, s.index) for s in batch.samples] == [("g", 0), ("g", 1)]
            assert isinstance(await client.call(VersionUpdate(version=1, step=1)), Ack)
            assert actor.counters["inbox.refused_invalid"] == 1
            assert actor.counters["buffer.refused_GetBatch"] == 1
            assert actor.logic.counters["added"] == 2  # nothing of the refused group went in
            assert actor.status == Status.RUNNING
        finally:
            sender.close()
            await client.close()


async def test_only_the_trainer_moves_versions_and_a_restart_never_jumps_ahead(ipc, factory):
    """A GetBatch claiming a trainer restart at version 1e9 hands out nothing and drops
    nothing: from a connection that did not prove the trainer's role (no role, or the role
    without the run's token) it is forbidden; from the trainer itself it is refused, since a
    resumed trainer goes back to a checkpoint, never past one step beyond where it was."""
    token = "run-token"
    actor = BufferActor(context("buffer", ipc, run_token=token, facts=PAIRS), BufferConfig())
    async with running(actor):
        sender = StreamSender(factory, actor.bound.inbox)
        trainer = RpcClient(factory, actor.bound.rpc, "trainer", 3.0, role="trainer",
                            token=token)
        strangers = [RpcClient(factory, actor.bound.rpc, "t", 3.0),
                     RpcClient(factory, actor.bound.rpc, "trainer", 3.0, role="trainer"),
                     RpcClient(factory, actor.bound.rpc, "trainer", 3.0, role="trainer",
                               token="another run's")]
        try:
            for group in ("g0", "g1"):
                await sender.send(SampleGroup(samples=[sample(group, 0, 3),
                                                       sample(group, 1, 3)]))
            while actor.logic.accounting()["pending"] < 4:  # both groups in
                await asyncio.sleep(0.01)
            await trainer.handshake()
            assert isinstance(await trainer.call(VersionUpdate(version=3, step=3,
                                                               trainer_epoch="t1")), Ack)
            for client in strangers:
                await client.handshake()
                for msg in (GetBatch(step=0, trainer_version=10**9, trainer_epoch="x"),
                            VersionUpdate(version=10**9, step=10**9, trainer_epoch="x")):
                    with pytest.raises(RemoteError) as err:
                        await client.call(msg)
                    assert err.value.code == ErrorCode.FORBIDDEN, err.value
                    assert "from its trainer only" in err.value.message
            # a client with a role handshakes again and tries once more before giving up
            assert actor.counters["rpc.refused_forbidden"] == 2 + 2 * 2 * 2
            assert actor.counters["rpc.refused_proof"] == 2 * 3  # 3 handshakes each
            with pytest.raises(RemoteError) as err:
                await trainer.call(GetBatch(step=0, trainer_version=10**9, trainer_epoch="t2"))
            assert err.value.code == ErrorCode.INVALID_VALUE
            assert "last saw version 3 at step 3" in err.value.message
            assert (actor.trainer_version, actor.trainer_step, actor.trainer_epoch) == (3, 3, "t1")
            books = actor.logic.accounting()
            assert (books["emitted"], books["dropped_stale"], books["ready_groups"]) == (0, 0, 2)
            # a real restart, one step back from a checkpoint, is taken
            batch = await trainer.call(GetBatch(step=2, trainer_version=2, trainer_epoch="t2"))
            assert isinstance(batch, TrainBatch) and len(batch.samples) == 2
        finally:
            sender.close()
            for client in (trainer, *strangers):
                await client.close()


# ------------------------------------------------------------------------------------ fuzz
def valid_frames(rng: random.Random, socket: str, req_id: int) -> list[bytes]:
    """A valid request for the socket (never a Shutdown), as frames to mutate."""
    if socket == "rpc" and rng.random() < 0.5:
        t = torch.arange(rng.randrange(1, 9), dtype=torch.float32)
        return [bytes(f) for f in Codec().encode(Kind.REQUEST, req_id,
                                                 Scale(tensor=t, factor=2.0))]
    msg = Ping(payload=rng.randbytes(rng.randrange(0, 40))) if rng.random() < 0.7 else \
        StatsRequest()
    return Codec().encode(Kind.REQUEST, req_id, msg)


def fuzz_case(rng: random.Random, socket: str, req_id: int) -> tuple[list[bytes], bool]:
    """(frames, must_be_answered_with_an_error) of one seeded hostile input."""
    base = valid_frames(rng, socket, req_id)
    case = rng.randrange(10)
    if case == 0:
        return [rng.randbytes(rng.randrange(0, 300))], False
    if case == 1:  # truncated header: never a complete value
        return [base[0][:rng.randrange(0, len(base[0]))], *base[1:]], False
    if case == 2:  # flipped bytes: may even stay valid, then it is answered normally
        head = bytearray(base[0])
        for _ in range(rng.randrange(1, 4)):
            head[rng.randrange(len(head))] = rng.randrange(256)
        return [bytes(head), *base[1:]], False
    if case == 3:  # deep nesting inside an attributable header
        depth = rng.randrange(SMALL.max_depth, 5000)
        return [header(with_field("Ping", "payload", b"\x91" * depth + b"\xc0"), req_id)], True
    if case == 4:  # wrong protocol version
        return [header(with_field("Ping", "payload", enc(b"x")), req_id,
                       v=rng.choice([0, PROTOCOL_VERSION + 1, 2**31]))], True
    if case == 5:  # unknown message type
        return [header(b"\x81" + enc("type") + enc(f"NoSuch{rng.randrange(99)}"), req_id)], True
    if case == 6:  # a container over max_container_len, or a header over max_header_bytes
        if rng.random() < 0.5:
            n = SMALL.max_container_len + rng.randrange(1, 1000)
            return [header(with_field("Ping", "payload", b"\xdc" + n.to_bytes(2, "big")
                                      + b"\x00" * n), req_id)], True
        blob = rng.randbytes(SMALL.max_header_bytes + rng.randrange(1, 100))
        return [header(with_field("Ping", "payload", enc(blob)), req_id)], True
    if case == 7:  # too many frames
        return [base[0], *[b"\x00" * 4] * (SMALL.max_frames + 1)], True
    if case == 8:  # not a request (events, replies) on a request socket: dropped
        kind = rng.choice([Kind.EVENT, Kind.REPLY, Kind.ERROR])
        return [header(with_field("Ping", "payload", enc(b"")), req_id, kind=kind)], False
    return [header(rng.randbytes(rng.randrange(1, 200)), req_id)], False  # garbage body


@pytest.mark.parametrize("socket", ["control", "rpc"])
async def test_fuzz_actor_sockets(ipc, factory, socket):
    rng = random.Random(20261130 + len(socket))
    actor = Scaler(context("scaler", ipc, limits=SMALL))
    t0 = time.monotonic()
    async with running(actor):
        peer = Peer(factory, getattr(actor.bound, socket))
        try:
            before, must_answer, sent = handled(actor.counters, socket), set(), 0
            for i in range(300):
                frames, answerable = fuzz_case(rng, socket, 1000 + i)
                await peer.send(frames)
                sent += 1
                if answerable:
                    must_answer.add(1000 + i)
            final = Hello(protocol=PROTOCOL_VERSION, actor="t") if socket == "rpc" else None
            assert not isinstance(await probe(peer, 7_777_777, final), ErrorReply)
            assert handled(actor.counters, socket) - before == sent + 1
            assert must_answer <= set(peer.answers)
            assert all(isinstance(peer.answers[i], ErrorReply) for i in must_answer)
            assert actor.status == Status.RUNNING
            if socket == "rpc":  # and a real client is still served correctly
                client = RpcClient(factory, actor.bound.rpc, "t", timeout_s=3.0)
                try:
                    reply = await client.call(Scale(tensor=torch.ones(3), factor=3.0))
                    assert torch.equal(reply.tensor, torch.full((3,), 3.0))
                finally:
                    await client.close()
        finally:
            peer.close()
    assert time.monotonic() - t0 < 30


def bad_body(rng: random.Random) -> bytes:
    """A seeded hostile /generate body (never a valid request)."""
    good = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    case = rng.randrange(7)
    if case == 0:
        return rng.randbytes(rng.randrange(1, 200))
    if case == 1:
        raw = json.dumps(good).encode()
        return raw[:rng.randrange(1, len(raw) - 1)]
    if case == 2:
        depth = rng.randrange(900, 20_000)
        return b'{"input_ids": ' + b"[" * depth + b"]" * depth + b"}"
    if case == 3:
        field = rng.choice(["max_new_tokens", "temperature", "top_p", "top_k", "sampling_seed",
                            "min_p", "stop_token_ids", "stop"])
        value = rng.choice([2**64, -(2**70), "x", [], {}, [[1]], None and 0, 10**400, True])
        if value is None:
            value = -1 if field != "stop" else 5
        return json.dumps({**good, "sampling_params": {field: value}}).encode()
    if case == 4:
        key = rng.choice(["input_ids", "rid", "return_logprob", "logprob_start_len",
                          "top_logprobs_num", "stream", "no_such_field"])
        value = rng.choice([2**64, -5, "", [2**65], {"a": 1}, [[]], 1.5, True])
        return json.dumps({**good, key: value}).encode()
    if case == 5:
        return json.dumps(rng.choice([[], 1, "s", None, [good]])).encode()
    return b'{"input_ids": [' + b"1e99999," * rng.randrange(1, 50) + b"1]}"


async def test_fuzz_worker_http(ipc):
    rng = random.Random(7)
    t0 = time.monotonic()
    async with serve(ipc) as (worker, client):
        statuses: collections.Counter = collections.Counter()
        for _ in range(150):
            status, answer = await post(client, "/generate", data=bad_body(rng))
            statuses[status] += 1
            if status != 200:  # a flip may still be valid; bad input is 400/413 with a message
                assert status in (400, 413), answer
                assert answer["error"]["message"]
        for path in ("/update_weights_from_disk", "/init_weights_update_group",
                     "/update_weights_from_tensor", "/update_weights_from_distributed",
                     "/abort_request"):
            for _ in range(6):
                status, _ = await post(client, path, data=bad_body(rng))
                assert status in (400, 413) or path == "/abort_request" and status == 200, \
                    (path, status)
        assert statuses[400] > 100 and not any(s >= 500 for s in statuses)
        await check_worker(client)
    assert time.monotonic() - t0 < 30


async def test_fuzz_buffer_inbox(ipc, factory):
    """The inbox (a PULL socket, no reply path) drops and counts what it cannot decode, and the
    buffer drops and counts well-typed groups it must refuse; a valid group still goes in."""
    rng = random.Random(99)
    actor = BufferActor(context("buffer", ipc, limits=SMALL, facts=PAIRS), BufferConfig())
    async with running(actor):
        push = factory.connect(zmq.PUSH, actor.bound.inbox)
        sender = StreamSender(factory, actor.bound.inbox)
        try:
            sent = 0
            for i in range(200):
                await push.send_multipart(fuzz_case(rng, "control", 1000 + i)[0], copy=True)
                sent += 1
            bad = [[sample("x", 2)], [sample("x", 0)] * 3, [sample("x", 0), sample("y", 1)]]
            for samples in bad:
                await sender.send(SampleGroup(samples=samples))
            await sender.send(SampleGroup(samples=[sample("g", 0), sample("g", 1)]))

            def seen() -> int:  # every message the inbox has taken in or refused so far
                inbox = {k: v for k, v in actor.counters.items() if k.startswith("inbox.")}
                refused = sum(v for k, v in inbox.items() if k.startswith("inbox.refused_"))
                return refused - inbox.get("inbox.refused_invalid", 0) + \
                    inbox.get("inbox.received", 0)

            # two sockets' messages are fair-queued: the valid group may arrive before the
            # last fuzz cases, so wait for all of them
            async with asyncio.timeout(20):
                while actor.logic.counters["added"] < 2 or seen() < sent + len(bad) + 1:
                    await asyncio.sleep(0.01)
            inbox = {k: v for k, v in actor.counters.items() if k.startswith("inbox.")}
            assert seen() == sent + len(bad) + 1
            assert inbox["inbox.refused_invalid"] == len(bad)
            assert actor.logic.ready_groups() == 1 and actor.status == Status.RUNNING
        finally:
            push.close(linger=0)
            sender.close()
