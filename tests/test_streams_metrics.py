"""Streams (PUSH -> PULL with backpressure, garbage dropped and counted) and the metrics path
(publisher that never blocks -> XSUB/XPUB proxy -> subscriber counting gaps)."""

from __future__ import annotations

import asyncio
import collections
import random
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from bench.transport import Blob
from examples.demo import WorkItem
from transport.codec import Codec
from transport.metrics import (
    TOPIC,
    MetricsProxy,
    MetricsPublisher,
    MetricsSubscriber,
    sample_record,
)
from transport.rpc import DeadlineExceeded
from transport.schema import SAMPLE_TEXT_CHARS, Header, Kind, Metrics, SampleRecord
from transport.sockets import SocketFactory
from transport.streams import StreamReceiver, StreamSender


@pytest.fixture
def factory():
    f = SocketFactory()
    yield f
    f.close()


async def recv(receiver, timeout_s: float = 2.0):
    return await asyncio.wait_for(receiver.recv(), timeout_s)


async def nothing_arrives(receiver, timeout_s: float = 0.2) -> bool:
    try:
        await asyncio.wait_for(receiver.recv(), timeout_s)
    except TimeoutError:
        return True
    return False


# ------------------------------------------------------------------------------------ streams
async def test_stream_delivers_in_order_with_tensors_intact(ipc, factory):
    ep = ipc("inbox")
    counters = collections.Counter()
    rx = StreamReceiver(factory, ep, counters, name="rx")
    tx = StreamSender(factory, ep)
    try:
        gen = np.random.default_rng(0)
        sent = []
        for i in range(100):
            data = gen.standard_normal((i % 7 + 1, 3)).astype(np.float32)
            sent.append(data)
            await tx.send(WorkItem(index=i, data=data, produced_at_s=float(i)), timeout_s=2.0)
        t = torch.randn(5, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        await tx.send(Blob(tensors={"t": t, "i": torch.arange(4)}, payload=b"end"))
        assert tx.sent == 101
        for i in range(100):
            msg = await recv(rx)
            assert isinstance(msg, WorkItem)
            assert msg.index == i and msg.produced_at_s == float(i)
            assert isinstance(msg.data, np.ndarray) and msg.data.dtype == np.float32
            np.testing.assert_array_equal(msg.data, sent[i])
        last = await recv(rx)
        assert isinstance(last, Blob) and last.payload == b"end"
        assert last.tensors["t"].dtype == torch.bfloat16
        assert torch.equal(last.tensors["t"].view(torch.int16), t.view(torch.int16))
        assert torch.equal(last.tensors["i"], torch.arange(4))
        assert counters == {"inbox.received": 101}
    finally:
        tx.close()
        rx.close()


async def test_stream_round_robins_over_several_receivers(ipc, factory):
    eps = [ipc("a"), ipc("b")]
    counters = [collections.Counter(), collections.Counter()]
    rxs = [StreamReceiver(factory, ep, c) for ep, c in zip(eps, counters)]
    tx = StreamSender(factory, eps)
    try:
        await asyncio.sleep(0.1)  # let both connections come up
        for i in range(10):
            await tx.send(WorkItem(index=i, data=np.zeros(1), produced_at_s=0.0), timeout_s=2.0)
        got: list[list[int]] = [[], []]
        deadline = time.monotonic() + 3.0
        while len(got[0]) + len(got[1]) < 10 and time.monotonic() < deadline:
            for k, rx in enumerate(rxs):
                try:
                    got[k].append((await recv(rx, 0.05)).index)
                except TimeoutError:
                    pass
        assert sorted(got[0] + got[1]) == list(range(10))
        assert got[0] and got[1]  # both receivers were used
        assert got[0] == sorted(got[0]) and got[1] == sorted(got[1])
        assert counters[0]["inbox.received"] + counters[1]["inbox.received"] == 10
        for rx in rxs:
            assert await nothing_arrives(rx, 0.1)
    finally:
        tx.close()
        for rx in rxs:
            rx.close()


async def _backpressure(factory, ep: str, numel: int, bound: int) -> None:
    rx = StreamReceiver(factory, ep, collections.Counter(), hwm=2)
    tx = StreamSender(factory, ep, hwm=2)
    try:
        def item(i):
            return WorkItem(index=i, data=np.full(numel, i, dtype=np.float32), produced_at_s=0.0)

        sent = 0
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            while sent < 1000:
                await tx.send(item(sent), timeout_s=0.3)
                sent += 1
        assert time.monotonic() - t0 < 3.0
        assert 2 <= sent < bound, f"{sent} messages went through a hwm of 2"
        assert tx.sent == sent
        # the receiver starts reading: every message that was sent arrives, in order, once
        for i in range(sent):
            msg = await recv(rx)
            assert msg.index == i
            np.testing.assert_array_equal(msg.data, np.full(numel, i, dtype=np.float32))
        assert await nothing_arrives(rx)  # the timed-out one was not half-sent
        # and the sender flows again
        await tx.send(item(sent), timeout_s=1.0)
        assert (await recv(rx)).index == sent
    finally:
        tx.close()
        rx.close()


async def test_backpressure_ipc_bounded_and_lossless(ipc, factory):
    # 60 kB items: under pyzmq's 64 KiB zero-copy threshold, and large enough that the kernel's
    # socket buffers hold only a few of them beyond the two high-water marks
    await _backpressure(factory, ipc("bp"), 15_000, bound=20)


async def test_backpressure_inproc_is_exactly_the_hwm(factory):
    await _backpressure(factory, "inproc://bp-test", 4, bound=7)


async def test_receiver_drops_garbage_and_keeps_receiving(ipc, factory):
    ep = ipc("inbox")
    counters = collections.Counter()
    rx = StreamReceiver(factory, ep, counters, name="rx")
    raw = factory.connect(zmq.PUSH, ep)
    try:
        rng = random.Random(3)
        await raw.send_multipart([rng.randbytes(100)])
        await raw.send_multipart([rng.randbytes(10), rng.randbytes(10)])
        head = Codec().encode(Kind.EVENT, 0, Blob(tensors={"x": torch.ones(3)}))[0]
        await raw.send_multipart([head])  # tensor frame missing
        await raw.send_multipart(Codec().encode(Kind.EVENT, 0, WorkItem(
            index=42, data=np.arange(3.0), produced_at_s=1.0)))
        msg = await recv(rx)
        assert isinstance(msg, WorkItem) and msg.index == 42
        np.testing.assert_array_equal(msg.data, np.arange(3.0))
        assert counters == {"inbox.refused_undecodable": 2, "inbox.refused_truncated": 1,
                            "inbox.received": 1}
    finally:
        raw.close(linger=0)
        rx.close()


async def test_stream_send_to_absent_receiver_times_out(ipc, factory):
    tx = StreamSender(factory, ipc("nobody"), hwm=1)
    try:
        sent = 0
        with pytest.raises(DeadlineExceeded):
            while sent < 100:
                await tx.send(WorkItem(index=sent, data=np.zeros(1), produced_at_s=0.0),
                              timeout_s=0.2)
                sent += 1
        assert sent <= 2
    finally:
        tx.close()


# ------------------------------------------------------------------------------------ metrics
@pytest.fixture
def proxy(ipc):
    f = SocketFactory()
    p = MetricsProxy(f, ipc("metrics-in"), ipc("metrics-out"))
    yield p
    p.close()
    f.close()


async def test_metrics_records_arrive_through_the_proxy(proxy, factory):
    pub = MetricsPublisher(factory, proxy.frontend, "trainer")
    sub = MetricsSubscriber(factory, proxy.backend)
    try:
        assert await pub.wait_subscribed(3.0)
        for step in range(1, 21):
            assert pub.publish({"loss": 1.0 / step, "tokens": step * 100}, step=step,
                               total_steps=20) is True
        before = time.time()
        got = [await recv(sub) for _ in range(20)]
        for step, m in enumerate(got, start=1):
            assert isinstance(m, Metrics)
            assert m.actor == "trainer" and m.seq == step and m.step == step
            assert m.total_steps == 20 and m.dropped == 0
            assert m.values == {"loss": 1.0 / step, "tokens": float(step * 100)}
            assert before - 5 < m.time_s <= before
        assert [m.seq for m in got] == list(range(1, 21))
        assert sub.gaps == {} and sub.refused == 0 and pub.dropped == 0
        assert sub.last_seq == {"trainer": 20}
    finally:
        pub.close()
        sub.close()


async def test_metrics_publish_never_blocks_and_counts_drops(proxy, factory):
    pub = MetricsPublisher(factory, proxy.frontend, "flood", hwm=1)
    sub = MetricsSubscriber(factory, proxy.backend)
    try:
        assert await pub.wait_subscribed(3.0)
        dropped_at = {}  # seq -> publisher.dropped when that record was made
        t0 = time.monotonic()
        queued = 0
        for i in range(10_000):
            dropped_at[pub.seq + 1] = pub.dropped
            queued += pub.publish({"i": i})
        assert time.monotonic() - t0 < 1.0
        assert pub.seq == 10_000
        assert pub.dropped > 0 and queued + pub.dropped == 10_000
        # drain what made it through (the subscriber had not been reading)
        got = []
        while True:
            try:
                got.append(await recv(sub, 0.3))
            except TimeoutError:
                break
        assert 0 < len(got) <= queued
        seqs = [m.seq for m in got]
        assert seqs == sorted(set(seqs))
        for m in got:
            assert m.dropped == dropped_at[m.seq]
            assert m.values == {"i": float(m.seq - 1)}
        assert sub.gaps.get("flood", 0) == seqs[-1] - seqs[0] + 1 - len(seqs)
        # a later record carries the drop count of the moment it was sent
        count = pub.dropped
        assert pub.publish({"marker": 1.0}) is True
        marker = await recv(sub)
        assert marker.values == {"marker": 1.0} and marker.seq == 10_001
        assert marker.dropped == count
        assert sub.gaps["flood"] == 10_001 - seqs[0] + 1 - (len(seqs) + 1)
    finally:
        pub.close()
        sub.close()


async def test_subscriber_counts_gaps_per_publisher_and_refuses_garbage(proxy, factory):
    a = MetricsPublisher(factory, proxy.frontend, "a")
    b = MetricsPublisher(factory, proxy.frontend, "b")
    sub = MetricsSubscriber(factory, proxy.backend)
    try:
        assert await a.wait_subscribed(3.0) and await b.wait_subscribed(3.0)
        a.publish({"x": 1})  # seq 1
        got = await recv(sub)
        assert (got.actor, got.seq) == ("a", 1)
        a.seq += 3  # seqs 2, 3, 4 lost on the way
        a.publish({"x": 5})  # seq 5
        got = await recv(sub)
        assert (got.actor, got.seq) == ("a", 5)
        assert sub.gaps == {"a": 3}
        b.publish({"y": 1})
        assert (await recv(sub)).actor == "b"
        b.seq += 1
        b.publish({"y": 3})
        assert (await recv(sub)).seq == 3
        a.publish({"x": 6})  # consecutive: no new gap
        assert (await recv(sub)).seq == 6
        assert sub.gaps == {"a": 3, "b": 1}
        assert sub.last_seq == {"a": 6, "b": 3}
        # garbage on the metrics topic is refused and counted; the next record still arrives
        a.sock.send_nowait([TOPIC, b"\xc1 not msgpack"])
        a.sock.send_nowait([TOPIC, *Codec().encode(Kind.EVENT, 0, Blob(payload=b"x"))])
        a.publish({"x": 7})
        got = await recv(sub)
        assert (got.actor, got.seq, got.values) == ("a", 7, {"x": 7.0})
        assert sub.refused == 2
        assert sub.gaps == {"a": 3, "b": 1}
    finally:
        a.close()
        b.close()
        sub.close()


async def test_publisher_without_subscribers_drops_nothing_silently(ipc, factory):
    """No proxy at all: publish() still returns at once, and every record is accounted for."""
    pub = MetricsPublisher(factory, ipc("nowhere"), "lonely", hwm=10)
    try:
        t0 = time.monotonic()
        results = [pub.publish({"i": i}) for i in range(1000)]
        assert time.monotonic() - t0 < 1.0
        assert sum(results) + pub.dropped == 1000
        assert pub.seq == 1000
        assert not await pub.wait_subscribed(0.05)
    finally:
        pub.close()


class OldMetrics(msgspec.Struct, tag="Metrics", omit_defaults=True, kw_only=True):
    """The Metrics record as it was before `samples` (what an older actor sends)."""

    actor: str
    seq: int
    time_s: float
    values: dict[str, float] = {}
    step: int | None = None
    total_steps: int | None = None
    dropped: int = 0


async def test_samples_ride_on_records_cut_and_old_or_malformed_records_are_handled(
        proxy, factory):
    pub = MetricsPublisher(factory, proxy.frontend, "rollout")
    sub = MetricsSubscriber(factory, proxy.backend)
    try:
        assert await pub.wait_subscribed(3.0)
        huge = "7" * (10 * SAMPLE_TEXT_CHARS)
        sent = [sample_record("eval", domain="math", prompt="3+4=", response=huge, reward=0.0,
                              weight_version=5, status="failed", error="ZeroDivisionError: x",
                              task="eval-3", env="ArithEnv", episode="eval5-3-0", cause="env"),
                sample_record("rollout", domain="reverse", prompt="rev ab=", response="ba",
                              reward=1.0, weight_version=4)]
        assert pub.publish({"eval/math": 0.5}, step=5, samples=sent)
        got = await recv(sub)
        assert got.values == {"eval/math": 0.5} and got.samples == sent
        first = got.samples[0]
        assert len(first.response) == SAMPLE_TEXT_CHARS and first.response.endswith("7...")
        assert (first.status, first.error, first.task, first.env, first.cause) == (
            "failed", "ZeroDivisionError: x", "eval-3", "ArithEnv", "env")
        # a record of an older actor (no `samples` field) decodes, with no samples
        old = msgspec.msgpack.encode(Header(v=2, kind=Kind.EVENT, id=0, body=Metrics(
            actor="x", seq=1, time_s=0.0)))
        assert b"samples" not in old  # omitted when empty: an older launcher reads it as before
        header = msgspec.msgpack.encode([2, int(Kind.EVENT), 0, OldMetrics(
            actor="old", seq=1, time_s=1.0, values={"loss": 1.0}, step=3)])
        pub.sock.send_nowait([TOPIC, header])
        got = await recv(sub)
        assert (got.actor, got.step, got.values, got.samples) == ("old", 3, {"loss": 1.0}, [])
        # a malformed sample (a reward that is text) is refused as a whole; the stream goes on
        bad = msgspec.msgpack.encode([2, int(Kind.EVENT), 0, {
            "type": "Metrics", "actor": "evil", "seq": 1, "time_s": 0.0,
            "samples": [{"kind": "eval", "reward": "lots"}]}])
        pub.sock.send_nowait([TOPIC, bad])
        assert pub.publish({"x": 1.0}, samples=[SampleRecord(kind="rollout")])
        got = await recv(sub)
        assert (got.actor, got.values) == ("rollout", {"x": 1.0}) and sub.refused == 1
    finally:
        pub.close()
        sub.close()
