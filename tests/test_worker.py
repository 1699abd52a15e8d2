"""A worker's failure branches, in process: the real ``WorkerService`` over real loopback
sockets, its loop driven one ``tick`` at a time, with this test playing the router, the
gateway and the KV peer. Each case checks the exact outcome, then that the worker still
serves a good request and holds no KV block afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import fields, replace

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import services.worker as worker_module
from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from common.connector import make_receiver, make_sender
from common.engine.engine import Engine
from common.metrics import counter_value
from common.outputs import FinishReason
from common.protocol import (
    Abort,
    Finished,
    Heartbeat,
    KVAck,
    KVHandoff,
    Message,
    ProtocolError,
    Register,
    Registered,
    Reregister,
    Task,
    Tokens,
    decode,
    encode,
)
from common.roles import FinishStage, WorkerRole
from common.sampling_params import SamplingParams
from services.worker import ACK_POLL_MS, WorkerService, WorkerSettings
from tests.conftest import loaded_model

DEADLINE_S = 30.0
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks of 16


class Harness:
    """One worker plus the sockets of everyone it talks to."""

    def __init__(self, model_dir, role: WorkerRole, num_blocks: int = 64, chunk: int = 512,
                 **settings) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        self.gateway = self.ctx.socket(zmq.PULL)
        self.gateway.bind("tcp://127.0.0.1:0")
        self.reply_to = self.gateway.getsockopt_string(zmq.LAST_ENDPOINT)
        config = EngineConfig(model=ModelConfig(path=str(model_dir)),
                              cache=CacheConfig(num_blocks=num_blocks),
                              scheduler=SchedulerConfig(max_num_batched_tokens=chunk), threads=1)
        engine = Engine(config, loaded=loaded_model(model_dir), detokenize=False)
        self.worker = WorkerService(WorkerSettings(
            role, self.router.getsockopt_string(zmq.LAST_ENDPOINT), worker_id=f"{role.value}-t",
            kv_bind="tcp://127.0.0.1:0", **settings), engine)
        self.worker.http.start()
        self.worker._register()  # noqa: SLF001 - what run() does before its loop
        self.identity, register = self.router.recv_multipart()
        assert isinstance(decode(register), Register)
        self.from_worker: list[Message] = []
        self.tokens: list[Tokens] = []

    def close(self) -> None:
        self.worker.close()
        for sock in (self.router, self.gateway):
            sock.close(linger=0)
        self.ctx.term()

    def send(self, msg: Message | bytes) -> None:
        self.router.send_multipart([self.identity, msg if isinstance(msg, bytes) else encode(msg)])

    def run_until(self, done: Callable[[], bool]) -> None:
        """Tick the worker, collecting what it sends, until ``done()`` or the deadline."""
        deadline = time.monotonic() + DEADLINE_S
        while not done():
            assert time.monotonic() < deadline, f"gave up; worker sent {self.from_worker}"
            self.worker.tick()
            while self.router.poll(0):
                self.from_worker.append(decode(self.router.recv_multipart()[1]))
            while self.gateway.poll(0):
                self.tokens.append(decode(self.gateway.recv()))

    def finished(self, request_id: str) -> Finished | None:
        return next((m for m in self.from_worker if isinstance(m, Finished)
                     and m.request_id == request_id and m.stage is FinishStage.REQUEST), None)

    def output(self, request_id: str) -> list[int]:
        return [t for m in self.tokens if m.request_id == request_id for t in m.token_ids]

    def errors(self, request_id: str) -> list[str]:
        return [m.error for m in self.tokens if m.request_id == request_id and m.error]

    def serve_one(self, request_id: str = "good") -> list[int]:
        """A good colocated request completes, and afterwards nothing is held."""
        self.send(Task.of(request_id, PROMPT, GREEDY, self.reply_to))
        self.run_until(lambda: len(self.output(request_id)) == GREEDY.max_tokens
                       and self.finished(request_id) is not None)
        self.assert_idle()
        return self.output(request_id)

    def assert_idle(self) -> None:
        stats = self.worker.engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, stats.num_blocks)
        assert self.worker.num_arriving == 0 and len(self.worker.outgoing) == 0


@pytest.fixture
def colocated(tiny_model_dir) -> Iterator[Harness]:
    h = Harness(tiny_model_dir, WorkerRole.COLOCATED)
    yield h
    h.close()


class WaitedShare:
    """A CpuShare whose steps ran on one thread and waited 0.25 s for CPUs in all."""

    waited_s = 0.25

    def threads(self, may_wait: bool = False) -> int:
        return 1

    def rest(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_time_steps_waited_for_a_cpu_and_their_threads_are_exported(colocated: Harness):
    colocated.worker.engine._cpu_share = WaitedShare()  # noqa: SLF001
    colocated.serve_one()
    metrics = colocated.worker.metrics
    assert counter_value(metrics.cpu_wait) == 0.25
    assert metrics.step_threads._value.get() == 1  # noqa: SLF001


def test_a_registered_worker_beats_before_its_first_tick(colocated: Harness) -> None:
    """A worker whose first step is long (a restarted one taking over the requests moved off
    a dead one) must not look dead to the router meanwhile: registering gives its heartbeat
    something to send, before any tick has run."""
    colocated.worker.heartbeat.start()
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert time.monotonic() < deadline, "no heartbeat from a registered worker that has not ticked"
        if colocated.router.poll(100) and isinstance(decode(colocated.router.recv_multipart()[1]), Heartbeat):
            break


def handoff_for(h: Harness, request_id: str, **changes) -> tuple[KVHandoff, list[bytes]]:
    """A consistent handoff for the decode side of ``h`` (zero KV: values do not matter here)."""
    e = h.worker.engine
    blocks = -(-len(PROMPT) // e.block_size)
    header = KVHandoff(f"t-{request_id}", request_id, PROMPT, [7], [None], [None], [False], GREEDY,
                       h.reply_to, 0, blocks, e.block_nbytes, e.kv_layout.as_list(),
                       e.kv_layout.kv_dtype)
    header = replace(header, **changes) if changes else header
    return header, [bytes(header.block_nbytes)] * header.num_blocks


def ship(h: Harness, header: KVHandoff | bytes, frames: list[bytes]) -> list[KVAck]:
    """Send a transfer to the worker's KV receiver as a prefill worker would; its acks."""
    sender = make_sender("zmq")
    sock = sender._socket(h.worker.kv_address)  # noqa: SLF001 - raw frames, bypassing checks
    sock.send_multipart([header if isinstance(header, bytes) else encode(header), *frames])
    acks: list[KVAck] = []
    h.run_until(lambda: bool(acks.extend(sender.poll_acks()) or acks))
    sender.close()
    return acks


