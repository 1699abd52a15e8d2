"""``tandem bench kv-transfer``: KV connector throughput against raw transport loopback.

Moves N transfers of 24 blocks x 737,280 bytes (one SmolLM2 prompt: 30 layers x (k, v) x
16 tokens x 3 kv heads x 64 dims x fp32 per block) from this process to a receiver
process, once per transport:

* ``zmq-tcp`` / ``zmq-ipc`` / ``ucx``: the real ``KVSender``/``KVReceiver``, the receiver
  acking every transfer, at most ``--window`` transfers un-acked (as a prefill worker's
  leases would bound them);
* the baselines: raw ZeroMQ PUSH/PULL of the same multipart messages (header + 24
  blocks, ``copy=False``, high-water marks = window) over the same tcp/ipc; for ucx, raw
  ucxx tag sends of the same messages into receives all posted up front (no probing,
  no checks, no thread hop), the raw zmq tcp figure beside it, and ``ucx_perftest`` per
  UCX transport configuration (``loadtest.ucx_perftest``), the best of which is the
  "best raw UCX" figure the connector is held to: once with messages of one block (one
  buffer reused for every message: it stays in the CPU's caches, so this one flatters
  UCX) and once with messages of a whole transfer (the bytes come from memory, as a
  transfer's do);
* ``shm``: the real sender lending blocks from a shared-memory segment (``--kv-shm on``,
  control messages over ipc) and the real receiver mapping it; the receiver copies every
  block into a huge-page destination (as a decode worker copies into its cache) before it
  acks, so the row is the whole transfer, its one copy included. Its baseline is that same
  copy (``kernels.cpu_memory.copy_blocks``) from private memory, timed in the
  receiver: how near memory speed the path runs. (The zmq and ucx rows stop once the
  bytes are in the receiver's frames: a worker's copy into its cache comes on top.)

Each run starts a fresh receiver process and warms up (connection set up) before the
clock starts. Connector and baseline runs alternate, and the ratio is the median of
the per-pair ratios, so a busy moment on a shared machine hits both sides alike.
MB/s is 10^6 bytes of block payload per second, timed on the sender from the moment
the receiver has the warm-up until it has every transfer (and the connector's acks
are back). The receiver checks the bytes of the last warm-up transfer (before the clock starts)
and of the last timed one (after it stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

import numpy as np
import zmq

from common.protocol import KVHandoff, encode
from common.sampling_params import SamplingParams
from loadtest.ucx_perftest import CONFIGS as PERFTEST_CONFIGS
from loadtest.ucx_perftest import perftest_binary, perftest_mb_s

NUM_BLOCKS = 24
BLOCK_NBYTES = 30 * 2 * 16 * 3 * 64 * 4  # 737,280
SEED = 1234


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transfers", type=int, default=32, help="timed transfers per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed transfers first")
    p.add_argument("--window", type=int, default=8, help="most transfers in flight")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    p.add_argument("--blocks", type=int, default=NUM_BLOCKS)
    p.add_argument("--block-bytes", type=int, default=BLOCK_NBYTES)
    p.add_argument("--transports", nargs="+", default=["zmq-tcp", "zmq-ipc", "shm", "ucx"],
                   choices=["zmq-tcp", "zmq-ipc", "shm", "ucx"])
    p.add_argument("--json", help="also write the results here")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Job:
    """One measurement, as the receiver process needs it."""

    mode: str  # connector | raw-zmq | raw-ucxx | raw-copy
    transport: str  # zmq-tcp | zmq-ipc | shm | ucx
    address: str
    warmup: int
    transfers: int
    window: int
    blocks: int
    block_bytes: int


@dataclass
class Row:
    transport: str
    connector_mb_s: float  # median
    raw: str
    raw_mb_s: float  # median
    ratio: float  # median of the per-run connector/raw ratios (runs are interleaved)
    ratio_min: float
    ratio_max: float
    vs_raw_zmq_tcp: float | None = None  # ucx only: median ratio against raw zmq tcp
    connector_runs: list[float] = field(default_factory=list)
    raw_runs: list[float] = field(default_factory=list)
    perftest_mb_s: dict[str, float] = field(default_factory=dict)  # ucx only: median per config
    vs_best_perftest: float | None = None  # ucx only: median ratio against that run's best config
    perftest_transfer_mb_s: dict[str, float] = field(default_factory=dict)  # the same, a message a transfer
    vs_best_perftest_transfer: float | None = None


def source_blocks(n: int, nbytes: int) -> list[np.ndarray]:
    """The blocks every transfer sends: rows of one huge-page-backed array, as a worker's
    blocks are slices of its cache (``kernels.cpu_memory``)."""
    import torch

    from kernels import cpu_memory

    rows = cpu_memory.empty((n, nbytes), torch.uint8).numpy()
    rows[:] = np.random.default_rng(SEED).integers(0, 256, (n, nbytes), dtype=np.uint8)
    return list(rows)


LAYOUT = [30, 16, 3, 64, 4]  # layers, block size (tokens), kv heads, head dim, element size


def header(i: int, job: Job) -> KVHandoff:
    prompt = list(range(job.blocks * LAYOUT[1]))  # exactly fills job.blocks blocks
    return KVHandoff(f"bench-{i}", f"req-{i}", prompt, [7], [None], [None], [False],
                     SamplingParams(), "", 0, job.blocks, job.block_bytes, LAYOUT, "float32")


def run(args: argparse.Namespace) -> int:
    transports = list(args.transports)
    if "ucx" in transports and not _have_ucxx():
        print("ucx: ucxx is not installed (pip install 'tandem[ucx]'), skipping", file=sys.stderr)
        transports.remove("ucx")
    blocks = source_blocks(args.blocks, args.block_bytes)
    rows = [_measure(transport, args, blocks) for transport in transports]
    result = {"transfers": args.transfers, "blocks": args.blocks, "block_bytes": args.block_bytes,
              "window": args.window, "repeat": args.repeat, "rows": [asdict(r) for r in rows]}
    _print(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _measure(transport: str, args: argparse.Namespace, blocks: list[np.ndarray]) -> Row:
    """Connector and baseline runs interleaved, so a busy moment hits both alike."""
    payload = args.transfers * args.blocks * args.block_bytes
    baselines = {"ucx": [("raw-ucxx", "ucx"), ("raw-zmq", "zmq-tcp")],
                 "shm": [("raw-copy", "shm")]}.get(transport, [("raw-zmq", transport)])
    if transport == "ucx" and perftest_binary() is not None:
        baselines += [(mode, label) for mode in PERFTEST_MODES for label in PERFTEST_CONFIGS]
    runs: dict[str, list[float]] = {"connector": []} | {_key(m, w): [] for m, w in baselines}
    for i in range(args.repeat):
        for mode, where in [("connector", transport), *baselines]:
            print(f"{transport}: {_key(mode, where)} run {i + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
            if mode in PERFTEST_MODES:
                runs[_key(mode, where)].append(_perftest(mode, where, args))
            else:
                runs[_key(mode, where)].append(payload / _one_run(mode, where, args, blocks) / 1e6)
    connector, (raw_mode, _) = runs["connector"], baselines[0]
    ratios = [c / r for c, r in zip(connector, runs[raw_mode], strict=True)]
    vs_tcp = None
    if transport == "ucx":
        vs_tcp = statistics.median(c / r for c, r in zip(connector, runs["raw-zmq"], strict=True))
    raw_name = {"ucx": "ucxx tag send/recv", "shm": "the same copy"}.get(
        transport, f"zmq PUSH/PULL {transport[4:]}")
    row = Row(transport, statistics.median(connector), raw_name, statistics.median(runs[raw_mode]),
              statistics.median(ratios), min(ratios), max(ratios), vs_tcp, connector, runs[raw_mode])
    for mode in PERFTEST_MODES:
        perftest = {w: runs[_key(m, w)] for m, w in baselines if m == mode}
        if perftest:
            best = [max(per_run) for per_run in zip(*perftest.values(), strict=True)]
            medians = {label: statistics.median(r) for label, r in perftest.items()}
            vs_best = statistics.median(c / b for c, b in zip(connector, best, strict=True))
            if mode == "perftest":
                row.perftest_mb_s, row.vs_best_perftest = medians, vs_best
            else:
                row.perftest_transfer_mb_s, row.vs_best_perftest_transfer = medians, vs_best
    return row


def _key(mode: str, where: str) -> str:
    return {"perftest": f"perftest {where}", "perftest-transfer": f"perftest {where} @transfer"}.get(mode, mode)


PERFTEST_MODES = ("perftest", "perftest-transfer")  # messages of a block, of a whole transfer


def _perftest(mode: str, label: str, args: argparse.Namespace) -> float:
    if mode == "perftest":
        return perftest_mb_s(label, args.block_bytes, args.transfers * args.blocks)
    return perftest_mb_s(label, args.blocks * args.block_bytes, args.transfers)


def _print(rows: list[Row], args: argparse.Namespace) -> None:
    mb = args.blocks * args.block_bytes / 1e6
    print(f"KV transfer throughput: {args.transfers} transfers x {args.blocks} blocks x "
          f"{args.block_bytes:,} B ({mb:.1f} MB each), window {args.window}, median of {args.repeat}")
    print(f"{'transport':<10} {'connector MB/s':>15}   {'raw baseline':<20} {'raw MB/s':>9} "
          f"{'ratio':>6}  {'(range)':<13}")
    for r in rows:
        extra = f"  {r.vs_raw_zmq_tcp:.2f}x raw zmq tcp" if r.vs_raw_zmq_tcp is not None else ""
        spread = f"({r.ratio_min:.2f}-{r.ratio_max:.2f})"
        print(f"{r.transport:<10} {r.connector_mb_s:>15.0f}   {r.raw:<20} {r.raw_mb_s:>9.0f} "
              f"{r.ratio:>5.2f}x  {spread:<13}{extra}")
        for what, figures, ratio in (("a block", r.perftest_mb_s, r.vs_best_perftest),
                                     ("a transfer", r.perftest_transfer_mb_s, r.vs_best_perftest_transfer)):
            if figures:
                listed = ", ".join(f"{label} {mb:.0f}" for label, mb in figures.items())
                print(f"{'':<10} ucx_perftest tag_bw MB/s, messages of {what}, by UCX config: {listed}; "
                      f"connector {ratio:.2f}x the best")


def _have_ucxx() -> bool:
    from common.connector.ucx import ucx_available

    return ucx_available()


# ---- one run: receiver process + sender here ------------------------------------------


def _one_run(mode: str, transport: str, args: argparse.Namespace, blocks: list[np.ndarray]) -> float:
    """Seconds for the timed transfers of one run."""
    with tempfile.TemporaryDirectory(prefix="kvbench") as tmp:
        address = {"zmq-tcp": "tcp://127.0.0.1:0", "zmq-ipc": f"ipc://{tmp}/kv.sock",
                   "shm": f"ipc://{tmp}/kv.sock", "ucx": "ucx://127.0.0.1:0"}[transport]
        job = Job(mode, transport, address, args.warmup, args.transfers, args.window,
                  args.blocks, args.block_bytes)
        ctx = mp.get_context("spawn")  # no fork: the parent may hold threads (zmq, ucx)
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=_receiver_main, args=(job, theirs), daemon=True)
        child.start()
        try:
            address = _expect(ours, "address", child)
            sender = {"connector": _send_connector, "raw-zmq": _send_raw_zmq,
                      "raw-ucxx": _send_raw_ucxx, "raw-copy": _send_raw_copy}[mode]
            seconds = sender(job, address, blocks, lambda what: _expect(ours, what, child))
            _expect(ours, "checked", child)  # the bytes, compared after the clock stopped
            return seconds
        finally:
            ours.close()  # tells a lingering receiver that everything arrived
            child.join(timeout=30)
            if child.is_alive():
                child.kill()


def _expect(pipe: Connection, what: str, child: mp.process.BaseProcess, timeout: float = 120.0):
    if not pipe.poll(timeout):
        raise RuntimeError(f"receiver sent no {what} within {timeout} s (alive: {child.is_alive()})")
    kind, value = pipe.recv()
    if kind == "error":
        raise RuntimeError(f"receiver failed: {value}")
    if kind != what:
        raise RuntimeError(f"receiver sent {kind}, expected {what}")
    return value


def _send_connector(job: Job, address: str, blocks: list[np.ndarray],
                    expect: Callable[[str], object]) -> float:
    from common.connector import KVTransport, make_sender

    if job.transport == "shm":
        sender, views = _shm_sender(blocks)
    else:
        sender = make_sender(KVTransport.UCX if job.transport == "ucx" else KVTransport.ZMQ)
        views = [memoryview(b) for b in blocks]
    acked = 0

    def send_window(first: int, count: int, expected_acks: int) -> None:
        nonlocal acked
        sent = first
        while acked < expected_acks:
            while sent < first + count and sent - acked < job.window:
                sender.send(address, header(sent, job), views)
                sent += 1
            acks = sender.poll_acks()
            if any(not a.ok for a in acks):
                raise RuntimeError(f"nacked: {[a for a in acks if not a.ok]}")
            acked += len(acks)
            if not acks:
                time.sleep(0.0002)  # pacing the ack poll: a worker would step its engine here

    try:
        send_window(0, job.warmup, job.warmup)
        expect("warm")
        start = time.perf_counter()
        send_window(job.warmup, job.transfers, job.warmup + job.transfers)
        expect("done")
        return time.perf_counter() - start
    finally:
        sender.close()


def _shm_sender(blocks: list[np.ndarray]):
    """A sender lending ``blocks`` from a shared segment they are copied into (untimed)."""
    import torch

    from common.connector import KVTransport, SharedKV, ShmMode, make_sender
    from common.shared_memory import SharedSegment

    segment = SharedSegment(sum(b.nbytes for b in blocks))
    rows = segment.tensor((len(blocks), blocks[0].nbytes), torch.uint8).numpy()
    for row, block in zip(rows, blocks, strict=True):
        row[:] = block
    sender = make_sender(KVTransport.ZMQ, shm=SharedKV(segment, ShmMode.ON, lease_seconds=600.0))
    return sender, [memoryview(row) for row in rows]


def _send_raw_copy(job: Job, address: str, blocks: list[np.ndarray],
                   expect: Callable[[str], object]) -> float:
    expect("warm")
    return float(expect("done"))  # timed in the receiver: nothing crosses a process here


def _send_raw_zmq(job: Job, address: str, blocks: list[np.ndarray],
                  expect: Callable[[str], object]) -> float:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, job.window)
    sock.connect(address)
    views = [memoryview(b) for b in blocks]
    try:
        for i in range(job.warmup):
            sock.send_multipart([encode(header(i, job)), *views], copy=False)
        expect("warm")
        start = time.perf_counter()
        for i in range(job.warmup, job.warmup + job.transfers):
            sock.send_multipart([encode(header(i, job)), *views], copy=False)
        expect("done")
        return time.perf_counter() - start
    finally:
        sock.close(linger=0)


def _send_raw_ucxx(job: Job, address: str, blocks: list[np.ndarray],
                   expect: Callable[[str], object]) -> float:
    from common.connector.ucx import parse_address
    from common.connector.ucx.loop import UcxLoop, ucxx  # through loop: it sets UCX_* env first

    host, port = parse_address(address)
    views = [memoryview(b) for b in blocks]

    async def main() -> float:
        ep = await ucxx.create_endpoint(host, port)

        async def send(i: int) -> None:
            head = encode(header(i, job))
            msgs = [np.array([len(head)], dtype="<u8"), np.frombuffer(head, np.uint8), *views]
            await asyncio.gather(*(ep.send(m) for m in msgs))

        for i in range(job.warmup):
            await send(i)
        await asyncio.to_thread(expect, "warm")
        start = time.perf_counter()
        for i in range(job.warmup, job.warmup + job.transfers):
            await send(i)
        await asyncio.to_thread(expect, "done")
        elapsed = time.perf_counter() - start
        await ep.close()
        return elapsed

    # The connector's loop: ucxx allows one context per process, bound to one loop.
    return UcxLoop.get().run(main(), timeout=600)


# ---- receiver process ------------------------------------------------------------------


def _receiver_main(job: Job, pipe: Connection) -> None:
    try:
        {"connector": _receive_connector, "raw-zmq": _receive_raw_zmq,
         "raw-ucxx": _receive_raw_ucxx, "raw-copy": _receive_raw_copy}[job.mode](job, pipe)
    except BaseException as e:  # report, so the parent fails with the reason, not a timeout
        pipe.send(("error", f"{type(e).__name__}: {e}"))
        raise


class _Checker:
    """Counts arrivals, signals warm/done, checks the first and last timed transfer."""

    def __init__(self, job: Job, pipe: Connection) -> None:
        self.job, self.pipe, self.count = job, pipe, 0
        self.want = source_blocks(job.blocks, job.block_bytes)
        self.last = job.warmup + job.transfers - 1

    def verify(self, frames: list[memoryview]) -> None:
        ok = len(frames) == len(self.want) and all(
            np.array_equal(np.frombuffer(f, np.uint8), w) for f, w in zip(frames, self.want, strict=True))
        if not ok:
            raise RuntimeError(f"transfer {self.count} arrived corrupted")

    def arrived(self, frames: list[memoryview]) -> bool:
        """Record one transfer; True when it was the last. The last warm-up transfer is
        checked before the clock starts, the last timed one after it stopped."""
        if self.count == self.job.warmup - 1:
            self.verify(frames)
        self.count += 1
        if self.count == self.job.warmup:
            self.pipe.send(("warm", None))
        if self.count == self.last + 1:
            self.pipe.send(("done", None))
            self.verify(frames)
            self.pipe.send(("checked", None))
            return True
        return False


def _receive_connector(job: Job, pipe: Connection) -> None:
    from common.connector import KVTransport, make_receiver

    kind = KVTransport.UCX if job.transport == "ucx" else KVTransport.ZMQ
    receiver = make_receiver(kind, job.address, shm=job.transport == "shm")
    pipe.send(("address", receiver.address))
    checker, done = _Checker(job, pipe), False
    cache = _Cache(job) if job.transport == "shm" else None
    try:
        while not done:
            for transfer in receiver.poll(timeout_ms=100):
                blocks = transfer.blocks if cache is None else cache.copy_in(transfer.blocks)
                receiver.ack(transfer, ok=True)
                done = checker.arrived(blocks) or done
        _linger_for_acks(pipe)
    finally:
        receiver.close()


class _Cache:
    """Where a shm receiver copies each transfer, as a decode worker into its KV cache."""

    def __init__(self, job: Job) -> None:
        import torch

        from kernels import cpu_memory

        self.copy, self.threads = cpu_memory.copy_blocks, torch.get_num_threads()
        self.rows = cpu_memory.zeros((job.blocks, job.block_bytes), torch.uint8)

    def copy_in(self, blocks: list[memoryview]) -> list[memoryview]:
        self.copy(list(self.rows), blocks, self.threads)  # as a decode worker's runner does
        return [memoryview(row.numpy()) for row in self.rows]


def _receive_raw_copy(job: Job, pipe: Connection) -> None:
    pipe.send(("address", ""))
    cache, blocks = _Cache(job), [memoryview(b) for b in source_blocks(job.blocks, job.block_bytes)]
    checker = _Checker(job, pipe)
    for _ in range(job.warmup):
        checker.arrived(cache.copy_in(blocks))  # signals "warm" after the last
    start = time.perf_counter()
    for _ in range(job.transfers):
        copied = cache.copy_in(blocks)
    pipe.send(("done", time.perf_counter() - start))  # the time is ours: nothing crossed a process
    checker.verify(copied)
    pipe.send(("checked", None))


def _linger_for_acks(pipe: Connection) -> None:
    # The last acks are on their way; closing now could drop them. The parent says
    # when it has them by closing its end (it joins us after its run).
    while True:
        try:
            if pipe.poll(0.05):
                pipe.recv()
        except EOFError:
            return


def _receive_raw_zmq(job: Job, pipe: Connection) -> None:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, job.window)
    sock.bind(job.address)
    pipe.send(("address", sock.getsockopt_string(zmq.LAST_ENDPOINT)))
    checker = _Checker(job, pipe)
    try:
        while True:
            _head, *frames = sock.recv_multipart(copy=False)
            if checker.arrived([f.buffer for f in frames]):
                return
    finally:
        sock.close(linger=0)


def _receive_raw_ucxx(job: Job, pipe: Connection) -> None:
    from common.connector.ucx.loop import UcxLoop, ucxx  # through loop: it sets UCX_* env first

    async def main() -> None:
        finished: asyncio.Future = asyncio.get_running_loop().create_future()
        checker = _Checker(job, pipe)

        async def serve(ep) -> None:
            try:
                length = np.empty(1, dtype="<u8")
                for _ in range(job.warmup + job.transfers):
                    await ep.recv(length)
                    await ep.recv(np.empty(int(length[0]), np.uint8))
                    frames = [np.empty(job.block_bytes, np.uint8) for _ in range(job.blocks)]
                    # Sizes are known here, so every receive is posted at once: no probing.
                    await asyncio.gather(*(ep.recv(f) for f in frames))
                    checker.arrived([memoryview(f) for f in frames])
                finished.set_result(None)
            except Exception as e:  # ucxx would only log it: hand it to main
                finished.set_exception(e)

        listener = ucxx.create_listener(serve, port=0)
        pipe.send(("address", f"ucx://127.0.0.1:{listener.port}"))
        await finished
        await asyncio.to_thread(_linger_for_acks, pipe)
        listener.close()

    UcxLoop.get().run(main(), timeout=600)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
