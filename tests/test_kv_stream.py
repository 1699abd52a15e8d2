"""KV streams below the worker: the engine's reserve → fill → commit intake, lent blocks,
and the bookkeeping of streams on each side — exact block counts and exact outcomes.

The central check: a prompt computed in chunks and shipped piece by piece (each piece's
bytes taken when its chunk was computed) leaves the decode engine's cache identical,
block for block, to the same prompt shipped whole, and decodes to the same tokens.
"""

from __future__ import annotations

import pytest

from common.connector.base import ReceivedTransfer
from common.connector.streams import IncomingStreams, OutgoingStreams
from common.engine.handoff import from_wire, to_wire
from common.errors import InvalidRequestError
from common.protocol import KVHandoff, KVPiece, decode, encode
from common.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.test_transfers import FakeClock

CHUNK = 32  # tokens per prefill step: two blocks of 16
PROMPT = list(range(300, 401))  # 101 tokens: chunks of 32, 32, 32, 5; blocks 0-5 full, 6 partial
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prefill_in_pieces(model_dir):
    """Run PROMPT prefill-only in chunks; (the pieces as (first block, bytes) taken after
    each step, the final handoff, the final's bytes from its first block on)."""
    prefill = make_engine(model_dir, num_blocks=32, max_num_batched_tokens=CHUNK)
    prefill.add_request(PROMPT, GREEDY, "r", prefill_only=True)
    pieces, shipped, handoffs = [], 0, []
    while not handoffs:
        prefill.step()
        for _, block_ids in prefill.prefilling_blocks():
            if len(block_ids) > shipped:
                data = [memoryview(bytes(b)) for b in prefill.export_blocks(block_ids[shipped:])]
                pieces.append((shipped, data))
                shipped = len(block_ids)
        handoffs = prefill.take_handoffs()
    [h] = handoffs
    rest = [memoryview(bytes(b)) for b in prefill.export_blocks(h.block_ids[shipped:])]
    whole = [memoryview(bytes(b)) for b in prefill.export_blocks(h.block_ids)]
    header = decode(encode(to_wire(h, "t", "tcp://gw:1", prefill.kv_layout, prefill.block_nbytes,
                                   stream_id="s", first_block=shipped, num_pieces=len(pieces))))
    return pieces, from_wire(header), rest, whole


def cache_bytes(engine) -> list[bytes]:
    [seq] = engine.scheduler.running
    return [bytes(b) for b in engine.export_blocks(engine.kv.block_ids(seq))]


def decode_to_end(engine) -> list[int]:
    tokens = []
    while engine.has_unfinished:
        for u in engine.step():
            tokens += u.token_ids
            if u.finish_reason is not None:
                engine.finished_output(u.request_id)
    return tokens


def test_streamed_pieces_fill_the_cache_exactly_as_a_whole_transfer(tiny_model_dir):
    pieces, h, rest, whole = prefill_in_pieces(tiny_model_dir)
    assert [(first, len(data)) for first, data in pieces] == [(0, 2), (2, 2), (4, 2)]
    assert len(rest) == 1  # the partial last block comes with the first token
    streamed = make_engine(tiny_model_dir, num_blocks=16)
    assert streamed.reserve_prefilled("r", len(PROMPT))
    assert streamed.pool.num_free_blocks == 16 - 7  # the whole prompt's room, at once
    for first, data in pieces:
        streamed.fill_prefilled("r", first, data)
        assert not streamed.has_unfinished  # not admitted before the final piece
    streamed.commit_prefilled(h, 6, rest)
    at_once = make_engine(tiny_model_dir, num_blocks=16)
    assert at_once.add_prefilled(h, whole)
    assert cache_bytes(streamed) == cache_bytes(at_once) == [bytes(b) for b in whole]
    assert decode_to_end(streamed) == decode_to_end(at_once)
    assert streamed.pool.num_free_blocks == at_once.pool.num_free_blocks == 16


def test_a_commit_with_a_block_missing_fails_and_releases_every_reserved_block(tiny_model_dir):
    pieces, h, rest, _ = prefill_in_pieces(tiny_model_dir)
    engine = make_engine(tiny_model_dir, num_blocks=16)
    assert engine.reserve_prefilled("r", len(PROMPT))
    engine.fill_prefilled("r", *pieces[0])
    engine.fill_prefilled("r", *pieces[2])  # piece 1 never arrived
    with pytest.raises(InvalidRequestError, match="2 KV blocks never arrived"):
        engine.commit_prefilled(h, 6, rest)
    assert engine.pool.num_free_blocks == 16 and not engine.has_unfinished


def test_a_block_filled_twice_or_outside_the_prompt_is_refused(tiny_model_dir):
    pieces, _, _, _ = prefill_in_pieces(tiny_model_dir)
    engine = make_engine(tiny_model_dir, num_blocks=16)
    assert engine.reserve_prefilled("r", len(PROMPT))
    engine.fill_prefilled("r", *pieces[0])
    with pytest.raises(InvalidRequestError, match="arrived twice"):
        engine.fill_prefilled("r", 1, pieces[1][1])
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.fill_prefilled("r", 6, pieces[1][1])
    with pytest.raises(InvalidRequestError, match="already has KV arriving"):
        engine.reserve_prefilled("r", len(PROMPT))
    assert engine.abort("r")  # an abort releases the reservation
    assert engine.pool.num_free_blocks == 16


