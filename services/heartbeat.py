"""A worker's heartbeat, from its own thread and socket.

An engine step can take seconds (a long prefill chunk on one core), and a busy worker is
not a dead one, so heartbeats do not wait for the loop. They stop when the loop itself
stops ticking for ``stall_seconds`` — a hung worker is reported dead by its silence.
"""

from __future__ import annotations

import threading
import time

import zmq

from common.protocol import Heartbeat, encode


class Heartbeater:
    def __init__(self, ctx: zmq.Context, router: str, worker_id: str, interval: float,
                 stall_seconds: float = 300.0) -> None:
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt_string(zmq.IDENTITY, f"{worker_id}/heartbeat")
        self._sock.connect(router)
        self._interval = interval
        self._stall = stall_seconds
        self.snapshot: Heartbeat | None = None  # replaced whole by the loop, read here
        self.last_tick = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._sock.close(linger=0)

    def _run(self) -> None:
        while not self._done.wait(self._interval):
            beat = self.snapshot
            if beat is not None and time.monotonic() - self.last_tick < self._stall:
                self._sock.send(encode(beat))
