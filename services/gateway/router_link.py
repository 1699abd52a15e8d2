"""The gateway's sockets: a DEALER to the router, and a PULL socket workers push tokens to.

``RouterLink`` turns them into awaitables: ``submit`` resolves to an ``Admission`` when
the router admits or refuses the request (a submission the router does not acknowledge
is sent again, see ACK_S), and every admitted request gets a channel (an ``asyncio.Queue`` of
``Tokens``) that fills as workers produce them — whichever worker that is. Channels are
created before the submission leaves, so no token can arrive to nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from common.addresses import reachable
from common.protocol import (
    Abort,
    Admitted,
    Message,
    Ping,
    ProtocolError,
    Queued,
    Rejected,
    Roster,
    Status,
    Submit,
    Survey,
    Tokens,
    decode,
    encode,
)
from common.sampling_params import SamplingParams

log = logging.getLogger("tandem.gateway")
CONNECT_GRACE_MS = 1000  # how long a message waits for the router's connection to be up
# A Submit the router has not acknowledged (Queued, Admitted or Rejected) within ACK_S was
# most likely written into the connection of a router that died as it left: it is sent
# again (the router answers a resend of a request it knows with its state) until the reach
# window (``reach_s``, the gateway's --router-reach-timeout, REACH_S by default) ends, which
# covers a supervised router restart, and then the request fails with a 503. Once the
# router has been out of reach for that long already, a new request is tried once and then
# refused, instead of each waiting out another window of a long outage.
# A router that is only behind (overloaded) is told apart from one that lost the Submit:
# while it answers messages sent before the Submit, it has yet to read it, and sending it
# again would only add to its backlog (every Submit once a second, a retry storm). It is
# sent again when the router answered a message sent after it (lost: the connection is in
# order), or said nothing at all for ACK_S (dead, or restarted).
ACK_S = 1.0
REACH_S = 10.0
# A request the router has queued (``Queued``) lives only in that router's memory: the
# Submit is sent again every QUEUED_RESEND_S while it waits. A live router answers a
# resend with the request's state (nothing changes there); a router restarted meanwhile
# does not know it and takes it as new, so a router killed with a full queue loses none.
QUEUED_RESEND_S = 2.0
STATUS_REFRESH_S = 1.0  # while the workers' block size is unknown, ask at most this often


class RouterUnavailable(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Admission:
    """The router's verdict on a submission; only an admitted request has a channel."""

    verdict: Admitted | Rejected
    channel: asyncio.Queue[Tokens] | None  # None exactly when the verdict is Rejected


