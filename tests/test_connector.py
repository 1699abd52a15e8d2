"""The KV connector's guarantees (common/connector/base.py), checked on every transport:
zmq over tcp and ipc, and ucx (required under CI, skipped locally without ucxx); plus
the failure reports (on_error) and the sender's lease table.

Waiting is always "poll until a condition holds, within an overall deadline": no sleeps
as synchronisation and no assertions about how long anything took.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import zmq

from common.connector import KVTransport, ReceivedTransfer, make_receiver, make_sender
from common.connector.faults import Fault, FaultPlan, FaultySender
from common.connector.lease import LeaseTable
from common.connector.ucx import ucx_available  # also sets UCX_* env before ucxx loads
from common.connector.zmq import ZmqReceiver, ZmqSender
from common.protocol import KVAck, KVHandoff, decode, encode
from common.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
TRANSPORTS = ["zmq-tcp", "zmq-ipc", "ucx"]
BLOCK = 4096
LAYOUT = [30, 16, 3, 64, 4]  # layers, block size (tokens), kv heads, head dim, element size
SMOLLM2_BLOCK = 30 * 2 * 16 * 3 * 64 * 4  # layers x (k, v) x tokens x kv heads x dims x fp32
DEADLINE_S = 10.0


def handoff(transfer_id: str, num_blocks: int, block_nbytes: int) -> KVHandoff:
    """Every test's KVHandoff: one choice, a prompt that fills exactly ``num_blocks``."""
    return KVHandoff(
        transfer_id=transfer_id, request_id=f"req-{transfer_id}",
        prompt_token_ids=list(range(1, num_blocks * LAYOUT[1] + 1)),
        first_tokens=[7], first_logprobs=[None], generator_states=[None], finished=[False],
        params=SamplingParams(max_tokens=4), reply_to="tcp://127.0.0.1:1", num_cached_tokens=0,
        num_blocks=num_blocks, block_nbytes=block_nbytes, layout=LAYOUT, kv_dtype="float32",
    )


def require_ucx() -> None:
    """UCX tests skip without ucxx, except under CI, where a missing extra is a failure."""
    if ucx_available():
        return
    if os.environ.get("CI"):
        pytest.fail("ucxx is not installed but CI is set: install the ucx extra (pip install 'tandem[ucx]')")
    pytest.skip("ucxx is not installed (pip install 'tandem[ucx]')")


def kind_of(transport: str) -> KVTransport:
    return KVTransport.UCX if transport == "ucx" else KVTransport.ZMQ


def bind_address(transport: str, tmp_path: Path, name: str) -> str:
    return {"zmq-tcp": "tcp://127.0.0.1:0", "zmq-ipc": f"ipc://{tmp_path}/{name}.sock",
            "ucx": "ucx://127.0.0.1:0"}[transport]


def poll_until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {DEADLINE_S} s")
        time.sleep(0.005)  # pacing a poll loop, not synchronisation


