"""KV transfer faults, in process and deterministic: the test-only fault hook
(``common.connector.faults``) on a real prefill worker, against a real decode worker or a
KV receiver this test drives, over loopback. Each fault kind has one exact outcome:

- drop → the lease expires → the same blocks go again under a new id → the request goes on;
- truncate → the receiver nacks it → retried; corrupt → refused, the lease expires → retried;
- delay (shorter than the lease) → it arrives late and nothing is retried;
- two failures in a row → the request fails with a clear error, its blocks freed.

Throughout, the prefill worker keeps the request's blocks allocated until its transfer
ends, and the decode worker never admits a rejected transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import islice

import pytest

from common.connector import ReceivedTransfer, make_receiver, make_sender
from common.connector.faults import Fault, FaultPlan, FaultySender
from common.connector.transfers import OutgoingTransfers
from common.protocol import Abort, Finished, KVAck, Task
from common.roles import FinishStage, WorkerRole
from services.worker import WorkerSettings
from tests.test_connector import handoff
from tests.test_transfers import FakeClock
from tests.test_worker import GREEDY, PROMPT, Harness, handoff_for

LEASE_S = 1.5  # short, so a dropped transfer costs little; far above one loopback round trip
PROMPT_BLOCKS = 3  # PROMPT is 40 tokens in blocks of 16
LONG = replace(GREEDY, max_tokens=12)
DELAY_S = 0.2  # a delayed transfer's lateness: well inside the lease


# ---- the plan ---------------------------------------------------------------------------

def test_a_spec_parses_into_a_plan_and_back():
    plan = FaultPlan.parse("drop=0.05,truncate=0.05,corrupt=0.05,delay=0.05:0.5,seed=7")
    assert plan.rates == ((Fault.DROP, 0.05), (Fault.TRUNCATE, 0.05), (Fault.CORRUPT, 0.05),
                          (Fault.DELAY, 0.05))
    assert (plan.delay_s, plan.seed, plan.script, plan.delays) == (0.5, 7, (), True)
    assert FaultPlan.parse(plan.spec) == plan
    scripted = FaultPlan.parse("script=drop+none+corrupt")
    assert scripted.script == (Fault.DROP, None, Fault.CORRUPT) and not scripted.delays
    assert FaultPlan.parse(scripted.spec) == scripted


@pytest.mark.parametrize("spec,why", [
    ("drop", "key=value"), ("explode=0.1", "not a valid Fault"), ("drop=x", "could not convert"),
    ("drop=1.5", r"\[0, 1\]"), ("drop=0.6,corrupt=0.6", "more than 1"),
    ("delay=0.1:0", "> 0 s"), ("script=drop+boom", "not a valid Fault"), ("seed=1.5", "invalid literal"),
])
def test_a_bad_spec_is_refused_with_its_reason(spec: str, why: str):
    with pytest.raises(ValueError, match=why):
        FaultPlan.parse(spec)


def test_draws_follow_the_script_then_the_seeded_rates():
    plan = FaultPlan.parse("script=truncate+none,drop=0.2,delay=0.1,seed=3")
    first = list(islice(plan.draws(), 2000))
    assert first[:2] == [Fault.TRUNCATE, None]
    assert first == list(islice(plan.draws(), 2000))  # seeded: the same every time
    random = first[2:]
    assert set(random) == {Fault.DROP, Fault.DELAY, None}
    assert 0.15 < random.count(Fault.DROP) / len(random) < 0.25  # 1998 draws at p = 0.2


def test_a_worker_takes_faults_only_from_its_settings_and_a_delay_must_fit_the_lease():
    plain = WorkerSettings(WorkerRole.PREFILL, "tcp://127.0.0.1:1")
    assert plain.kv_faults is None and plain.kv_transfer_attempts == 2
    on = WorkerSettings(WorkerRole.PREFILL, "tcp://127.0.0.1:1", kv_faults="drop=0.1,seed=2")
    assert on.kv_faults == FaultPlan(((Fault.DROP, 0.1),), seed=2)
    with pytest.raises(ValueError, match="shorter than the lease"):
        WorkerSettings(WorkerRole.PREFILL, "tcp://127.0.0.1:1", lease_seconds=1.0,
                       kv_faults="delay=0.1:1.0")


# ---- the bookkeeping: which failures are retried -----------------------------------------

def test_a_failed_transfer_is_retried_once_then_ends():
    clock = FakeClock()
    out = OutgoingTransfers(lease_seconds=5.0, clock=clock, max_attempts=2)
    out.open("t1", "r", 10, resend="handoff")
    [nacked] = out.settle([KVAck("t1", False, "bad frames")])
    assert (nacked.error, nacked.attempt, nacked.retry, nacked.resend) == ("bad frames", 1, True, "handoff")
    out.open("t2", "r", 10, attempt=2, resend="handoff")
    clock.now += 5.0
    [expired] = out.expire()
    assert (expired.error, expired.attempt, expired.retry) == ("KV transfer lease expired", 2, False)
    out.open("t3", "q", 10, resend="h")
    assert out.cancel("q")
    [cancelled] = out.settle([KVAck("t3", False, "gone")])
    assert cancelled.cancelled and not cancelled.retry  # an aborted request is not sent again
    out.open("t4", "p", 10, resend="h")
    [acked] = out.settle([KVAck("t4", True)])
    assert acked.ok and not acked.retry and len(out) == 0


# ---- the connector: what each fault puts on the wire ---------------------------------------

@pytest.fixture
def decode_worker(tiny_model_dir) -> Iterator[Harness]:
    h = Harness(tiny_model_dir, WorkerRole.DECODE, num_blocks=8)
    yield h
    h.close()


def test_the_decode_side_never_admits_a_truncated_or_corrupt_transfer(decode_worker: Harness):
    sender = make_sender("zmq", faults=FaultPlan.parse("script=truncate+corrupt+none"))
    acks: list[KVAck] = []
    for rid in ("cut", "garbled", "good"):
        header, frames = handoff_for(decode_worker, rid)
        sender.send(decode_worker.worker.kv_address, header, [memoryview(f) for f in frames])
    decode_worker.run_until(lambda: bool(acks.extend(sender.poll_acks())) or len(acks) == 3)
    assert acks[0] == KVAck("t-cut", False, "expected 3 block frames, got 2")
    assert not acks[1].ok and acks[1].transfer_id == ""  # a garbled header names no transfer
    assert acks[2] == KVAck("t-good", True, "")
    assert failures(decode_worker, "bad_transfer") == 2
    decode_worker.run_until(lambda: decode_worker.finished("good") is not None)
    assert decode_worker.output("cut") == decode_worker.output("garbled") == []
    assert len(decode_worker.output("good")) == GREEDY.max_tokens - 1  # + 1 from prefill
    decode_worker.assert_idle()  # nothing of the refused ones was kept
    sender.close()


def test_a_delayed_transfer_is_held_until_its_time():
    clock = FakeClock()
    receiver = make_receiver("zmq", "tcp://127.0.0.1:0")
    sender = FaultySender(make_sender("zmq"), FaultPlan.parse("script=delay,delay=0:2"), clock)
    sender.send(receiver.address, handoff("late", 1, 64), [memoryview(bytes(64))])
    sender.poll_acks()
    assert receiver.poll(timeout_ms=200) == []  # its time has not come
    clock.now += 2.0
    sender.poll_acks()  # the first call after its time sends it
    assert [t.header.transfer_id for t in receiver.poll(timeout_ms=5000)] == ["late"]
    assert sender.injected == {Fault.DELAY: 1}
    sender.close()
    receiver.close()


# ---- the prefill side: retry once, then fail clearly ----------------------------------------

def failures(h: Harness, reason: str) -> float:
    """``tandem:kv_transfer_failures_total{reason}`` on the worker."""
    [family] = h.worker.metrics.kv_failures.collect()
    return sum(s.value for s in family.samples
               if s.name.endswith("_total") and s.labels.get("reason") == reason)


def held(h: Harness) -> int:
    stats = h.worker.engine.stats()
    return stats.num_blocks - stats.num_free_blocks


def prefill_with(model_dir, script: str, attempts: int = 2) -> Harness:
    """A prefill worker whose next transfers get the faults in ``script`` ("drop+none")."""
    return Harness(model_dir, WorkerRole.PREFILL, lease_seconds=LEASE_S,
                   kv_faults=f"script={script},delay=0:{DELAY_S}", kv_transfer_attempts=attempts)


def tick_once(h: Harness) -> None:
    h.run_until(iter([False, True]).__next__)  # one tick, and collect what it sent


def run_lent(h: Harness, done: Callable[[], bool]) -> None:
    """Tick until ``done()``; after every tick that leaves a transfer of the request in
    flight (the first attempt, or the retry that follows it within the same tick), its
    blocks must still be allocated."""
    h.run_until(lambda: len(h.worker.outgoing) == 1)  # shipped: lent from here on
    lent = []

    def sample() -> None:
        if len(h.worker.outgoing):
            lent.append(held(h))
    h.run_until(lambda: sample() or done())
    assert len(h.worker.outgoing) == 0 and lent and min(lent) >= PROMPT_BLOCKS


def prefill_finished(h: Harness, request_id: str) -> Finished | None:
    return next((m for m in h.from_worker if isinstance(m, Finished)
                 and m.request_id == request_id and m.stage is FinishStage.PREFILL), None)


@pytest.fixture
def peer() -> Iterator[object]:
    receiver = make_receiver("zmq", "tcp://127.0.0.1:0")
    yield receiver
    receiver.close()


def serve_from(peer, got: list[ReceivedTransfer]) -> Callable[[], None]:
    """What a decode worker's receiver does each tick: take transfers, ack them."""
    def serve() -> None:
        for transfer in peer.poll(0):
            got.append(transfer)
            peer.ack(transfer, ok=True)
    return serve