def test_a_reservation_is_all_the_prompt_or_nothing(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=8)
    assert engine.reserve_prefilled("a", 5 * 16)  # 5 blocks
    assert not engine.reserve_prefilled("b", 4 * 16)  # 3 free: nothing taken
    assert engine.pool.num_free_blocks == 3
    with pytest.raises(InvalidRequestError, match="needs 9 KV blocks"):
        engine.reserve_prefilled("c", 9 * 16)
    assert engine.abort("a") and not engine.abort("a")
    assert engine.pool.num_free_blocks == 8


def test_lent_blocks_outlive_their_request_until_given_back(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=16, max_num_batched_tokens=CHUNK)
    engine.add_request(PROMPT, GREEDY, "r", prefill_only=True)
    engine.step()
    [(_, block_ids)] = engine.prefilling_blocks()
    assert len(block_ids) == 2  # the first chunk's two full blocks
    engine.lend_blocks(block_ids)
    engine.abort("r")  # aborted (or preempted) mid-transfer ...
    assert engine.pool.num_free_blocks == 14  # ... the lent blocks cannot be reused
    engine.return_blocks(block_ids)
    assert engine.pool.num_free_blocks == 16


# ---- the bookkeeping ----------------------------------------------------------------------

def test_outgoing_pieces_cover_each_new_block_once_and_the_final_the_rest():
    streams = OutgoingStreams(lambda rid: f"{rid}:s")
    assert streams.next_piece("r", 0) is None  # nothing computed yet: no stream
    p0 = streams.next_piece("r", 2)
    assert (p0.transfer_id, p0.first_block, p0.num_blocks) == ("r:s/0", 0, 2)
    assert streams.next_piece("r", 2) is None  # nothing new
    p1 = streams.next_piece("r", 5)
    assert (p1.piece, p1.first_block, p1.num_blocks) == (1, 2, 3)
    final = streams.final("r", "handoff")
    assert (final.shipped, final.pieces, final.resend) == (5, 2, "handoff")
    assert streams.next_piece("r", 6) is None  # the final carries the rest
    for tid in ("r:s/0", "r:s/final"):
        assert not streams.ended("r", tid, None).succeeded
    assert streams.ended("r", "r:s/1", None).succeeded  # every transfer acked
    assert streams.ended("r", "r:s/1", None) is None  # each ends once


def test_the_first_failure_breaks_a_stream_and_no_more_pieces_go():
    streams = OutgoingStreams(lambda rid: f"{rid}:s")
    streams.next_piece("r", 2)
    streams.next_piece("r", 4)
    assert streams.ended("r", "r:s/0", "lease expired").failed == "lease expired"
    assert streams.ended("r", "r:s/1", "refused").failed == "lease expired"  # the first cause
    assert streams.next_piece("r", 6) is None and streams.final("r") is None  # the rest: whole


FINAL = KVHandoff("s/final", "r", PROMPT, [7], [None], [None], [False], GREEDY, "tcp://gw:1",
                  0, 3, 8, [1, 16, 1, 1, 4], "float32", "s", 4, 2)  # after pieces of blocks 0-3


def received(header) -> ReceivedTransfer:
    return ReceivedTransfer(header, [memoryview(bytes(8))] * header.num_blocks, None)


def piece(stream_id: str, index: int, first: int, count: int = 1) -> KVPiece:
    return KVPiece(f"{stream_id}/{index}", stream_id, "r", index, first, count, 101, 8,
                   [1, 16, 1, 1, 4], "float32", "tcp://gw:1")


def test_an_incoming_stream_is_complete_with_its_final_and_every_piece_it_counts():
    clock = FakeClock()
    streams = IncomingStreams(idle_seconds=2.0, clock=clock)
    a, replaced = streams.arrive(received(piece("s", 1, 2, 2)))  # out of order: piece 1 first
    assert replaced is None and a.num_prompt_tokens == 101 and not a.arrived
    streams.arrive(received(FINAL))
    assert not a.arrived  # piece 0 is missing
    clock.now += 1.9
    streams.arrive(received(piece("s", 0, 0, 2)))
    assert a.arrived and streams.expired() == []
    clock.now += 5
    assert streams.expired() == []  # complete: it waits for room as long as it takes


def test_a_silent_incomplete_stream_expires_and_a_newer_one_replaces_an_older():
    clock = FakeClock()
    streams = IncomingStreams(idle_seconds=2.0, clock=clock)
    old, _ = streams.arrive(received(piece("s1", 0, 0)))
    new, replaced = streams.arrive(received(piece("s2", 0, 0)))
    assert replaced is old and new is not old
    assert streams.arrive(received(piece("s1", 1, 1))) == (None, None)  # s1 ended: dropped
    clock.now += 2.0
    assert streams.expired() == [new] and len(streams) == 0
    assert streams.arrive(received(piece("s2", 1, 1))) == (None, None)

