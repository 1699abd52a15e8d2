"""TEST ONLY: a KV sender that drops, truncates, corrupts or delays some of its transfers.

Off by default. A worker turns it on only when told to (``--kv-faults SPEC`` or
``TANDEM_KV_FAULTS=SPEC``) and then says so in a warning at startup; the factory wraps
the transport's sender in a ``FaultySender`` (``make_sender(kind, faults=plan)``). It
exists so that tests can prove what the rest of the system does when a transfer goes
wrong; nothing in production needs it.

Spec: comma-separated ``key=value`` pairs, every one optional::

    drop=P  truncate=P  corrupt=P   probability that a transfer gets this fault
    delay=P[:SECONDS]               probability, and how late (default 1 s)
    seed=N                          the random draws' seed (default 0)
    script=F+F+...                  the next transfers' faults, in order, before any random
                                    draw (F: drop, truncate, corrupt, delay or none)

e.g. ``drop=0.05,truncate=0.05,corrupt=0.05,delay=0.05:0.5,seed=7`` or ``script=drop+none``.
Each piece of a KV stream (``KVPiece``) is a transfer of its own, so it takes its own draw
(a 101-token prompt in chunks of 32 is four transfers: ``script=none+drop`` drops piece 1).

What each fault does, and what the other side sees:

- ``drop``: never sent. Nobody nacks it: the sender's lease expires.
- ``truncate``: the header promises every block but the last frame is left off. The
  receiver rejects it (zmq at once; ucx when the next message, or its frame timeout,
  shows the frame missing) and nacks it.
- ``corrupt``: the header's first byte becomes 0xc1, which msgpack never uses, so the
  header cannot decode and the receiver refuses it. Its nack cannot name the transfer:
  over zmq the lease expires; over ucx the receiver drops the connection, which nacks
  every transfer it owed.
- ``delay``: sent ``SECONDS`` late (at the first ``send`` or ``poll_acks`` after then). A
  worker requires the delay to be shorter than its lease, so a late transfer is never
  sent again while the first copy is still on its way.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

from common.connector.base import KVHeader, KVSender
from common.protocol import KVAck, encode

log = logging.getLogger("tandem.connector.faults")

NEVER_MSGPACK = b"\xc1"  # the one byte msgpack leaves unused: a header starting so cannot decode


class Fault(str, Enum):
    DROP = "drop"
    TRUNCATE = "truncate"
    CORRUPT = "corrupt"
    DELAY = "delay"


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Which transfers get which fault; ``FaultPlan.parse`` reads the spec above."""

    rates: tuple[tuple[Fault, float], ...] = ()  # (fault, probability per transfer)
    delay_s: float = 1.0
    seed: int = 0
    script: tuple[Fault | None, ...] = ()  # the first transfers' faults (None: no fault)

    def __post_init__(self) -> None:
        if any(not 0 <= p <= 1 for _, p in self.rates):
            raise ValueError(f"fault probabilities must be in [0, 1], got {self.spec}")
        if sum(p for _, p in self.rates) > 1:
            raise ValueError(f"fault probabilities add up to more than 1: {self.spec}")
        if not self.delay_s > 0:
            raise ValueError(f"a fault delay must be > 0 s, got {self.delay_s:g}")

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        rates: dict[Fault, float] = {}
        delay_s, seed, script = 1.0, 0, ()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, value = item.partition("=")
            try:
                if not sep:
                    raise ValueError("expected key=value")
                if key == "seed":
                    seed = int(value)
                elif key == "script":
                    script = tuple(None if f == "none" else Fault(f) for f in value.split("+"))
                elif key == Fault.DELAY.value:
                    rate, _, seconds = value.partition(":")
                    rates[Fault.DELAY], delay_s = float(rate), float(seconds or delay_s)
                else:
                    rates[Fault(key)] = float(value)
            except ValueError as e:
                raise ValueError(f"bad KV fault spec item {item!r} in {spec!r}: {e}") from None
        return cls(tuple(rates.items()), delay_s, seed, script)

    @property
    def spec(self) -> str:
        """This plan in the syntax ``parse`` reads."""
        parts = [f"{f.value}={p:g}" + (f":{self.delay_s:g}" if f is Fault.DELAY else "")
                 for f, p in self.rates]
        if self.script:
            parts.append("script=" + "+".join(f.value if f else "none" for f in self.script))
        return ",".join([*parts, f"seed={self.seed}"])

    @property
    def delays(self) -> bool:
        return any(f is Fault.DELAY and p > 0 for f, p in self.rates) or Fault.DELAY in self.script

    def draws(self) -> Iterator[Fault | None]:
        """The fault (or None) of each transfer in turn: the script, then random draws."""
        yield from self.script
        rng = random.Random(self.seed)
        while True:
            u, edge = rng.random(), 0.0
            fault = None
            for f, p in self.rates:
                edge += p
                if u < edge:
                    fault = f
                    break
            yield fault


@dataclass(frozen=True, slots=True)
class _Late:
    due: float
    addr: str
    header: KVHeader
    blocks: Sequence[memoryview]


class FaultySender:
    """A ``KVSender`` that hands each transfer to ``inner`` as its plan says.

    ``injected`` counts the faults applied so far, by kind. A delayed transfer keeps
    its block views until it is sent, like any transfer queued in a transport.
    """

    def __init__(self, inner: KVSender, plan: FaultPlan,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._inner = inner
        self.plan = plan
        self.frame_timeout_s = inner.frame_timeout_s
        self._draws = plan.draws()
        self._clock = clock
        self._late: list[_Late] = []
        self.injected: Counter[Fault] = Counter()

    def send(self, addr: str, header: KVHeader, blocks: Sequence[memoryview]) -> None:
        self._send_due()
        fault = next(self._draws)
        if fault is None:
            self._inner.send(addr, header, blocks)
            return
        self.injected[fault] += 1
        log.warning("KV fault injected (test only): %s transfer %s", fault.value, header.transfer_id)
        if fault is Fault.TRUNCATE:
            self._inner.send(addr, header, blocks[:-1])
        elif fault is Fault.CORRUPT:
            head = encode(header)
            self._inner.send_encoded(addr, header.transfer_id, NEVER_MSGPACK + head[1:], blocks)
        elif fault is Fault.DELAY:
            self._late.append(_Late(self._clock() + self.plan.delay_s, addr, header, blocks))
        # Fault.DROP: nothing is sent

    def send_encoded(self, addr: str, transfer_id: str, head: bytes,
                     blocks: Sequence[memoryview]) -> None:
        self._inner.send_encoded(addr, transfer_id, head, blocks)  # already hand-made: no fault

    def poll_acks(self) -> list[KVAck]:
        self._send_due()
        return self._inner.poll_acks()

    def abandon(self, addr: str) -> None:
        self._late = [late for late in self._late if late.addr != addr]
        self._inner.abandon(addr)

    def close(self) -> None:
        self._late.clear()
        self._inner.close()

    def _send_due(self) -> None:
        now = self._clock()
        due = [late for late in self._late if late.due <= now]
        self._late = [late for late in self._late if late.due > now]
        for late in due:
            self._inner.send(late.addr, late.header, late.blocks)