@pytest.mark.parametrize("fault,cause", [
    ("drop", "KV transfer lease expired"),
    ("truncate", "expected 3 block frames, got 2"),
    ("corrupt", "KV transfer lease expired"),  # the receiver cannot name it in its nack
])
def test_a_failed_transfer_goes_again_with_the_same_blocks(tiny_model_dir, peer, caplog, fault, cause):
    h = prefill_with(tiny_model_dir, f"{fault}+none")
    try:
        h.send(Task.of("r", PROMPT, GREEDY, h.reply_to, handoff_addr=peer.address))
        got: list[ReceivedTransfer] = []
        serve = serve_from(peer, got)
        run_lent(h, lambda: serve() or prefill_finished(h, "r") is not None)
        assert prefill_finished(h, "r").error is None
        [retry] = got  # only the second attempt ever reached the receiver whole
        assert retry.header.request_id == "r" and retry.header.num_blocks == PROMPT_BLOCKS
        assert f"({cause}): sending it again" in caplog.text
        assert (failures(h, "retried"), failures(h, "send")) == (1, 0)
        assert h.errors("r") == [] and len(h.output("r")) == 1  # the first token, no error
        assert h.worker.sender.injected == {Fault(fault): 1}
        h.assert_idle()
    finally:
        h.close()