def random_blocks(n: int, nbytes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


def views(blocks: Sequence[np.ndarray]) -> list[memoryview]:
    return [memoryview(b) for b in blocks]


def same_bytes(got: Sequence[memoryview], want: Sequence[np.ndarray]) -> bool:
    return len(got) == len(want) and all(
        np.array_equal(np.frombuffer(g, dtype=np.uint8), w) for g, w in zip(got, want, strict=True))


Errors = dict[str, list[tuple[str, str]]]  # "sender"/"receiver" -> on_error calls (kind, detail)


def new_errors() -> Errors:
    return {"sender": [], "receiver": []}


def recorder(errors: Errors, role: str) -> Callable[[str, str], None]:
    return lambda kind, detail: errors[role].append((kind, detail))


@dataclass
class Harness:
    """A sender and a receiver on one transport, plus a low-level way to send garbage."""

    kind: str
    sender: object
    receiver: object
    raw_send: Callable[[str, bytes, Sequence[bytes | memoryview]], None]  # id, header, frames
    raw_acks: Callable[[], list[KVAck]]
    received: list[ReceivedTransfer] = field(default_factory=list)
    acks: list[KVAck] = field(default_factory=list)
    errors: Errors = field(default_factory=new_errors)

    def error_kinds(self, role: str) -> list[str]:
        return [kind for kind, _ in self.errors[role]]

    def send(self, transfer_id: str, blocks: Sequence[np.ndarray]) -> None:
        nbytes = blocks[0].nbytes if blocks else 0
        self.sender.send(self.receiver.address, handoff(transfer_id, len(blocks), nbytes), views(blocks))

    def pump(self, auto_ack: bool) -> None:
        for transfer in self.receiver.poll(timeout_ms=20):
            self.received.append(transfer)
            if auto_ack:
                self.receiver.ack(transfer, ok=True)
        self.acks += self.sender.poll_acks() + self.raw_acks()

    def wait(self, done: Callable[[], bool], what: str, auto_ack: bool = True) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not done():
            if time.monotonic() > deadline:
                pytest.fail(f"{self.kind}: no {what} within {DEADLINE_S} s "
                            f"(received {[t.header.transfer_id for t in self.received]}, acks {self.acks})")
            self.pump(auto_ack)

    def ack_for(self, transfer_id: str) -> KVAck | None:
        return next((a for a in self.acks if a.transfer_id == transfer_id), None)

    def received_ids(self) -> list[str]:
        return [t.header.transfer_id for t in self.received]


def _zmq_harness(kind: str, address: str) -> Iterator[Harness]:
    errors = new_errors()
    receiver = make_receiver(KVTransport.ZMQ, address, on_error=recorder(errors, "receiver"))
    sender = make_sender(KVTransport.ZMQ, on_error=recorder(errors, "sender"))
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(receiver.address)

    def raw_send(transfer_id: str, head: bytes, frames: Sequence[bytes | memoryview]) -> None:
        raw.send_multipart([head, *frames])

    def raw_acks() -> list[KVAck]:
        out = []
        while raw.poll(0):
            msg = decode(raw.recv())
            assert isinstance(msg, KVAck)
            out.append(msg)
        return out

    yield Harness(kind, sender, receiver, raw_send, raw_acks, errors=errors)
    raw.close(linger=0)
    sender.close()
    receiver.close()


def _ucx_harness(frame_timeout_s: float | None = None) -> Iterator[Harness]:
    require_ucx()
    errors = new_errors()
    receiver = make_receiver(KVTransport.UCX, "ucx://127.0.0.1:0", frame_timeout_s=frame_timeout_s,
                             on_error=recorder(errors, "receiver"))
    sender = make_sender(KVTransport.UCX, on_error=recorder(errors, "sender"))

    def raw_send(transfer_id: str, head: bytes, frames: Sequence[bytes | memoryview]) -> None:
        # The same endpoint a real transfer takes, with hand-made messages.
        sender._send_raw(receiver.address, transfer_id, [struct.pack("<Q", len(head)), head, *frames])

    yield Harness("ucx", sender, receiver, raw_send, lambda: [], errors=errors)
    sender.close()
    receiver.close()


@pytest.fixture
def ucx_harness() -> Iterator[Harness]:
    yield from _ucx_harness()


@pytest.fixture(params=TRANSPORTS)
def harness(request: pytest.FixtureRequest, tmp_path) -> Iterator[Harness]:
    if request.param == "ucx":
        yield from _ucx_harness()
    elif request.param == "zmq-ipc":
        yield from _zmq_harness("zmq-ipc", f"ipc://{tmp_path}/kv.sock")
    else:
        yield from _zmq_harness("zmq-tcp", "tcp://127.0.0.1:0")


# ---- (a) one transfer, byte-exact, acked ---------------------------------------------


def test_transfer_arrives_byte_exact_and_is_acked(harness: Harness) -> None:
    blocks = random_blocks(5, BLOCK, seed=1)
    harness.send("t-one", blocks)
    harness.wait(lambda: harness.received, "transfer", auto_ack=False)

    (transfer,) = harness.received
    assert transfer.header == handoff("t-one", 5, BLOCK)
    assert same_bytes(transfer.blocks, blocks)
    if harness.kind == "ucx":  # zmq hands out its frames' (writable) buffers as they are
        assert all(b.readonly for b in transfer.blocks)

    harness.receiver.ack(transfer, ok=True)
    harness.wait(lambda: harness.acks, "ack")
    assert harness.acks == [KVAck("t-one", True, "")]


def test_wakeup_socket_turns_readable_for_a_transfer(harness: Harness) -> None:
    wakeup = getattr(harness.receiver, "wakeup_socket", None)
    if wakeup is None:
        pytest.skip(f"{harness.kind} receiver offers no wakeup_socket")
    assert not wakeup.poll(0)
    harness.send("t-wake", random_blocks(2, BLOCK, seed=2))
    deadline = time.monotonic() + DEADLINE_S
    while not wakeup.poll(20):  # what a worker's poller would sleep on
        assert time.monotonic() < deadline, "wakeup socket never turned readable"
    harness.wait(lambda: harness.received, "transfer")
    assert not wakeup.poll(0)  # poll() took the transfer and the wake-up with it


# ---- (b) several in a row, in order --------------------------------------------------


def test_transfers_arrive_in_order(harness: Harness) -> None:
    sent = {f"t-{i}": random_blocks(3, BLOCK, seed=10 + i) for i in range(8)}
    for transfer_id, blocks in sent.items():
        harness.send(transfer_id, blocks)
    harness.wait(lambda: len(harness.acks) == len(sent), "acks for every transfer")

    assert harness.received_ids() == list(sent)
    for transfer in harness.received:
        assert same_bytes(transfer.blocks, sent[transfer.header.transfer_id])
    assert sorted(a.transfer_id for a in harness.acks) == sorted(sent)
    assert all(a.ok for a in harness.acks)


# ---- (c) malformed transfers are refused ---------------------------------------------


def _missing_frame(tid: str) -> tuple[bytes, list[bytes]]:
    return encode(handoff(tid, 3, BLOCK)), [bytes(BLOCK), bytes(BLOCK)]


def _short_frame(tid: str) -> tuple[bytes, list[bytes]]:
    return encode(handoff(tid, 3, BLOCK)), [bytes(BLOCK), bytes(BLOCK - 1), bytes(BLOCK)]


def _long_frame(tid: str) -> tuple[bytes, list[bytes]]:
    return encode(handoff(tid, 2, BLOCK)), [bytes(BLOCK + 1), bytes(BLOCK)]


def _not_a_handoff(tid: str) -> tuple[bytes, list[bytes]]:
    return encode(KVAck(tid, True, "")), [bytes(BLOCK)]


def _undecodable(tid: str) -> tuple[bytes, list[bytes]]:
    return b"\xc1 not msgpack", [bytes(BLOCK)]


MALFORMED = {"missing-frame": _missing_frame, "short-frame": _short_frame,
             "long-frame": _long_frame, "not-a-handoff": _not_a_handoff,
             "undecodable": _undecodable}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_transfer_is_rejected_and_nacked(harness: Harness, case: str) -> None:
    bad = f"bad-{case}"
    head, frames = MALFORMED[case](bad)
    harness.raw_send(bad, head, frames)

    # Then good transfers until one gets through. Over ucx the receiver drops a
    # connection whose framing broke, so the first good one may be nacked (the sender
    # reconnects for the next); the zmq transports take the first.
    good_blocks = random_blocks(2, BLOCK, seed=3)
    attempt = [f"good-{uuid.uuid4().hex[:8]}"]
    harness.send(attempt[0], good_blocks)

    def settled() -> bool:
        ack = harness.ack_for(attempt[0])
        if ack is not None and not ack.ok:
            attempt[0] = f"good-{uuid.uuid4().hex[:8]}"
            harness.send(attempt[0], good_blocks)
            return False
        nacked = any(not a.ok and a.transfer_id in (bad, "") for a in harness.acks)
        return ack is not None and nacked

    harness.wait(settled, "nack for the bad transfer and an ack for a good one")

    assert harness.error_kinds("receiver") == ["bad_transfer"]  # reported once, as well as nacked
    assert bad not in harness.received_ids()
    nacks = [a for a in harness.acks if a.transfer_id in (bad, "")]
    assert nacks and all(not a.ok and a.reason for a in nacks)
    good = [t for t in harness.received if t.header.transfer_id == attempt[0]]
    assert len(good) == 1 and same_bytes(good[0].blocks, good_blocks)
    if harness.kind != "ucx":
        assert len(harness.received) == 1  # zmq keeps the connection: first good one arrives


# ---- (c'') the test-only fault hook's faults are refused the same way -----------------


@pytest.mark.parametrize("fault", ["drop", "truncate", "corrupt"])
def test_an_injected_fault_never_delivers_and_the_next_transfer_arrives(harness: Harness, fault: str) -> None:
    faulty = FaultySender(harness.sender, FaultPlan.parse(f"script={fault}"))
    assert faulty.frame_timeout_s == harness.sender.frame_timeout_s
    faulty.send(harness.receiver.address, handoff("hurt", 3, BLOCK), views(random_blocks(3, BLOCK, seed=6)))

    # Then clean transfers until one is acked: over ucx a refused transfer drops the
    # connection, which may nack the first clean one (the next reconnects).
    good_blocks = random_blocks(2, BLOCK, seed=7)
    attempt = [f"good-{uuid.uuid4().hex[:8]}"]
    faulty.send(harness.receiver.address, handoff(attempt[0], 2, BLOCK), views(good_blocks))

    def settled() -> bool:
        ack = harness.ack_for(attempt[0])
        if ack is not None and not ack.ok:
            attempt[0] = f"good-{uuid.uuid4().hex[:8]}"
            faulty.send(harness.receiver.address, handoff(attempt[0], 2, BLOCK), views(good_blocks))
            return False
        refused = fault == "drop" or any(not a.ok and a.transfer_id in ("hurt", "") for a in harness.acks)
        return ack is not None and refused

    harness.wait(settled, f"the {fault} refused and a clean transfer acked")
    assert "hurt" not in harness.received_ids() and faulty.injected == {Fault(fault): 1}
    [good] = [t for t in harness.received if t.header.transfer_id == attempt[0]]
    assert same_bytes(good.blocks, good_blocks)
    assert harness.error_kinds("receiver") == ([] if fault == "drop" else ["bad_transfer"])
    if fault == "drop":
        assert harness.ack_for("hurt") is None  # nobody can nack what never left


# ---- (c') a confused receiver's acks are reported -------------------------------------


GARBAGE_ACKS = [b"\xc1 not msgpack", encode(handoff("not-an-ack", 1, BLOCK))]


@contextlib.contextmanager
def _zmq_garbage_acker(address: str) -> Iterator[tuple[str, Callable[[], None]]]:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(address)

    def answer() -> None:  # answers every transfer with GARBAGE_ACKS
        while sock.poll(0):
            identity, *_ = sock.recv_multipart()
            for body in GARBAGE_ACKS:
                sock.send_multipart([identity, body])

    yield sock.getsockopt_string(zmq.LAST_ENDPOINT), answer
    sock.close(linger=0)


@contextlib.contextmanager
def _ucx_garbage_acker() -> Iterator[tuple[str, Callable[[], None]]]:
    require_ucx()
    from common.connector.ucx import UcxLoop, framed
    from common.connector.ucx.framing import send_in_order
    from common.connector.ucx.loop import ucxx

    loop = UcxLoop.get()
    endpoints: list[object] = []

    async def serve(ep) -> None:  # well-framed garbage, then the endpoint stays open
        endpoints.append(ep)
        for body in GARBAGE_ACKS:
            await send_in_order(ep, framed(body))

    async def listen():
        return ucxx.create_listener(serve, port=0)

    async def stop() -> None:
        for ep in endpoints:
            await ep.close()
        listener.close()

    listener = loop.run(listen())
    yield f"ucx://127.0.0.1:{listener.port}", lambda: None
    loop.run(stop())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_garbage_acks_are_reported(transport: str, tmp_path: Path) -> None:
    errors = new_errors()
    acker = (_ucx_garbage_acker() if transport == "ucx"
             else _zmq_garbage_acker(bind_address(transport, tmp_path, "garbage")))
    with acker as (address, answer):
        sender = make_sender(kind_of(transport), on_error=recorder(errors, "sender"))
        try:
            sender.send(address, handoff("t-garbage", 1, BLOCK), views(random_blocks(1, BLOCK, seed=6)))
            acks: list[KVAck] = []

            def reported() -> bool:
                answer()
                acks.extend(sender.poll_acks())
                return len(errors["sender"]) >= len(GARBAGE_ACKS)

            poll_until(reported, "report of both garbage acks")
            assert [kind for kind, _ in errors["sender"]] == ["bad_ack", "bad_ack"]
            assert "expected kv_ack" in errors["sender"][1][1]
            assert acks == []  # neither counts as an ack: the lease will decide
        finally:
            sender.close()


# ---- (d) real-size blocks ------------------------------------------------------------


def test_smollm2_sized_transfers(harness: Harness) -> None:
    sent = {f"big-{i}": random_blocks(24, SMOLLM2_BLOCK, seed=20 + i) for i in range(2)}
    for transfer_id, blocks in sent.items():
        harness.send(transfer_id, blocks)
    harness.wait(lambda: len(harness.acks) == len(sent), "acks for the big transfers")

    assert harness.received_ids() == list(sent)
    for transfer in harness.received:
        assert transfer.header.block_nbytes == SMOLLM2_BLOCK
        assert same_bytes(transfer.blocks, sent[transfer.header.transfer_id])
    assert all(a.ok for a in harness.acks)


def test_ack_for_a_sender_that_left_is_reported(harness: Harness) -> None:
    harness.send("t-orphan", random_blocks(1, BLOCK, seed=11))
    harness.wait(lambda: harness.received, "transfer", auto_ack=False)
    harness.sender.close()
    (transfer,) = harness.received

    def reported() -> bool:  # until the receiver has noticed the sender is gone
        harness.receiver.ack(transfer, ok=True)
        harness.receiver.poll(timeout_ms=5)
        return bool(harness.errors["receiver"])

    poll_until(reported, "report of the undeliverable ack")
    # One report per undeliverable ack (the last loop may have tried twice), nothing else.
    assert set(harness.error_kinds("receiver")) == {"reply_failed"}
    assert all("t-orphan" in detail for _, detail in harness.errors["receiver"])


# ---- (e) a receiver that vanishes mid-transfer ------------------------------------------


DOOMED_RECEIVER = """
import sys
from common.connector import make_receiver
receiver = make_receiver(sys.argv[1], sys.argv[2])
print(receiver.address, flush=True)
while True:  # acks only the warm-up: later transfers stay in flight or un-acked until the kill
    for transfer in receiver.poll(timeout_ms=100):
        if transfer.header.transfer_id.startswith("warm"):
            receiver.ack(transfer, ok=True)
"""


def _start_doomed_receiver(transport: str, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    log = open(tmp_path / "doomed.log", "w")  # noqa: SIM115 - the child's stderr, read on failure
    child = subprocess.Popen(
        [sys.executable, "-c", DOOMED_RECEIVER, kind_of(transport).value, bind_address(transport, tmp_path, "doomed")],
        stdout=subprocess.PIPE, stderr=log, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
    log.close()
    ready, _, _ = select.select([child.stdout], [], [], DEADLINE_S * 3)  # a fresh interpreter imports numpy, zmq, ucxx
    if not ready:
        child.kill()
        pytest.fail(f"the receiver process printed no address: {(tmp_path / 'doomed.log').read_text()}")
    return child, child.stdout.readline().strip()


def _next_receiver_gets_the_next_transfer(transport: str, tmp_path: Path, sender: object,
                                          acks: list[KVAck], errors: Errors) -> Harness:
    """A new receiver at a new address, served by the same sender."""
    receiver = make_receiver(kind_of(transport), bind_address(transport, tmp_path, "survivor"),
                             on_error=recorder(errors, "receiver"))
    h = Harness(transport, sender, receiver, lambda *a: None, lambda: [], acks=acks, errors=errors)
    after = random_blocks(2, BLOCK, seed=9)
    try:
        h.send("after", after)
        h.wait(lambda: h.ack_for("after") is not None, "ack from the new receiver")
    finally:
        receiver.close()
    assert h.received_ids() == ["after"] and same_bytes(h.received[0].blocks, after)
    assert h.ack_for("after").ok and errors["receiver"] == []
    return h


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_receiver_killed_mid_transfer_leaves_the_sender_working(transport: str, tmp_path: Path) -> None:
    if transport == "ucx":
        require_ucx()
    errors = new_errors()
    sender = make_sender(kind_of(transport), on_error=recorder(errors, "sender"))
    child, address = _start_doomed_receiver(transport, tmp_path)
    try:
        acks: list[KVAck] = []
        sender.send(address, handoff("warm", 1, BLOCK), views(random_blocks(1, BLOCK, seed=7)))
        poll_until(lambda: acks.extend(sender.poll_acks()) or acks, "ack for the warm-up")
        assert acks == [KVAck("warm", True, "")]  # connected: the next transfer rides this connection

        big = random_blocks(24, SMOLLM2_BLOCK, seed=8)
        sender.send(address, handoff("big", len(big), SMOLLM2_BLOCK), views(big))
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=DEADLINE_S) == -signal.SIGKILL

        if transport == "ucx":  # the dead connection nacks what it owed
            poll_until(lambda: acks.extend(sender.poll_acks()) or len(acks) > 1, "nack for the big transfer")
            assert acks[1].transfer_id == "big" and not acks[1].ok and acks[1].reason.startswith("ucx:")
            # The loss is reported from the UCX thread, which may come just after the nack;
            # the hook hears of it in the sender's next call.
            poll_until(lambda: acks.extend(sender.poll_acks()) or errors["sender"],
                       "the sender's report of the lost peer")
            assert [kind for kind, _ in errors["sender"]] == ["peer_lost"]
        h = _next_receiver_gets_the_next_transfer(transport, tmp_path, sender, acks, errors)
        if transport != "ucx":  # zmq keeps "big" queued for the dead address: no ack, no nack
            assert h.ack_for("big") is None and errors["sender"] == []
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        sender.close()


# ---- ucx specifics -------------------------------------------------------------------


@pytest.mark.parametrize(("prefix", "reason"), [
    (struct.pack("<Q", 1 << 40), "message length"),  # a 1 TB header
    (struct.pack("<Q", 0), "message length"),
    (bytes(9), "8-byte length prefix"),
])
def test_ucx_bad_length_prefix_is_refused(ucx_harness: Harness, prefix: bytes, reason: str) -> None:
    h = ucx_harness
    h.sender._send_raw(h.receiver.address, "huge", [prefix, b"x"])
    h.wait(lambda: any(reason in a.reason for a in h.acks) and h.errors["receiver"],
           f"nack saying {reason!r}, and its report")
    assert not h.received
    assert all(not a.ok for a in h.acks)
    assert h.error_kinds("receiver") == ["bad_transfer"]


def test_ucx_transfer_cut_off_midway_is_dropped(ucx_harness: Harness) -> None:
    h = ucx_harness
    quitter = make_sender(KVTransport.UCX)
    try:
        cut = [struct.pack("<Q", len(head := encode(handoff("cut", 3, BLOCK)))), head, bytes(BLOCK)]
        quitter._send_raw(h.receiver.address, "cut", cut, commit=False)
        h.wait(lambda: len(h.receiver._connections) == 1, "the quitter's connection")
        quitter.close()  # gone after one of three blocks
        h.wait(lambda: not h.receiver._connections, "the receiver to drop the dead connection")
        h.send("after", random_blocks(1, BLOCK, seed=5))
        h.wait(lambda: h.ack_for("after") is not None, "a later transfer")
        assert h.received_ids() == ["after"]
        assert h.error_kinds("receiver") == ["peer_lost"]
    finally:
        quitter.close()


@pytest.fixture
def ucx_impatient_harness() -> Iterator[Harness]:
    yield from _ucx_harness(frame_timeout_s=0.3)


def test_ucx_stalled_transfer_is_nacked_after_the_frame_timeout(ucx_impatient_harness: Harness) -> None:
    h = ucx_impatient_harness
    assert h.receiver.frame_timeout_s == 0.3
    head = encode(handoff("stall", 3, BLOCK))
    h.sender._send_raw(h.receiver.address, "stall", [struct.pack("<Q", len(head)), head, bytes(BLOCK)],
                       commit=False)  # 1 block of 3, and nothing after it
    h.wait(lambda: h.ack_for("stall") is not None and h.errors["receiver"], "nack for the stalled transfer")
    assert not h.received
    assert not h.ack_for("stall").ok and "did not arrive" in h.ack_for("stall").reason
    assert h.error_kinds("receiver") == ["bad_transfer"]


def _raw_transfer(tid: str, blocks: list[np.ndarray]) -> list[bytes]:
    head = encode(handoff(tid, len(blocks), BLOCK))
    return [struct.pack("<Q", len(head)), head, *(b.tobytes() for b in blocks)]


def test_ucx_transfer_without_its_commit_is_never_delivered(ucx_impatient_harness: Harness) -> None:
    h = ucx_impatient_harness
    h.sender._send_raw(h.receiver.address, "uncommitted", _raw_transfer("uncommitted", random_blocks(2, BLOCK, seed=1)),
                       commit=False)  # every block, then nothing: as after an abandon
    h.wait(lambda: h.ack_for("uncommitted") is not None and h.errors["receiver"],
           "nack for the uncommitted transfer, and its report")
    assert not h.received
    assert not h.ack_for("uncommitted").ok and "commit did not arrive" in h.ack_for("uncommitted").reason
    assert h.error_kinds("receiver") == ["bad_transfer"]


def test_ucx_wrong_commit_is_refused(ucx_impatient_harness: Harness) -> None:
    h = ucx_impatient_harness
    messages = [*_raw_transfer("forged", random_blocks(2, BLOCK, seed=2)), b"NOTCOMIT"]
    h.sender._send_raw(h.receiver.address, "forged", messages, commit=False)
    h.wait(lambda: h.ack_for("forged") is not None, "nack for the forged commit")
    assert not h.received
    assert not h.ack_for("forged").ok and "expected the commit" in h.ack_for("forged").reason


def test_ucx_blocks_land_in_memory_reused_once_the_caller_drops_them(ucx_harness: Harness) -> None:
    h = ucx_harness
    h.send("first", random_blocks(3, BLOCK, seed=9))
    h.wait(lambda: h.ack_for("first") is not None, "the first transfer")
    where = {np.frombuffer(b, np.uint8).ctypes.data for b in h.received[0].blocks}
    h.received.clear()  # the worker copied them into its cache and let go
    gc.collect()
    assert h.receiver._buffers.idle_bytes == 3 * BLOCK
    second = random_blocks(3, BLOCK, seed=10)
    h.send("second", second)
    h.wait(lambda: h.ack_for("second") is not None, "the second transfer")
    assert {np.frombuffer(b, np.uint8).ctypes.data for b in h.received[0].blocks} == where
    assert same_bytes(h.received[0].blocks, second)


def test_ucx_idle_connection_does_not_spin_the_loop(ucx_harness: Harness) -> None:
    """Futures completed by ucxx's notifier (only its thread progress modes run one): in
    its "blocking" mode each pending receive polls with asyncio.sleep(0), and an idle
    worker whose sender and receiver were connected used a whole CPU."""
    import ucxx.core

    ctx = ucxx.core._get_ctx()
    assert ctx.progress_mode.startswith("thread") and ctx.enable_python_future
    h = ucx_harness
    h.send("connect", random_blocks(2, BLOCK, seed=11))  # both ends now wait on the link
    h.wait(lambda: h.ack_for("connect") is not None, "the transfer")
    start = time.process_time()
    time.sleep(1.0)  # a window to measure in, not synchronisation
    assert time.process_time() - start < 0.5  # spinning used ~1.0 s of it


def test_ucx_unreachable_receiver_is_nacked_locally() -> None:
    require_ucx()
    from common.connector.ucx import UcxSender

    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        address = f"ucx://127.0.0.1:{free.getsockname()[1]}"
    sender = UcxSender(connect_timeout_s=1.0)  # ucxx occasionally waits it out (see ucx/sender.py)
    try:
        sender.send(address, handoff("lost", 1, BLOCK), views(random_blocks(1, BLOCK, seed=4)))
        deadline = time.monotonic() + DEADLINE_S
        acks: list[KVAck] = []
        while not acks and time.monotonic() < deadline:
            acks = sender.poll_acks()
            time.sleep(0.01)  # pacing a poll loop, not synchronisation
        assert len(acks) == 1 and acks[0].transfer_id == "lost" and not acks[0].ok
        assert acks[0].reason.startswith("ucx:")
    finally:
        sender.close()


NO_UCXX_CHECK = """
import sys
sys.modules["ucxx"] = None  # makes `import ucxx` raise ImportError
from common.connector.ucx import UcxReceiver, UcxSender, ucx_available
assert not ucx_available()
for role in (UcxSender, lambda: UcxReceiver("ucx://127.0.0.1:0")):
    try:
        role()
    except RuntimeError as e:
        assert "pip install 'tandem[ucx]'" in str(e), e
    else:
        raise AssertionError("constructed without ucxx")
"""


def test_ucx_package_imports_without_ucxx() -> None:
    # A fresh interpreter: this one has ucxx loaded (and its loop running) already.
    done = subprocess.run([sys.executable, "-c", NO_UCXX_CHECK], capture_output=True, text=True,
                          timeout=60, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr


LAZY_IMPORT_CHECK = """
import sys
import common.connector
loaded = [m for m in sys.modules if m.startswith(("common.connector.zmq", "common.connector.ucx"))]
assert not loaded, loaded
"""


def test_connector_interface_loads_no_transport() -> None:
    done = subprocess.run([sys.executable, "-c", LAZY_IMPORT_CHECK], capture_output=True, text=True,
                          timeout=60, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr


def test_factory_takes_the_enum_or_its_value(tmp_path: Path) -> None:
    for kind in (KVTransport.ZMQ, "zmq"):
        receiver = make_receiver(kind, f"ipc://{tmp_path}/factory.sock")
        sender = make_sender(kind)
        assert isinstance(receiver, ZmqReceiver) and isinstance(sender, ZmqSender)
        assert receiver.frame_timeout_s is None and sender.frame_timeout_s is None
        sender.close()
        receiver.close()
    for bad in ("tcp", "UCX", ""):
        with pytest.raises(ValueError, match="unknown KV transport"):
            make_sender(bad)
        with pytest.raises(ValueError, match="unknown KV transport"):
            make_receiver(bad, "tcp://127.0.0.1:0")
    with pytest.raises(ValueError, match="frame_timeout_s"):
        make_sender(KVTransport.UCX, frame_timeout_s=0)


def test_ucx_address_parsing() -> None:
    from common.connector.ucx import parse_address

    assert parse_address("ucx://10.0.0.5:4000") == ("10.0.0.5", 4000)
    assert parse_address("ucx://[::1]:0") == ("::1", 0)
    for bad in ("tcp://1.2.3.4:5", "ucx://host", "ucx://:5", "ucx://h:99999", "ucx://h:x"):
        with pytest.raises(ValueError):
            parse_address(bad)


# ---- LeaseTable ----------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_settle_ends_a_lease_once() -> None:
    clock = FakeClock()
    table = LeaseTable(ttl_seconds=5.0, clock=clock)
    lease = table.open("t1", "r1")
    table.open("t2", "r1")
    assert lease.deadline == 105.0 and len(table) == 2

    assert table.settle(KVAck("t1", True)) == lease
    assert table.settle(KVAck("t1", True)) is None  # a duplicate ack frees nothing twice
    assert table.settle(KVAck("unknown", False, "x")) is None
    assert len(table) == 1


def test_lease_cancel_ends_only_that_requests_leases() -> None:
    table = LeaseTable(ttl_seconds=5.0, clock=FakeClock())
    table.open("t1", "r1")
    table.open("t2", "r2")
    table.open("t3", "r1")

    assert sorted(lease.transfer_id for lease in table.cancel("r1")) == ["t1", "t3"]
    assert table.cancel("r1") == []
    assert len(table) == 1 and table.settle(KVAck("t2", True)) is not None


def test_lease_expired_hands_back_each_lease_once() -> None:
    clock = FakeClock()
    table = LeaseTable(ttl_seconds=5.0, clock=clock)
    table.open("t1", "r1")
    clock.now += 2.0
    table.open("t2", "r2")

    clock.now = 104.9
    assert table.expired() == []
    clock.now = 105.0  # the deadline itself counts as expired
    assert [lease.transfer_id for lease in table.expired()] == ["t1"]
    assert table.expired() == []
    assert table.settle(KVAck("t1", True)) is None  # too late: already handed back
    clock.now = 1000.0
    assert [lease.transfer_id for lease in table.expired()] == ["t2"]
    assert len(table) == 0


def test_an_abandoned_zmq_transfer_is_never_delivered_later() -> None:
    """A transfer queued for a receiver that is not there yet, abandoned when its lease ran
    out: a receiver that appears at that address afterwards must never get it (its blocks
    are being reused), while a transfer sent after the abandon arrives."""
    from common.addresses import free_port

    addr = f"tcp://127.0.0.1:{free_port()}"
    sender = ZmqSender()
    stale = handoff("stale", 1, BLOCK)
    sender.send(addr, stale, [memoryview(bytes(BLOCK))])
    sender.abandon(addr)
    receiver = ZmqReceiver(addr)
    try:
        sender.send(addr, handoff("fresh", 1, BLOCK), [memoryview(bytes(BLOCK))])
        got: list[str] = []
        deadline = time.monotonic() + DEADLINE_S
        while "fresh" not in got:
            assert time.monotonic() < deadline
            got += [t.header.transfer_id for t in receiver.poll(100)]
        assert got == ["fresh"]
    finally:
        receiver.close()
        sender.close()
