"""The process's UCX runtime: the optional ``ucxx`` import and the one asyncio event
loop, on a daemon thread, that runs every ucxx call.

Why one loop per process and not one per object: ucxx keeps a single application
context (one UCX worker) per process, and with ``enable_python_future`` its notifier
thread completes request futures on the loop that created the context. Without that
option every pending receive busy-polls its loop (``asyncio.sleep(0)``), burning a core
per idle connection. So the context is created once, inside the shared loop, with
futures on; the notifier thread then inherits the loop thread's daemon flag and never
holds up interpreter exit.

Which transports UCX may use is fixed when the context is created, so ``UCX_OPTIONS``
are passed then (a ``UCX_*`` environment variable of the same name still wins). Our
endpoints are created with peer-failure handling (a dead peer must fail its transfers,
not hang or abort the process), and in that mode UCX only puts rendezvous on a transport
whose memory domain can invalidate remote access; cma claims that only when told to,
so without ``CMA_MEMORY_INVALIDATE`` every block went through tcp on loopback.
What invalidation would guard (a reader still copying blocks the sender has freed) the
transfer's commit message guards instead (``framing``).

Caveats: the loop thread and UCX do not survive ``fork`` (start workers with spawn), and
ucxx's progress thread ("thread" mode, ours) makes CUDA device 0 current at start,
so on a GPU machine each process using this transport holds a CUDA context there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any

# UCX warns about every UCX_* variable it does not know, and ucxx sets some at import
# that this UCX no longer reads; UCX's documented switch turns that off. It only works
# before ucxx is first imported in the process; setdefault lets a user's choice win.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

try:
    import ucxx
except ImportError:  # the optional ``ucx`` extra is not installed
    ucxx = None

# Context options (UCX_ prefix dropped). Peer-failure mode keeps the tcp lanes for
# messages (the shared-memory fifos cannot detect a dead peer); this lets rendezvous,
# i.e. every KV block, be read in place by the receiver over cma (one copy, no socket).
UCX_OPTIONS = {"CMA_MEMORY_INVALIDATE": "y"}
# How the UCX worker is progressed (ucxx's UCXPY_PROGRESS_MODE still wins): "thread", a
# progress thread that sleeps in the worker's event fd, with ucxx's notifier thread
# completing request futures on our loop. Only the thread modes run the notifier: in
# "blocking" (this transport's mode until 2026-12-07) ucxx falls back to futures that
# poll with asyncio.sleep(0), so every pending receive (a receiver waiting for the next
# transfer, a sender for acks) spun the loop: an idle prefill and decode worker at 100% of
# a CPU each once their first transfer had connected them. It looked faster in
# `tandem bench kv-transfer --transports ucx` (3,913 against 2,911 MB/s, machine F) only
# because the two benchmark processes had nothing else to run.
PROGRESS_MODE = "thread"
MISSING = "UCX transport needs the ucx extra: pip install 'tandem[ucx]'"
CLOSE_TIMEOUT_S = 10.0


def ucx_available() -> bool:
    """Whether the optional ucxx package could be imported."""
    return ucxx is not None


log = logging.getLogger("tandem.connector")


class UcxLoop:
    """The one asyncio loop (daemon thread) that runs every ucxx call in this process."""

    _instance: UcxLoop | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> UcxLoop:
        if ucxx is None:
            raise RuntimeError(MISSING)
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tandem-ucx", daemon=True)
        self._thread.start()
        self.run(self._init_ucx())

    @staticmethod
    async def _init_ucx() -> None:
        # Inside the loop thread, so ucxx binds its futures to this loop and its
        # notifier thread is a daemon like this one.
        with contextlib.suppress(RuntimeError):  # already initialised here: use that context
            ucxx.init(options=UCX_OPTIONS, env_takes_precedence=True, enable_python_future=True,
                      progress_mode=os.environ.get("UCXPY_PROGRESS_MODE", PROGRESS_MODE))

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = CLOSE_TIMEOUT_S) -> Any:
        """Run ``coro`` on the loop and wait for its result (never call from the loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def shut_down(self, owner: str, coro: Coroutine[Any, Any, Any]) -> None:
        """Run an owner's shutdown on the loop; a stuck or stopped loop is logged, not
        raised (the process is going away anyway)."""
        try:
            self.run(coro, timeout=CLOSE_TIMEOUT_S + 5)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            coro.close()
            log.warning("ucx: %s did not close cleanly: %s", owner, type(e).__name__)


class TaskSet:
    """Strong references to fire-and-forget tasks (asyncio keeps only weak ones)."""

    def __init__(self) -> None:
        self._live: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._live.add(task)
        task.add_done_callback(self._live.discard)
        return task

    def cancel_others(self) -> None:
        current = asyncio.current_task()
        for task in list(self._live):
            if task is not current:
                task.cancel()

    async def cancel_all(self) -> None:
        tasks = list(self._live)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
