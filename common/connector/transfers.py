"""A worker's bookkeeping of KV transfers, one small object per direction.

``OutgoingTransfers`` (prefill side): every transfer it opens ends exactly once — acked,
nacked, expired or cancelled — and each end comes back as a ``TransferOutcome`` naming
the request, so the worker frees that request's blocks exactly once and records the
bytes and seconds it took. It owns the leases (``LeaseTable``), the send times and the
attempt count: a transfer that failed (nacked or expired, not cancelled) before its
``max_attempts``-th attempt comes back with ``retry`` set and what the worker gave to send
it again (``resend``) — its blocks are still lent, so it can go again under a new id.

``IncomingTransfers`` (decode side): transfers that arrived but wait for free cache
blocks, and the requests aborted before their KV arrived (a late transfer for one of
those is dropped, never admitted). A waiting transfer never holds borrowed blocks past
its ack: ``own_borrowed`` copies them out first.

Neither touches blocks, sockets or the engine: the worker does what an outcome says.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from common.connector.base import ReceivedTransfer, owned
from common.connector.lease import Lease, LeaseTable
from common.protocol import KVAck

MAX_REMEMBERED_ABORTS = 10_000


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    transfer_id: str
    request_id: str
    nbytes: int
    seconds: float  # from send to this outcome
    error: str | None = None  # None: the receiver has the bytes
    attempt: int = 1  # 1 for the first send of a request's blocks, 2 for the retry, ...
    retry: bool = False  # failed with attempts left: send it again (the blocks are still lent)
    resend: Any = None  # as given to ``open``, untouched (the worker's Handoff)
    cancelled: bool = False  # its request was aborted meanwhile: just free the blocks now
    addr: str | None = None  # where it was sent

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class _Sent:
    nbytes: int
    started: float
    attempt: int
    resend: Any
    addr: str | None


class OutgoingTransfers:
    def __init__(self, lease_seconds: float, clock: Callable[[], float] = time.monotonic,
                 max_attempts: int = 1) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self._clock = clock
        self._leases = LeaseTable(lease_seconds, clock)
        self._sent: dict[str, _Sent] = {}
        self._cancelled: set[str] = set()  # transfer ids whose request was aborted
        self.max_attempts = max_attempts

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def wanted(self) -> int:
        """Transfers in flight whose request still wants them: not cancelled. A cancelled
        one only keeps its blocks from being reused until it ends."""
        return len(self._leases) - len(self._cancelled)

    def open(self, transfer_id: str, request_id: str, nbytes: int, *, attempt: int = 1,
             resend: Any = None, addr: str | None = None) -> None:
        """A transfer was handed to the sender: its blocks are lent until it ends."""
        self._leases.open(transfer_id, request_id)
        self._sent[transfer_id] = _Sent(nbytes, self._clock(), attempt, resend, addr)

    def settle(self, acks: Iterable[KVAck]) -> list[TransferOutcome]:
        """Outcomes of acks (ok) and nacks (error); acks of unknown transfers are ignored."""
        out = []
        for ack in acks:
            lease = self._leases.settle(ack)
            if lease is not None:
                out.append(self._end(lease, None if ack.ok else ack.reason or "refused"))
        return out

    def expire(self) -> list[TransferOutcome]:
        """Transfers whose lease ran out unacked: failed."""
        return [self._end(lease, "KV transfer lease expired") for lease in self._leases.expired()]

    def cancel(self, request_id: str) -> bool:
        """An aborted request: True when a transfer out of its blocks is still in flight.

        The transport may still be reading those blocks, so they stay lent: the transfer
        ends as usual (ack, nack or lease expiry), with ``cancelled`` set and no retry, and
        only then may the worker free them.
        """
        ids = self._leases.transfers_of(request_id)
        self._cancelled.update(ids)
        return bool(ids)

    def _end(self, lease: Lease, error: str | None) -> TransferOutcome:
        sent = self._sent.pop(lease.transfer_id)
        cancelled = lease.transfer_id in self._cancelled
        self._cancelled.discard(lease.transfer_id)
        retry = not cancelled and error is not None and sent.attempt < self.max_attempts
        return TransferOutcome(lease.transfer_id, lease.request_id, sent.nbytes,
                               self._clock() - sent.started, error, sent.attempt, retry,
                               sent.resend, cancelled, sent.addr)


class IncomingTransfers:
    def __init__(self, max_remembered_aborts: int = MAX_REMEMBERED_ABORTS) -> None:
        self._pending: list[ReceivedTransfer] = []
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._max_aborts = max_remembered_aborts

    def __len__(self) -> int:
        return len(self._pending)

    def was_aborted(self, request_id: str) -> bool:
        """Whether a transfer for ``request_id`` arriving now would be dropped."""
        return request_id in self._aborted

    def arrive(self, transfer: ReceivedTransfer) -> bool:
        """Queue an arrived transfer; False (dropped) when its request was aborted."""
        if self.was_aborted(transfer.header.request_id):
            return False
        self._pending.append(transfer)
        return True

    def abort(self, request_id: str) -> None:
        """Drop the request's waiting transfer, and any that arrives later."""
        self._pending = [t for t in self._pending if t.header.request_id != request_id]
        self._aborted[request_id] = None
        while len(self._aborted) > self._max_aborts:
            self._aborted.popitem(last=False)

    def clear(self) -> None:
        self._pending.clear()

    def discard(self, request_id: str) -> None:
        """Drop the request's waiting transfer, but take a later one (a resend)."""
        self._pending = [t for t in self._pending if t.header.request_id != request_id]

    def own_borrowed(self) -> None:
        """Give every waiting transfer blocks of its own (``owned``): its ack, which ends a
        loan of shared-memory blocks, may then go out while it still waits for room."""
        self._pending = [owned(t) for t in self._pending]

    def admit(self, try_admit: Callable[[ReceivedTransfer], bool]) -> None:
        """Offer each waiting transfer, oldest first; keep those ``try_admit`` declines."""
        self._pending = [t for t in self._pending if not try_admit(t)]
