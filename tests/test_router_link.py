"""The gateway's link to the router, in process, over real ZeroMQ sockets: how long a new
request waits for a router that is out of reach (``REACH_S`` at most, and one try once the
outage is older than that), and that a router back on its address is used at once."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from common.addresses import free_port
from common.protocol import Admitted, Queued, Submit, decode, encode
from common.sampling_params import SamplingParams
from services.gateway.router_link import REACH_S, RouterLink, RouterUnavailable
from tests.conftest import ManualClock


def test_a_long_outage_refuses_a_new_request_after_one_try_and_a_returning_router_is_used():
    address = f"tcp://127.0.0.1:{free_port()}"

    async def main():
        clock = ManualClock()  # frozen unless moved: a request that waited for it would never end
        link = RouterLink(address, "tcp://127.0.0.1:0", clock=clock)
        link.start()
        try:
            assert link.unreachable_for() is None
            assert await link.status(timeout=0.1) is None  # nobody listens: the send fails
            assert link.unreachable_for() == 0.0
            clock.now += REACH_S  # the router has been away for the whole reach window
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
                gateway, data = await asyncio.wait_for(router.recv_multipart(), 30)
                submit = decode(data)
                assert isinstance(submit, Submit) and submit.request_id == "r2"
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
