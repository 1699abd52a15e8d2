"""The two roles of the KV connector and how a worker uses them.

Prefill worker (sender)::

    sender.send(addr, header, blocks)   # non-blocking; the buffers must stay untouched
    ...                                 # keep stepping the engine
    for ack in sender.poll_acks():      # the receiver has the bytes: free the blocks
        ...

Decode worker (receiver)::

    for transfer in receiver.poll():    # complete transfers only, validated
        ...                             # copy transfer.blocks into the cache (or owned())
        receiver.ack(transfer, ok=True)  # only then: an ack ends a loan of borrowed blocks

Guarantees common to every transport:
- A transfer arrives whole or not at all: ``poll`` never yields a partial transfer, and a
  transfer that fails midway is dropped by the receiver (its buffers released) and
  nacked when the sender can still be told.
- Each block frame has exactly ``header.block_nbytes`` bytes and there are exactly
  ``header.num_blocks`` of them; anything else is rejected before the worker sees it.
- The connector never owns KV-cache blocks: it reads the sender's buffers in place and
  hands the receiver buffers to copy from. Freeing blocks is the workers' business
  (``common.connector.lease`` on the sender side).
- Borrowed blocks (same-host shared memory, ``ReceivedTransfer.lent_until`` set) are views
  of the sender's own cache, valid until the transfer is acked or nacked and at the
  latest until ``lent_until``: the receiver copies them (into its cache, or ``owned``)
  before it acks, within the call that polled them. Other transports' blocks are the
  receiver's and stay valid after the ack.
- Neither role blocks the caller except ``poll(timeout_ms)`` when asked to wait.
- Nothing fails in silence: every failure is logged and handed to the role's optional
  ``on_error(kind, detail)`` hook from inside its own calls, on the caller's thread
  (``common.connector.failures``).

This module only states the interface; ``common.connector.factory`` builds a transport's
sender or receiver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from common.protocol import KVAck, KVHandoff, KVPiece, KVShmHandoff, ProtocolError, decode

MAX_BLOCK_FRAME_BYTES = 64 * 1024 * 1024

# What a transfer's header may be: a whole transfer or a stream's final one (KVHandoff), or
# a stream's earlier piece (KVPiece). Transports carry both alike; workers tell them apart.
KVHeader = KVHandoff | KVPiece


class KVTransport(str, Enum):
    """The transports ``common.connector.make_sender``/``make_receiver`` can build."""

    ZMQ = "zmq"  # tcp:// or ipc:// addresses
    UCX = "ucx"  # ucx://HOST:PORT; needs the optional ucx extra


class ShmMode(str, Enum):
    """``--kv-shm``: whether KV moves through same-host shared memory (zmq transport only)."""

    AUTO = "auto"  # where both ends are on one host; frames elsewhere (learnt per destination)
    ON = "on"  # always: a destination that cannot map the segment fails its transfers
    OFF = "off"  # never: block frames over the socket


@dataclass(slots=True)
class ReceivedTransfer:
    header: KVHeader
    blocks: list[memoryview]  # num_blocks buffers of block_nbytes each, read-only
    peer: object  # transport-specific return address for the ack
    lent_until: float | None = None  # set: blocks borrowed from the sender until then (monotonic)

    @property
    def borrowed(self) -> bool:
        return self.lent_until is not None


def owned(transfer: ReceivedTransfer) -> ReceivedTransfer:
    """The transfer with blocks of its own: borrowed blocks are copied out (for a transfer
    that must wait past its ack), others returned as they are."""
    if not transfer.borrowed:
        return transfer
    blocks = [memoryview(bytes(b)) for b in transfer.blocks]
    return ReceivedTransfer(transfer.header, blocks, transfer.peer)


class KVSender(Protocol):
    # Longest wait for the next frame of a message already begun, or None when the
    # transport has none (zmq delivers whole messages): a lease must outlast it.
    frame_timeout_s: float | None

    def send(self, addr: str, header: KVHeader, blocks: Sequence[memoryview]) -> None:
        """Queue one transfer to the receiver at ``addr``; returns at once."""
        ...

    def send_encoded(self, addr: str, transfer_id: str, head: bytes, blocks: Sequence[memoryview]) -> None:
        """``send`` with the header already encoded, sent as given (unchecked): what the
        test-only fault hook (``common.connector.faults``) uses to send a bad one."""
        ...

    def abandon(self, addr: str) -> None:
        """Drop whatever is still queued for ``addr`` (a transfer to it ran out of lease): the
        caller is about to reuse those blocks, so nothing may read them any more. Transfers
        to ``addr`` that were in flight end by their leases or a nack."""
        ...

    def poll_acks(self) -> list[KVAck]:
        """Acks (and nacks) that arrived since the last call; runs the on_error hook."""
        ...

    def close(self) -> None: ...


class KVReceiver(Protocol):
    """May also offer ``wakeup_socket``: a zmq socket that turns readable when a transfer
    arrives, so an idle worker can sleep in one poller instead of polling on a timer."""

    address: str  # what senders connect to
    frame_timeout_s: float | None  # as KVSender's: a stalled transfer is nacked after it

    def poll(self, timeout_ms: int = 0) -> list[ReceivedTransfer]:
        """Transfers that completed since the last call (waits up to ``timeout_ms`` for one);
        runs the on_error hook."""
        ...

    def ack(self, transfer: ReceivedTransfer, ok: bool, reason: str = "") -> None: ...

    def close(self) -> None: ...


def decode_header(data: bytes | memoryview, *, shm: bool = False) -> KVHeader | KVShmHandoff:
    """A transfer's header from its bytes; ProtocolError unless it is a valid KV header
    (or, with ``shm``, a ``KVShmHandoff``: blocks lent in shared memory instead of frames).
    Every transport's receiver decodes headers here, so a new header type needs no change
    in any transport."""
    header = decode(data)
    kinds = (KVHandoff, KVPiece, KVShmHandoff) if shm else (KVHandoff, KVPiece)
    if not isinstance(header, kinds):
        raise ProtocolError(f"expected {' or '.join(k.TAG for k in kinds)}, got {header.TAG}")
    return header


def check_transfer(header: KVHeader, frames: Sequence[memoryview]) -> str | None:
    """Why a transfer's frames do not match its header, or None when they do."""
    if header.num_blocks != len(frames):
        return f"expected {header.num_blocks} block frames, got {len(frames)}"
    if header.block_nbytes > MAX_BLOCK_FRAME_BYTES:
        return f"block of {header.block_nbytes} bytes exceeds {MAX_BLOCK_FRAME_BYTES}"
    bad = next((i for i, f in enumerate(frames) if f.nbytes != header.block_nbytes), None)
    if bad is not None:
        return f"block frame {bad} has {frames[bad].nbytes} bytes, expected {header.block_nbytes}"
    return None
