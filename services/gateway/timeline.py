"""Recent requests as this gateway saw them, phase by phase (``/dashboard``'s timeline).

A request's phases come from what reaches the gateway, on its own clock:

- **queue**: its ``Submit`` left → the router's ``Admitted`` (waiting for a worker);
- **prefill**: admitted → its first token (which the prefill worker sends at once);
- **transfer**: first token → the first token from a second worker (the decode worker,
  once the KV has arrived there and joined its batch); none when one worker did both
  (colocated, or a prompt prefilled on its decode worker);
- **decode**: from there to the last token.

``Tokens.worker_id`` says which worker produced each message, so the second worker is
seen without asking anyone. ``Timeline`` keeps the open requests and the last
``capacity`` finished ones; the gateway's event loop is its only user.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

PHASES = ("queue", "prefill", "transfer", "decode")


@dataclass(slots=True, eq=False)
class RequestTrace:
    request_id: str
    submitted: float
    admitted: float | None = None
    first_token: float | None = None
    handoff: float | None = None  # the first token from a second worker
    finished: float | None = None
    outcome: str | None = None  # a finish reason, "abort" or "rejected"; None while open
    workers: list[str] = field(default_factory=list)  # in the order they produced tokens
    output_tokens: int = 0

    def saw_tokens(self, worker_id: str, count: int, now: float) -> None:
        """A ``Tokens`` message with ``count`` tokens arrived from ``worker_id``."""
        if self.admitted is None:  # tokens before the Admitted was read: admitted by then
            self.admitted = now
        if self.first_token is None:
            self.first_token = now
        if worker_id and worker_id not in self.workers:
            if self.workers and self.handoff is None:
                self.handoff = now
            self.workers.append(worker_id)
        self.output_tokens += count

    def phase(self, awaiting_handoff: bool = False) -> str:
        """The phase it is in now, or its outcome once it ended. ``awaiting_handoff``: its
        first token came from a prefill-only worker, so a decode worker is still to come."""
        if self.outcome is not None:
            return self.outcome
        if self.admitted is None:
            return "queue"
        if self.first_token is None:
            return "prefill"
        return "transfer" if awaiting_handoff and self.handoff is None else "decode"

    def durations(self, now: float, awaiting_handoff: bool = False) -> dict[str, float]:
        """Seconds spent in each phase so far (an open phase runs until ``now``); a phase
        it never reached is absent (``awaiting_handoff`` as for ``phase``)."""
        end = self.finished if self.finished is not None else now
        handoff = self.handoff
        if handoff is None and awaiting_handoff and self.finished is None:
            handoff = now + 1.0  # still on its way: transfer runs until now, no decode yet
        marks = [self.submitted, self.admitted, self.first_token,
                 handoff if handoff is not None else self.first_token, None]
        out: dict[str, float] = {}
        for name, start, stop in zip(PHASES, marks, marks[1:], strict=True):
            if start is None:
                break
            stop = end if stop is None else min(stop, end)
            out[name] = max(stop - start, 0.0)
            if stop >= end:
                break
        if handoff is None:
            out.pop("transfer", None)
        return out


class Timeline:
    """The open requests and the most recent ``capacity`` finished ones."""

    def __init__(self, capacity: int = 50, max_open: int = 1000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._open: OrderedDict[str, RequestTrace] = OrderedDict()
        self._done: deque[RequestTrace] = deque(maxlen=capacity)
        self._max_open = max_open

    def start(self, request_id: str) -> RequestTrace:
        trace = RequestTrace(request_id, self.clock())
        self._open[request_id] = trace
        while len(self._open) > self._max_open:  # a leak would need a bug; bound it anyway
            self._open.popitem(last=False)
        return trace

    def end(self, trace: RequestTrace, outcome: str) -> None:
        if trace.outcome is not None:
            return
        trace.finished, trace.outcome = self.clock(), outcome
        if self._open.pop(trace.request_id, None) is not None:
            self._done.append(trace)

    def recent(self) -> list[RequestTrace]:
        """Open requests, then finished ones, newest first in each."""
        return [*reversed(self._open.values()), *reversed(self._done)]
