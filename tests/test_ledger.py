"""The router's load ledger, in process: exact totals after every charge and release."""

from __future__ import annotations

import pytest

from common.roles import WorkerRole
from services.router.ledger import LoadLedger
from services.router.registry import WorkerInfo


def worker(worker_id: str, role: WorkerRole) -> WorkerInfo:
    return WorkerInfo(worker_id, role, None, "", 100, 16, 1024, 0.0, free_blocks=100)


@pytest.fixture
def cluster() -> tuple[dict[str, WorkerInfo], LoadLedger]:
    workers = {w.worker_id: w for w in (worker("p", WorkerRole.PREFILL),
                                        worker("d", WorkerRole.DECODE),
                                        worker("c", WorkerRole.COLOCATED))}
    return workers, LoadLedger(workers)


def totals(workers: dict[str, WorkerInfo]) -> dict[str, tuple[int, int]]:
    return {w.worker_id: (w.outstanding_tokens, w.reserved_blocks) for w in workers.values()}


def test_disaggregated_request_is_charged_on_both_sides_until_prefill_is_done(cluster):
    workers, ledger = cluster
    ledger.charge("r1", workers["p"], 40, workers["d"], 4)
    ledger.charge("r2", workers["p"], 10, workers["d"], 2)
    assert totals(workers) == {"p": (50, 0), "d": (0, 6), "c": (0, 0)}
    assert ledger.requests_on("p") == ["r1", "r2"] and ledger.requests_on("d") == ["r1", "r2"]
    ledger.prefill_done("r1")
    ledger.prefill_done("r1")  # a repeated report takes nothing back twice
    assert totals(workers) == {"p": (10, 0), "d": (0, 2), "c": (0, 0)}
    assert ledger.requests_on("p") == ["r2"] and ledger.requests_on("d") == ["r1", "r2"]


def test_release_returns_the_holders_and_takes_back_only_what_is_left(cluster):
    workers, ledger = cluster
    ledger.charge("r1", workers["p"], 40, workers["d"], 4)
    ledger.charge("r2", workers["p"], 8, workers["d"], 2)
    ledger.prefill_done("r2")
    assert ledger.release("r1") == {"p", "d"}  # mid-prefill: both hold it
    assert ledger.release("r2") == {"d"}  # decoding: only the decode worker
    assert ledger.release("r2") == set()  # once
    assert totals(workers) == {"p": (0, 0), "d": (0, 0), "c": (0, 0)}
    assert "r1" not in ledger and ledger.requests_on("d") == []


def test_colocated_request_reserves_no_decode_blocks(cluster):
    workers, ledger = cluster
    ledger.charge("r", workers["c"], 30, None, 5)
    assert totals(workers)["c"] == (30, 0)
    assert ledger.requests_on("c") == ["r"]
    ledger.prefill_done("r")
    assert ledger.requests_on("c") == ["r"]  # still decoding there
    assert ledger.release("r") == {"c"} and totals(workers)["c"] == (0, 0)


def test_a_dead_worker_is_simply_absent(cluster):
    workers, ledger = cluster
    ledger.charge("r", workers["p"], 40, workers["d"], 4)
    del workers["p"]  # the registry dropped it
    assert ledger.release("r") == {"p", "d"}
    assert totals(workers) == {"d": (0, 0), "c": (0, 0)}


def test_a_request_is_charged_once(cluster):
    workers, ledger = cluster
    ledger.charge("r", workers["c"], 1)
    with pytest.raises(ValueError, match="charged already"):
        ledger.charge("r", workers["c"], 1)
    assert totals(workers)["c"] == (1, 0)
