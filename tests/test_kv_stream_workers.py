"""KV streams between two real workers, in process: a prefill worker computing a long
prompt in chunks of 32 tokens and a decode worker, over loopback, ticked in turn; this
test plays the router and the gateway (the prefill harness's sockets).

The prompt (101 tokens, blocks of 16) goes as four transfers: pieces 0, 1, 2 (blocks 0-1,
2-3, 4-5) while the prompt is computed, then the final (block 6, the first token). Every
case ends with an exact outcome and both workers holding 0 KV blocks: the same tokens as
a whole transfer, colocated and HF; a fault at the first, a middle or the final transfer
(retried whole; or a clear error with no attempt left); an abort at each; a dead receiver;
a dead sender. The overlap is shown by order of events, not by time: the decode worker
holds piece 0's blocks while the prefill worker is still computing the prompt.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from common.protocol import Abort, Task
from common.roles import WorkerRole
from tests.conftest import hf_greedy
from tests.test_kv_faults import failures, tick_once
from tests.test_worker import GREEDY, Harness

CHUNK = 32
PROMPT = list(range(300, 401))  # 101 tokens: 4 chunks, 7 blocks
LONG = replace(GREEDY, max_tokens=12)
LEASE_S = 1.0  # a lost transfer costs this much; far above one loopback round trip
FINAL = 3  # the index of the final transfer among the request's four


def pieces(h: Harness, direction: str) -> float:
    [family] = h.worker.metrics.kv_pieces.collect()
    return sum(s.value for s in family.samples
               if s.name.endswith("_total") and s.labels.get("direction") == direction)


def held(h: Harness) -> int:
    stats = h.worker.engine.stats()
    return stats.num_blocks - stats.num_free_blocks


class StreamPair:
    def __init__(self, model_dir, script: str = "none", attempts: int = 2, stream: bool = True) -> None:
        self.decode = Harness(model_dir, WorkerRole.DECODE, lease_seconds=LEASE_S)
        self.prefill = Harness(model_dir, WorkerRole.PREFILL, chunk=CHUNK, lease_seconds=LEASE_S,
                               kv_faults=f"script={script},delay=0:0.2", kv_transfer_attempts=attempts,
                               kv_stream_chunks=stream)
        self.events: list[str] = []
        self.alive = {"prefill": True, "decode": True}

    def close(self) -> None:
        for name, h in (("prefill", self.prefill), ("decode", self.decode)):
            if self.alive[name]:
                h.close()

    def kill(self, name: str) -> None:
        getattr(self, name).close()
        self.alive[name] = False

    def send(self, rid: str = "r") -> None:
        self.prefill.send(Task.of(rid, PROMPT, LONG, self.prefill.reply_to,
                               handoff_addr=self.decode.worker.kv_address))

    def abort(self, rid: str = "r") -> None:
        for name in ("prefill", "decode"):  # the router forwards it to every holder
            if self.alive[name]:
                getattr(self, name).send(Abort(rid))

    def tick(self) -> None:
        """One prefill tick, then the decode worker until it has every piece sent so far
        (if it is alive and the piece was not lost on the way), noting events in order."""
        p, d = self.prefill, self.decode
        if self.alive["prefill"]:
            tick_once(p)
            if p.output("r") and "first token" not in self.events:
                self.events.append("first token")
        if self.alive["decode"]:
            sent = pieces(p, "sent") if self.alive["prefill"] else 0
            tick_once(d)
            if not p.worker.sender or p.worker.sender.injected or not self.alive["prefill"]:
                return
            d.run_until(lambda: pieces(d, "received") >= sent)
            if pieces(d, "received") and "piece 0 in" not in self.events:
                self.events.append("piece 0 in")

    def run_until(self, done) -> None:
        self.prefill.run_until(lambda: self.tick() or done())

    def run(self) -> list[int]:
        self.send()
        self.run_until(lambda: self.ended())
        return self.tokens()

    def ended(self) -> bool:
        p = self.prefill
        served = self.decode.finished("r") is not None and len(p.output("r")) == LONG.max_tokens
        failed = bool(p.errors("r"))
        return (served or failed) and len(p.worker.outgoing) == 0 and len(p.worker.outbox.streams) == 0

    def tokens(self) -> list[int]:
        updates = sorted((m for m in self.prefill.tokens if m.request_id == "r"), key=lambda m: m.index)
        return [t for m in updates for t in m.token_ids]

    def assert_idle(self) -> None:
        for name in ("prefill", "decode"):
            if self.alive[name]:
                getattr(self, name).assert_idle()


@pytest.fixture
def pair(request, tiny_model_dir) -> Iterator[StreamPair]:
    p = StreamPair(tiny_model_dir, **getattr(request, "param", {}))
    yield p
    p.close()


@pytest.fixture(scope="module")
def whole(tiny_model_dir) -> list[int]:
    """The tokens with streaming off: one transfer after the first token."""
    p = StreamPair(tiny_model_dir, stream=False)
    try:
        tokens = p.run()
        assert pieces(p.prefill, "sent") == 0 and pieces(p.decode, "received") == 0
        return tokens
    finally:
        p.close()


def test_streamed_equals_whole_colocated_and_hf_and_overlaps_the_prefill(tiny_model_dir, pair, whole):
    assert pair.run() == whole == hf_greedy(tiny_model_dir, PROMPT, LONG.max_tokens)
    assert (pieces(pair.prefill, "sent"), pieces(pair.decode, "received")) == (3, 3)
    # The decode worker had piece 0 copied in before the prefill worker sampled its first
    # token: the transfer overlapped the prompt's compute.
    assert pair.events == ["piece 0 in", "first token"]
    assert failures(pair.prefill, "retried") == failures(pair.prefill, "send") == 0
    pair.assert_idle()
    colocated = Harness(tiny_model_dir, WorkerRole.COLOCATED, chunk=CHUNK)
    try:
        colocated.send(Task.of("c", PROMPT, LONG, colocated.reply_to))
        colocated.run_until(lambda: colocated.finished("c") is not None)
        assert colocated.output("c") == whole
    finally:
        colocated.close()


def script_at(index: int, fault: str) -> str:
    return "+".join([*["none"] * index, fault])


@pytest.mark.parametrize("index,fault", [(0, "drop"), (1, "truncate"), (2, "corrupt"), (FINAL, "drop")],
                         ids=["first-drop", "middle-truncate", "last-piece-corrupt", "final-drop"])
def test_a_fault_at_any_transfer_of_the_stream_is_retried_whole(tiny_model_dir, whole, index, fault):
    pair = StreamPair(tiny_model_dir, script=script_at(index, fault))
    try:
        assert pair.run() == whole and pair.prefill.errors("r") == []
        assert failures(pair.prefill, "retried") == 1 and failures(pair.prefill, "send") == 0
        assert pair.decode.finished("r").error is None
        pair.assert_idle()
    finally:
        pair.close()


@pytest.mark.parametrize("index", [0, 1, FINAL])
def test_with_no_attempt_left_a_fault_fails_the_request_clearly(tiny_model_dir, index):
    pair = StreamPair(tiny_model_dir, script=script_at(index, "truncate"), attempts=1)
    try:
        pair.send()
        pair.run_until(pair.ended)
        [error] = pair.prefill.errors("r")
        assert error.startswith("KV transfer failed (attempt 1 of 1)")
        # The first token, if the prompt was done before the nack came back; never more,
        # and never a finish: the error ends the request.
        assert len(pair.tokens()) == (1 if index == FINAL else len(pair.tokens())) <= 1
        assert all(m.finish_reason is None for m in pair.prefill.tokens)
        pair.abort()  # what the router does on the prefill worker's Finished(error)
        pair.run_until(lambda: pair.decode.worker.num_arriving == 0 and held(pair.decode) == 0)
        pair.assert_idle()
    finally:
        pair.close()


@pytest.mark.parametrize("after", [1, 2, "final"])
def test_an_abort_at_any_piece_frees_both_sides(pair, after):
    pair.send()
    if after == "final":  # the final is on its way, not yet taken in
        pair.prefill.run_until(lambda: pair.prefill.worker.outbox.streams.get("r") is not None
                               and pair.prefill.worker.outbox.streams.get("r").final_sent)
    else:
        pair.run_until(lambda: pieces(pair.decode, "received") >= after)
        assert held(pair.decode) == 7  # the whole prompt reserved, pieces copied in
    pair.abort()
    pair.run_until(lambda: held(pair.prefill) == held(pair.decode) == 0
                   and len(pair.prefill.worker.outgoing) == 0 and pair.decode.worker.num_arriving == 0)
    assert pair.decode.finished("r") is None and pair.prefill.errors("r") == []
    pair.assert_idle()


@pytest.mark.parametrize("after", [1, 2])
def test_a_dead_receiver_mid_stream_leaves_no_block_held_by_the_sender(pair, after):
    pair.send()
    pair.run_until(lambda: pieces(pair.decode, "received") >= after)
    pair.kill("decode")
    pair.prefill.run_until(lambda: bool(pair.prefill.errors("r")) and len(pair.prefill.worker.outgoing) == 0)
    [error] = pair.prefill.errors("r")
    assert error == "KV transfer failed (attempt 2 of 2): KV transfer lease expired"
    pair.assert_idle()


@pytest.mark.parametrize("after", [1, 3])
def test_a_dead_sender_mid_stream_leaves_no_block_reserved_by_the_receiver(pair, after):
    pair.send()
    pair.run_until(lambda: pieces(pair.decode, "received") >= after)
    assert held(pair.decode) == 7
    pair.kill("prefill")
    d = pair.decode
    d.run_until(lambda: held(d) == 0)  # silent for the lease: the stream is dropped
    assert failures(d, "stream_expired") == 1 and d.finished("r") is None
    pair.assert_idle()
