"""HTTP servers' start and stop, for every aiohttp server of the project (the inference
worker's SGLang-compatible API, the OpenAI-compatible endpoint environments talk to).

Invariant: a stopped server leaves no connection open. aiohttp's graceful shutdown closes the
connections it knows, but a client that reconnects as the server stops (a router retrying, its
health checks) can be accepted while that shutdown waits on in-flight requests, which then
forgets it (it clears its table of connections afterwards), or after the shutdown; nothing
else would close such a connection (it would be left to the garbage collector, a
ResourceWarning). `stop_http` closes every connection made once stopping began, and then any
connection the server accepted that is still open. The server's connections are held by
strong references until then: a connection aiohttp forgot is otherwise garbage at once, and
the collector (run by any thread, e.g. a model's forward) may take it, unclosed, before
`stop_http` reaches it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

SHUTDOWN_TIMEOUT_S = 1.0  # how long in-flight requests get to finish when a server stops
# per running server (start_http): each connection's handler -> its transport, from its
# arrival until it is lost; closed by stop_http if still open
_TRANSPORTS: dict[web.AppRunner, dict[Any, asyncio.BaseTransport]] = {}


async def start_http(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: any free port); returns the runner (stop it with
    `stop_http`) and the bound port."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                           handler_cancellation=True)
    await runner.setup()
    server = runner.server
    assert server is not None
    track, forget = server.connection_made, server.connection_lost
    transports: dict[Any, asyncio.BaseTransport] = {}

    def made(handler: Any, transport: asyncio.Transport) -> None:
        transports[handler] = transport
        track(handler, transport)

    def lost(handler: Any, exc: BaseException | None = None) -> None:
        transports.pop(handler, None)
        forget(handler, exc)

    server.connection_made = made  # type: ignore[method-assign]
    server.connection_lost = lost  # type: ignore[method-assign]
    _TRANSPORTS[runner] = transports
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        _TRANSPORTS.pop(runner, None)
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])


async def stop_http(runner: web.AppRunner) -> None:
    """`runner.cleanup()`, closing every connection made once stopping began (module doc)."""
    server = runner.server
    if server is not None:
        track = server.connection_made

        def close_on_arrival(handler: Any, transport: asyncio.Transport) -> None:
            track(handler, transport)
            handler.force_close()

        server.connection_made = close_on_arrival  # type: ignore[method-assign]
    try:
        await runner.cleanup()
    finally:  # whatever aiohttp's shutdown left open (it was cut short, or forgot one)
        for transport in list(_TRANSPORTS.pop(runner, {}).values()):
            if not transport.is_closing():
                transport.close()
