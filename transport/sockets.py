"""Socket creation: endpoints, limits, linger, and CURVE security in one place.

Sockets are plain (thread-bound) zmq sockets wrapped in `AsyncSocket`, which sends with NOBLOCK
first and waits on the socket's edge-triggered fd only when it must: no future per message on the
fast path (zmq.asyncio allocates several), which roughly doubles small-message round trips.

Invariant: actor code never sets socket security options itself. Every socket is made by a
`SocketFactory`, which applies CURVE (encryption plus client authentication) to `tcp://` endpoints
when the cluster's `Security` turns it on, and leaves `ipc://`/`inproc://` (same host, protected by
file permissions) alone. Each process makes its own zmq context after it starts. A bind that
fails raises `BindError`, one line naming the endpoint and what the failure means (an address
of another machine, a port in use), never zmq's own error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from transport.addresses import bind_advice
from transport.errors import RlxError

log = logging.getLogger(__name__)


def free_port(host: str) -> int:
    """A TCP port free right now on `host` (for a server or TCP store that binds it a moment
    later; another process could take it in between, which its bind then reports)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """True when `port` can be bound on `host` right now (SO_REUSEADDR, as servers bind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


class BindError(RlxError, OSError):
    """A socket could not bind its endpoint: `address`, `port` and `errno` say where and why,
    and the message is one line that says what it means (transport/addresses.py)."""

    def __init__(self, endpoint: str, error: zmq.ZMQError):
        scheme, _, rest = endpoint.partition("://")
        address, _, port = rest.rpartition(":") if scheme == "tcp" else (rest, "", "")
        self.endpoint, self.address, self.port = endpoint, address.strip("[]"), port
        super().__init__(f"cannot bind {endpoint}: "
                         f"{bind_advice(error.errno, self.address, port)}")
        self.errno = error.errno


class Security(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Transport security for tcp:// endpoints (ipc:// is protected by the run directory)."""

    # encrypt and authenticate tcp traffic with CURVE; None (not set): on for a run over several
    # machines (launch/config.py), off on one
    curve: bool | None = None
    # holds server.key_secret/server.key and client.key_secret/client.key; "" with curve on:
    # the launcher makes keys for the run (<run_dir>/keys, removed at the end)
    keys_dir: str = ""


def make_curve_keys(keys_dir: str | Path) -> None:
    """Write one server and one client keypair (zmq's certificate format) into keys_dir. The
    folder is made 0700 (an existing one must be this user's, and is set to 0700); each file is
    created new (an old one is removed first), the secret ones 0600 from their creation, so no
    other user can read a secret key at any moment, not even through a pre-existing file."""
    folder = Path(keys_dir)
    folder.parent.mkdir(parents=True, exist_ok=True)  # the run directory: its own mode
    old = os.umask(0o077)  # the folder and its files are never readable by others
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
    finally:
        os.umask(old)
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{folder} is not a folder of this user: the run's CURVE keys "
                              f"go into a private folder (give another keys_dir)")
    os.chmod(folder, 0o700)
    for name in ("server", "client"):
        public, secret = zmq.curve_keypair()
        _write_certificate(folder / f"{name}.key_secret", public, secret, 0o600)
        _write_certificate(folder / f"{name}.key", public, None, 0o644)


def _write_certificate(path: Path, public: bytes, secret: bytes | None, mode: int) -> None:
    """One certificate file as zmq.auth writes it, created (O_EXCL) with `mode`."""
    path.unlink(missing_ok=True)
    kind = "Secret" if secret else "Public"
    text = (f"#   ZeroMQ CURVE **{kind}** Certificate (rlx run keys)\n\nmetadata\ncurve\n"
            f"    public-key = \"{public.decode()}\"\n")
    if secret:
        text += f"    secret-key = \"{secret.decode()}\"\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)  # the umask may have narrowed a public file's mode