# ---- the router side --------------------------------------------------------------------

def test_a_bad_task_fails_alone(colocated: Harness):
    vocab = colocated.worker.engine.spec.vocab_size
    colocated.send(Task.of("bad", [1, vocab + 5], GREEDY, colocated.reply_to))
    colocated.run_until(lambda: colocated.finished("bad") and colocated.errors("bad"))
    assert "not a token id" in colocated.finished("bad").error
    assert colocated.output("bad") == []
    assert len(colocated.serve_one()) == 6


def test_a_duplicate_task_does_not_take_down_the_request_holding_the_id(colocated: Harness):
    colocated.send(Task.of("r", PROMPT, replace(GREEDY, max_tokens=20), colocated.reply_to))
    colocated.run_until(lambda: len(colocated.output("r")) >= 1)
    colocated.send(Task.of("r", PROMPT, GREEDY, colocated.reply_to))
    colocated.run_until(lambda: colocated.finished("r") is not None)
    first = colocated.finished("r")
    assert first.error and "already in use" in first.error  # the duplicate failed ...
    colocated.from_worker.remove(first)
    colocated.run_until(lambda: colocated.finished("r") is not None and len(colocated.output("r")) == 20)
    assert colocated.finished("r").error is None  # ... not r


def test_an_abort_stops_the_work_and_frees_every_block(colocated: Harness):
    colocated.send(Task.of("long", PROMPT, replace(GREEDY, max_tokens=500), colocated.reply_to))
    colocated.run_until(lambda: len(colocated.output("long")) >= 2)
    colocated.send(Abort("long"))
    colocated.run_until(lambda: colocated.worker.engine.stats().num_running == 0)
    assert len(colocated.output("long")) < 500
    colocated.assert_idle()


