"""Same-host shared memory for KV transfers, over real sockets and processes.

The connector: an shm transfer equals a zmq one byte for byte; a receiver that cannot map
the segment (``--kv-shm off``, another host) gets the same transfer as frames and the
sender remembers, unless forced (``on``); a SIGKILLed sender leaves the receiver working,
its segment unmapped, nothing in /dev/shm. The worker: the flag's choices, and an abort
while an shm transfer is in flight frees the blocks on both sides. End to end: P/D greedy
output through shm equals colocated, and the decode worker really mapped the
prefill worker's segment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import zmq

from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from common.connector import KVTransport, SharedKV, ShmMode, make_receiver, make_sender
from common.connector.shm import Route
from common.connector.zmq import SHM_UNAVAILABLE, ZmqReceiver
from common.engine.engine import Engine
from common.protocol import Abort, KVAck, KVHandoff, Register, Task, decode, encode
from common.roles import WorkerRole
from common.sampling_params import SamplingParams
from common.shared_memory import HEADER_BYTES, HUGE_PAGE, MEMFD_NAME, PeerSegments, SharedSegment
from services.worker import WorkerService
from services.worker_settings import WorkerSettings, shared_kv
from tests.cluster import Cluster, TokenIds, readable_prompt, wait_for
from tests.conftest import loaded_model

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 4096 * 3  # bytes per block in the connector cases
LAYOUT = [1, 16, 1, 1, 4]


def header(transfer_id: str, num_blocks: int, block_nbytes: int = BLOCK) -> KVHandoff:
    return KVHandoff(transfer_id, f"req-{transfer_id}", list(range(16 * num_blocks)), [7], [None],
                     [None], [False], SamplingParams(), "", 0, num_blocks, block_nbytes, LAYOUT,
                     "float32")


@pytest.fixture
def segment() -> SharedSegment:
    """8 blocks of random bytes in a shared segment, as a prefill worker's cache holds them."""
    seg = SharedSegment(8 * BLOCK)
    rows = seg.tensor((8, BLOCK), torch.uint8)
    rows.copy_(torch.from_numpy(np.random.default_rng(3).integers(0, 256, (8, BLOCK), dtype=np.uint8)))
    return seg


def views(seg: SharedSegment, ids: list[int]) -> list[memoryview]:
    rows = seg.tensor((8, BLOCK), torch.uint8).numpy()
    return [memoryview(rows[i]) for i in ids]


