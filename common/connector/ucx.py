"""UCX transport for KV transfers (``ucx://HOST:PORT``), built on ``ucxx``.

What this module owns: one asyncio event loop per process, on a daemon thread, that runs
every ucxx call, and the framing of transfers over UCX tag messages. The workers' loops
are synchronous, so ``UcxSender``/``UcxReceiver`` hand work to that loop with
``call_soon_threadsafe``/``run_coroutine_threadsafe`` and collect results from
``queue.SimpleQueue``s; no public method blocks except ``poll(timeout_ms)`` and ``close``.

Why one loop per process and not one per object: ucxx keeps a single application
context (one UCX worker) per process, and with ``enable_python_future`` its notifier
thread completes request futures on the loop that created the context. Without that
option every pending receive busy-polls its loop (``asyncio.sleep(0)``), burning a core
per idle connection. So the context is created once, inside the shared loop, with
futures on; the notifier thread then inherits the loop thread's daemon flag and never
holds up interpreter exit.

Wire format, per transfer, on one endpoint (messages on the endpoint's own tag, which
UCX delivers in order)::

    8-byte little-endian header length | msgpack KVHandoff | block 0 | ... | block n-1

and acks travel back on the same endpoint as ``length | msgpack KVAck``. UCX does not
report how many bytes a receive got, so the receiver probes each message's length
before receiving it: a header or block of the wrong size is rejected before any memory
is allocated for it. A rejected or broken transfer leaves the stream's framing unknown,
so the receiver nacks it (when the peer can still hear) and closes that connection; the
sender reconnects on its next transfer.

Sender-side extra: when a connection dies, every transfer on it that was not acked yet
is nacked locally (reason starting ``ucx:``). The sender can no longer learn what the
receiver did with them, so treat such a nack like an expired lease: free the blocks.

Caveats: the loop thread and UCX do not survive ``fork`` (start workers with spawn), and
ucxx's progress thread makes CUDA device 0 current at start, so on a GPU machine each
process using this transport holds a CUDA context there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import struct
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from common.connector.base import MAX_BLOCK_FRAME_BYTES, ReceivedTransfer, check_transfer
from common.protocol import MAX_MESSAGE_BYTES, KVAck, KVHandoff, ProtocolError, decode, encode

# UCX warns about every UCX_* variable it does not know, and ucxx sets some at import
# that this UCX no longer reads; UCX's documented switch turns that off. It only works
# before ucxx is first imported in the process; setdefault lets a user's choice win.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

try:
    import ucxx
except ImportError:  # the optional ``ucx`` extra is not installed
    ucxx = None

_MISSING = "UCX transport needs the ucx extra: pip install 'tandem[ucx]'"
_LEN = struct.Struct("<Q")
FRAME_TIMEOUT_S = 30.0  # longest wait for the next frame of a transfer already begun
# ucxx's default. Dialling a dead port usually fails at once, but ucxx sometimes misses
# the endpoint error and waits out this whole timeout instead.
CONNECT_TIMEOUT_S = 5.0
_CLOSE_TIMEOUT_S = 10.0
_PROBE_MAX_SLEEP_S = 0.001  # probing backs off to this; frames of a transfer come in bursts


def parse_address(addr: str) -> tuple[str, int]:
    """``ucx://HOST:PORT`` (HOST may be ``[v6]``) as (host, port)."""
    if not addr.startswith("ucx://"):
        raise ValueError(f"not a ucx:// address: {addr!r}")
    host, sep, port = addr[len("ucx://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"ucx address must be ucx://HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


# ---- the process's UCX event loop ----------------------------------------------------


class _Loop:
    """The one asyncio loop (daemon thread) that runs every ucxx call in this process."""

    _instance: _Loop | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> _Loop:
        if ucxx is None:
            raise RuntimeError(_MISSING)
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tandem-ucx", daemon=True)
        self._thread.start()
        self.run(self._init_ucx())

    @staticmethod
    async def _init_ucx() -> None:
        # Inside the loop thread, so ucxx binds its futures to this loop and its
        # notifier thread is a daemon like this one.
        with contextlib.suppress(RuntimeError):  # already initialised here: use that context
            ucxx.init(enable_python_future=True)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = _CLOSE_TIMEOUT_S) -> Any:
        """Run ``coro`` on the loop and wait for its result (never call from the loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)


class _Tasks:
    """Strong references to fire-and-forget tasks (asyncio keeps only weak ones)."""

    def __init__(self) -> None:
        self._live: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._live.add(task)
        task.add_done_callback(self._live.discard)
        return task

    def cancel_others(self) -> None:
        current = asyncio.current_task()
        for task in list(self._live):
            if task is not current:
                task.cancel()

    async def cancel_all(self) -> None:
        tasks = list(self._live)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- framing helpers (loop thread only) ----------------------------------------------


class _Malformed(Exception):
    """The peer sent something that is not a well-formed transfer or ack."""

    def __init__(self, transfer_id: str, reason: str) -> None:
        super().__init__(reason)
        self.transfer_id = transfer_id
        self.reason = reason


async def _next_length(ep: Any, timeout: float, what: str, transfer_id: str) -> int:
    """Size of the next message on ``ep``, probed without receiving it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    sleep = 0.0
    while True:
        probe = ep.tag_probe()
        if probe.matched:
            return probe.length
        if ep.closed:
            raise ConnectionError("peer closed the connection")
        if loop.time() > deadline:
            raise _Malformed(transfer_id, f"{what} did not arrive within {timeout:g} s")
        # Frames of a begun transfer are already on their way: start with plain yields
        # and back off to a short sleep so a stalled peer costs little CPU.
        await asyncio.sleep(sleep)
        sleep = min(max(sleep * 2, 1e-5), _PROBE_MAX_SLEEP_S)


async def _recv_exact(ep: Any, nbytes: int, timeout: float, what: str, transfer_id: str = "") -> np.ndarray:
    """Receive the next message, which must have exactly ``nbytes`` bytes."""
    got = await _next_length(ep, timeout, what, transfer_id)
    if got != nbytes:
        raise _Malformed(transfer_id, f"{what} has {got} bytes, expected {nbytes}")
    buf = np.empty(nbytes, dtype=np.uint8)
    await ep.recv(buf)  # matches the probed message: the first queued one on this tag
    return buf


async def _recv_blocks(ep: Any, header: KVHandoff, timeout: float) -> list[memoryview]:
    """The transfer's block frames, each size-checked before its bytes are taken.

    Receives overlap: a frame is taken off the matching queue once probed, so the next
    one can be probed and posted while earlier ones are still streaming in.
    """
    tid, nbytes = header.transfer_id, header.block_nbytes
    bufs, receives = [], []
    try:
        for i in range(header.num_blocks):
            got = await _next_length(ep, timeout, f"block frame {i}", tid)
            if got != nbytes:
                raise _Malformed(tid, f"block frame {i} has {got} bytes, expected {nbytes}")
            handle = ep.tag_probe(remove=True)  # the same message: nobody else reads this tag
            bufs.append(np.empty(nbytes, dtype=np.uint8))
            receives.append(asyncio.ensure_future(ep.recv_with_handle(bufs[-1], handle)))
        await asyncio.gather(*receives)
    except BaseException:
        for r in receives:
            r.cancel()
        await asyncio.gather(*receives, return_exceptions=True)
        raise
    return [memoryview(b).toreadonly() for b in bufs]


async def _recv_length_prefix(ep: Any) -> int:
    """Wait (no deadline, no polling) for the 8-byte length that starts a message."""
    buf = np.zeros(_LEN.size, dtype=np.uint8)  # zeros: a shorter message fills only part
    try:
        await ep.recv(buf)
    except ucxx.exceptions.UCXMessageTruncatedError as e:
        raise _Malformed("", "expected an 8-byte length prefix") from e
    return _LEN.unpack(buf.tobytes())[0]


async def _recv_message(ep: Any, frame_timeout: float, transfer_id: str = "") -> np.ndarray:
    """One ``length | bytes`` message of at most MAX_MESSAGE_BYTES."""
    nbytes = await _recv_length_prefix(ep)
    if not 0 < nbytes <= MAX_MESSAGE_BYTES:
        raise _Malformed(transfer_id, f"message length {nbytes} outside 1..{MAX_MESSAGE_BYTES}")
    return await _recv_exact(ep, nbytes, frame_timeout, "message", transfer_id)


async def _send_in_order(ep: Any, messages: Sequence[Any]) -> None:
    """Post every message at once (UCX keeps their order on one tag) and wait for all."""
    # gather starts the coroutines in list order and each posts its send before its
    # first await, so the posting order is the list order.
    results = await asyncio.gather(*(ep.send(m) for m in messages), return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        raise error


async def _close_endpoint(ep: Any) -> None:
    with contextlib.suppress(Exception):  # a dying endpoint may fail to close: gone either way
        await ep.close()


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _as_bytes_view(block: memoryview | bytes | np.ndarray) -> memoryview:
    """A flat byte view of a block; raises for non-contiguous memory (it cannot be sent in place)."""
    view = memoryview(block)
    if not view.c_contiguous:
        raise ValueError("KV blocks must be contiguous to be sent in place")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


# ---- sender ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Outgoing:
    transfer_id: str
    messages: list[Any]  # length, header, blocks: held until their sends complete


@dataclass(slots=True)
class _Link:
    """The sender's connection to one receiver address (loop thread only)."""

    addr: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unacked: dict[str, None] = field(default_factory=dict)  # queued, in flight or sent
    ep: Any = None
    dead: bool = False
    tasks: _Tasks = field(default_factory=_Tasks)


class UcxSender:
    """``KVSender`` over UCX: one endpoint per receiver address, transfers sent in order."""

    def __init__(self, frame_timeout_s: float = FRAME_TIMEOUT_S,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self._loop = _Loop.get()
        self._frame_timeout = frame_timeout_s
        self._connect_timeout = connect_timeout_s
        self._acks: queue.SimpleQueue[KVAck] = queue.SimpleQueue()
        self._links: dict[str, _Link] = {}  # loop thread only
        self._closed = False

    def send(self, addr: str, header: KVHandoff, blocks: Sequence[memoryview]) -> None:
        head = encode(header)
        if len(head) > MAX_MESSAGE_BYTES:
            raise ValueError(f"header of {len(head)} bytes exceeds {MAX_MESSAGE_BYTES}")
        self._send_raw(addr, header.transfer_id, [_LEN.pack(len(head)), head, *blocks])

    def poll_acks(self) -> list[KVAck]:
        acks = []
        while True:
            try:
                acks.append(self._acks.get_nowait())
            except queue.Empty:
                return acks

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # A stuck or stopped loop means the process is going away anyway.
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self._loop.run(self._shutdown(), timeout=_CLOSE_TIMEOUT_S + 5)

    def _send_raw(self, addr: str, transfer_id: str, messages: Sequence[Any]) -> None:
        """Queue raw messages as one transfer (``send`` builds them; tests craft bad ones)."""
        if self._closed:
            raise RuntimeError("sender is closed")
        parse_address(addr)  # a bad address is the caller's bug: say so now
        item = _Outgoing(transfer_id, [_as_bytes_view(m) for m in messages])
        self._loop.call(self._enqueue, addr, item)

    # -- loop thread --

    def _enqueue(self, addr: str, item: _Outgoing) -> None:
        if self._closed:
            return
        link = self._links.get(addr)
        if link is None:
            link = self._links[addr] = _Link(addr)
            link.tasks.spawn(self._write(link))
        link.unacked[item.transfer_id] = None
        link.queue.put_nowait(item)

    async def _write(self, link: _Link) -> None:
        try:
            host, port = parse_address(link.addr)
            link.ep = await ucxx.create_endpoint(host, port, connect_timeout=self._connect_timeout)
            link.tasks.spawn(self._read_acks(link))
            while True:
                item: _Outgoing = await link.queue.get()
                await _send_in_order(link.ep, item.messages)
                item.messages.clear()  # sent: the caller's blocks are no longer referenced
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any failure ends this connection
            await self._fail(link, f"ucx: connection to {link.addr} failed: {_describe(e)}")

    async def _read_acks(self, link: _Link) -> None:
        try:
            while True:
                body = await _recv_message(link.ep, self._frame_timeout)
                try:
                    msg = decode(body)
                except ProtocolError:
                    continue  # a confused peer: its transfer will hit the lease deadline
                if isinstance(msg, KVAck):
                    link.unacked.pop(msg.transfer_id, None)
                    self._acks.put(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any failure ends this connection
            await self._fail(link, f"ucx: connection to {link.addr} lost: {_describe(e)}")

    async def _fail(self, link: _Link, reason: str) -> None:
        """End a connection: nack what it still owed, forget it so the next send reconnects."""
        if link.dead:
            return
        link.dead = True
        if self._links.get(link.addr) is link:
            del self._links[link.addr]
        if link.ep is not None:
            # Closing cancels the sends still posted, so UCX stops reading the caller's
            # blocks before the nacks below let the caller free them.
            await _close_endpoint(link.ep)
        link.tasks.cancel_others()
        while not link.queue.empty():
            link.queue.get_nowait().messages.clear()
        if not self._closed:
            for transfer_id in link.unacked:
                self._acks.put(KVAck(transfer_id, False, reason))
        link.unacked.clear()

    async def _shutdown(self) -> None:
        links = list(self._links.values())
        self._links.clear()
        for link in links:
            link.dead = True
            if link.ep is not None:
                await _close_endpoint(link.ep)  # first: stops UCX reading the blocks
            await link.tasks.cancel_all()


# ---- receiver -------------------------------------------------------------------------


@dataclass(slots=True, eq=False)  # identity: kept in a set
class _Connection:
    """One sender's endpoint on the receiver side; ``ReceivedTransfer.peer`` is this."""

    ep: Any
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # a reply's 2 messages stay together


class UcxReceiver:
    """``KVReceiver`` over UCX: listens on ``ucx://HOST:PORT`` (port 0 picks a free one)."""

    def __init__(self, address: str, frame_timeout_s: float = FRAME_TIMEOUT_S) -> None:
        self._loop = _Loop.get()
        host, port = parse_address(address)
        self._frame_timeout = frame_timeout_s
        self._ready: queue.SimpleQueue[ReceivedTransfer] = queue.SimpleQueue()
        self._tasks = _Tasks()  # replies
        self._serving: set[asyncio.Task] = set()  # one per connection
        self._connections: set[_Connection] = set()
        self._closed = False
        # A zmq pipe the loop thread pokes per ready transfer, so a worker can sleep in
        # its zmq poller instead of polling this receiver on a timer.
        wake = f"inproc://tandem-ucx-wakeup-{id(self):x}"
        self._wake_rx = zmq.Context.instance().socket(zmq.PULL)
        self._wake_rx.bind(wake)
        self._wake_tx: zmq.Socket | None = None  # loop thread only
        self._listener = self._loop.run(self._listen(port, wake))
        # UCX listens on every interface; HOST is what senders should dial.
        self.address = f"ucx://{host}:{self._listener.port}"

    @property
    def wakeup_socket(self) -> zmq.Socket:
        """Readable while a transfer may be waiting; ``poll`` empties it."""
        return self._wake_rx

    def poll(self, timeout_ms: int = 0) -> list[ReceivedTransfer]:
        # Drain the wake-ups before taking transfers: one arriving in between leaves a
        # spare wake-up (a harmless extra poll), never a transfer nobody is woken for.
        with contextlib.suppress(zmq.Again):
            while True:
                self._wake_rx.recv(zmq.NOBLOCK)
        try:
            first = self._ready.get(timeout=timeout_ms / 1000) if timeout_ms > 0 else self._ready.get_nowait()
        except queue.Empty:
            return []
        out = [first]
        while True:
            try:
                out.append(self._ready.get_nowait())
            except queue.Empty:
                return out

    def ack(self, transfer: ReceivedTransfer, ok: bool, reason: str = "") -> None:
        if self._closed:
            return
        reply = KVAck(transfer.header.transfer_id, ok, reason)
        self._loop.call(self._spawn_reply, transfer.peer, reply)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # A stuck or stopped loop means the process is going away anyway.
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self._loop.run(self._shutdown(), timeout=_CLOSE_TIMEOUT_S + 5)
        self._wake_rx.close(linger=0)

    # -- loop thread --

    async def _listen(self, port: int, wake: str) -> Any:
        self._wake_tx = zmq.Context.instance().socket(zmq.PUSH)
        self._wake_tx.connect(wake)
        return ucxx.create_listener(self._serve, port=port)

    def _deliver(self, transfer: ReceivedTransfer) -> None:
        self._ready.put(transfer)
        # Full pipe (a worker not polling): it is readable already, so dropping is fine.
        with contextlib.suppress(zmq.Again):
            self._wake_tx.send(b"", zmq.NOBLOCK)

    async def _serve(self, ep: Any) -> None:
        """Receive transfers from one sender until it leaves or sends garbage."""
        task = asyncio.current_task()
        conn = _Connection(ep)
        self._serving.add(task)
        self._connections.add(conn)
        try:
            while not self._closed:
                self._deliver(await self._receive_transfer(conn))
        except _Malformed as e:
            # The framing is lost: nack, then drop the connection (the sender reconnects).
            await self._reply(conn, KVAck(e.transfer_id, False, e.reason))
        except asyncio.CancelledError:
            pass  # closing
        except Exception:  # the sender went away: nobody left to nack
            pass
        finally:
            # Partial transfers die with _receive_transfer's frame: their buffers are freed.
            self._connections.discard(conn)
            self._serving.discard(task)
            await _close_endpoint(ep)

    async def _receive_transfer(self, conn: _Connection) -> ReceivedTransfer:
        ep = conn.ep
        head = await _recv_message(ep, self._frame_timeout)
        header = self._decode_header(head)
        tid = header.transfer_id
        if header.block_nbytes > MAX_BLOCK_FRAME_BYTES or header.num_blocks < 0:
            raise _Malformed(tid, check_transfer(header, []) or f"bad num_blocks {header.num_blocks}")
        blocks = await _recv_blocks(ep, header, self._frame_timeout)
        problem = check_transfer(header, blocks)
        if problem:
            raise _Malformed(tid, problem)
        return ReceivedTransfer(header, blocks, conn)

    @staticmethod
    def _decode_header(head: np.ndarray) -> KVHandoff:
        try:
            header = decode(memoryview(head))
        except ProtocolError as e:
            raise _Malformed("", str(e)) from e
        if not isinstance(header, KVHandoff):
            raise _Malformed("", f"expected kv_handoff, got {header.TAG}")
        return header

    def _spawn_reply(self, conn: _Connection, reply: KVAck) -> None:
        if conn in self._connections:
            self._tasks.spawn(self._reply(conn, reply))

    async def _reply(self, conn: _Connection, reply: KVAck) -> None:
        body = encode(reply)
        try:
            async with conn.send_lock:
                await _send_in_order(conn.ep, [_LEN.pack(len(body)), body])
        except Exception:  # the sender is gone; its lease will expire
            pass

    async def _shutdown(self) -> None:
        await self._tasks.cancel_all()
        serving = list(self._serving)
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
        self._listener.close()
        self._wake_tx.close(linger=0)
