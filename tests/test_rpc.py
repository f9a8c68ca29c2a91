"""Request/reply against a running actor (and a bare RpcServer): replies, deadlines, refusals of bad
input with typed errors and counters, handler failures, control under load, shutdown and CURVE."""

from __future__ import annotations

import asyncio
import collections
import random
import shutil
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from bench.transport import Blob
from examples.demo import Scale, ScaleReply, WorkItem
from examples.demo import Scaler, ScalerConfig
from runtime.actor import Status
from tests.helpers import context, running
from transport.codec import Codec, Decoded, Limits
from transport.rpc import DeadlineExceeded, RemoteError, RpcClient, RpcServer
from transport.schema import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    Hello,
    Kind,
    Ping,
    Pong,
    Shutdown,
    ShutdownReply,
    StatsReply,
    StatsRequest,
    Welcome,
)
from transport.sockets import Security, SocketFactory, bound_endpoint, make_curve_keys


@pytest.fixture
def factory():
    f = SocketFactory()
    yield f
    f.close()


async def stats(factory: SocketFactory, actor) -> dict[str, int]:
    """The actor's counters, asked for over its control socket."""
    client = RpcClient(factory, actor.bound.control, "stats", timeout_s=3.0)
    try:
        reply = await client.call(StatsRequest())
    finally:
        await client.close()
    assert isinstance(reply, StatsReply)
    assert reply.actor == actor.name and reply.status == "running" and reply.uptime_s > 0
    return reply.counters


def refusals(counters: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counters.items() if k.startswith("rpc.refused_")}


async def check_scale(client: RpcClient, factor: float = 3.0, n: int = 5) -> None:
    x = torch.arange(n, dtype=torch.float32)
    reply = await client.call(Scale(tensor=x, factor=factor), timeout_s=3.0)
    assert isinstance(reply, ScaleReply)
    assert torch.equal(reply.tensor, x * factor)
    assert reply.total == float(x.sum())


class RawPeer:
    """A bare DEALER that sends hand-made frames and decodes what comes back."""

    def __init__(self, factory: SocketFactory, endpoint: str):
        self.sock = factory.connect(zmq.DEALER, endpoint)
        self.codec = Codec()

    async def send(self, frames) -> None:
        await self.sock.send_multipart(list(frames))

    async def recv(self, timeout_s: float = 2.0) -> Decoded | None:
        try:
            frames = await asyncio.wait_for(self.sock.recv_multipart(copy=False), timeout_s)
        except TimeoutError:
            return None
        return self.codec.decode(frames)

    def close(self) -> None:
        self.sock.close(linger=0)


# ------------------------------------------------------------------------------------ basics
async def test_request_reply_and_handshake(ipc, factory):
    async with running(Scaler(context("scaler", ipc))) as actor:
        client = RpcClient(factory, actor.bound.rpc, "tester", timeout_s=5.0)
        try:
            welcome = await client.handshake()
            assert isinstance(welcome, Welcome)
            assert welcome.actor == "scaler" and welcome.protocol == PROTOCOL_VERSION
            assert client.peer == "scaler"
            x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
            reply = await client.call(Scale(tensor=x, factor=2.5))
            assert isinstance(reply, ScaleReply)
            assert reply.tensor.shape == (2, 3) and reply.tensor.dtype == torch.float32
            assert torch.equal(reply.tensor, x * 2.5)
            assert reply.total == 15.0
            # concurrent calls are matched to their own replies
            factors = [float(i) for i in range(1, 21)]
            replies = await asyncio.gather(*(client.call(Scale(tensor=x, factor=f))
                                             for f in factors))
            for f, r in zip(factors, replies):
                assert torch.equal(r.tensor, x * f)
            assert actor.counters["scaled"] == 21
        finally:
            await client.close()
        # the control socket speaks the same handshake
        ctl = RpcClient(factory, actor.bound.control, "tester", timeout_s=5.0)
        try:
            assert (await ctl.handshake()).actor == "scaler"
            pong = await ctl.call(Ping(payload=b"abc"))
            assert pong == Pong(actor="scaler", status="running", payload=b"abc")
        finally:
            await ctl.close()
        counters = await stats(factory, actor)
        assert counters["rpc.requests"] == 22  # Hello + 21 Scale
        assert refusals(counters) == {}


