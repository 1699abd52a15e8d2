"""Noticing at once that a client has gone: a task that waits on the ASGI ``receive()``.

Starlette's ``Request.is_disconnected`` only peeks, so a request busy receiving tokens
would notice a closed connection only when it next thought to ask. ``ClientWatch`` awaits
``receive()`` for ``http.disconnect`` in its own task from the moment the body is read:
the request races its admission and every wait for tokens against it (``race``), and the
watch itself calls ``on_gone`` (the request's abort) the instant the client leaves — even
if nothing is waiting at that moment, or a streaming response never started iterating.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
Receive = Callable[[], Awaitable[dict[str, Any]]]
log = logging.getLogger("tandem.gateway")


class ClientGone(Exception):
    """The client closed its connection before the response was complete."""


class ClientWatch:
    """Watches one request's connection; ``close`` it once the response is done, since
    the server reports a finished response as a disconnect too."""

    def __init__(self, receive: Receive) -> None:
        self.on_gone: Callable[[], Awaitable[None]] | None = None
        self._task = asyncio.create_task(self._watch(receive))
        self._reaction: asyncio.Task | None = None  # on_gone, run on its own

    @property
    def gone(self) -> bool:
        return self._task.done() and not self._task.cancelled()

    async def race(self, work: Awaitable[T], timeout: float | None = None) -> T:
        """``work``'s result; ``ClientGone`` if the client leaves first, ``TimeoutError``
        after ``timeout`` seconds. ``work`` is cancelled whenever it does not win."""
        job = asyncio.ensure_future(work)
        try:
            if not self.gone:
                await asyncio.wait({job, self._task}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            if self.gone:
                raise ClientGone()
            if not job.done():
                raise TimeoutError()
            return job.result()
        finally:
            if not job.done():
                job.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await job

    def close(self) -> None:
        if not self._task.done():
            self._task.cancel()

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # more body (none is expected once it was read): keep listening
        if self.on_gone is not None:  # in its own task, so ``gone`` is true from now on
            self._reaction = asyncio.create_task(self._react(self.on_gone))

    @staticmethod
    async def _react(on_gone: Callable[[], Awaitable[None]]) -> None:
        try:
            await on_gone()
        except Exception:  # the request is gone either way; say why it was not aborted
            log.exception("aborting a request whose client left failed")