def test_two_failures_in_a_row_fail_the_request_clearly_and_free_its_blocks(tiny_model_dir, peer):
    h = prefill_with(tiny_model_dir, "drop+truncate")
    try:
        h.send(Task.of("r", PROMPT, GREEDY, h.reply_to, handoff_addr=peer.address))
        got: list[ReceivedTransfer] = []
        run_lent(h, lambda: serve_from(peer, got)() or (prefill_finished(h, "r") is not None
                                                        and bool(h.errors("r"))))
        assert prefill_finished(h, "r").error == "expected 3 block frames, got 2"
        assert h.errors("r") == ["KV transfer failed (attempt 2 of 2): expected 3 block frames, got 2"]
        assert got == [] and (failures(h, "retried"), failures(h, "send")) == (1, 1)
        h.assert_idle()
    finally:
        h.close()


def test_an_abort_during_the_retry_ends_it_without_another(tiny_model_dir, peer):
    h = prefill_with(tiny_model_dir, "drop+drop+drop", attempts=3)
    try:
        h.send(Task.of("r", PROMPT, GREEDY, h.reply_to, handoff_addr=peer.address))
        h.run_until(lambda: failures(h, "retried") == 1)  # the second attempt is in flight
        h.send(Abort("r"))
        h.run_until(lambda: len(h.worker.outgoing) == 0)
        h.assert_idle()
        assert h.worker.sender.injected == {Fault.DROP: 2} and h.errors("r") == []
    finally:
        h.close()


