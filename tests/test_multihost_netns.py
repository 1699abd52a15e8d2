"""Multi-host, simulated for real: router + gateway, each prefill worker and the decode
worker on hosts of their own (network namespaces on one bridge, ``tests/netns.py``), the
prefill workers' links shaped to 1 and 10 Gbit/s.

One cluster for the module serves long prompts round robin, every prompt prefilled
remotely (``--disagg-mode always``), and the tests show: greedy outputs equal Hugging
Face transformers'; the KV crossed the shaped links (each prefill host's qdisc sent at
least the KV bytes its worker shipped, and the decode worker took every transfer over
tcp — hosts in different network namespaces never share memory, though /proc would let
them); every address advertised is the host's own, though the gateway and the decode
worker bind 0.0.0.0; and the router prices the 1 Gbit/s worker's link above the
10 Gbit/s one's, from the workers' own measurements — the numbers the disaggregation rule
weighs. Root only (CI is): skipped where ``ip netns`` or ``tc`` cannot be used.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import httpx
import pytest
from prometheus_client import CollectorRegistry

from common.addresses import advertise_host, local_address_toward
from common.roles import WorkerRole
from common.shared_memory import host_identity
from services import launcher
from services.router.disagg import DEFAULT_TRANSFER_S_PER_TOKEN, CostGauges, default_costs
from services.router.registry import WorkerInfo
from tests.cluster import Cluster, TokenIds, readable_prompt, wait_for
from tests.conftest import write_tiny_model
from tests.netns import NetnsUnavailable, SimulatedHosts

PROMPT_TOKENS = 768  # three chunks of --max-num-batched-tokens 256: three transfers each
KV_PER_TOKEN = 16384  # fp32: 8 layers x (K, V) x 8 heads x 32
MAX_TOKENS = 8
NUM_PROMPTS = 4  # round robin: two per prefill worker
ROUTER_PORT, GATEWAY_PORT, KV_PORT, METRICS_PORT = 7100, 8000, 7200, 9100
RATES = {"prefill-slow": "1gbit", "prefill-fast": "10gbit"}
SENT = "tandem:kv_transfer_bytes_total"
RECEIVED = "tandem:kv_transfers_received_total"
LINK = "tandem:router_link_seconds_per_token"


# ---- addresses (no namespaces needed) -------------------------------------------------

def test_a_wildcard_bind_advertises_the_address_on_the_route_to_the_router():
    assert advertise_host("0.0.0.0", None, "tcp://127.0.0.1:7100") == "127.0.0.1"
    assert advertise_host("0.0.0.0", "decode-3.tandem", "tcp://127.0.0.1:7100") == "decode-3.tandem"
    assert advertise_host("10.1.2.3", None, "tcp://10.1.2.1:7100") == "10.1.2.3"
    assert local_address_toward("ipc:///tmp/router.sock") is None


def test_a_loopback_address_advertised_to_a_remote_router_is_warned_about(caplog):
    assert advertise_host("127.0.0.1", None, "tcp://127.0.0.1:7100") == "127.0.0.1"
    assert not caplog.records
    assert advertise_host("127.0.0.1", None, "tcp://10.1.2.1:7100") == "127.0.0.1"
    assert "peers on other hosts cannot reach it" in caplog.text


def test_the_router_exports_the_costs_it_prices_each_prefill_worker_at():
    def sample(worker: str, source: str) -> float | None:
        return registry.get_sample_value(LINK, {"worker": worker, "source": source})

    registry = CollectorRegistry()
    gauges = CostGauges(registry)
    fresh, measured = (WorkerInfo(name, WorkerRole.PREFILL, None, "", 8, 16, 64, 0.0)
                       for name in ("fresh", "measured"))
    measured.transfer_s_per_token, measured.prefill_s_per_token = 2e-4, 3e-4
    gauges.update([fresh, measured])
    assert sample("fresh", "default") == DEFAULT_TRANSFER_S_PER_TOKEN == default_costs(fresh)[0]
    assert sample("measured", "measured") == 2e-4
    assert registry.get_sample_value("tandem:router_prefill_seconds_per_token",
                                     {"worker": "measured", "source": "measured"}) == 3e-4
    fresh.transfer_s_per_token = 1e-4
    gauges.update([fresh])  # "measured" is gone; "fresh" has measured its link since
    assert sample("fresh", "default") is None and sample("measured", "measured") is None
    assert sample("fresh", "measured") == 1e-4


# ---- the simulated hosts --------------------------------------------------------------

@pytest.fixture(scope="module")
def hosts():
    with contextlib.ExitStack() as made:
        try:
            net = made.enter_context(SimulatedHosts())
            hosts = {name: net.add(name, rate) for name, rate in
                     (("frontend", None), *RATES.items(), ("decode", "10gbit"))}
        except NetnsUnavailable as e:
            pytest.skip(str(e))  # after removing what was made
        yield hosts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    """More KV per token than the shared tiny model (16 KiB), still cheap to compute: a
    prompt's 12 MiB take about 100 ms at 1 Gbit/s and 10 ms at 10."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-deep"), smollm2_dir,
                            intermediate_size=128, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=8, head_dim=32, max_position_embeddings=1024)


