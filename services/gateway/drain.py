"""The gateway's graceful shutdown: on SIGTERM it refuses new requests (an OpenAI-style
503 with ``Retry-After``; ``/ready`` answers 503) while the open ones finish, for up to
``--drain-timeout`` seconds; then uvicorn stops. A second SIGTERM or SIGINT stops at once.

``OpenRequests`` is the count (a plain ASGI middleware: a streamed response is open until
its last byte is sent); ``serve`` runs the app under a uvicorn server whose first exit
signal starts the drain instead of the shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("tandem.gateway")
FORCED_CLOSE_S = 2.0  # after the drain, what uvicorn still gives a connection left open


class GatewayDrain:
    """Whether the gateway is draining, and how many API requests are open (loop thread)."""

    def __init__(self) -> None:
        self.draining = False
        self.open = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def opened(self) -> None:
        self.open += 1
        self._idle.clear()

    def closed(self) -> None:
        self.open -= 1
        if self.open == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Until no API request is open (True) or ``timeout`` seconds passed (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False


class OpenRequests:
    """ASGI middleware: counts the POSTs under ``/v1/`` from arrival to their last byte."""

    def __init__(self, app: ASGIApp, drain: GatewayDrain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or not scope.get("path", "").startswith("/v1/")):
            await self.app(scope, receive, send)
            return
        self.drain.opened()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.closed()


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: GatewayDrain, grace: float) -> None:
        super().__init__(config)
        self.drain, self.grace = drain, grace
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self._loop is None:  # a second signal: stop at once
            self.should_exit = self.force_exit = True
            return
        self.drain.draining = True  # from here on new requests get 503 (read on the loop)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        log.info("draining: refusing new requests, %d open, up to %g s", self.drain.open, self.grace)
        if not await self.drain.wait_idle(self.grace):
            log.warning("drain timeout: %d requests still open are cut", self.drain.open)
        self.should_exit = True


def serve(app, host: str, port: int) -> None:
    """Run the gateway app (``create_app``) until it has drained or is stopped."""
    gw = app.state.gateway
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=FORCED_CLOSE_S)
    DrainingServer(config, gw.drain, gw.settings.drain_timeout).run()