def test_a_prefill_only_task_to_a_worker_that_cannot_ship_fails_clearly(colocated: Harness):
    colocated.send(Task.of("p", PROMPT, GREEDY, colocated.reply_to, handoff_addr="tcp://127.0.0.1:9"))
    colocated.run_until(lambda: colocated.finished("p") is not None)
    assert "cannot ship KV" in colocated.finished("p").error
    colocated.assert_idle()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.one_of(
    st.binary(max_size=64),
    st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.text(max_size=8),
                       st.binary(max_size=8)),
             max_size=6).map(lambda v: msgpack.packb(["task", 3, v])),
    st.tuples(st.sampled_from(["task", "abort", "reregister", "tokens", "kv_ack", "ping"]),
              st.integers(0, 3), st.lists(st.integers(-5, 5), max_size=6))
    .map(lambda t: msgpack.packb(list(t))),
))
def test_garbage_from_the_router_is_dropped_and_the_worker_keeps_serving(colocated: Harness, junk):
    colocated.send(junk)
    rid = f"probe-{len(colocated.from_worker)}"
    assert len(colocated.serve_one(rid)) == 6  # sent after the junk: proves it was handled


def test_after_the_garbage_a_good_request_still_completes(colocated: Harness):
    for junk in (b"", b"\x93", msgpack.packb(["task", 3, [1, 2, 3]]), encode(Abort("nobody"))):
        colocated.send(junk)
    assert len(colocated.serve_one()) == 6
    assert colocated.worker.metrics.handler_errors.labels("decode")._value.get() >= 2  # noqa: SLF001


# ---- the decode side: KV coming in ------------------------------------------------------

@pytest.fixture
def decode_worker(tiny_model_dir) -> Iterator[Harness]:
    h = Harness(tiny_model_dir, WorkerRole.DECODE, num_blocks=8)
    yield h
    h.close()


@pytest.mark.parametrize("changes,reason", [
    ({"first_logprobs": [None, None]}, "per-choice lists"),
    ({"num_blocks": 2}, "needs 3"),
    ({"finished": [True]}, "finished already"),
])
def test_an_inconsistent_handoff_is_nacked_and_the_decode_worker_keeps_serving(
        decode_worker: Harness, changes, reason):
    header, frames = handoff_for(decode_worker, "bad")
    values = msgpack.unpackb(encode(header))
    names = [f.name for f in fields(KVHandoff)]
    for name, value in changes.items():
        values[2][names.index(name)] = value
    [ack] = ship(decode_worker, msgpack.packb(values), frames[: changes.get("num_blocks", 3)])
    assert not ack.ok and reason in ack.reason
    assert decode_worker.tokens == []  # nothing reached the engine
    good, frames = handoff_for(decode_worker, "good")
    [ack] = ship(decode_worker, good, frames)
    assert ack.ok
    decode_worker.run_until(lambda: len(decode_worker.output("good")) == 5  # + 1 from prefill
                            and decode_worker.finished("good") is not None)
    decode_worker.assert_idle()


