"""A worker's graceful shutdown, as one small state: asked, started, released, overdue.

SIGTERM (or SIGINT) asks for a drain; the worker's loop starts it (``Draining`` to the
router), goes on serving what it holds, and leaves (``Deregister``, exit 0) as soon as the
router has released it (``Drained``: none of its placements is left) and nothing is left
locally — no request, no KV arriving, no transfer out of its blocks in flight. At the
deadline, or on a second signal, it leaves anyway and hands what is left over: each
request fails back to its gateway as retryable, and the gateway continues it elsewhere.

The signal handler only counts (``ask``); everything else runs on the worker's loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum


class Leave(Enum):
    """What the worker's loop should do about its drain on this tick."""

    STAY = "stay"  # not draining, or still finishing its work
    NOW = "now"  # released and idle: leave, nothing to hand over
    HAND_OVER = "hand over"  # the deadline passed or a second signal came: hand over, leave


class DrainState:
    """One worker's drain. ``timeout``: seconds from the start of the drain to its deadline."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        if timeout < 0:
            raise ValueError(f"drain timeout must be >= 0, got {timeout:g}")
        self.timeout = timeout
        self._clock = clock
        self.asked = 0  # signals received (written by the signal handler only)
        self.deadline: float | None = None  # set when the drain starts
        self.released = False  # the router answered Drained since the last registration

    def ask(self) -> None:
        """A signal came (safe to call from a signal handler: it only counts)."""
        self.asked += 1

    @property
    def started(self) -> bool:
        return self.deadline is not None

    def start(self) -> bool:
        """Begin the drain if it was asked for and has not begun; True when it begins now."""
        if self.asked == 0 or self.started:
            return False
        self.deadline = self._clock() + self.timeout
        return True

    def rejoined(self) -> None:
        """A new registration: the router must release this worker again."""
        self.released = False

    def decide(self, idle: bool, registered: bool) -> Leave:
        """``idle``: nothing is left locally. ``registered``: the router knows this worker
        (an unregistered worker has nothing of the router's to wait for)."""
        if not self.started:
            return Leave.STAY
        if idle and (self.released or not registered):
            return Leave.NOW
        if self.asked > 1 or self._clock() >= self.deadline:
            return Leave.HAND_OVER
        return Leave.STAY