def check_secret_file(path: Path) -> None:
    """ValueError when a secret key file is missing or readable by group or others."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise ValueError(f"CURVE secret key {path} cannot be read: {e}; make the keys with "
                         "transport.sockets.make_curve_keys") from None
    if mode & 0o077:
        raise ValueError(f"CURVE secret key {path} is readable by others (mode "
                         f"{stat.S_IMODE(mode):o}); run: chmod 600 {path}")


def bound_endpoint(sock: zmq.Socket) -> str:
    """The endpoint actually bound (tcp port 0 resolved to the real port)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class AsyncSocket:
    """A zmq socket used from one asyncio loop; other attributes pass through to the socket."""

    _OWN = frozenset({"sock", "fd", "_waiters", "_loop"})

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.fd = sock.FD
        self._waiters: list[asyncio.Future] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # socket options (curve_server, router_mandatory, ...) reach the zmq socket
            setattr(self.sock, name, value)

    async def recv_multipart(self, copy: bool = False) -> list[Any]:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=copy)
                self._kick()
                return frames
            except zmq.Again:
                await self._wait(zmq.POLLIN)

    async def recv(self) -> bytes:
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
                self._kick()
                return data
            except zmq.Again:
                await self._wait(zmq.POLLIN)

    async def send_multipart(self, frames: list[Any], copy: bool = False) -> None:
        while True:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
                self._kick()
                return
            except zmq.Again:
                await self._wait(zmq.POLLOUT)

    def send_nowait(self, frames: list[Any]) -> None:
        """Send now or raise zmq.Again (queue full or, for some types, no peer)."""
        self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        self._kick()

    def _kick(self) -> None:
        """Any operation may consume the fd's edge: wake waiters whose event is now ready."""
        if self._waiters and self.sock.getsockopt(zmq.EVENTS):
            self._wake()

    async def _wait(self, event: int) -> None:
        # zmq's fd is edge-triggered: reading EVENTS re-arms it, so check before sleeping
        while not self.sock.getsockopt(zmq.EVENTS) & event:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            fut = self._loop.create_future()
            if not self._waiters:
                self._loop.add_reader(self.fd, self._wake)
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
                    if not self._waiters:
                        self._loop.remove_reader(self.fd)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        self._loop.remove_reader(self.fd)
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def close(self, linger: int = 0) -> None:
        if self._waiters:
            self._loop.remove_reader(self.fd)
            for fut in self._waiters:
                fut.cancel()
            self._waiters = []
        self.sock.close(linger=linger)


class SocketFactory:
    """Makes sockets on one context with the cluster's security and sane defaults."""

    def __init__(self, ctx: zmq.Context | None = None, security: Security | None = None):
        self.ctx = ctx or zmq.Context()
        self.security = security or Security()
        self._keys: dict[str, tuple[bytes, bytes]] = {}
        self._auth = None

    def bind(self, kind: int, endpoint: str, hwm: int | None = None) -> AsyncSocket:
        sock = self._socket(kind, hwm)
        if self.security.curve and endpoint.startswith("tcp://"):
            self._start_authenticator()
            public, secret = self._keypair("server")
            sock.curve_server = True
            sock.curve_secretkey = secret
            sock.curve_publickey = public
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close()
            raise BindError(endpoint, e) from None
        return sock

    def bind_thread_socket(self, kind: int, endpoint: str, hwm: int | None = None) -> zmq.Socket:
        """A plain zmq socket, secured and bound like `bind`, for a socket that lives in a zmq
        thread (the metrics proxy) instead of the asyncio loop."""
        return self.bind(kind, endpoint, hwm).sock

    def connect(self, kind: int, endpoint: str, hwm: int | None = None) -> AsyncSocket:
        sock = self._socket(kind, hwm)
        if self.security.curve and endpoint.startswith("tcp://"):
            public, secret = self._keypair("client")
            sock.curve_serverkey = self._server_public()
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        sock.connect(endpoint)
        return sock

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.destroy(linger=0)

    def _socket(self, kind: int, hwm: int | None) -> AsyncSocket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        if hwm is not None:
            sock.sndhwm = hwm
            sock.rcvhwm = hwm
        return AsyncSocket(sock)

    def _keypair(self, name: str) -> tuple[bytes, bytes]:
        if name not in self._keys:
            if not self.security.keys_dir:
                raise ValueError("security.curve = true needs security.keys_dir (a folder with "
                                 "server.key_secret and client.key_secret; see make_curve_keys)")
            path = Path(self.security.keys_dir) / f"{name}.key_secret"
            check_secret_file(path)
            self._keys[name] = zmq.auth.load_certificate(str(path))
        return self._keys[name]

    def _server_public(self) -> bytes:
        self._keypair("client")  # validates keys_dir
        return zmq.auth.load_certificate(str(Path(self.security.keys_dir) / "server.key"))[0]

    def _start_authenticator(self) -> None:
        """ZAP handler: only clients holding the cluster's client key may connect."""
        if self._auth is not None:
            return
        self._auth = ThreadAuthenticator(self.ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=self.security.keys_dir)


class RateLimitedLog:
    """Logs at most one line per key per `interval_s`, reporting how many were suppressed."""

    def __init__(self, logger: logging.Logger, interval_s: float = 5.0):
        self.logger, self.interval_s = logger, interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, text: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        skipped = self._suppressed.pop(key, 0)
        self._last[key] = now
        self.logger.warning("%s%s", text, f" ({skipped} similar suppressed)" if skipped else "")