def test_a_layout_mismatch_is_nacked_and_fails_the_request(decode_worker: Harness):
    header, frames = handoff_for(decode_worker, "r")
    layout = header.layout[:4] + [2]  # a bf16 cache
    [ack] = ship(decode_worker, replace(header, layout=layout), frames)
    assert not ack.ok and "does not match" in ack.reason
    decode_worker.run_until(lambda: decode_worker.finished("r") and decode_worker.errors("r"))
    assert decode_worker.output("r") == []
    decode_worker.assert_idle()


def test_a_kv_dtype_mismatch_is_nacked_with_the_flag_to_fix(decode_worker: Harness):
    header, frames = handoff_for(decode_worker, "q")  # same sizes, but int8 codes
    [ack] = ship(decode_worker, replace(header, kv_dtype="int8"), frames)
    assert not ack.ok and "KV cache dtype int8" in ack.reason and "--kv-cache-dtype" in ack.reason
    decode_worker.run_until(lambda: decode_worker.finished("q") and decode_worker.errors("q"))
    decode_worker.assert_idle()


def test_a_handoff_arriving_after_its_abort_is_dropped(decode_worker: Harness):
    decode_worker.send(Abort("late"))
    # the abort and the handoff come on different sockets: let the abort land first
    decode_worker.run_until(lambda: decode_worker.worker.incoming.was_aborted("late"))
    header, frames = handoff_for(decode_worker, "late")
    [ack] = ship(decode_worker, header, frames)
    assert ack.ok  # the bytes arrived; the request is simply gone
    decode_worker.run_until(lambda: True)
    assert decode_worker.output("late") == [] and decode_worker.finished("late") is None
    decode_worker.assert_idle()


def test_a_handoff_waits_for_room_and_then_runs(decode_worker: Harness):
    """8 blocks: a 40-token request takes 3, grows to 4; two fit, the third must wait."""
    long = replace(GREEDY, max_tokens=40)
    for rid in ("a", "b", "c"):
        header, frames = handoff_for(decode_worker, rid, params=long)
        [ack] = ship(decode_worker, header, frames)
        assert ack.ok
    assert len(decode_worker.worker.incoming) == 1  # c is pending, not failed
    decode_worker.run_until(lambda: all(len(decode_worker.output(r)) == 39
                                        and decode_worker.finished(r) for r in "abc"))
    decode_worker.assert_idle()


# ---- the prefill side: KV going out -----------------------------------------------------

@pytest.fixture
def prefill_worker(tiny_model_dir) -> Iterator[tuple[Harness, object]]:
    # One attempt: these cases are how a single transfer ends; tests/test_kv_faults.py
    # covers the retry of a failed one.
    h = Harness(tiny_model_dir, WorkerRole.PREFILL, lease_seconds=0.5, kv_transfer_attempts=1)
    peer = make_receiver("zmq", "tcp://127.0.0.1:0")
    yield h, peer
    peer.close()
    h.close()


def test_a_nack_fails_the_request_and_frees_the_prefill_blocks(prefill_worker):
    h, peer = prefill_worker
    h.send(Task.of("r", PROMPT, GREEDY, h.reply_to, handoff_addr=peer.address))
    got = []
    h.run_until(lambda: bool(got.extend(peer.poll(0)) or got))
    peer.ack(got[0], ok=False, reason="no room")
    h.run_until(lambda: any(isinstance(m, Finished) for m in h.from_worker) and h.errors("r"))
    [done] = [m for m in h.from_worker if isinstance(m, Finished)]
    assert (done.stage, done.error) == (FinishStage.PREFILL, "no room")
    assert any("no room" in e for e in h.errors("r"))
    assert len(h.output("r")) == 1  # the first token had gone out at once
    h.assert_idle()


def test_an_unacked_transfer_expires_and_frees_the_prefill_blocks(prefill_worker):
    h, peer = prefill_worker
    h.send(Task.of("r", PROMPT, GREEDY, h.reply_to, handoff_addr=peer.address))
    h.run_until(lambda: any(isinstance(m, Finished) for m in h.from_worker))
    [done] = [m for m in h.from_worker if isinstance(m, Finished)]
    assert done.error == "KV transfer lease expired"
    h.assert_idle()
    assert [t.header.request_id for t in peer.poll(0)] == ["r"]  # it was sent, never acked


