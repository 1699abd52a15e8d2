"""Sender-side leases: a prefill worker keeps a shipped request's blocks until the
receiver acks the transfer or the lease expires, whichever comes first.

The table only keeps time and ids; the worker frees blocks for every lease that
``settle`` or ``expired`` hands back, so blocks are freed exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from common.protocol import KVAck


@dataclass(frozen=True, slots=True)
class Lease:
    transfer_id: str
    request_id: str
    deadline: float


class LeaseTable:
    def __init__(self, ttl_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl_seconds
        self._clock = clock
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def open(self, transfer_id: str, request_id: str) -> Lease:
        lease = Lease(transfer_id, request_id, self._clock() + self.ttl)
        self._leases[transfer_id] = lease
        return lease

    def settle(self, ack: KVAck) -> Lease | None:
        """The lease an ack ends, or None for an unknown or already expired transfer."""
        return self._leases.pop(ack.transfer_id, None)

    def transfers_of(self, request_id: str) -> list[str]:
        """The ids of a request's open leases."""
        return [t for t, lease in self._leases.items() if lease.request_id == request_id]

    def cancel(self, request_id: str) -> list[Lease]:
        """End the leases of an aborted request."""
        gone = [lease for lease in self._leases.values() if lease.request_id == request_id]
        for lease in gone:
            del self._leases[lease.transfer_id]
        return gone

    def expired(self) -> list[Lease]:
        now = self._clock()
        gone = [lease for lease in self._leases.values() if lease.deadline <= now]
        for lease in gone:
            del self._leases[lease.transfer_id]
        return gone
