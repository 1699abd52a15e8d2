"""The router killed and restarted under load, over real processes.

While it is gone, new requests get 503 with Retry-After at once (never a 500, never a
hang) and a stream already running goes on to its end: tokens flow from the workers to
the gateway without the router. The restarted router learns every worker again, and
with them their caches, so a prompt cached before the restart is placed on its cache.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.cluster import Cluster, wait_for
from tests.conftest import write_tiny_model

PREFIX = list(range(2000, 2256))  # 16 full blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-restart"), smollm2_dir,
                            max_position_embeddings=2048)


def complete(cluster: Cluster, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def hits(cluster: Cluster) -> dict[str, float]:
    return {w.name: cluster.metric(w, "tandem:prefix_cache_hits_total")
            for w in cluster.workers("prefill")}


def router_up(cluster: Cluster) -> bool:
    try:
        return (cluster.metric(cluster.router, "tandem:router_workers", role="prefill") == 2
                and cluster.metric(cluster.router, "tandem:router_workers", role="decode") == 1)
    except OSError:
        return False


def test_a_router_restart_loses_no_stream_and_no_cache(model_dir):
    # The request sent while the router is gone waits out the reach window for its 503.
    with Cluster(str(model_dir), prefill=2, decode=1,
                 extra=("--num-kv-blocks", "512", "--router-reach-timeout", "3")) as cluster:
        assert complete(cluster, PREFIX + [1, 2]).status_code == 200  # warms one worker
        [warm] = [name for name, n in hits(cluster).items() if n == 0 and
                  cluster.metric(cluster.child(name), "tandem:prefix_cache_queries_total") > 0]
        before = hits(cluster)

        events: list[str] = []
        streaming = threading.Event()

        def long_stream() -> None:
            with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=120, json={
                    "prompt": list(range(600, 640)), "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        streaming.set()

        reader = threading.Thread(target=long_stream)
        reader.start()
        assert streaming.wait(60)
        cluster.router.proc.send_signal(signal.SIGKILL)
        cluster.router.proc.wait(10)

        refused = complete(cluster, [5, 6, 7])  # the router is gone
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "service_unavailable_error"

        assert cluster.local.respawn(cluster.router)
        wait_for(lambda: router_up(cluster), "the new router to learn every worker")
        reader.join(120)
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        tokens = sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1])
        assert tokens > 0

        assert complete(cluster, PREFIX + [3, 4]).status_code == 200
        after = hits(cluster)
        assert after[warm] - before[warm] == len(PREFIX)  # placed on the cache it had before
        assert sum(after.values()) - sum(before.values()) == len(PREFIX)



def unread_bytes(port: int) -> int:
    """Bytes waiting in the receive queues of the sockets listening-side on ``port``
    (``/proc/net/tcp``: local address, then ``tx_queue:rx_queue`` in hex)."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port:
            total += int(fields[4].split(":")[1], 16)
    return total


def test_a_request_the_dying_router_never_read_is_sent_again(model_dir):
    """A Submit in the socket of a router that dies before reading it is lost with it.
    Unacknowledged, the gateway sends it again, and the restarted router serves it. The
    router is frozen (SIGSTOP) so the Submit is certainly there unread when it is killed;
    the admission timeout is far beyond the client's, so a lost request would show as a
    client timeout."""
    extra = ("--num-kv-blocks", "512", "--admission-timeout", "900", "--queue-timeout", "800")
    with Cluster(str(model_dir), prefill=1, decode=1, extra=extra, supervise=True) as cluster:
        assert complete(cluster, [1, 2, 3]).status_code == 200
        router = cluster.router
        port = int(router.argv[router.argv.index("--port") + 1])
        router.proc.send_signal(signal.SIGSTOP)
        answer: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: answer.append(complete(cluster, [7, 8, 9])))
        sender.start()
        wait_for(lambda: unread_bytes(port) > 0, "the Submit to reach the frozen router's socket")
        router.proc.send_signal(signal.SIGKILL)
        sender.join(120)
        assert answer and answer[0].status_code == 200, answer and answer[0].text
        assert answer[0].json()["usage"]["completion_tokens"] == 4


def test_a_request_queued_at_a_router_that_dies_is_served_by_the_next(model_dir):
    """A request the router has queued (acknowledged ``Queued``: no decode worker to take
    it) lives only in that router's memory. The gateway sends a queued request's Submit
    again every few seconds, so when the router is killed the restarted one takes it as
    new and serves it once a decode worker is back. The decode worker is frozen (SIGSTOP)
    to keep the request queued; the admission timeout is far beyond the client's, so a
    lost request would show as a client timeout."""
    extra = ("--num-kv-blocks", "512", "--admission-timeout", "900", "--queue-timeout", "800")
    with Cluster(str(model_dir), prefill=1, decode=1, extra=extra, supervise=True) as cluster:
        assert complete(cluster, [1, 2, 3]).status_code == 200
        router, [decode] = cluster.router, cluster.workers("decode")
        decode.proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: cluster.metric(router, "tandem:router_workers", role="decode") == 0,
                     "the router to drop the frozen decode worker")
            answer: list[httpx.Response] = []
            sender = threading.Thread(target=lambda: answer.append(complete(cluster, [7, 8, 9])))
            sender.start()
            wait_for(lambda: cluster.metric(router, "tandem:router_queue_length") == 1,
                     "the request to wait in the router's queue")
            router.proc.send_signal(signal.SIGKILL)
        finally:
            decode.proc.send_signal(signal.SIGCONT)
        sender.join(120)
        assert answer and answer[0].status_code == 200, answer and answer[0].text
        assert answer[0].json()["usage"]["completion_tokens"] == 4