async def test_hello_with_wrong_protocol_is_refused(ipc, factory):
    async with running(Scaler(context("scaler", ipc))) as actor:
        client = RpcClient(factory, actor.bound.rpc, "old-tool", timeout_s=3.0)
        try:
            with pytest.raises(RemoteError) as info:
                await client.call(Hello(protocol=PROTOCOL_VERSION + 1, actor="old-tool"))
            assert not isinstance(info.value, DeadlineExceeded)
            assert info.value.code == ErrorCode.PROTOCOL_MISMATCH
            assert f"speaks protocol {PROTOCOL_VERSION + 1}" in info.value.message
            assert "old-tool" in info.value.message
            assert (await client.handshake()).actor == "scaler"  # the right one still works
        finally:
            await client.close()


# ------------------------------------------------------------------------------------ deadlines
async def test_call_deadline_and_late_reply(ipc, factory):
    async with running(Scaler(context("slow", ipc), ScalerConfig(delay_s=1.0))) as actor:
        client = RpcClient(factory, actor.bound.rpc, "tester", timeout_s=10.0)
        try:
            x = torch.ones(3)
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded) as info:
                await client.call(Scale(tensor=x, factor=2.0), timeout_s=0.2)
            elapsed = time.monotonic() - t0
            assert 0.15 <= elapsed < 0.5
            assert isinstance(info.value, TimeoutError)
            assert info.value.code == ErrorCode.DEADLINE
            assert client.counters["deadlines"] == 1
            assert client.counters["late_replies"] == 0
            deadline = time.monotonic() + 3.0
            while client.counters["late_replies"] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert client.counters["late_replies"] == 1
            assert time.monotonic() - t0 >= 0.9  # it was the real (late) reply
            # the client still works afterwards, and the late reply was not mistaken for it
            reply = await client.call(Scale(tensor=x, factor=5.0), timeout_s=3.0)
            assert torch.equal(reply.tensor, x * 5.0)
        finally:
            await client.close()


async def test_dead_peer_raises_deadline(ipc, factory):
    client = RpcClient(factory, ipc("nobody"), "tester", timeout_s=0.3)
    try:
        for timeout in (0.25, None):  # per-call deadline and the client's default
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                await client.call(Ping(), timeout_s=timeout)
            assert 0.2 <= time.monotonic() - t0 < 0.8
        assert client.counters["deadlines"] == 2
    finally:
        await client.close()