def mapped_segments(pid: int | str = "self") -> int:
    """How many peers' KV segments the process maps (read-only; its own are read-write)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sum(1 for line in lines if f"/memfd:{MEMFD_NAME}" in line and line.split()[1] == "r--s")


def exchange(sender, receiver, addr: str, h: KVHandoff, blocks: list[memoryview]):
    """Send one transfer, take it (copying borrowed blocks out), ack it; (transfer, bytes, ack)."""
    sender.send(addr, h, blocks)
    got, acks = [], []
    wait_for(lambda: got.extend(receiver.poll(0)) or sender.poll_acks() or got, "the transfer", 30)
    [transfer] = got
    data = [bytes(b) for b in transfer.blocks]  # the copy a decode worker makes
    receiver.ack(transfer, ok=True)
    wait_for(lambda: acks.extend(sender.poll_acks()) or acks, "the ack", 30)
    return transfer, data, acks


def test_shm_transfer_equals_a_zmq_transfer_byte_for_byte(segment):
    ids = [5, 0, 7, 2]
    shm_rx, zmq_rx = make_receiver("zmq", "tcp://127.0.0.1:0", shm=True), make_receiver("zmq", "tcp://127.0.0.1:0")
    shm_tx = make_sender("zmq", shm=SharedKV(segment, ShmMode.AUTO, 40.0))
    zmq_tx = make_sender("zmq")
    try:
        via_shm, shm_bytes, [ack] = exchange(shm_tx, shm_rx, shm_rx.address, header("a", 4), views(segment, ids))
        via_zmq, zmq_bytes, _ = exchange(zmq_tx, zmq_rx, zmq_rx.address, header("a", 4), views(segment, ids))
        assert via_shm.borrowed and not via_zmq.borrowed
        assert ack == KVAck("a", True) and shm_tx.route(shm_rx.address) is Route.SHM
        assert via_shm.header == via_zmq.header
        assert shm_bytes == zmq_bytes == [bytes(v) for v in views(segment, ids)]
    finally:
        for end in (shm_tx, zmq_tx, shm_rx, zmq_rx):
            end.close()


def other_host(seg: SharedSegment) -> SharedSegment:
    seg.ref = replace(seg.ref, host="another-boot-id,pid:1")  # as a peer elsewhere sees it
    return seg


@pytest.mark.parametrize("case", ["receiver off", "another host"])
def test_a_segment_the_receiver_cannot_map_falls_back_to_frames_and_is_remembered(segment, case):
    receiver = make_receiver("zmq", "tcp://127.0.0.1:0", shm=case != "receiver off")
    seg = other_host(segment) if case == "another host" else segment
    sender = make_sender("zmq", shm=SharedKV(seg, ShmMode.AUTO, 40.0))
    try:
        for transfer_id in ("first", "second"):
            transfer, data, [ack] = exchange(sender, receiver, receiver.address,
                                             header(transfer_id, 2), views(seg, [3, 1]))
            assert ack == KVAck(transfer_id, True)  # the refusal never reached the worker
            assert not transfer.borrowed and data == [bytes(v) for v in views(seg, [3, 1])]
            assert sender.route(receiver.address) is Route.FRAMES
    finally:
        sender.close()
        receiver.close()


def test_on_never_falls_back_and_the_nack_says_why(segment):
    receiver = make_receiver("zmq", "tcp://127.0.0.1:0", shm=False)
    sender = make_sender("zmq", shm=SharedKV(segment, ShmMode.ON, 40.0))
    try:
        sender.send(receiver.address, header("x", 1), views(segment, [0]))
        acks: list[KVAck] = []
        wait_for(lambda: receiver.poll(0) or acks.extend(sender.poll_acks()) or acks, "the nack", 30)
        [ack] = acks
        assert not ack.ok and ack.reason.startswith(SHM_UNAVAILABLE) and "--kv-shm off" in ack.reason
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("role,mode,transport,shares,maps", [
    (WorkerRole.PREFILL, ShmMode.AUTO, KVTransport.ZMQ, True, True),
    (WorkerRole.PREFILL, ShmMode.OFF, KVTransport.ZMQ, False, False),
    (WorkerRole.DECODE, ShmMode.AUTO, KVTransport.ZMQ, False, True),
    (WorkerRole.DECODE, ShmMode.OFF, KVTransport.ZMQ, False, False),
    (WorkerRole.PREFILL, ShmMode.AUTO, KVTransport.UCX, False, False),
])
def test_the_flag_decides_who_shares_and_who_maps(role, mode, transport, shares, maps):
    s = WorkerSettings(role, "tcp://127.0.0.1:1", kv_shm=mode.value, kv_transport=transport)
    assert (s.shares_kv_cache, s.maps_peer_kv) == (shares, maps)


def test_on_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="needs --kv-transport zmq"):
        WorkerSettings(WorkerRole.PREFILL, "tcp://127.0.0.1:1", kv_shm="on", kv_transport="ucx")
    on = WorkerSettings(WorkerRole.PREFILL, "tcp://127.0.0.1:1", kv_shm="on")
    with pytest.raises(ValueError, match="needs the KV cache in shared memory"):
        shared_kv(on, None)
    auto = WorkerSettings(WorkerRole.PREFILL, "tcp://127.0.0.1:1")
    assert shared_kv(auto, None) is None  # a cache not in shared memory: frames


KILLED_SENDER = """
import sys, time, numpy as np, torch
from common.connector import SharedKV, ShmMode, make_sender
from common.shared_memory import SharedSegment
from tests.test_kv_shm import BLOCK, header
seg = SharedSegment(2 * BLOCK)
rows = seg.tensor((2, BLOCK), torch.uint8)
rows.fill_(9)
sender = make_sender("zmq", shm=SharedKV(seg, ShmMode.ON, 40.0))
sender.send(sys.argv[1], header("doomed", 2), [memoryview(r.numpy()) for r in rows])
print("sent", flush=True)
time.sleep(600)
"""


def resident_bytes(address: int) -> int:
    """The resident bytes of the mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and ":" not in first:  # a mapping's header: start-end perms ...
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside and first == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_peer_segment_is_mapped_as_its_blocks_are_read():
    """A receiver maps a peer's segment without reading it in: its pages come in as blocks
    are copied. Mapped with MAP_POPULATE, a decode worker's first transfer from a prefill
    worker brought in the whole cache (2 GB) at once, holding the interpreter lock: 5-9 s on
    a slow VM, its requests stalled and its heartbeats missed (the router declared it dead)."""
    seg = SharedSegment(64 * 2**20)
    peers = PeerSegments()
    try:
        [block] = peers.blocks(seg.ref, [HEADER_BYTES + 32 * 2**20], BLOCK)
        address = np.frombuffer(block, np.uint8).ctypes.data
        assert resident_bytes(address) <= 2 * HUGE_PAGE  # the header's page (a huge one at most)
        assert bytes(block) == bytes(BLOCK)  # a fresh segment reads as zeros
        assert resident_bytes(address) <= 4 * HUGE_PAGE  # and the block's
        del block
    finally:
        peers.close()


