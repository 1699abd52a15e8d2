"""``tandem bench router`` at a tiny scale: the real router process against the simulated
fleet and gateway processes. Asserts the outcome's shape, never its timing."""

from __future__ import annotations

import pytest

from common.hashing import hash_prefix_blocks
from common.protocol import Finished, Submit, encode
from common.roles import FinishStage, WorkerRole
from common.sampling_params import SamplingParams
from loadtest.router_bench import Result, bench, table
from loadtest.router_gateway import SubmitEncoder
from loadtest.router_sim import finished_bytes
from loadtest.router_workload import Topology, Workload, prompts

TINY = Workload(workers=4, topology=Topology.PD, blocks=2000, groups=8, prefix_blocks=8,
                replicas=2, tail_tokens=32)


@pytest.fixture(scope="module")
def result() -> Result:
    return bench(TINY, rates=[300, 600], duration=1.0, fleet=dict(prefill_ms=5, decode_ms=20))


def test_every_worker_registers_and_the_index_holds_every_snapshot(result: Result) -> None:
    assert result.registered_workers == 4
    assert result.indexed_blocks == TINY.indexed_blocks() == 2000


def test_every_placement_is_answered_and_the_counts_add_up(result: Result) -> None:
    assert len(result.phases) == 2
    for phase in result.phases:
        assert phase.sent > 0
        assert phase.acks.get("admitted", 0) == phase.sent  # each Submit placed, none refused
        assert phase.acks.get("rejected", 0) == 0
        assert phase.placed == phase.sent  # and its Task reached a simulated worker
        assert phase.p50_ms <= phase.p99_ms <= phase.max_ms
        assert phase.reregisters == 0  # no worker was declared dead on the way


def test_kv_events_reach_the_router_and_the_index_keeps_its_size(result: Result) -> None:
    for phase in result.phases:
        assert phase.kv_events_per_s > 0
        assert phase.index_blocks == TINY.indexed_blocks()  # each event stores as many as it evicts


def test_the_table_has_a_row_per_phase(result: Result) -> None:
    lines = table(result).splitlines()
    assert len(lines) == 2 + len(result.phases)
    assert all(line.startswith("| 4 | 2,000 |") for line in lines[2:])


def test_fast_encoders_write_the_same_bytes_as_the_codec() -> None:
    params = SamplingParams(max_tokens=16)
    encoder = SubmitEncoder(params, "tcp://127.0.0.1:1", block_size=2)
    tokens = [5, 70_000, 0, 31_999, 7]
    assert encoder.encode("p0-7", encoder.packed_prompt(tokens)) == encode(
        Submit.of("p0-7", tokens, params, "tcp://127.0.0.1:1", block_size=2))
    for stage in FinishStage:
        assert finished_bytes("r", "w", stage) == encode(Finished("r", "w", stage))


def test_each_prompt_shares_a_prefix_with_the_workers_that_hold_it() -> None:
    snapshots = TINY.snapshots()
    assert [TINY.role(i) for i in range(4)] == [WorkerRole.PREFILL] * 2 + [WorkerRole.DECODE] * 2
    assert all(len(chains) + len(filler) == 500 for chains, filler in snapshots)
    for prompt in prompts(TINY, 20, seed=3):
        hashes = hash_prefix_blocks(prompt, TINY.block_size)
        holders = [i for i, (chains, _) in enumerate(snapshots) if hashes[0] in chains]
        assert holders and all(TINY.role(i).can_prefill for i in holders)
        assert TINY.prefix_blocks // 2 <= _leading(hashes, set(snapshots[holders[0]][0])) <= TINY.prefix_blocks


def _leading(hashes: list[bytes], held: set[bytes]) -> int:
    count = 0
    while count < len(hashes) and hashes[count] in held:
        count += 1
    return count
