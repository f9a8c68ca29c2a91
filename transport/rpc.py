"""Request/reply over ROUTER (server) and DEALER (client) with reply matching and deadlines.

Invariants: every REQUEST that can be attributed to a request id gets exactly one answer, a reply
or a typed `ErrorReply`; anything that cannot be attributed (garbage, events on a request socket)
is dropped and counted, logged at a limited rate, and the server keeps serving: the codec checks
every `Limits` limit before decoding and raises only `WireError`, and no exception leaves the
receive loop. A client call
either returns the reply, raises `RemoteError` with the server's error code, or raises
`DeadlineExceeded` when its per-call deadline passes (a dead peer never hangs a caller).

Roles: a request type a server takes from one role only (the buffer's GetBatch and
VersionUpdate: the trainer's) is answered `forbidden` unless this connection's HELLO proved that
role: with a run token (the launcher gives every actor of a run the same one), the HELLO carries
an HMAC of its actor name and role under it; without one (an actor run on its own), the claim
is taken as said. A client answered `forbidden` handshakes again and sends once more (a server
that restarted knows none of its old connections).
Sockets are owned by their server/client object and used from its event loop thread only.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import inspect
import itertools
import logging
import os
from typing import Any, Awaitable, Callable

import zmq

from transport.codec import Codec, Limits, WireError
from transport.errors import RlxError
from transport.schema import PROTOCOL_VERSION, ErrorCode, ErrorReply, Hello, Kind, Msg, Welcome
from transport.shm import ShmConfig, channel_for
from transport.sockets import RateLimitedLog, SocketFactory

log = logging.getLogger(__name__)
Handler = Callable[[Msg], Awaitable[Msg] | Msg]  # plain functions answer inline, no task
MAX_KNOWN_CALLERS = 4096  # connections whose proven role a server remembers (oldest forgotten)


def role_proof(token: str, actor: str, role: str) -> str:
    """What a HELLO of `actor` in `role` carries under the run's `token` (hex HMAC-SHA256)."""
    return hmac.new(token.encode(), f"{actor}\0{role}".encode(), hashlib.sha256).hexdigest()


