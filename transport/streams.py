"""One-way message streams (PUSH -> PULL) with bounded high-water marks and backpressure.

Invariant: a sender never grows an unbounded queue. When the receiver is slow, the HWM fills and
`send()` awaits (backpressure) until there is room or its deadline passes; it never drops. The
receiver drops undecodable messages and messages over its `Limits` (checked before decoding),
counts them (`inbox.refused_<code>`), logs them at a limited rate and keeps receiving.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import zmq

from transport.codec import Codec, Limits, WireError
from transport.rpc import DeadlineExceeded
from transport.schema import Kind, Msg
from transport.shm import ShmConfig, channel_for
from transport.sockets import RateLimitedLog, SocketFactory

log = logging.getLogger(__name__)


class StreamSender:
    """Connects a PUSH socket to one or more receivers' inboxes (round-robin between them)."""

    def __init__(self, factory: SocketFactory, endpoints: list[str] | str, hwm: int = 64,
                 shm: ShmConfig | None = None):
        endpoints = [endpoints] if isinstance(endpoints, str) else endpoints
        self.sock = factory.connect(zmq.PUSH, endpoints[0], hwm=hwm)
        for ep in endpoints[1:]:
            self.sock.connect(ep)
        self.codec = Codec(shm=channel_for(endpoints[0], shm))
        self.sent = 0

    async def send(self, msg: Msg, timeout_s: float | None = None) -> None:
        frames = self.codec.encode(Kind.EVENT, 0, msg)
        try:
            if timeout_s is None:
                await self.sock.send_multipart(frames, copy=False)
            else:
                async with asyncio.timeout(timeout_s):
                    await self.sock.send_multipart(frames, copy=False)
        except TimeoutError:
            raise DeadlineExceeded(f"stream send of {type(msg).__name__} blocked for "
                                   f"{timeout_s:g} s (receiver slow or gone)") from None
        self.sent += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.codec.shm is not None:
            self.codec.shm.close()


class StreamReceiver:
    """Binds a PULL socket (an actor's inbox)."""

    def __init__(self, factory: SocketFactory, endpoint: str, counters: collections.Counter,
                 hwm: int = 64, limits: Limits | None = None, shm: ShmConfig | None = None,
                 name: str = ""):
        self.sock = factory.bind(zmq.PULL, endpoint, hwm=hwm)
        self.codec = Codec(limits, shm=channel_for(endpoint, shm))
        self.counters, self.name = counters, name
        self._log = RateLimitedLog(log)

    async def recv(self) -> Msg:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = self.codec.decode(frames)
            except WireError as e:  # the codec raises nothing else
                self.counters[f"inbox.refused_{e.code}"] += 1
                self._log.warning(str(e.code), f"{self.name}: dropped inbox message: {e}")
                continue
            self.counters["inbox.received"] += 1
            return msg.body

    def __aiter__(self):
        return self

    async def __anext__(self) -> Msg:
        return await self.recv()

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.codec.shm is not None:
            self.codec.shm.close()
