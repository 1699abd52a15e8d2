"""Admission: a bounded priority queue in front of placement, with clear refusals.

A request the workers cannot take right now (every prefill worker over its token
budget, or no decode worker with room) waits here, in the order it will be served:
by priority (vLLM's semantics: lower first, default 0), then by arrival, so with no
priorities given it is plain FCFS. The queue never
grows past ``max_queue``, and nothing waits longer than ``timeout``: the gateway turns
the refusal into HTTP 429 (queue full) or 503 (nothing to serve it, or waited too long)
with a ``Retry-After`` instead of letting latency grow without bound.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    reason: str
    retry_after: float


@dataclass(slots=True)
class _Waiting(Generic[T]):
    item: T
    since: float
    key: tuple[int, int] = field(default=(0, 0))  # (priority, arrival number)


class AdmissionQueue(Generic[T]):
    def __init__(self, max_queue: int, timeout: float) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = max_queue
        self.timeout = timeout
        self._queue: list[_Waiting[T]] = []  # in serving order
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._queue)

    def offer(self, item: T, now: float, priority: int = 0) -> Refusal | None:
        """Queue ``item`` behind everything of its priority or lower (a smaller or equal
        value); a Refusal when the queue is full."""
        if len(self._queue) >= self.max_queue:
            return Refusal(429, f"server busy: {len(self._queue)} requests already queued",
                           retry_after=1.0)
        waiting = _Waiting(item, now, (priority, next(self._arrivals)))
        bisect.insort_right(self._queue, waiting, key=lambda w: w.key)
        return None

    def waiting(self) -> Iterator[T]:
        """Queued items in serving order: by priority, then oldest first."""
        return (w.item for w in self._queue)

    def remove(self, item: T) -> bool:
        """Take out this very item (by identity: equal items are distinct requests)."""
        for i, w in enumerate(self._queue):
            if w.item is item:
                del self._queue[i]
                return True
        return False

    def expired(self, now: float) -> list[T]:
        """Take out everything that has waited longer than the timeout."""
        old = [w.item for w in self._queue if now - w.since > self.timeout]
        self._queue = [w for w in self._queue if now - w.since <= self.timeout]
        return old

    def refusal_for_timeout(self) -> Refusal:
        return Refusal(503, f"no worker could take the request within {self.timeout:g} s",
                       retry_after=2.0)