class RemoteError(RlxError):
    """The peer answered with an ErrorReply."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class DeadlineExceeded(RemoteError, TimeoutError):
    def __init__(self, message: str):
        super().__init__(ErrorCode.DEADLINE, message)


class RpcServer:
    """Serves typed requests on a bound ROUTER socket; one task per request."""

    def __init__(self, factory: SocketFactory, endpoint: str, name: str,
                 handlers: dict[type, Handler], counters: collections.Counter,
                 limits: Limits | None = None, spawn: Callable[..., Any] | None = None,
                 prefix: str = "rpc", shm: ShmConfig | None = None, token: str = "",
                 roles: dict[type, str] | None = None):
        self.name, self.counters, self.prefix = name, counters, prefix
        self.handlers: dict[type, Handler] = {Hello: self._hello, **handlers}
        self.token, self.roles = token, roles or {}
        self._callers: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._is_async = {t: inspect.iscoroutinefunction(h) for t, h in self.handlers.items()}
        self.sock = factory.bind(zmq.ROUTER, endpoint)
        self.sock.router_mandatory = True  # unroutable replies raise, so they are counted
        self.codec = Codec(limits, shm=channel_for(endpoint, shm))
        self._spawn = spawn or asyncio.ensure_future
        self._log = RateLimitedLog(log)
        self.accepting = True

    async def serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                self._dispatch(frames)
            except Exception as e:  # noqa: BLE001 - no input may end the receive loop
                self._count("refused_internal")
                self._log.warning(f"{self.prefix}:internal", f"{self.name}: dropped a message "
                                  f"that failed dispatch: {type(e).__name__}: {e}")

    def _dispatch(self, frames: list[Any]) -> None:
        ident, rest = frames[0].bytes, frames[1:]
        try:
            msg = self.codec.decode(rest)
        except WireError as e:
            self._count(f"refused_{e.code}")
            self._log.warning(f"{self.prefix}:{e.code}", f"{self.name}: refused message: {e}")
            if e.kind == Kind.REQUEST and e.req_id:
                self._send(ident, Kind.ERROR, e.req_id, ErrorReply(code=e.code, message=e.message))
            return
        if msg.kind != Kind.REQUEST:
            self._count("refused_not_request")
            self._log.warning(f"{self.prefix}:kind", f"{self.name}: dropped a {msg.kind.name}")
            return
        handler = self.handlers.get(type(msg.body))
        rtype = type(msg.body).__name__
        if self._forbidden(ident, msg.req_id, type(msg.body)):
            return
        if handler is None or not self.accepting:
            code = ErrorCode.NO_HANDLER if handler is None else ErrorCode.SHUTTING_DOWN
            self._count(f"refused_{code}")
            self._send(ident, Kind.ERROR, msg.req_id, ErrorReply(
                code=code, message=f"{self.name} does not serve {rtype} now", request_type=rtype))
            return
        self._count("requests")
        if isinstance(msg.body, Hello):  # the one handler that needs the connection
            self._reply(ident, msg.req_id, self._hello(msg.body, ident))
            return
        if self._is_async[type(msg.body)]:
            self._spawn(self._handle(ident, msg.req_id, rtype, handler, msg.body))
            return
        try:
            reply = handler(msg.body)
        except Exception as e:  # a failing handler is the caller's answer, not our crash
            reply = self._failed(rtype, e)
        self._reply(ident, msg.req_id, reply)

    async def _handle(self, ident: bytes, req_id: int, rtype: str, handler: Handler, body: Msg):
        try:
            reply = await handler(body)
        except Exception as e:  # a failing handler is the caller's answer, not our crash
            reply = self._failed(rtype, e)
        self._reply(ident, req_id, reply)

    def _failed(self, rtype: str, e: Exception) -> ErrorReply:
        self._count("handler_errors")
        log.exception("%s: handler for %s failed", self.name, rtype)
        return ErrorReply(code=ErrorCode.HANDLER_ERROR, message=f"{type(e).__name__}: {e}",
                          request_type=rtype)

    def _reply(self, ident: bytes, req_id: int, reply: Msg) -> None:
        kind = Kind.ERROR if isinstance(reply, ErrorReply) else Kind.REPLY
        self._send(ident, kind, req_id, reply)

    def _send(self, ident: bytes, kind: Kind, req_id: int, body: Msg) -> None:
        try:
            frames = self.codec.encode(kind, req_id, body)
        except Exception as e:  # noqa: BLE001 - the caller still gets exactly one answer
            self._count("handler_errors")
            log.error("%s: reply %s not encodable: %s", self.name, type(body).__name__, e)
            frames = self.codec.encode(Kind.ERROR, req_id, ErrorReply(
                code=ErrorCode.HANDLER_ERROR, message=f"reply not encodable: {e}",
                request_type=type(body).__name__))
        try:
            self.sock.send_nowait([ident, *frames])
        except zmq.ZMQError:  # peer gone (EHOSTUNREACH) or its queue full (EAGAIN)
            self._count("replies_dropped")

    def _hello(self, msg: Hello, ident: bytes = b"") -> Msg:
        if msg.protocol != PROTOCOL_VERSION:
            return ErrorReply(code=ErrorCode.PROTOCOL_MISMATCH, message=(
                f"{msg.actor or 'peer'} speaks protocol {msg.protocol}, {self.name} speaks "
                f"{PROTOCOL_VERSION}; run the same version of the project on every host"))
        if msg.role:
            self._grant(ident, msg)
        return Welcome(protocol=PROTOCOL_VERSION, actor=self.name)

    def _grant(self, ident: bytes, msg: Hello) -> None:
        """Remember the role `msg` proved for this connection (none if its proof is wrong)."""
        self._callers.pop(ident, None)
        if self.token and not hmac.compare_digest(
                msg.proof, role_proof(self.token, msg.actor, msg.role)):
            self._count("refused_proof")
            self._log.warning(f"{self.prefix}:proof", f"{self.name}: a handshake claimed "
                              f"{msg.actor!r} as {msg.role!r} without the run's proof; its "
                              f"connection gets no role")
            return
        self._callers[ident] = msg.role
        if len(self._callers) > MAX_KNOWN_CALLERS:
            self._callers.popitem(last=False)

    def _forbidden(self, ident: bytes, req_id: int, mtype: type) -> bool:
        """Answer `forbidden` (and True) when `mtype` needs a role this connection lacks."""
        needed = self.roles.get(mtype)
        if needed is None or self._callers.get(ident) == needed:
            return False
        self._count("refused_forbidden")
        rtype = mtype.__name__
        self._log.warning(f"{self.prefix}:forbidden", f"{self.name}: refused {rtype} from a "
                          f"connection that is not the {needed}'s")
        self._send(ident, Kind.ERROR, req_id, ErrorReply(
            code=ErrorCode.FORBIDDEN, request_type=rtype, message=(
                f"{self.name} takes {rtype} from its {needed} only, and this connection's "
                f"handshake proved {self._callers.get(ident) or 'no role'} (an actor of this "
                f"run connects as its role; a tool may only observe)")))
        return True

    def _count(self, key: str) -> None:
        self.counters[f"{self.prefix}.{key}"] += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.codec.shm is not None:
            self.codec.shm.close()


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class RpcClient:
    """Calls one peer over a DEALER socket; replies are matched to calls by request id."""

    def __init__(self, factory: SocketFactory, endpoint: str, name: str = "",
                 timeout_s: float = 10.0, limits: Limits | None = None,
                 shm: ShmConfig | None = None, role: str = "", token: str = ""):
        self.endpoint, self.name, self.timeout_s = endpoint, name, timeout_s
        self.role, self.token = role, token
        self.sock = factory.connect(zmq.DEALER, endpoint)
        self.codec = Codec(limits, shm=channel_for(endpoint, shm))
        self.counters: collections.Counter = collections.Counter()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._log = RateLimitedLog(log)
        self.peer = ""

    async def handshake(self, timeout_s: float | None = None) -> Welcome:
        """HELLO/WELCOME: fails with RemoteError(protocol_mismatch) on a version mismatch."""
        proof = role_proof(self.token, self.name, self.role) if self.token and self.role else ""
        reply = await self._call(Hello(protocol=PROTOCOL_VERSION, actor=self.name,
                                       role=self.role, pid=os.getpid(), proof=proof), timeout_s)
        assert isinstance(reply, Welcome)
        self.peer = reply.actor
        return reply

    async def call(self, msg: Msg, timeout_s: float | None = None) -> Msg:
        """The reply to `msg`; a `forbidden` answer to a client with a role is met by one new
        handshake and one more try (a restarted server does not know this connection)."""
        try:
            return await self._call(msg, timeout_s)
        except RemoteError as e:
            if e.code != ErrorCode.FORBIDDEN or not self.role or isinstance(msg, Hello):
                raise
        await self.handshake(timeout_s)
        return await self._call(msg, timeout_s)

    async def _call(self, msg: Msg, timeout_s: float | None = None) -> Msg:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())
        req_id = next(self._ids)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending[req_id] = fut
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        timer = loop.call_later(timeout_s, _expire, fut)
        try:
            frames = self.codec.encode(Kind.REQUEST, req_id, msg)
            try:
                self.sock.send_nowait(frames)
            except zmq.Again:  # no peer yet or queue full: wait, bounded by the deadline
                send = asyncio.ensure_future(self.sock.send_multipart(frames))
                await asyncio.wait({send, fut}, return_when=asyncio.FIRST_COMPLETED)
                if not send.done():
                    send.cancel()
            return await fut
        except TimeoutError:
            self.counters["deadlines"] += 1
            raise DeadlineExceeded(f"{type(msg).__name__} to {self.endpoint} got no answer "
                                   f"within {timeout_s:g} s") from None
        finally:
            timer.cancel()
            self._pending.pop(req_id, None)

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = self.codec.decode(frames)
            except WireError as e:  # the codec raises nothing else
                self.counters[f"refused_{e.code}"] += 1
                self._log.warning(str(e.code), f"client of {self.endpoint}: refused reply: {e}")
                fut = self._pending.get(e.req_id)
                if fut is not None and not fut.done():
                    fut.set_exception(RemoteError(e.code, e.message))
                continue
            fut = self._pending.get(msg.req_id)
            if fut is None or fut.done():
                self.counters["late_replies"] += 1
                continue
            if msg.kind == Kind.ERROR and isinstance(msg.body, ErrorReply):
                fut.set_exception(RemoteError(msg.body.code, msg.body.message))
            else:
                fut.set_result(msg.body)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        for fut in self._pending.values():
            fut.cancel()
        self.sock.close(linger=0)
        if self.codec.shm is not None:
            self.codec.shm.close()
