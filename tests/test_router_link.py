"""The gateway's link to the router, in process, over real ZeroMQ sockets: how long a new
request waits for a router that is out of reach (``REACH_S`` at most, and one try once the
outage is older than that), and that a router back on its address is used at once."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq
import zmq.asyncio

from common.addresses import free_port
from common.hashing import hash_prefix_blocks
from common.protocol import Admitted, Ping, Queued, Status, Submit, decode, encode
from common.sampling_params import SamplingParams
from services.gateway.router_link import ACK_S, REACH_S, RouterLink, RouterUnavailable
from tests.conftest import ManualClock


@pytest.mark.parametrize("reach_s", [None, 3.0])  # the default, and --router-reach-timeout 3
def test_a_long_outage_refuses_a_new_request_after_one_try_and_a_returning_router_is_used(reach_s):
    address = f"tcp://127.0.0.1:{free_port()}"

    async def main():
        clock = ManualClock()  # frozen unless moved: a request that waited for it would never end
        link = (RouterLink(address, "tcp://127.0.0.1:0", clock=clock) if reach_s is None else
                RouterLink(address, "tcp://127.0.0.1:0", clock=clock, reach_s=reach_s))
        link.start()
        try:
            assert link.unreachable_for() is None
            assert await link.status(timeout=0.1) is None  # nobody listens: the send fails
            assert link.unreachable_for() == 0.0
            clock.now += reach_s or REACH_S  # the router has been away for the whole window
            with pytest.raises(RouterUnavailable):  # a hang would be wait_for's TimeoutError
                await asyncio.wait_for(link.submit("r1", [1, 2, 3], SamplingParams(max_tokens=2),
                                                   timeout=5.0), 30)
            # The router comes back on its address: the next request reaches it and the
            # outage is over.
            ctx = zmq.asyncio.Context()
            router = ctx.socket(zmq.ROUTER)
            router.bind(address)
            try:
                pending = asyncio.create_task(link.submit(
                    "r2", [1, 2, 3], SamplingParams(max_tokens=2), timeout=5.0))
                gateway, submit = await _next_submit(router)
                assert submit.request_id == "r2"
                assert link.unreachable_for() is None
                await router.send_multipart([gateway, encode(Queued("r2"))])
                await router.send_multipart([gateway, encode(Admitted("r2"))])
                admission = await asyncio.wait_for(pending, 30)
                assert isinstance(admission.verdict, Admitted) and admission.channel is not None
            finally:
                router.close(linger=0)
                ctx.term()
        finally:
            await link.close()

    asyncio.run(main())



@contextlib.asynccontextmanager
async def link_and_router(address: str):
    """A started RouterLink and a bare ROUTER socket on ``address`` playing the router."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    link = RouterLink(address, "tcp://127.0.0.1:0")
    link.start()
    try:
        yield link, router
    finally:
        await link.close()
        router.close(linger=0)
        ctx.term()


async def _next_submit(router: zmq.asyncio.Socket) -> tuple[bytes, Submit]:
    """The next Submit the router socket reads, past any Ping (the link asking for the
    block size: left unanswered)."""
    while True:
        gateway, data = await asyncio.wait_for(router.recv_multipart(), 30)
        msg = decode(data)
        if isinstance(msg, Submit):
            return gateway, msg
        assert isinstance(msg, Ping)


def test_the_link_learns_the_block_size_and_hashes_the_prompt_in_it():
    address = f"tcp://127.0.0.1:{free_port()}"
    prompt = list(range(10, 30))  # 20 tokens: 2 full blocks of 8
    params = SamplingParams(max_tokens=2)

    async def main():
        async with link_and_router(address) as (link, router):
            # Block size unknown: the Submit goes unhashed (the router hashes it) and sets
            # off a Ping; the two may arrive in either order.
            pending = asyncio.create_task(link.submit("r1", prompt, params, timeout=5.0))
            frames = [await asyncio.wait_for(router.recv_multipart(), 30) for _ in range(2)]
            gateway = frames[0][0]
            got = [decode(data) for _, data in frames]
            submit = next(m for m in got if isinstance(m, Submit))
            ping = next(m for m in got if isinstance(m, Ping))
            assert (submit.block_size, submit.block_hashes, submit.num_prompt_tokens) == (None, [], 20)
            assert submit.open().prompt_token_ids == prompt
            await router.send_multipart([gateway, encode(Status(ping.nonce, 1, 1, 0, 4096, 60.0, 8))])
            await router.send_multipart([gateway, encode(Admitted("r1"))])
            await asyncio.wait_for(pending, 30)
            deadline = asyncio.get_running_loop().time() + 30
            while link.last_status is None:  # the Status is read by the link's own task
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            pending = asyncio.create_task(link.submit("r2", prompt, params, timeout=5.0))
            _, submit = await _next_submit(router)
            assert (submit.block_size, submit.block_hashes) == (8, hash_prefix_blocks(prompt, 8))
            await router.send_multipart([gateway, encode(Admitted("r2"))])
            await asyncio.wait_for(pending, 30)

    asyncio.run(main())


def test_a_router_behind_on_its_socket_gets_no_resends_and_a_lost_submit_is_sent_again():
    """Unacknowledged for ACK_S, a Submit used to be sent again every second, even to a
    router that was only behind (overloaded) and still answering what came before it: a
    retry storm. Now it waits while the router answers earlier messages, and is sent again
    when the router answers a later one (so it was lost: the connection keeps order)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    params = SamplingParams(max_tokens=2)
    gap = ACK_S * 0.4  # between two acks: each well within ACK_S, all five past it

    async def main():
        async with link_and_router(address) as (link, router):
            ids = [f"r{i}" for i in range(5)]
            pending = []
            for request_id in ids:  # one at a time, so they go out in this order
                pending.append(asyncio.create_task(link.submit(request_id, [1, 2, 3], params, timeout=30.0)))
                gateway, submit = await _next_submit(router)
                assert submit.request_id == request_id
            for request_id in ids:  # a slow router: it answers them in order, one per gap
                await asyncio.sleep(gap)
                await router.send_multipart([gateway, encode(Admitted(request_id))])
            await asyncio.wait_for(asyncio.gather(*pending), 30)
            while await router.poll(0):  # nothing was sent again (Pings asking the block size aside)
                assert isinstance(decode((await router.recv_multipart())[1]), Ping)
            # Lost: the router answers a later Submit (r6) first; r5 is sent again.
            lost = asyncio.create_task(link.submit("r5", [1, 2, 3], params, timeout=30.0))
            assert (await _next_submit(router))[1].request_id == "r5"
            later = asyncio.create_task(link.submit("r6", [1, 2, 3], params, timeout=30.0))
            assert (await _next_submit(router))[1].request_id == "r6"
            await router.send_multipart([gateway, encode(Admitted("r6"))])
            await asyncio.wait_for(later, 30)
            assert (await _next_submit(router))[1].request_id == "r5"  # the resend
            await router.send_multipart([gateway, encode(Admitted("r5"))])
            await asyncio.wait_for(lost, 30)

    asyncio.run(main())
