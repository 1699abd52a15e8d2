"""The metric families themselves, in process: every request and engine metric carries
``model_name`` (vLLM's label), under vLLM's names, and the totals a heartbeat reports are
read back from the counters."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from common.metrics import EngineMetrics, GatewayMetrics, RequestPhases

VLLM_NAMES = {  # vLLM's names (vllm: → tandem:) that a Tandem cluster exports
    "gateway": {"tandem:time_to_first_token_seconds", "tandem:time_per_output_token_seconds",
                "tandem:e2e_request_latency_seconds", "tandem:request_prefill_time_seconds",
                "tandem:request_decode_time_seconds", "tandem:request_prompt_tokens",
                "tandem:request_generation_tokens", "tandem:request_success",
                "tandem:prompt_tokens", "tandem:generation_tokens",
                "tandem:inter_token_latency_seconds"},
    "worker": {"tandem:num_requests_running", "tandem:num_requests_waiting",
               "tandem:kv_cache_usage_perc", "tandem:iteration_tokens_total",
               "tandem:prefix_cache_queries", "tandem:prefix_cache_hits",
               "tandem:num_preemptions"},
}


def families(kind) -> tuple[CollectorRegistry, object]:
    registry = CollectorRegistry()
    return registry, kind(registry, "tiny")


@pytest.mark.parametrize("kind,names", [(GatewayMetrics, VLLM_NAMES["gateway"]),
                                        (EngineMetrics, VLLM_NAMES["worker"])])
def test_every_family_has_vllm_names_and_the_model_name_label(kind, names):
    registry, m = families(kind)
    m.success.labels("length").inc()  # a labelled family shows its children once used
    if isinstance(m, EngineMetrics):
        for family in (m.kv_bytes, m.kv_received, m.kv_pieces, m.kv_failures, m.handler_errors):
            family.labels("x").inc()
    collected = list(registry.collect())
    assert names <= {f.name for f in collected}
    for family in collected:
        assert family.samples, family.name
        for sample in family.samples:
            assert sample.labels.get("model_name") == "tiny", (family.name, sample)


def test_request_phases_feed_the_gateways_histograms():
    registry, m = families(GatewayMetrics)
    m.observe_request(RequestPhases(admitted=10.0, first_token=10.5, finished=12.5,
                                    prompt_tokens=7, generation_tokens=5))
    m.observe_request(RequestPhases(10.0, None, 11.0, 3, 0))  # ended before any token

    def get(name: str) -> float:
        return registry.get_sample_value(name, {"model_name": "tiny"})

    assert get("tandem:request_prefill_time_seconds_sum") == 0.5
    assert get("tandem:request_decode_time_seconds_sum") == 2.0
    assert get("tandem:time_per_output_token_seconds_sum") == 0.5  # 2 s over 4 tokens
    assert get("tandem:request_prefill_time_seconds_count") == 1
    assert (get("tandem:request_prompt_tokens_count"), get("tandem:request_prompt_tokens_sum")) == (2, 10)
    assert get("tandem:request_generation_tokens_sum") == 5


def test_kv_byte_totals_read_back_from_the_counters():
    _, m = families(EngineMetrics)
    assert m.kv_bytes_total("sent") == 0
    m.kv_bytes.labels("sent").inc(4096)
    m.kv_bytes.labels("sent").inc(1024)
    m.kv_bytes.labels("received").inc(7)
    assert (m.kv_bytes_total("sent"), m.kv_bytes_total("received")) == (5120, 7)