def plan(hosts, model_dir) -> list[launcher.Child]:
    """The children, each in its host's namespace: what ``tandem up`` would run, spread out."""
    front = hosts["frontend"]
    router = f"tcp://{front.ip}:{ROUTER_PORT}"
    py = [sys.executable, "-m", "cli"]
    engine = ["--model", str(model_dir), "--max-model-len", "1024", "--threads", "1",
              "--max-num-batched-tokens", "256", "--num-kv-blocks", "192"]
    children = [launcher.Child("router", front.argv(py + [
        "router", "--host", front.ip, "--port", str(ROUTER_PORT), "--metrics-port",
        str(METRICS_PORT), "--policy", "round_robin", "--disagg-mode", "always"]),
        f"http://{front.ip}:{METRICS_PORT}/health")]
    for name in (*RATES, "decode"):
        host = hosts[name]
        bind = ["--host", "0.0.0.0", "--kv-port", str(KV_PORT)] if name == "decode" else ["--host", host.ip]
        role = "decode" if name == "decode" else "prefill"
        children.append(launcher.Child(name, host.argv(py + [
            role, "--router", router, *bind, "--metrics-port", str(METRICS_PORT),
            "--worker-id", name, *engine]), f"http://{host.ip}:{METRICS_PORT}/health"))
    children.append(launcher.Child("gateway", front.argv(py + [
        "gateway", "--router", router, "--host", "0.0.0.0", "--port", str(GATEWAY_PORT),
        "--model", str(model_dir), "--max-model-len", "1024"]),
        f"http://{front.ip}:{GATEWAY_PORT}/health"))
    return children


class SpreadCluster(Cluster):
    """``tests.cluster.Cluster``'s reading side (metrics, health, logs) over our own plan."""

    def __init__(self, children: list[launcher.Child], url: str) -> None:
        self.local, self._url, self.supervisor = launcher.LocalCluster(children), url, None

    @property
    def url(self) -> str:
        return self._url


@pytest.fixture(scope="module")
def cluster(hosts, model_dir):
    spread = SpreadCluster(plan(hosts, model_dir), f"http://{hosts['frontend'].ip}:{GATEWAY_PORT}")
    try:
        spread.local.start(timeout=240)
    except launcher.StartupError as e:
        raise RuntimeError(f"cluster did not become healthy: {e}\n{spread.logs()}") from e
    try:
        wait_for(lambda: spread.health(spread.router)["prefill_workers"] == 2, "both prefill workers")
        yield spread
    finally:
        spread.local.stop()


@pytest.fixture(scope="module")
def served(cluster, hosts, model_dir):
    """Every prompt through the gateway once: (outputs, expected, the counters around it)."""
    ids = TokenIds(model_dir)
    cases = [readable_prompt(model_dir, ids, PROMPT_TOKENS, 1000 * i, MAX_TOKENS, step=97, span=900)
             for i in range(NUM_PROMPTS)]
    before = counters(cluster, hosts)
    outputs = [ids.of(complete(cluster, prompt)) for prompt, _ in cases]
    return outputs, [expected for _, expected in cases], before, counters(cluster, hosts)


def complete(cluster: Cluster, prompt: list[int]) -> dict:
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def counters(cluster: Cluster, hosts) -> dict[str, float]:
    out = {}
    for name in RATES:
        out[f"{name} kv"] = cluster.metric(cluster.child(name), SENT, direction="sent")
        out[f"{name} link"] = hosts[name].sent_bytes()
    for via in ("tcp", "shm"):
        out[f"decode {via}"] = cluster.metric(cluster.child("decode"), RECEIVED, via=via)
    return out


# ---- the tests ------------------------------------------------------------------------

def test_greedy_across_hosts_equals_hf(served):
    outputs, expected, _, _ = served
    assert outputs == expected


def test_kv_crosses_the_shaped_links_over_tcp_never_shared_memory(served):
    _, _, before, after = served
    for name in RATES:
        shipped = after[f"{name} kv"] - before[f"{name} kv"]
        assert shipped >= 2 * PROMPT_TOKENS * KV_PER_TOKEN, name  # two prompts' KV each
        assert after[f"{name} link"] - before[f"{name} link"] >= shipped, name
    assert after["decode tcp"] - before["decode tcp"] >= NUM_PROMPTS * 3
    assert after["decode shm"] == 0


def test_every_advertised_address_is_the_hosts_own(cluster, hosts, served):
    decode, front = hosts["decode"], hosts["frontend"]
    assert cluster.health(cluster.child("decode"))["kv_address"] == f"tcp://{decode.ip}:{KV_PORT}"
    tokens_at = cluster.health(cluster.child("gateway"))["tokens_at"]
    assert tokens_at.startswith(f"tcp://{front.ip}:"), tokens_at


def test_the_router_prices_the_slow_link_above_the_fast_one(cluster, served):
    def measured(name: str) -> float:
        return cluster.metric(cluster.router, LINK, worker=name, source="measured")

    wait_for(lambda: all(measured(name) > 0 for name in RATES), "both links measured", timeout=10)
    assert measured("prefill-slow") > measured("prefill-fast")


def test_hosts_in_other_network_namespaces_have_another_identity(hosts):
    """So a decode worker never maps the segment of a prefill worker on another
    (simulated) host: the transfer goes over that host's network."""
    code = "from common.shared_memory import host_identity; print(host_identity())"
    theirs = subprocess.run(hosts["decode"].argv([sys.executable, "-c", code]),
                            capture_output=True, text=True, check=True).stdout.strip()
    ours = host_identity()
    assert theirs.split(",")[0] == ours.split(",")[0]  # one machine (boot id) ...
    assert theirs != ours  # ... yet another host
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert here.stdout.strip() == ours
