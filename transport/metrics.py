"""Metrics stream: a publisher that never blocks and counts what it drops, and a SUB helper.

Invariant: `MetricsPublisher.publish()` returns immediately. It uses an XPUB socket with
XPUB_NODROP so that a full queue surfaces as EAGAIN, which is counted (plain PUB would drop
silently); every record carries a per-publisher `seq` and the running `dropped` count, so a
subscriber can tell loss from silence. Publishers connect to the cluster's metrics proxy (an
XSUB/XPUB forwarder in the launcher) so that one address serves every actor's metrics.

A record may carry a few episodes as text (`samples`, built with `sample_record`, which cuts
every text to `SAMPLE_TEXT_CHARS`), so that what the model answers reaches the launcher with
the numbers (launch/sinks.py: <run_dir>/samples/*.jsonl; launch/console.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator

import zmq

from transport.codec import Codec, WireError
from transport.schema import SAMPLE_TEXT_CHARS, Kind, Metrics, SampleRecord
from transport.sockets import SocketFactory

TOPIC = b"metrics"
# records queued from the proxy to each subscriber (and in a subscriber) before the proxy drops:
# every publisher's burst funnels into this one queue, so it is sized for 1,000 publishers (a
# burst of 50 records each went through whole in bench/scale.py; at 1,000 it lost half); records
# are ~150 bytes, so the bound is ~15 MiB per subscriber. What is dropped past it shows as gaps
# in the publishers' `seq` (MetricsSubscriber.gaps)
FANIN_HWM = 100_000


def cut(text: str, limit: int = SAMPLE_TEXT_CHARS) -> str:
    """`text` whole when it has at most `limit` characters, else its start and "..." (`limit`
    characters in all)."""
    return text if len(text) <= limit else text[:max(0, limit - 3)] + "..."


def sample_record(kind: str, *, domain: str, prompt: str, response: str, reward: float,
                  weight_version: int, status: str = "ok", error: str = "", task: str = "",
                  env: str = "", episode: str = "", cause: str = "") -> SampleRecord:
    """A SampleRecord with every text cut to SAMPLE_TEXT_CHARS (names and ids to 200)."""
    return SampleRecord(kind=kind, domain=cut(domain, 200), prompt=cut(prompt),
                        response=cut(response), reward=float(reward),
                        weight_version=int(weight_version), status=cut(status, 40),
                        error=cut(error), task=cut(task, 200), env=cut(env, 200),
                        episode=cut(episode, 200), cause=cut(cause, 40))


class MetricsPublisher:
    def __init__(self, factory: SocketFactory, endpoint: str, actor: str, hwm: int = 1000):
        self.actor = actor
        self.sock = factory.connect(zmq.XPUB, endpoint, hwm=hwm)
        self.sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.codec = Codec()
        self.seq = 0
        self.dropped = 0

    def publish(self, values: dict[str, float], step: int | None = None,
                total_steps: int | None = None,
                samples: list[SampleRecord] | None = None) -> bool:
        """Send one record now or count it as dropped; True if it was queued."""
        self.seq += 1
        msg = Metrics(actor=self.actor, seq=self.seq, time_s=time.time(),
                      values={k: float(v) for k, v in values.items()}, step=step,
                      total_steps=total_steps, dropped=self.dropped, samples=samples or [])
        try:
            self.sock.send_nowait([TOPIC, *self.codec.encode(Kind.EVENT, 0, msg)])
            return True
        except zmq.Again:
            self.dropped += 1
            return False

    async def wait_subscribed(self, timeout_s: float) -> bool:
        """Wait until some subscriber's subscription reached us (PUB drops before that)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.sock.recv()
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close(linger=0)


class MetricsSubscriber:
    """Async iterator over Metrics records from one or more publisher/proxy endpoints."""

    def __init__(self, factory: SocketFactory, endpoints: list[str] | str):
        endpoints = [endpoints] if isinstance(endpoints, str) else endpoints
        self.sock = factory.connect(zmq.SUB, endpoints[0], hwm=FANIN_HWM)
        for ep in endpoints[1:]:
            self.sock.connect(ep)
        self.sock.subscribe(TOPIC)
        self.codec = Codec()
        self.refused = 0
        self.last_seq: dict[str, int] = {}
        self.gaps: dict[str, int] = {}  # records lost between publisher and us, per actor

    async def recv(self) -> Metrics:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = self.codec.decode(frames[1:])
            except WireError:
                self.refused += 1
                continue
            if isinstance(msg.body, Metrics):
                self._track(msg.body)
                return msg.body
            self.refused += 1

    def _track(self, m: Metrics) -> None:
        last = self.last_seq.get(m.actor)
        if last is not None and m.seq > last + 1:
            self.gaps[m.actor] = self.gaps.get(m.actor, 0) + m.seq - last - 1
        self.last_seq[m.actor] = m.seq

    def __aiter__(self) -> AsyncIterator[Metrics]:
        return self

    async def __anext__(self) -> Metrics:
        return await self.recv()

    def close(self) -> None:
        self.sock.close(linger=0)


class MetricsProxy:
    """XSUB (publishers connect) -> XPUB (subscribers connect), forwarded in a zmq thread."""

    def __init__(self, factory: SocketFactory, frontend: str, backend: str):
        """Both sides are bound through `factory`, so with CURVE on tcp:// only holders of the
        cluster's client key can publish or subscribe."""
        ctx = self.ctx = factory.ctx
        self._xsub = factory.bind_thread_socket(zmq.XSUB, frontend)
        self._xpub = factory.bind_thread_socket(zmq.XPUB, backend, hwm=FANIN_HWM)
        self.frontend = self._xsub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend = self._xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ctl_addr = f"inproc://metrics-proxy-{id(self)}"
        self._ctl = ctx.socket(zmq.PAIR)
        self._ctl.linger = 0
        self._ctl.bind(self._ctl_addr)
        self._thread = threading.Thread(target=self._run, name="metrics-proxy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ctl = self.ctx.socket(zmq.PAIR)
        ctl.linger = 0
        ctl.connect(self._ctl_addr)
        try:
            zmq.proxy_steerable(self._xsub, self._xpub, None, ctl)
        except zmq.ContextTerminated:
            pass
        finally:
            ctl.close()
            self._xsub.close()
            self._xpub.close()

    def close(self) -> None:
        if self._thread.is_alive():
            self._ctl.send(b"TERMINATE")
            self._thread.join(timeout=5)
        self._ctl.close()
