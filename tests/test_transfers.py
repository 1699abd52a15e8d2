"""A worker's transfer bookkeeping and the handoff's wire conversion, in process."""

from __future__ import annotations

import pytest

from common.connector.base import ReceivedTransfer
from common.connector.transfers import IncomingTransfers, OutgoingTransfers, TransferOutcome
from common.engine.handoff import Handoff, KVLayout, from_wire, to_wire
from common.outputs import TokenLogprob
from common.protocol import KVAck, KVHandoff, ProtocolError, decode, encode
from common.sampling_params import SamplingParams


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


LAYOUT = KVLayout(2, 4, 2, 8, 4, "float32")


def handoff(request_id: str = "r", n: int = 2, finished=(True, False)) -> Handoff:
    return Handoff(request_id, list(range(10)), SamplingParams(n=n, max_tokens=8, seed=3),
                   [7, 8, 9], [5, 2][:n], [TokenLogprob(5, -0.5, ((5, -0.5),)), None][:n],
                   [b"state", None][:n], list(finished)[:n], 4)


# ---- Handoff <-> KVHandoff ------------------------------------------------------------

def test_handoff_survives_the_wire_with_every_per_choice_field():
    h = handoff()
    header = decode(encode(to_wire(h, "t1", "tcp://gw:1", LAYOUT, 256)))
    assert isinstance(header, KVHandoff)
    assert (header.num_blocks, header.block_nbytes, header.layout) == (3, 256, [2, 4, 2, 8, 4])
    back = from_wire(header)
    assert back.finished == [True, False]  # a choice that ended at its first token stays ended
    assert (back.first_tokens, back.first_logprobs, back.generator_states) == (
        h.first_tokens, h.first_logprobs, h.generator_states)
    assert back.params == h.params and back.num_cached_tokens == 4 and back.block_ids == []


def test_a_handoff_whose_blocks_do_not_cover_the_prompt_is_refused():
    h = handoff()
    h.block_ids = [7, 8]  # 10 tokens in blocks of 4 need 3
    with pytest.raises(ProtocolError, match="needs 3"):
        to_wire(h, "t1", "tcp://gw:1", LAYOUT, 256)


def test_layout_mismatch_names_both_layouts():
    assert LAYOUT.mismatch([2, 4, 2, 8, 4], "float32") is None
    assert "[2, 4, 2, 8, 2]" in LAYOUT.mismatch([2, 4, 2, 8, 2], "float32")


# ---- OutgoingTransfers ----------------------------------------------------------------

def test_each_transfer_ends_exactly_once():
    clock = FakeClock()
    out = OutgoingTransfers(lease_seconds=5.0, clock=clock)
    out.open("t1", "r1", 100)
    out.open("t2", "r2", 200)
    out.open("t3", "r3", 300)
    clock.now += 1.5
    ended = out.settle([KVAck("t1", True), KVAck("t2", False, "no room"), KVAck("t9", True)])
    assert ended == [TransferOutcome("t1", "r1", 100, 1.5), TransferOutcome("t2", "r2", 200, 1.5, "no room")]
    assert out.settle([KVAck("t1", True)]) == []  # a duplicate ack ends nothing
    assert len(out) == 1
    clock.now += 3.5
    assert out.expire() == [TransferOutcome("t3", "r3", 300, 5.0, "KV transfer lease expired")]
    assert len(out) == 0 and out.expire() == [] and out.settle([KVAck("t3", True)]) == []


def test_a_cancelled_transfer_keeps_its_blocks_lent_until_it_ends():
    """An abort cannot take blocks back from a transport that may still be reading them:
    the transfer ends as usual, marked cancelled, and only then are they free."""
    clock = FakeClock()
    out = OutgoingTransfers(lease_seconds=5.0, clock=clock, max_attempts=2)
    out.open("a", "r1", 1)
    out.open("b", "r2", 1)
    assert out.cancel("r1") and not out.cancel("r9")
    assert len(out) == 2 and out.wanted == 1  # still lent, no longer wanted
    [a] = out.settle([KVAck("a", True)])
    assert (a.request_id, a.cancelled, a.retry) == ("r1", True, False)
    out.open("c", "r3", 1)
    out.cancel("r3")
    clock.now += 5.0
    ended = {t.transfer_id: (t.cancelled, t.retry) for t in out.expire()}
    assert ended == {"b": (False, True), "c": (True, False)}  # an aborted one is never resent


def test_a_nack_without_reason_is_still_an_error():
    out = OutgoingTransfers(lease_seconds=5.0, clock=FakeClock())
    out.open("a", "r", 1)
    [t] = out.settle([KVAck("a", False)])
    assert not t.ok and t.error == "refused"


# ---- IncomingTransfers ----------------------------------------------------------------

def arrived(request_id: str) -> ReceivedTransfer:
    header = to_wire(handoff(request_id), f"t-{request_id}", "tcp://gw:1", LAYOUT, 256)
    return ReceivedTransfer(header, [memoryview(bytes(256))] * 3, peer=None)


def test_waiting_transfers_are_offered_oldest_first_and_kept_when_declined():
    incoming = IncomingTransfers()
    for rid in ("a", "b", "c"):
        assert incoming.arrive(arrived(rid))
    offered = []
    incoming.admit(lambda t: offered.append(t.header.request_id) or t.header.request_id != "b")
    assert offered == ["a", "b", "c"] and len(incoming) == 1
    offered.clear()
    incoming.admit(lambda t: offered.append(t.header.request_id) or True)
    assert offered == ["b"] and len(incoming) == 0


def test_an_abort_drops_the_waiting_transfer_and_any_late_one():
    incoming = IncomingTransfers(max_remembered_aborts=2)
    incoming.arrive(arrived("a"))
    incoming.abort("a")
    assert len(incoming) == 0
    assert not incoming.arrive(arrived("a"))  # late: dropped, never admitted
    incoming.abort("b")
    incoming.abort("c")  # the oldest remembered abort ("a") is forgotten
    assert incoming.arrive(arrived("a")) and not incoming.arrive(arrived("c"))
