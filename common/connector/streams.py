"""A worker's bookkeeping of KV *streams*: a long prompt's KV shipped piece by piece while
it is computed, one small object per direction (as ``transfers`` is for transfers).

A stream is a request's ``KVPiece`` transfers (full blocks, in order, as chunks of the
prompt are computed) and one final ``KVHandoff`` (the rest, with the first tokens) under
one ``stream_id``. Every piece is a transfer of its own: its own lease, ack and fault
draws in ``OutgoingTransfers`` and the transport.

``OutgoingStreams`` (prefill side): what each request has shipped so far, which of its
transfers are still in flight, and whether the stream broke. A stream succeeds only when
every one of its transfers is acked; the first failure breaks it, and the request then
goes again as one whole transfer (or fails, with no attempt left) — pieces are never
resent one by one.

``IncomingStreams`` (decode side): the pieces and final transfer that arrived per
request, until the engine has reserved its blocks and they are copied in. Pieces that
arrive while the cache has no room are held (acked) until it has: at most one prompt's
KV per stream, what a whole transfer waiting for room holds. An *incomplete* stream (a
piece or the final still missing) that hears nothing for ``idle_seconds`` is dropped; a
complete one waits for room as a whole transfer does.

Neither touches blocks, sockets or the engine: the worker does what they say.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.connector.base import ReceivedTransfer, owned
from common.protocol import KVHandoff, KVPiece

MAX_REMEMBERED_STREAMS = 10_000


@dataclass(frozen=True, slots=True)
class PiecePlan:
    stream_id: str
    piece: int
    first_block: int
    num_blocks: int

    @property
    def transfer_id(self) -> str:
        return f"{self.stream_id}/{self.piece}"


@dataclass(slots=True)
class OutgoingStream:
    stream_id: str
    shipped: int = 0  # leading prompt blocks sent as pieces
    pieces: int = 0
    in_flight: set[str] = field(default_factory=set)  # transfer ids not yet ended
    final_sent: bool = False
    final_acked: bool = False
    failed: str | None = None  # why it broke: the request goes whole (or fails)
    resend: Any = None  # given to ``final``: what a whole retry sends (the worker's Handoff)

    @property
    def succeeded(self) -> bool:
        return self.final_acked and not self.in_flight and self.failed is None


class OutgoingStreams:
    def __init__(self, new_id: Callable[[str], str]) -> None:
        self._new_id = new_id  # request id -> a fresh stream id
        self._streams: dict[str, OutgoingStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def get(self, request_id: str) -> OutgoingStream | None:
        return self._streams.get(request_id)

    def next_piece(self, request_id: str, num_computed_blocks: int) -> PiecePlan | None:
        """The piece to send now for a request with that many full, computed blocks, or
        None (nothing new, or its stream broke: the rest goes whole)."""
        stream = self._streams.get(request_id)
        if stream is None:
            if num_computed_blocks == 0:
                return None
            stream = self._streams[request_id] = OutgoingStream(self._new_id(request_id))
        if stream.failed is not None or stream.final_sent or num_computed_blocks <= stream.shipped:
            return None
        plan = PiecePlan(stream.stream_id, stream.pieces, stream.shipped,
                         num_computed_blocks - stream.shipped)
        stream.shipped, stream.pieces = num_computed_blocks, stream.pieces + 1
        stream.in_flight.add(plan.transfer_id)
        return plan

    def final(self, request_id: str, resend: Any = None) -> OutgoingStream | None:
        """The request's healthy stream, now ending with its final transfer; None when it
        has none (or it broke): then the request goes as one whole transfer."""
        stream = self._streams.get(request_id)
        if stream is None or stream.failed is not None:
            return None
        stream.final_sent, stream.resend = True, resend
        stream.in_flight.add(f"{stream.stream_id}/final")
        return stream

    def ended(self, request_id: str, transfer_id: str, error: str | None) -> OutgoingStream | None:
        """One of the stream's transfers ended; the stream, or None when it is gone (its
        request ended) or ``transfer_id`` is not its own."""
        stream = self._streams.get(request_id)
        if stream is None or transfer_id not in stream.in_flight:
            return None
        stream.in_flight.discard(transfer_id)
        if error is not None and stream.failed is None:
            stream.failed = error
        elif error is None and transfer_id.endswith("/final"):
            stream.final_acked = True
        return stream

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)


@dataclass(slots=True)
class Assembly:
    """A stream arriving at the decode side."""

    stream_id: str
    request_id: str
    reply_to: str
    num_prompt_tokens: int
    last_heard: float
    reserved: bool = False
    waiting: list[ReceivedTransfer] = field(default_factory=list)  # pieces not yet copied in
    filled: set[int] = field(default_factory=set)  # piece indices copied in
    final: ReceivedTransfer | None = None

    def own_borrowed(self) -> None:
        """Give what is not copied in yet blocks of its own (``owned``), so the acks that
        end shared-memory loans may go out while the stream waits."""
        self.waiting = [owned(t) for t in self.waiting]
        if self.final is not None:
            self.final = owned(self.final)

    @property
    def arrived(self) -> bool:
        """The final transfer and every piece it counts have arrived."""
        if self.final is None:
            return False
        pieces = self.filled | {t.header.piece for t in self.waiting}
        return pieces == set(range(self.final.header.num_pieces))


class IncomingStreams:
    def __init__(self, idle_seconds: float, clock: Callable[[], float] = time.monotonic,
                 max_remembered: int = MAX_REMEMBERED_STREAMS) -> None:
        self._idle = idle_seconds
        self._clock = clock
        self._open: dict[str, Assembly] = {}  # by request id, oldest first
        self._ended: OrderedDict[str, None] = OrderedDict()  # stream ids: late pieces dropped
        self._max = max_remembered

    def __len__(self) -> int:
        return len(self._open)

    def assemblies(self) -> list[Assembly]:
        return list(self._open.values())

    def own_borrowed(self) -> None:
        """``Assembly.own_borrowed`` for every open stream (see ``IncomingTransfers``)."""
        for a in self._open.values():
            a.own_borrowed()

    def arrive(self, transfer: ReceivedTransfer) -> tuple[Assembly | None, Assembly | None]:
        """File a piece or final transfer: (its assembly or None when it is stale and
        dropped, an older assembly of the same request it replaced, if any — the caller
        releases that one's reservation)."""
        h = transfer.header
        assert isinstance(h, KVPiece | KVHandoff) and h.stream_id is not None
        if h.stream_id in self._ended:
            return None, None
        old = self._open.get(h.request_id)
        if old is not None and old.stream_id != h.stream_id:
            self.end(h.request_id)
        else:
            old = None
        a = self._open.get(h.request_id)
        if a is None:
            num_prompt = h.num_prompt_tokens if isinstance(h, KVPiece) else len(h.prompt_token_ids)
            a = self._open[h.request_id] = Assembly(h.stream_id, h.request_id, h.reply_to,
                                                     num_prompt, self._clock())
        a.last_heard = self._clock()
        if isinstance(h, KVPiece):
            a.waiting.append(transfer)
        else:
            a.final = transfer
        return a, old

    def end(self, request_id: str) -> Assembly | None:
        """Forget a request's assembly (admitted, failed, aborted or replaced); its stream's
        late pieces will be dropped."""
        a = self._open.pop(request_id, None)
        if a is not None:
            self._ended[a.stream_id] = None
            while len(self._ended) > self._max:
                self._ended.popitem(last=False)
        return a

    def expired(self) -> list[Assembly]:
        """Incomplete assemblies silent for ``idle_seconds``, ended."""
        now = self._clock()
        gone = [a for a in self._open.values() if not a.arrived and now - a.last_heard >= self._idle]
        for a in gone:
            self.end(a.request_id)
        return gone

    def clear(self) -> list[Assembly]:
        gone = list(self._open.values())
        for a in gone:
            self.end(a.request_id)
        return gone