def test_a_killed_sender_leaves_the_receiver_working_and_nothing_behind(segment):
    shm_before = sorted(os.listdir("/dev/shm"))
    peers = PeerSegments()
    receiver = ZmqReceiver("tcp://127.0.0.1:0", segments=peers)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SENDER, receiver.address], cwd=ROOT,
                            env=os.environ | {"PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
    try:
        got = []
        wait_for(lambda: got.extend(receiver.poll(0)) or got, "the doomed transfer", 60)
        [transfer] = got
        assert transfer.borrowed and mapped_segments() == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert [bytes(b) for b in transfer.blocks] == [b"\x09" * BLOCK] * 2  # still readable
        receiver.ack(transfer, ok=True)  # to nobody: reported, not raised
        got.clear()
        del transfer
        peers.sweep(force=True)
        assert len(peers) == 0 and mapped_segments() == 0  # the dead owner's memory is freed
        sender = make_sender("zmq", shm=SharedKV(segment, ShmMode.ON, 40.0))
        again, data, [ack] = exchange(sender, receiver, receiver.address, header("next", 1),
                                      views(segment, [4]))
        assert again.borrowed and ack.ok and data == [bytes(views(segment, [4])[0])]
        sender.close()
    finally:
        proc.kill()
        proc.wait()
        receiver.close()
    assert sorted(os.listdir("/dev/shm")) == shm_before


# ---- the worker: an abort while an shm transfer is in flight ---------------------------

PROMPT = list(range(100, 140))  # 3 blocks of 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class Worker:
    """A real WorkerService whose loop the test ticks, with this test as its router."""

    def __init__(self, model_dir, role: WorkerRole, shared: bool) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        config = EngineConfig(model=ModelConfig(path=str(model_dir)),
                              cache=CacheConfig(num_blocks=16, shared_memory=shared),
                              scheduler=SchedulerConfig(max_num_batched_tokens=512), threads=1)
        engine = Engine(config, loaded=loaded_model(model_dir), detokenize=False)
        self.worker = WorkerService(WorkerSettings(
            role, self.router.getsockopt_string(zmq.LAST_ENDPOINT), worker_id=role.value,
            kv_bind="tcp://127.0.0.1:0"), engine)
        self.worker.http.start()  # what run() does before its loop (close() stops it)
        self.worker._register()  # noqa: SLF001
        self.identity, register = self.router.recv_multipart()
        assert isinstance(decode(register), Register)

    def send(self, msg) -> None:
        self.router.send_multipart([self.identity, encode(msg)])

    def held_blocks(self) -> int:
        stats = self.worker.engine.stats()
        return stats.num_blocks - stats.num_free_blocks

    def close(self) -> None:
        self.worker.close()
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def pair(tiny_model_dir) -> Iterator[tuple[Worker, Worker]]:
    ctx = zmq.Context()
    gateway = ctx.socket(zmq.PULL)
    gateway.bind("tcp://127.0.0.1:0")
    reply_to = gateway.getsockopt_string(zmq.LAST_ENDPOINT)
    prefill = Worker(tiny_model_dir, WorkerRole.PREFILL, True)
    decode_ = Worker(tiny_model_dir, WorkerRole.DECODE, False)
    prefill.reply_to = reply_to
    yield prefill, decode_
    prefill.close()
    decode_.close()
    gateway.close(linger=0)
    ctx.term()


def tick_until(workers, done, what: str) -> None:
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for w in workers:
            w.worker.tick()


def test_an_abort_during_an_shm_transfer_frees_the_blocks_on_both_sides(pair):
    prefill, decode_ = pair
    assert prefill.worker.engine.kv_segment is not None
    decode_.send(Abort("r"))
    tick_until([decode_], lambda: decode_.worker.incoming.was_aborted("r"), "the decode abort")
    prefill.send(Task.of("r", PROMPT, GREEDY, prefill.reply_to, handoff_addr=decode_.worker.kv_address))
    tick_until([prefill], lambda: len(prefill.worker.outgoing) == 1, "the shipment")
    prefill.send(Abort("r"))
    tick_until([prefill], lambda: prefill.worker.clock.get("r") is None, "the prefill abort")
    assert prefill.held_blocks() == 3  # still lent: the receiver may be reading them
    tick_until([prefill, decode_], lambda: len(prefill.worker.outgoing) == 0, "the ack")
    assert mapped_segments() == 1  # the decode side took it through shared memory
    assert (prefill.held_blocks(), decode_.held_blocks()) == (0, 0)
    assert len(decode_.worker.incoming) == 0 and not decode_.worker.engine.has_unfinished


class _LateClock:
    """``time`` as the decode inbox sees it: every loan already over when it settles."""

    @staticmethod
    def monotonic() -> float:
        return time.monotonic() + 3600.0


def failures(w: Worker, reason: str) -> float:
    return w.worker.metrics.kv_failures.labels(reason)._value.get()  # noqa: SLF001


def test_a_copy_that_ends_after_its_loan_is_discarded_and_the_resend_taken(pair, monkeypatch):
    import services.kv_inbox as inbox

    prefill, decode_ = pair
    monkeypatch.setattr(inbox, "time", _LateClock)  # the inbox's clock only: accepts still check
    prefill.send(Task.of("r", PROMPT, GREEDY, prefill.reply_to, handoff_addr=decode_.worker.kv_address))
    tick_until([prefill, decode_], lambda: failures(decode_, "loan_expired") == 1, "the late copy")
    assert decode_.held_blocks() == 0 and not decode_.worker.engine.has_request("r")
    monkeypatch.setattr(inbox, "time", time)
    tick_until([prefill, decode_], lambda: decode_.worker.engine.has_request("r"), "the resend")
    assert failures(prefill, "retried") == 1  # the nack made the sender go again, once
    tick_until([prefill, decode_], lambda: not decode_.worker.engine.has_unfinished, "the decode")
    assert (prefill.held_blocks(), decode_.held_blocks()) == (0, 0)


# ---- end to end ---------------------------------------------------------------------------

N = 12
EXTRA = ("--num-kv-blocks", "256", "--max-num-batched-tokens", "32")


def complete(cluster: Cluster, prompt: list[int]) -> list[str]:
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True,
                         "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_pd_greedy_through_shm_equals_hf(tiny_model_dir):
    ids = TokenIds(tiny_model_dir)
    cases = [readable_prompt(tiny_model_dir, ids, 70, 100, N),  # 5 blocks (chunked)
             readable_prompt(tiny_model_dir, ids, 5, 300, N)]  # and 1
    with Cluster(str(tiny_model_dir), extra=(*EXTRA, "--kv-shm", "on")) as pd:
        for prompt, want in cases:
            assert ids.of({"logprobs": {"tokens": complete(pd, prompt)}}) == want
        decode_pid = pd.workers("decode")[0].proc.pid
        assert mapped_segments(decode_pid) == 1  # the blocks came through shared memory
