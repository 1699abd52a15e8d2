"""How the connector reports what went wrong: never in silence.

Every failure a transport meets (a garbage ack, a rejected transfer, a peer lost with
transfers owed, an ack that could not be sent) is logged at once, one warning line on
``tandem.connector``, and counted through the owner's optional hook
``on_error(kind, detail)`` (the worker turns it into ``tandem:kv_transfer_failures``).
The hook runs inside the owner's own calls (``poll``, ``poll_acks``, ``ack``), on its
thread, even when the failure happened on a transport thread: it need not be
thread-safe.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from enum import Enum

from common.protocol import KVAck, ProtocolError, decode

log = logging.getLogger("tandem.connector")

ErrorHook = Callable[[str, str], None]  # (kind, detail); kind is a TransferFailure value


class TransferFailure(str, Enum):
    """The kinds an ``ErrorHook`` is called with (stable: they label a metric)."""

    BAD_ACK = "bad_ack"  # sender: an ack that does not decode, or is not a KVAck
    BAD_TRANSFER = "bad_transfer"  # receiver: a transfer rejected (header, frames, framing)
    PEER_LOST = "peer_lost"  # the other side went away with a transfer in flight or owed
    REPLY_FAILED = "reply_failed"  # receiver: an ack or nack that could not be sent


class FailureLog:
    """Logs failures when they happen; hands them to the hook when its owner flushes.

    ``report`` may be called from any thread; ``flush`` only from the owner's.
    """

    def __init__(self, on_error: ErrorHook | None) -> None:
        self._hook = on_error
        self._pending: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()

    def report(self, kind: TransferFailure, detail: str) -> None:
        log.warning("KV transfer failure %s: %s", kind.value, detail)
        if self._hook is not None:
            self._pending.put((kind.value, detail))

    def decode_ack(self, data: bytes | memoryview, source: str) -> KVAck | None:
        """The ack in ``data``, or None after reporting why it is not one (a confused peer:
        the transfer it meant will hit its lease deadline)."""
        try:
            msg = decode(data)
        except ProtocolError as e:
            self.report(TransferFailure.BAD_ACK, f"from {source}: {e}")
            return None
        if not isinstance(msg, KVAck):
            self.report(TransferFailure.BAD_ACK, f"from {source}: expected kv_ack, got {msg.TAG}")
            return None
        return msg

    def flush(self) -> None:
        if self._hook is None:
            return
        while True:
            try:
                kind, detail = self._pending.get_nowait()
            except queue.Empty:
                return
            self._hook(kind, detail)
