"""The router's own account of the load it has placed, per request and per worker.

Heartbeats say what a worker saw a moment ago; this ledger adds what the router has sent
since: prompt tokens placed on a prefill worker whose prefill is not done, and blocks
promised to a decode worker for a handoff still on its way. So two placements in the
same instant do not both see the same idle worker.

The ledger is the only writer of ``WorkerInfo.outstanding_tokens`` and
``reserved_blocks``; each request's charge is taken back exactly once (``prefill_done``
releases the prefill side and the decode reservation, ``release`` whatever is left).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.router.registry import WorkerInfo


@dataclass(slots=True)
class Charge:
    prefill: str  # worker id
    tokens: int  # uncached prompt tokens charged to it
    decode: str | None  # worker id of the decode side, for a disaggregated request
    blocks: int  # reserved on the decode worker until the handoff lands
    prefill_done: bool = False

    def holders(self) -> set[str]:
        """Workers that still hold some of the request."""
        if self.decode is None:
            return {self.prefill}
        return {self.decode} if self.prefill_done else {self.prefill, self.decode}


class LoadLedger:
    def __init__(self, workers: Mapping[str, WorkerInfo]) -> None:
        self._workers = workers  # the registry's live table: dead workers are simply absent
        self._charges: dict[str, Charge] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._charges

    def get(self, request_id: str) -> Charge | None:
        return self._charges.get(request_id)

    def charge(self, request_id: str, prefill: WorkerInfo, tokens: int,
               decode: WorkerInfo | None = None, blocks: int = 0) -> Charge:
        if request_id in self._charges:
            raise ValueError(f"request {request_id} is charged already")
        c = Charge(prefill.worker_id, tokens, decode.worker_id if decode else None,
                   blocks if decode else 0)
        prefill.outstanding_tokens += c.tokens
        if decode is not None:
            decode.reserved_blocks += c.blocks
        self._charges[request_id] = c
        return c

    def prefill_done(self, request_id: str) -> None:
        """The prompt is computed and its KV has landed: only decoding is left."""
        c = self._charges.get(request_id)
        if c is None or c.prefill_done:
            return
        c.prefill_done = True
        if (w := self._workers.get(c.prefill)) is not None:
            w.outstanding_tokens -= c.tokens
        if c.decode is not None and (w := self._workers.get(c.decode)) is not None:
            w.reserved_blocks -= c.blocks

    def release(self, request_id: str) -> set[str]:
        """The request is over: take back whatever it still holds; returns the workers that
        held part of it until now (empty for an unknown request)."""
        c = self._charges.get(request_id)
        if c is None:
            return set()
        holders = c.holders()
        self.prefill_done(request_id)
        del self._charges[request_id]
        return holders

    def requests_on(self, worker_id: str) -> list[str]:
        """Requests that a worker still holds part of, oldest first."""
        return [rid for rid, c in self._charges.items() if worker_id in c.holders()]