class RouterLink:
    def __init__(self, router_addr: str, stream_bind: str, advertise_host: str = "127.0.0.1",
                 clock: Callable[[], float] = time.monotonic, reach_s: float = REACH_S) -> None:
        self._clock = clock  # the reach window's; tests move it by hand
        self._reach_s = reach_s
        self._unreachable_since: float | None = None  # the first failed send since the last good one
        self._ctx = zmq.asyncio.Context()
        self.gateway_id = f"gateway-{uuid.uuid4().hex[:8]}"
        self._router = self._ctx.socket(zmq.DEALER)
        self._router.setsockopt_string(zmq.IDENTITY, self.gateway_id)
        # Queue only to a connected router, so a router that is not there shows as a send
        # that cannot start (see _send) instead of a request waiting out its admission.
        self._router.setsockopt(zmq.IMMEDIATE, 1)
        self._router.connect(router_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(stream_bind)
        self.reply_to = reachable(self._pull.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        self._channels: dict[str, asyncio.Queue[Tokens]] = {}
        self._admissions: dict[str, asyncio.Future[Message]] = {}
        self._acks: dict[str, asyncio.Future[None]] = {}  # set when the router has the Submit
        self._pings: dict[int, asyncio.Future[Status]] = {}
        self._surveys: dict[int, asyncio.Future[Roster]] = {}
        self._nonces = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self.last_status: Status | None = None
        self._status_refresh: asyncio.Task | None = None  # a ping to learn the block size
        self._status_asked = -STATUS_REFRESH_S
        # Every message to the router is numbered as sent; ``_answered`` is the highest
        # number the router has answered (a Submit's ack, a Ping's Status, a Survey's
        # Roster): how far it has read, for telling "behind" from "lost" (see ACK_S).
        self._sent = 0
        self._answered = 0
        self._asked: dict[tuple[str, object], int] = {}  # (kind, request id or nonce) -> number

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read(self._router)),
                       asyncio.create_task(self._read(self._pull))]

    async def close(self) -> None:
        if self._status_refresh is not None:
            self._tasks.append(self._status_refresh)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._router.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                     timeout: float, channel: asyncio.Queue[Tokens] | None = None) -> Admission:
        """Admitted (with the request's channel) or Rejected (channel None). ``channel``: an
        existing one to deliver to (a continuation shares its request's)."""
        channel = channel if channel is not None else asyncio.Queue()
        self._channels[request_id] = channel
        loop = asyncio.get_running_loop()
        decided, heard = loop.create_future(), loop.create_future()
        self._admissions[request_id] = decided
        self._acks[request_id] = heard
        try:
            submit = Submit.of(request_id, prompt, params, self.reply_to, self._block_size())
            await self._deliver(submit, heard)
            verdict = await self._verdict(submit, decided, timeout)
        except RouterUnavailable:
            self.release(request_id)
            raise
        except TimeoutError:
            self.release(request_id)
            await self.abort(request_id)
            raise RouterUnavailable(f"the request was not placed within {timeout:g} s") from None
        finally:
            self._admissions.pop(request_id, None)
            self._acks.pop(request_id, None)
        if isinstance(verdict, Rejected):
            self.release(request_id)
            return Admission(verdict, None)
        return Admission(verdict, channel)

    async def abort(self, request_id: str, reason: str = "client") -> None:
        self.release(request_id)
        try:
            await self._send(Abort(request_id, reason))
        except RouterUnavailable:  # the router has forgotten the request along with us
            log.info("could not abort %s: the router is not reachable", request_id)

    def release(self, request_id: str) -> None:
        """Stop listening for a request (tokens that still arrive are dropped)."""
        self._channels.pop(request_id, None)

    async def status(self, timeout: float = 2.0) -> Status | None:
        nonce = next(self._nonces)
        fut = asyncio.get_running_loop().create_future()
        self._pings[nonce] = fut
        try:
            self._asked["nonce", nonce] = await self._send(Ping(nonce))
            status = await asyncio.wait_for(fut, timeout)
        except (RouterUnavailable, TimeoutError):
            return None
        finally:
            self._pings.pop(nonce, None)
            self._asked.pop(("nonce", nonce), None)
        self.last_status = status
        return status

    async def survey(self, timeout: float = 1.0) -> Roster:
        """Every worker as the router sees it (``/dashboard``); ``RouterUnavailable`` when
        the router cannot be reached or does not answer within ``timeout``."""
        nonce = next(self._nonces)
        fut = asyncio.get_running_loop().create_future()
        self._surveys[nonce] = fut
        try:
            self._asked["nonce", nonce] = await self._send(
                Survey(nonce), grace_ms=min(CONNECT_GRACE_MS, timeout * 1000))
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise RouterUnavailable(f"the router did not answer within {timeout:g} s") from None
        finally:
            self._surveys.pop(nonce, None)
            self._asked.pop(("nonce", nonce), None)

    def _block_size(self) -> int | None:
        """The block size a Submit hashes its prompt in: the prefill workers' as the last
        ``Status`` said; None (not hashed: the router hashes) while unknown, and then a ping in
        the background, at most one per ``STATUS_REFRESH_S``, asks again."""
        status = self.last_status
        if status is not None and status.block_size:
            return status.block_size
        now = self._clock()
        if (self._status_refresh is None or self._status_refresh.done()) and \
                now - self._status_asked >= STATUS_REFRESH_S:
            self._status_asked = now
            self._status_refresh = asyncio.create_task(self.status())
        return None

    def unreachable_for(self) -> float | None:
        """Seconds since a send to the router first failed with none succeeding after it;
        None while the router is reachable."""
        since = self._unreachable_since
        return None if since is None else self._clock() - since

    async def _verdict(self, submit: Submit, decided: asyncio.Future[Message], timeout: float) -> Message:
        """The router's Admitted or Rejected for an acknowledged ``submit``, sending it again
        every QUEUED_RESEND_S meanwhile (see there); TimeoutError after ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(decided), min(left, QUEUED_RESEND_S))
            with contextlib.suppress(RouterUnavailable):  # away: the deadline still holds
                await self._send(submit, grace_ms=0)

    async def _deliver(self, submit: Submit, heard: asyncio.Future[None]) -> None:
        """Send ``submit`` until the router acknowledges it (see ACK_S and REACH_S)."""
        away = self.unreachable_for()
        reach = self._reach_s
        give_up = self._clock() + (reach if away is None or away < reach else 0.0)
        key = ("submit", submit.request_id)
        try:
            while True:
                try:
                    number = self._asked[key] = await self._send(submit)
                    await self._acknowledged(heard, number, give_up)
                    return
                except (RouterUnavailable, TimeoutError):
                    if self._clock() >= give_up:
                        raise RouterUnavailable("the router did not acknowledge the request") from None
                log.info("resending %s: the router has not acknowledged it", submit.request_id)
        finally:
            self._asked.pop(key, None)

    async def _acknowledged(self, heard: asyncio.Future[None], number: int, give_up: float) -> None:
        """Wait for the ack of message ``number``: TimeoutError once it looks lost (see
        ACK_S); while the router keeps answering earlier messages, it is behind: wait on
        (until ``give_up``)."""
        while True:
            answered = self._answered
            try:
                return await asyncio.wait_for(asyncio.shield(heard), ACK_S)
            except TimeoutError:
                behind = answered < self._answered < number
                if not behind or self._clock() >= give_up:
                    raise

    async def _send(self, msg: Message, grace_ms: float = CONNECT_GRACE_MS) -> int:
        """To the router, once connected (the grace covers a connection still being made);
        returns the message's number."""
        if not await self._router.poll(grace_ms, zmq.POLLOUT):
            if self._unreachable_since is None:
                self._unreachable_since = self._clock()
            raise RouterUnavailable("the router is not reachable")
        self._unreachable_since = None
        await self._router.send(encode(msg))
        self._sent += 1
        return self._sent

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        """One frame at a time, for good: whatever a frame holds, the loop goes on (if it
        ended, no request would ever receive a token again)."""
        while True:
            data = await sock.recv()
            try:
                msg = decode(data)
            except ProtocolError as e:
                log.warning("dropping a bad message: %s", e)
                continue
            except Exception:  # a decoder bug: still one bad frame, not a dead gateway
                log.exception("dropping a message that failed to decode")
                continue
            try:
                self._route(msg)
            except Exception:
                log.exception("dropping a %s that could not be routed", msg.TAG)

    def _route(self, msg: Message) -> None:
        if isinstance(msg, Tokens):
            channel = self._channels.get(msg.request_id)
            if channel is not None:
                channel.put_nowait(msg)
        elif isinstance(msg, Queued | Admitted | Rejected):
            self._answer(("submit", msg.request_id))
            heard = self._acks.get(msg.request_id)
            if heard is not None and not heard.done():
                heard.set_result(None)
            if isinstance(msg, Queued):
                return
            fut = self._admissions.get(msg.request_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, Status | Roster):
            self._answer(("nonce", msg.nonce))
            waiting = self._pings if isinstance(msg, Status) else self._surveys
            fut = waiting.get(msg.nonce)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _answer(self, key: tuple[str, object]) -> None:
        """The router answered the message ``key`` names: it has read that far."""
        number = self._asked.get(key)
        if number is not None and number > self._answered:
            self._answered = number