class RecordingPoller:
    """The worker's poller, recording each timeout it is asked to wait."""

    def __init__(self, inner: zmq.Poller) -> None:
        self.inner, self.timeouts = inner, []

    def poll(self, timeout=None):
        self.timeouts.append(timeout)
        return self.inner.poll(timeout)


def test_a_loop_waiting_only_for_acks_sleeps_instead_of_spinning(prefill_worker):
    """A prompt computed and shipped leaves its request detached in the engine until the
    receiver acks: nothing to compute, so each tick waits in the poller (briefly: acks do
    not wake it) rather than spinning. The spin burnt a core beside the decode worker."""
    h, peer = prefill_worker
    h.send(Task.of("r", PROMPT, GREEDY, h.reply_to, handoff_addr=peer.address))
    got = []
    h.run_until(lambda: bool(got.extend(peer.poll(0)) or got))  # shipped, not acked
    engine = h.worker.engine
    assert engine.has_unfinished and not engine.has_work
    poller = h.worker._poller = RecordingPoller(h.worker._poller)  # noqa: SLF001
    h.worker.tick()
    assert poller.timeouts == [ACK_POLL_MS]
    peer.ack(got[0], ok=True)
    h.run_until(lambda: any(isinstance(m, Finished) for m in h.from_worker))
    h.assert_idle()
    assert not engine.has_unfinished


def test_a_loop_whose_prompt_waits_for_blocks_lent_to_a_transfer_sleeps_instead_of_spinning(
        tiny_model_dir):
    """Only the ack frees the blocks the second prompt needs: each tick waits briefly in
    the poller instead of stepping an engine that can compute nothing."""
    h = Harness(tiny_model_dir, WorkerRole.PREFILL, num_blocks=4, kv_transfer_attempts=1)
    peer = make_receiver("zmq", "tcp://127.0.0.1:0")
    try:
        h.send(Task.of("a", PROMPT, GREEDY, h.reply_to, handoff_addr=peer.address))
        got = []
        h.run_until(lambda: bool(got.extend(peer.poll(0)) or got))  # 3 of 4 blocks lent
        h.send(Task.of("b", [t + 1000 for t in PROMPT], GREEDY, h.reply_to, handoff_addr=peer.address))
        engine = h.worker.engine
        h.run_until(lambda: engine.stalled and engine.has_work)  # b waits for blocks
        poller = h.worker._poller = RecordingPoller(h.worker._poller)  # noqa: SLF001
        h.worker.tick()
        assert poller.timeouts == [ACK_POLL_MS]
        peer.ack(got.pop(), ok=True)
        h.run_until(lambda: bool(got.extend(peer.poll(0)) or got))  # b computed and shipped
        peer.ack(got.pop(), ok=True)
        h.run_until(lambda: {m.request_id for m in h.from_worker if isinstance(m, Finished)} == {"a", "b"})
        h.assert_idle()
    finally:
        peer.close()
        h.close()


def test_an_acked_transfer_finishes_the_prefill_stage(prefill_worker):
    h, peer = prefill_worker
    h.send(Task.of("r", PROMPT, replace(GREEDY, n=2, temperature=0.5, seed=1), h.reply_to,
                handoff_addr=peer.address))
    got = []
    h.run_until(lambda: bool(got.extend(peer.poll(0)) or got))
    header = got[0].header
    assert (header.num_blocks, len(header.first_tokens), header.finished) == (3, 2, [False, False])
    peer.ack(got[0], ok=True)
    h.run_until(lambda: any(isinstance(m, Finished) for m in h.from_worker)
                and len({m.choice for m in h.tokens if m.request_id == "r"}) == 2)
    [done] = [m for m in h.from_worker if isinstance(m, Finished)]
    assert (done.stage, done.error) == (FinishStage.PREFILL, None)
    assert sorted(m.choice for m in h.tokens if m.request_id == "r") == [0, 1]
    assert all(m.finish_reason is None for m in h.tokens)
    h.assert_idle()