async def test_dead_tcp_peer_raises_deadline(factory):
    client = RpcClient(factory, "tcp://127.0.0.1:1", "tester", timeout_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await client.call(Ping())
        assert time.monotonic() - t0 < 0.8
    finally:
        await client.close()


# ------------------------------------------------------------------------------------ bad input
LIMIT = 16 * 1024  # small: zero-copy sends over 64 KiB would start pyzmq's gc thread


def _bad_frames(case: str) -> tuple[list, int]:
    """(frames, req_id) for each kind of bad input; req_id 0 where no answer is possible."""
    codec = Codec()
    if case == "random_bytes":
        return [random.Random(7).randbytes(200)], 0
    if case == "truncated":
        frames = codec.encode(Kind.REQUEST, 101, Scale(tensor=torch.ones(16), factor=2.0))
        return [bytes(frames[0])], 101  # its tensor frame removed
    if case == "unknown_message":
        return [msgspec.msgpack.encode([PROTOCOL_VERSION, 1, 102, {"type": "NoSuchMsg"}])], 102
    if case == "protocol_mismatch":
        return [msgspec.msgpack.encode([PROTOCOL_VERSION + 1, 1, 103, {"type": "Ping"}])], 103
    if case == "too_large":
        return codec.encode(Kind.REQUEST, 104, Scale(tensor=torch.ones(LIMIT // 2), factor=1.0)), 104
    if case == "no_handler":
        return codec.encode(Kind.REQUEST, 105, WorkItem(index=1, data=np.ones(3),
                                                        produced_at_s=0.0)), 105
    if case == "not_request":
        return codec.encode(Kind.EVENT, 0, Scale(tensor=torch.ones(2), factor=1.0)), 0
    raise AssertionError(case)


BAD = ["random_bytes", "truncated", "unknown_message", "protocol_mismatch", "too_large",
       "no_handler", "not_request"]
CODE = {"random_bytes": "undecodable", "not_request": "not_request",
        **{c: c for c in BAD[1:6]}}  # the counter is rpc.refused_<CODE>


@pytest.mark.parametrize("case", BAD)
async def test_bad_input_is_refused_and_counted(ipc, factory, case):
    actor = Scaler(context("scaler", ipc, limits=Limits(max_message_bytes=LIMIT)))
    async with running(actor):
        raw = RawPeer(factory, actor.bound.rpc)
        client = RpcClient(factory, actor.bound.rpc, "tester", timeout_s=3.0)
        try:
            frames, req_id = _bad_frames(case)
            await raw.send(frames)
            if req_id:
                answer = await raw.recv()
                assert answer is not None, f"no answer to {case}"
                assert answer.kind == Kind.ERROR and answer.req_id == req_id
                assert isinstance(answer.body, ErrorReply)
                assert answer.body.code == CODE[case]
                assert answer.body.message
                if case == "no_handler":
                    assert answer.body.request_type == "WorkItem"
            else:
                assert await raw.recv(0.3) is None  # nothing to attribute an answer to
            # the same peer and a fresh client are both still served
            ok = Codec().encode(Kind.REQUEST, 900, Scale(tensor=torch.ones(4), factor=2.0))
            await raw.send(ok)
            answer = await raw.recv()
            assert answer is not None and answer.kind == Kind.REPLY and answer.req_id == 900
            assert torch.equal(answer.body.tensor, torch.full((4,), 2.0))
            await check_scale(client)
            counters = await stats(factory, actor)
            assert refusals(counters) == {f"rpc.refused_{CODE[case]}": 1}
            assert counters["rpc.requests"] == 2
            assert counters["scaled"] == 2
        finally:
            raw.close()
            await client.close()


async def test_every_refusal_on_one_actor(ipc, factory):
    """All bad inputs in a row against one actor: it keeps serving and counts each once."""
    actor = Scaler(context("scaler", ipc, limits=Limits(max_message_bytes=LIMIT)))
    async with running(actor):
        raw = RawPeer(factory, actor.bound.rpc)
        client = RpcClient(factory, actor.bound.rpc, "tester", timeout_s=3.0)
        try:
            for case in BAD:
                frames, req_id = _bad_frames(case)
                await raw.send(frames)
                if req_id:
                    answer = await raw.recv()
                    assert answer is not None and answer.body.code == CODE[case]
                await check_scale(client, factor=float(len(case)))
            counters = await stats(factory, actor)
            assert refusals(counters) == {
                "rpc.refused_undecodable": 1, "rpc.refused_truncated": 1,
                "rpc.refused_unknown_message": 1, "rpc.refused_protocol_mismatch": 1,
                "rpc.refused_too_large": 1, "rpc.refused_no_handler": 1,
                "rpc.refused_not_request": 1}
            assert counters["rpc.requests"] == len(BAD)
        finally:
            raw.close()
            await client.close()


@pytest.mark.parametrize("ref", ["negative_shape", "missing_shm_segment"])
async def test_malformed_tensor_reference_does_not_kill_the_actor(ipc, factory, ref):
    if ref == "negative_shape":
        meta, frames = [1, ["float32", [-1, -4], 0]], [bytes(16)]
    else:
        meta, frames = [2, ["float32", [4], "rlx-no-such-segment", 16]], []
    ext = msgspec.msgpack.Ext(meta[0], msgspec.msgpack.encode(meta[1]))
    head = msgspec.msgpack.encode([PROTOCOL_VERSION, 1, 77, {"type": "Scale", "tensor": ext,
                                                             "factor": 1.0}])
    async with running(Scaler(context("scaler", ipc))) as actor:
        raw = RawPeer(factory, actor.bound.rpc)
        client = RpcClient(factory, actor.bound.rpc, "tester", timeout_s=1.0)
        try:
            await raw.send([head, *frames])
            answer = await raw.recv(1.0)
            assert answer is not None and answer.req_id == 77
            assert answer.body.code == ErrorCode.UNDECODABLE
            await check_scale(client)
            assert actor.status == Status.RUNNING
        finally:
            raw.close()
            await client.close()


# ------------------------------------------------------------------------------------ handlers
class _Custom:
    pass


class TrickyScaler(Scaler):
    """Raises for a negative factor; returns an unencodable reply for factors 13 and 14."""

    async def scale(self, msg: Scale):
        if msg.factor < 0:
            raise ValueError(f"negative factor {msg.factor} not allowed")
        if msg.factor == 13:
            return Blob(payload=_Custom())  # enc_hook raises NotImplementedError
        if msg.factor == 14:
            return Blob(arrays={"s": np.array(["text"])})  # as_tensor raises TypeError
        return await super().scale(msg)


async def test_handler_error_is_the_callers_answer(ipc, factory):
    async with running(TrickyScaler(context("tricky", ipc))) as actor:
        client = RpcClient(factory, actor.bound.rpc, "tester", timeout_s=3.0)
        try:
            for i in range(3):
                with pytest.raises(RemoteError) as info:
                    await client.call(Scale(tensor=torch.ones(2), factor=-1.0))
                assert not isinstance(info.value, DeadlineExceeded)
                assert info.value.code == ErrorCode.HANDLER_ERROR
                assert info.value.message == "ValueError: negative factor -1.0 not allowed"
                await check_scale(client)
            assert actor.status == Status.RUNNING
            counters = await stats(factory, actor)
            assert counters["rpc.handler_errors"] == 3
            assert counters["scaled"] == 3
        finally:
            await client.close()


@pytest.mark.parametrize("sync", [False, True], ids=["async_handler", "plain_handler"])
async def test_rpc_server_handler_errors_sync_and_async(ipc, factory, sync):
    counters = collections.Counter()

    def boom_sync(msg: Ping):
        if msg.payload == b"boom":
            raise RuntimeError("kaput")
        return Pong(actor="bare", status="ok", payload=msg.payload)

    async def boom_async(msg: Ping):
        return boom_sync(msg)

    server = RpcServer(factory, ipc("bare"), "bare", {Ping: boom_sync if sync else boom_async},
                       counters)
    task = asyncio.ensure_future(server.serve())
    client = RpcClient(factory, server.sock.last_endpoint.decode(), "tester", timeout_s=3.0)
    try:
        assert (await client.handshake()).actor == "bare"
        with pytest.raises(RemoteError) as info:
            await client.call(Ping(payload=b"boom"))
        assert info.value.code == ErrorCode.HANDLER_ERROR
        assert info.value.message == "RuntimeError: kaput"
        assert (await client.call(Ping(payload=b"ok"))).payload == b"ok"
        assert counters["rpc.handler_errors"] == 1 and counters["rpc.requests"] == 3
        # a server that stopped accepting answers with shutting_down
        server.accepting = False
        with pytest.raises(RemoteError) as info:
            await client.call(Ping(payload=b"late"))
        assert info.value.code == ErrorCode.SHUTTING_DOWN
        assert counters["rpc.refused_shutting_down"] == 1
    finally:
        await client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()


@pytest.mark.parametrize("factor", [13.0, 14.0], ids=["custom_object", "string_array"])
async def test_unencodable_reply_is_a_handler_error(ipc, factory, factor):
    async with running(TrickyScaler(context("tricky", ipc))) as actor:
        client = RpcClient(factory, actor.bound.rpc, "tester", timeout_s=1.0)
        try:
            with pytest.raises(RemoteError) as info:
                await client.call(Scale(tensor=torch.ones(2), factor=factor))
            assert info.value.code == ErrorCode.HANDLER_ERROR
            await check_scale(client)
            assert actor.status == Status.RUNNING
        finally:
            await client.close()


# ------------------------------------------------------------------------------------ control plane
async def test_control_answers_while_data_path_is_busy(ipc, factory):
    async with running(Scaler(context("busy", ipc), ScalerConfig(delay_s=2.0))) as actor:
        client = RpcClient(factory, actor.bound.rpc, "tester", timeout_s=10.0)
        ctl = RpcClient(factory, actor.bound.control, "tester", timeout_s=2.0)
        calls = [asyncio.ensure_future(client.call(Scale(tensor=torch.ones(1024), factor=2.0)))
                 for _ in range(50)]
        try:
            deadline = time.monotonic() + 5.0
            while actor.counters["rpc.requests"] < 50 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert actor.counters["rpc.requests"] == 50  # all 50 are in service
            t0 = time.monotonic()
            pong = await ctl.call(Ping(payload=b"still there?"))
            assert time.monotonic() - t0 < 0.5
            assert pong == Pong(actor="busy", status="running", payload=b"still there?")
            counters = await stats(factory, actor)
            assert counters["rpc.requests"] == 50 and counters.get("scaled", 0) == 0
            assert not any(c.done() for c in calls)
        finally:
            for c in calls:
                c.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            await client.close()
            await ctl.close()


async def test_shutdown_on_control_socket_stops_the_actor(ipc, factory):
    actor = Scaler(context("scaler", ipc))
    task = asyncio.ensure_future(actor.serve())
    ctl = None
    try:
        await asyncio.wait_for(actor.wait_running(), 10)
        ctl = RpcClient(factory, actor.bound.control, "tester", timeout_s=3.0)
        reply = await ctl.call(Shutdown(reason="test says stop"))
        assert isinstance(reply, ShutdownReply)
        assert reply.actor == "scaler" and reply.status in ("stopping", "stopped")
        assert await asyncio.wait_for(task, 10) == 0
        assert actor.status == Status.STOPPED
        assert actor._stop_reason == "test says stop"
        with pytest.raises(DeadlineExceeded):  # nobody serves the control socket any more
            await ctl.call(Ping(), timeout_s=0.2)
    finally:
        if ctl is not None:
            await ctl.close()
        actor.stop("test over")
        await asyncio.wait_for(task, 10)


async def test_reply_to_departed_peer_is_counted(ipc, factory):
    async with running(Scaler(context("slow", ipc), ScalerConfig(delay_s=0.3))) as actor:
        assert actor.counters["rpc.replies_dropped"] == 0
        raw = RawPeer(factory, actor.bound.rpc)
        await raw.send(Codec().encode(Kind.REQUEST, 1, Scale(tensor=torch.ones(2), factor=1.0)))
        deadline = time.monotonic() + 2.0
        while actor.counters["rpc.requests"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        raw.close()  # gone before the reply
        deadline = time.monotonic() + 2.0
        while actor.counters["scaled"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        counters = await stats(factory, actor)
        assert counters["scaled"] == 1
        assert counters.get("rpc.replies_dropped", 0) == 1


# ------------------------------------------------------------------------------------ client side
class FakeServer:
    """A bare ROUTER that answers with whatever frames a test gives it."""

    def __init__(self, factory: SocketFactory, endpoint: str):
        self.sock = factory.bind(zmq.ROUTER, endpoint)
        self.endpoint = self.sock.last_endpoint.decode()
        self.codec = Codec()

    async def request(self) -> tuple[bytes, Decoded]:
        frames = await asyncio.wait_for(self.sock.recv_multipart(copy=False), 3.0)
        return frames[0].bytes, self.codec.decode(frames[1:])

    async def answer(self, ident: bytes, *messages: list) -> None:
        for frames in messages:
            await self.sock.send_multipart([ident, *frames])

    def close(self) -> None:
        self.sock.close(linger=0)


async def test_client_turns_an_undecodable_reply_into_remote_error(ipc, factory):
    server = FakeServer(factory, ipc("fake"))
    client = RpcClient(factory, server.endpoint, "tester", timeout_s=3.0)
    try:
        call = asyncio.ensure_future(client.call(Ping(payload=b"x")))
        ident, req = await server.request()
        assert req.kind == Kind.REQUEST and req.body == Ping(payload=b"x")
        bad = Codec().encode(Kind.REPLY, req.req_id, Blob(tensors={"t": torch.ones(3)}))[:1]
        await server.answer(ident, bad)
        with pytest.raises(RemoteError) as info:
            await call
        assert not isinstance(info.value, DeadlineExceeded)
        assert info.value.code == ErrorCode.TRUNCATED
        assert client.counters["refused_truncated"] == 1
        # a reply for an id nobody waits for is counted, not delivered
        await server.answer(ident, Codec().encode(Kind.REPLY, 999, Pong(actor="x", status="y")))
        call = asyncio.ensure_future(client.call(Ping(payload=b"y")))
        ident, req = await server.request()
        await server.answer(ident, Codec().encode(Kind.REPLY, req.req_id,
                                                  Pong(actor="fake", status="ok", payload=b"y")))
        assert (await call).payload == b"y"
        assert client.counters["late_replies"] == 1
    finally:
        await client.close()
        server.close()


async def test_client_survives_duplicate_garbled_reply(ipc, factory):
    server = FakeServer(factory, ipc("fake"))
    client = RpcClient(factory, server.endpoint, "tester", timeout_s=1.0)
    try:
        call = asyncio.ensure_future(client.call(Ping(payload=b"1")))
        ident, req = await server.request()
        good = Codec().encode(Kind.REPLY, req.req_id, Pong(actor="fake", status="ok"))
        garbled = Codec().encode(Kind.REPLY, req.req_id, Blob(tensors={"t": torch.ones(3)}))[:1]
        await server.answer(ident, good, garbled)  # both queued before the client reads
        assert isinstance(await call, Pong)
        call = asyncio.ensure_future(client.call(Ping(payload=b"2")))
        ident, req = await server.request()
        await server.answer(ident, Codec().encode(Kind.REPLY, req.req_id,
                                                  Pong(actor="fake", status="ok", payload=b"2")))
        assert (await call).payload == b"2"
    finally:
        await client.close()
        server.close()


# ------------------------------------------------------------------------------------ CURVE
@pytest.fixture
def curve(tmp_path):
    """A secured server on tcp://127.0.0.1:0 with its handler, plus factories to call it."""
    keys = tmp_path / "keys"
    make_curve_keys(keys)
    return Security(curve=True, keys_dir=str(keys))


async def _serve_secure(security: Security):
    sf = SocketFactory(security=security)
    server = RpcServer(sf, "tcp://127.0.0.1:0", "secure",
                       {Ping: lambda m: Pong(actor="secure", status="ok", payload=m.payload)},
                       collections.Counter())
    task = asyncio.ensure_future(server.serve())
    return sf, server, task


async def _stop_secure(sf, server, task):
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    server.close()
    sf.close()


async def test_curve_client_with_keys_is_answered(curve):
    sf, server, task = await _serve_secure(curve)
    cf = SocketFactory(security=curve)
    client = None
    try:
        endpoint = bound_endpoint(server.sock)
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        client = RpcClient(cf, endpoint, "tester", timeout_s=3.0)
        assert (await client.handshake()).actor == "secure"
        assert (await client.call(Ping(payload=b"secret"))).payload == b"secret"
    finally:
        if client is not None:
            await client.close()
        cf.close()
        await _stop_secure(sf, server, task)


async def test_curve_refuses_clients_without_the_keys(curve, tmp_path):
    sf, server, task = await _serve_secure(curve)
    plain, cf, stranger_f = SocketFactory(), SocketFactory(security=curve), None
    clients = []
    try:
        endpoint = bound_endpoint(server.sock)
        assert server.sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        # a client that knows the server key but holds a client key the server never issued
        other = tmp_path / "other"
        make_curve_keys(other)
        shutil.copy(f"{curve.keys_dir}/server.key", other / "server.key")
        stranger_f = SocketFactory(security=Security(curve=True, keys_dir=str(other)))
        for f in (plain, stranger_f):
            clients.append(RpcClient(f, endpoint, "intruder", timeout_s=0.5))
            with pytest.raises(DeadlineExceeded):
                await clients[-1].call(Ping(payload=b"let me in"))
        clients.append(RpcClient(cf, endpoint, "tester", timeout_s=3.0))
        assert (await clients[-1].handshake()).actor == "secure"
    finally:
        for c in clients:
            await c.close()
        for f in (plain, cf, stranger_f):
            if f is not None:
                f.close()
        await _stop_secure(sf, server, task)
