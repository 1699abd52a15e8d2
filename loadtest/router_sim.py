"""The simulated fleet of ``tandem bench router`` (``loadtest.router_gateway`` is the
simulated gateway): real ZeroMQ peers of a real router, running no model.

``fleet_main``: one DEALER per worker (identity = worker id), as ``services/worker.py``
has: it registers with its snapshot of cached block hashes, heartbeats every
``heartbeat_interval`` (from the same socket: the router does not care which), sends
``KVEvents`` every ``kv_interval`` (``kv_blocks`` fresh hashes stored, as many of its
oldest non-prefix ones evicted, so the index keeps its size), answers a ``Reregister``
by registering again, and answers each ``Task`` as a worker of its role would:
``Finished(prefill)`` after ``prefill_ms`` (from the prefill worker, or from a decode
worker that prefills locally), ``Finished(request)`` ``decode_ms`` later from the worker
that decodes; a colocated worker sends only the latter. It notes when each Task arrived.

It takes commands from the parent over a ``multiprocessing`` pipe, between phases.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import msgpack
import zmq

from common.protocol import Finished, Heartbeat, KVEvents, Ping, Register, encode
from common.roles import FinishStage, WorkerRole
from loadtest.router_workload import Workload

SIM_NUM_BLOCKS = 1_000_000  # each worker's KV capacity: decode room never runs out
SIM_MAX_MODEL_LEN = 32_768


@dataclass(frozen=True, slots=True)
class FleetSettings:
    workload: Workload
    router: str
    heartbeat_interval: float = 0.25
    kv_interval: float = 0.1
    kv_blocks: int = 8
    prefill_ms: float = 20.0
    decode_ms: float = 200.0


@dataclass(slots=True, eq=False)
class SimWorker:
    index: int
    worker_id: str
    role: WorkerRole
    sock: zmq.Socket
    chains: list[bytes] = field(default_factory=list)  # its shared prefixes' blocks: kept
    evictable: deque[bytes] = field(default_factory=deque)  # filler, then stored hashes
    running: int = 0

    @property
    def kv_addr(self) -> str | None:
        return None if self.role is WorkerRole.PREFILL else f"sim://{self.worker_id}"


def finished_bytes(request_id: str, worker_id: str, stage: FinishStage) -> bytes:
    """``encode(Finished(...))``, without the generic walk (tests check they agree)."""
    return msgpack.packb([Finished.TAG, Finished.VERSION, [request_id, worker_id, stage.value, None]],
                         use_bin_type=True)


# ---- the fleet ----------------------------------------------------------------------------

class Fleet:
    def __init__(self, s: FleetSettings) -> None:
        self.s = s
        self._ctx = zmq.Context()
        w = s.workload
        self.workers = [self._socket(i, wid) for i, wid in enumerate(w.worker_ids())]
        self._by_kv_addr = {x.kv_addr: x for x in self.workers if x.kv_addr}
        self._by_socket = {x.sock: x for x in self.workers}
        self._poller = zmq.Poller()
        for x in self.workers:
            self._poller.register(x.sock, zmq.POLLIN)
        # due, seq, worker, what to send (None: a heartbeat, b"kv": KV events), ends a request
        self._timers: list[tuple[float, int, int, bytes | None, bool]] = []
        self._seq = itertools.count()
        self.arrivals: dict[str, float] = {}  # request id -> when its Task arrived
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(w.seed)

    def _socket(self, index: int, worker_id: str) -> SimWorker:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt_string(zmq.IDENTITY, worker_id)
        sock.connect(self.s.router)
        return SimWorker(index, worker_id, self.s.workload.role(index), sock)

    def prepare(self) -> None:
        for x, (chains, filler) in zip(self.workers, self.s.workload.snapshots(), strict=True):
            x.chains, x.evictable = chains, deque(filler)

    def _join(self, x: SimWorker) -> None:
        """Register one worker and start its beats and events. Workers join one at a time
        (a Ping after each Register: its Status says the router is done with it), as a
        fleet comes up: 256 snapshots at once would keep the router from reading the
        heartbeats of the first ones until it declared them dead."""
        self._register(x)
        x.sock.send(encode(Ping(x.index)))
        now = time.monotonic()
        self._at(now + self.s.heartbeat_interval, x, None)
        self._at(now + self.s.kv_interval, x, b"kv")

    def _register(self, x: SimWorker) -> None:
        """Register with everything it holds now (as a worker does after a Reregister too)."""
        x.sock.send(encode(Register(
            x.worker_id, x.role, x.kv_addr, "http://127.0.0.1:1/metrics", SIM_NUM_BLOCKS,
            self.s.workload.block_size, SIM_MAX_MODEL_LEN, "sim", self.s.heartbeat_interval,
            x.chains + list(x.evictable))))
        self.counts["register"] += 1

    def _at(self, due: float, x: SimWorker, msg: bytes | None, ends: bool = False) -> None:
        heapq.heappush(self._timers, (due, next(self._seq), x.index, msg, ends))

    def run(self, pipe: Connection) -> None:
        """Serve until told to stop; tells ``pipe`` "registered" once every worker is."""
        self._pipe = pipe
        self._join(self.workers[0])
        next_check = 0.0
        while True:
            now = time.monotonic()
            self._fire(now)
            wait = (self._timers[0][0] - now) if self._timers else 0.01
            for sock, _ in self._poller.poll(max(0, min(wait, 0.005)) * 1000):
                self._read(sock)
            if now >= next_check:
                next_check = now + 0.01
                if pipe.poll() and not self._command(pipe, pipe.recv()):
                    return

    def _command(self, pipe: Connection, cmd: tuple) -> bool:
        if cmd[0] == "take":  # the arrivals of one phase so far, and the counters
            prefix = cmd[1]
            taken = {rid: t for rid, t in self.arrivals.items() if rid.startswith(prefix)}
            for rid in taken:
                del self.arrivals[rid]
            pipe.send((taken, dict(self.counts)))
            return True
        return False  # "stop"

    def _fire(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, index, msg, ends = heapq.heappop(self._timers)
            x = self.workers[index]
            if msg is None:
                self._heartbeat(x)
                self._at(now + self.s.heartbeat_interval, x, None)
            elif msg == b"kv":
                self._kv_events(x)
                self._at(now + self.s.kv_interval, x, b"kv")
            else:
                x.sock.send(msg)
                x.running -= ends
                self.counts["finished"] += 1

    def _heartbeat(self, x: SimWorker) -> None:
        x.sock.send(encode(Heartbeat(x.worker_id, x.running, 0, SIM_NUM_BLOCKS, SIM_NUM_BLOCKS)))
        self.counts["heartbeat"] += 1

    def _kv_events(self, x: SimWorker) -> None:
        n = self.s.kv_blocks
        if n == 0:
            return
        stored = [self._rng.randbytes(16) for _ in range(n)]
        evicted = [x.evictable.popleft() for _ in range(min(n, len(x.evictable)))]
        x.evictable.extend(stored)
        x.sock.send(encode(KVEvents(x.worker_id, stored, evicted)))
        self.counts["kv_events"] += 1
        self.counts["kv_blocks"] += len(stored) + len(evicted)

    def _read(self, sock: zmq.Socket) -> None:
        x = self._by_socket[sock]
        while True:
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            tag, _, values = msgpack.unpackb(raw, raw=False)
            if tag == "task":  # request_id, reply_to, job, handoff_addr
                self.arrivals[values[0]] = now
                self._on_task(x, values[0], values[3], now)
            elif tag == "reregister":
                self.counts["reregister"] += 1
                self._register(x)
            elif tag == "status" and values[0] == x.index and self.counts["joined"] < len(self.workers):
                self.counts["joined"] += 1
                if x.index + 1 < len(self.workers):
                    self._join(self.workers[x.index + 1])
                else:
                    self._pipe.send("registered")
            else:
                self.counts[tag] += 1

    def _on_task(self, x: SimWorker, request_id: str, handoff: str | None, now: float) -> None:
        self.counts["task"] += 1
        prefilled, done = now + self.s.prefill_ms / 1e3, now + (self.s.prefill_ms + self.s.decode_ms) / 1e3
        decoder = self._by_kv_addr.get(handoff, x) if handoff else x
        decoder.running += 1
        if x.role is not WorkerRole.COLOCATED:  # a prefill worker, or a decode one prefilling
            self._at(prefilled, x, finished_bytes(request_id, x.worker_id, FinishStage.PREFILL))
        self._at(done, decoder, finished_bytes(request_id, decoder.worker_id, FinishStage.REQUEST), True)


def fleet_main(s: FleetSettings, pipe: Connection) -> None:
    fleet = Fleet(s)
    fleet.prepare()
    fleet.run(pipe)