def test_protocol_errors_are_value_errors_the_cli_reports():
    assert issubclass(ProtocolError, ValueError)
    assert FinishReason.STOP.value == "stop"


@pytest.mark.parametrize("lost_work", [False, True])
def test_a_reregister_keeps_or_drops_the_work_as_the_router_says(colocated: Harness, lost_work):
    colocated.send(Registered(colocated.worker.s.worker_id))
    colocated.send(Task.of("r", PROMPT, replace(GREEDY, max_tokens=200), colocated.reply_to))
    colocated.run_until(lambda: len(colocated.output("r")) >= 2)
    colocated.send(Reregister(colocated.worker.s.worker_id, lost_work=lost_work))
    colocated.run_until(lambda: any(isinstance(m, Register) for m in colocated.from_worker))
    if lost_work:  # the router failed r already: it must stop here
        colocated.run_until(lambda: colocated.worker.engine.stats().num_running == 0)
        assert len(colocated.output("r")) < 200
    else:  # a restarted router: r goes on to its end
        colocated.run_until(lambda: len(colocated.output("r")) == 200)
    colocated.assert_idle()


def test_reregisters_sent_before_the_router_read_our_register_make_one_register(colocated: Harness,
                                                                               monkeypatch):
    """A worker frozen past its heartbeat timeout wakes to a Reregister for each second the
    router heard its heartbeats unregistered. It registers once: to the router a second
    Register is a restart, which fails what it placed on the worker in between."""
    worker_id = colocated.worker.s.worker_id
    registers = lambda: sum(isinstance(m, Register) for m in colocated.from_worker)  # noqa: E731
    colocated.send(Registered(worker_id))
    colocated.send(Task.of("r", PROMPT, replace(GREEDY, max_tokens=200), colocated.reply_to))
    colocated.run_until(lambda: len(colocated.output("r")) >= 2)
    for _ in range(3):
        colocated.send(Reregister(worker_id, lost_work=True))
    colocated.run_until(lambda: registers() == 1 and colocated.worker.engine.stats().num_running == 0)
    colocated.send(Registered(worker_id))  # the router read the one Register
    assert colocated.serve_one("placed after") and registers() == 1
    colocated.send(Reregister(worker_id, lost_work=False))  # answered: a new question
    colocated.run_until(lambda: registers() == 2)
    # Unanswered for longer than REGISTER_ANSWER_S (here: at once), a Register went to a
    # router that died: its successor's Reregister is obeyed.
    monkeypatch.setattr(worker_module, "REGISTER_ANSWER_S", 0.0)
    colocated.send(Reregister(worker_id, lost_work=False))
    colocated.run_until(lambda: registers() == 3)


def test_a_structured_output_failure_fails_its_request_alone(colocated: Harness, monkeypatch):
    """A grammar that breaks in the worker (llguidance refuses it for this tokenizer):
    the gateway hears the error, the router hears Finished with it, nothing is held."""
    from common.grammar import GrammarCache, GrammarError
    from common.structured import StructuredKind, StructuredOutput

    def refuse(self, structured):
        raise GrammarError(structured.kind, "too complex for this tokenizer")

    monkeypatch.setattr(GrammarCache, "new_matcher", refuse)
    params = replace(GREEDY, structured=StructuredOutput(StructuredKind.REGEX, "a+"))
    colocated.send(Task.of("so", PROMPT, params, colocated.reply_to))
    colocated.run_until(lambda: colocated.finished("so") and colocated.errors("so"))
    assert "too complex" in colocated.errors("so")[0] and colocated.output("so") == []
    assert "too complex" in colocated.finished("so").error
    assert len(colocated.serve_one()) == 6
