"""The router's view of its workers: who registered, how loaded they are, who is dead.

Load has two sources. Heartbeats report what a worker itself sees (running, waiting,
free blocks); ``services.router.ledger`` adds what the router has placed since, and is
the only writer of ``outstanding_tokens`` and ``reserved_blocks``.

A draining worker (``Draining``) stays in the table — its heartbeats, KV transfers and
``Finished`` reports go on as before — but is no candidate for new work:
``prefill_workers`` and ``decode_workers`` are the workers placement may choose.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import Heartbeat, Register, WorkerView
from common.roles import WorkerRole


@dataclass(slots=True, eq=False)
class WorkerInfo:
    worker_id: str
    role: WorkerRole
    kv_addr: str | None
    metrics_url: str
    num_blocks: int
    block_size: int
    max_model_len: int
    last_seen: float
    num_running: int = 0
    num_waiting: int = 0
    free_blocks: int = 0
    outstanding_tokens: int = 0  # prompt tokens placed here, prefill not yet done
    reserved_blocks: int = 0  # decode blocks promised to handoffs not yet arrived
    step_seconds: float | None = None  # its recent engine step time (None: not measured yet)
    prefill_s_per_token: float | None = None  # a prefill worker's measured compute cost
    transfer_s_per_token: float | None = None  # a prefill worker's measured link cost
    draining: bool = False  # shutting down: finishes what it holds, is given nothing new
    prefix_queries: int = 0  # the heartbeat's totals since the worker started
    prefix_hits: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0

    @property
    def can_prefill(self) -> bool:
        return self.role.can_prefill

    @property
    def can_decode(self) -> bool:
        return self.role.can_decode

    @property
    def available_blocks(self) -> int:
        return self.free_blocks - self.reserved_blocks


class Registry:
    """The live workers. ``workers`` is read by others but changed only here, so the views
    every placement reads (who can prefill, who can decode, the context limit) are
    rebuilt when the membership changes instead of on every request."""

    def __init__(self, heartbeat_timeout: float) -> None:
        self.timeout = heartbeat_timeout
        self.workers: dict[str, WorkerInfo] = {}
        self._prefill: list[WorkerInfo] = []
        self._prefill_rows: dict[str, int] = {}  # worker id -> its index in ``_prefill``
        self._decode: list[WorkerInfo] = []
        self._draining: list[WorkerInfo] = []
        self._max_model_len: int | None = None

    def _membership_changed(self) -> None:
        live = self.workers.values()
        self._prefill = [w for w in live if w.can_prefill and not w.draining]
        self._prefill_rows = {w.worker_id: i for i, w in enumerate(self._prefill)}
        self._decode = [w for w in live if w.can_decode and not w.draining]
        self._draining = [w for w in live if w.draining]
        self._max_model_len = min((w.max_model_len for w in live), default=None)

    def register(self, msg: Register, now: float) -> WorkerInfo:
        """Add (or re-add, after a restart) a worker; returns its fresh record."""
        info = WorkerInfo(msg.worker_id, msg.role, msg.kv_addr, msg.metrics_url, msg.num_blocks,
                          msg.block_size, msg.max_model_len, last_seen=now, free_blocks=msg.num_blocks)
        self.workers[msg.worker_id] = info
        self._membership_changed()
        return info

    def heartbeat(self, msg: Heartbeat, now: float) -> WorkerInfo | None:
        info = self.workers.get(msg.worker_id)
        if info is None:
            return None  # unknown: it must register first
        info.last_seen = now
        info.num_running, info.num_waiting = msg.num_running, msg.num_waiting
        info.free_blocks = msg.free_blocks
        info.step_seconds = msg.step_seconds
        info.prefill_s_per_token = msg.prefill_s_per_token
        info.transfer_s_per_token = msg.transfer_s_per_token
        info.prefix_queries, info.prefix_hits = msg.prefix_queries, msg.prefix_hits
        info.kv_bytes_sent, info.kv_bytes_received = msg.kv_bytes_sent, msg.kv_bytes_received
        return info

    def views(self, now: float) -> list[WorkerView]:
        """Every registered worker as a ``Roster`` carries it, in registration order."""
        return [WorkerView(w.worker_id, w.role, w.draining, max(now - w.last_seen, 0.0),
                           w.num_running, w.num_waiting, min(w.free_blocks, w.num_blocks),
                           w.num_blocks, w.outstanding_tokens, w.reserved_blocks,
                           w.prefix_queries, w.prefix_hits, w.kv_bytes_sent,
                           w.kv_bytes_received, w.step_seconds)
                for w in self.workers.values()]

    def expire(self, now: float) -> list[WorkerInfo]:
        """Drop workers silent for longer than the timeout; returns them."""
        dead = [w for w in self.workers.values() if now - w.last_seen > self.timeout]
        for w in dead:
            del self.workers[w.worker_id]
        if dead:
            self._membership_changed()
        return dead

    def remove(self, worker_id: str) -> WorkerInfo | None:
        info = self.workers.pop(worker_id, None)
        if info is not None:
            self._membership_changed()
        return info

    def drain(self, worker_id: str) -> WorkerInfo | None:
        """Mark a worker as draining; None if it is not registered."""
        info = self.workers.get(worker_id)
        if info is not None and not info.draining:
            info.draining = True
            self._membership_changed()
        return info

    def prefill_workers(self) -> list[WorkerInfo]:
        """Prefill-capable live workers that may take new work (not draining), in
        registration order (a fresh list)."""
        return list(self._prefill)

    def prefill_position(self, worker_id: str) -> int | None:
        """A worker's index in ``prefill_workers()`` (None: not among them)."""
        return self._prefill_rows.get(worker_id)

    def decode_workers(self) -> list[WorkerInfo]:
        """Decode-capable live workers that may take new work (not draining), in
        registration order (a fresh list)."""
        return list(self._decode)

    def draining_workers(self) -> list[WorkerInfo]:
        return list(self._draining)

    def max_model_len(self) -> int | None:
        """The smallest context limit among live workers (None when there are none)."""
        return self._max_model_len