# ---- both sides together: what the client gets -----------------------------------------------

class Pair:
    """A prefill worker and a decode worker, ticked in turn; this test plays the router
    and the gateway (the prefill harness's sockets)."""

    def __init__(self, model_dir, script: str) -> None:
        self.decode = Harness(model_dir, WorkerRole.DECODE)
        self.prefill = prefill_with(model_dir, script)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    def run(self, request_id: str) -> None:
        """Send one request and tick both workers until the decode side or prefill ends it."""
        self.prefill.send(Task.of(request_id, PROMPT, LONG, self.prefill.reply_to,
                               handoff_addr=self.decode.worker.kv_address))
        p, d = self.prefill, self.decode
        p.run_until(lambda: tick_once(d) or self._ended(request_id))

    def tokens(self, request_id: str) -> list[int]:
        """The request's tokens in index order (they come from two workers, two sockets)."""
        updates = sorted((m for m in self.prefill.tokens if m.request_id == request_id),
                         key=lambda m: m.index)
        return [t for m in updates for t in m.token_ids]

    def finish_reasons(self, request_id: str) -> list[str]:
        return [m.finish_reason for m in self.prefill.tokens
                if m.request_id == request_id and m.finish_reason is not None]

    def _ended(self, request_id: str) -> bool:
        streamed = (self.decode.finished(request_id) is not None
                    and len(self.prefill.output(request_id)) == LONG.max_tokens)
        return (streamed or bool(self.prefill.errors(request_id))) and len(self.prefill.worker.outgoing) == 0


@pytest.fixture(scope="module")
def undisturbed(tiny_model_dir) -> list[int]:
    pair = Pair(tiny_model_dir, "none")
    try:
        pair.run("clean")
        assert len(pair.tokens("clean")) == LONG.max_tokens
        return pair.tokens("clean")
    finally:
        pair.close()


@pytest.mark.parametrize("script", ["drop", "truncate", "corrupt", "delay"])
def test_the_client_gets_the_undisturbed_tokens_after_one_fault(tiny_model_dir, undisturbed, script):
    pair = Pair(tiny_model_dir, script)
    try:
        pair.run("r")
        assert pair.tokens("r") == undisturbed and pair.prefill.errors("r") == []
        assert pair.finish_reasons("r") == ["length"]
        assert pair.decode.finished("r").error is None
        assert failures(pair.prefill, "retried") == (0 if script == "delay" else 1)
        pair.prefill.assert_idle()
        pair.decode.assert_idle()
    finally:
        pair.close()


def test_when_both_attempts_fail_the_client_gets_an_error_and_nothing_is_held(tiny_model_dir):
    pair = Pair(tiny_model_dir, "corrupt+truncate")
    try:
        pair.run("r")
        [error] = pair.prefill.errors("r")
        assert error.startswith("KV transfer failed (attempt 2 of 2)")
        assert len(pair.tokens("r")) == 1 and pair.finish_reasons("r") == []  # never "length"
        assert pair.decode.finished("r") is None and failures(pair.decode, "bad_transfer") == 2
        pair.prefill.assert_idle()
        pair.decode.assert_idle()
    finally:
        pair.close()
