"""The prefix index's two views agree: ``matches`` (every worker at once, through the
per-block holder masks) equals ``matched_blocks`` (one worker, through its own blocks) after
any sequence of stores, evictions, clears and dropped workers, slot reuse included; and
the garbage collector never walks the blocks."""

from __future__ import annotations

import gc
import random

import pytest

from common.protocol import KVEvents
from services.router.prefix_index import PrefixIndex

BLOCKS = [bytes([i]) * 16 for i in range(12)]


def _expected(index: PrefixIndex, workers: list[str], hashes: list[bytes]) -> dict[str, int]:
    counts = {w: index.matched_blocks(w, hashes) for w in workers}
    return {w: n for w, n in counts.items() if n}


@pytest.mark.parametrize("seed", range(20))
def test_matches_agrees_with_matched_blocks_for_every_worker(seed: int) -> None:
    rng = random.Random(seed)
    index = PrefixIndex()
    workers = [f"w{i}" for i in range(6)]
    for _ in range(200):
        worker = rng.choice(workers)
        if rng.random() < 0.05:
            index.drop_worker(worker)
        else:
            index.apply(KVEvents(worker, rng.sample(BLOCKS, rng.randint(0, 6)),
                                 rng.sample(BLOCKS, rng.randint(0, 4)), cleared=rng.random() < 0.05))
        prompt = BLOCKS[: rng.randint(0, len(BLOCKS))]
        assert index.matches(prompt) == _expected(index, workers, prompt)
    assert index.total_blocks() == sum(index.num_blocks(w) for w in workers)


def test_a_dropped_workers_slot_is_reused_without_inheriting_its_blocks() -> None:
    index = PrefixIndex()
    index.apply(KVEvents("a", BLOCKS[:3]))
    index.apply(KVEvents("b", BLOCKS[:1]))
    index.drop_worker("a")
    index.apply(KVEvents("c", BLOCKS[:2]))  # takes a's slot
    assert index.matches(BLOCKS[:3]) == {"b": 1, "c": 2}
    assert index.num_blocks("a") == 0


def test_a_block_stored_or_evicted_twice_in_one_event_counts_once() -> None:
    index = PrefixIndex()
    index.apply(KVEvents("a", BLOCKS[:3] + BLOCKS[:1]))
    index.apply(KVEvents("b", BLOCKS[:1]))
    index.apply(KVEvents("a", [], [BLOCKS[2], BLOCKS[2]]))
    assert (index.num_blocks("a"), index.matches(BLOCKS[:3])) == (2, {"a": 2, "b": 1})


def test_the_collector_does_not_track_the_index():
    """A full collection walks every container it tracks: sets of a million block hashes
    paused the router ~85 ms each time. Dicts of atomic values are not tracked."""
    index = PrefixIndex()
    index.apply(KVEvents("a", BLOCKS[:6]))
    index.apply(KVEvents("b", BLOCKS[:3]))
    index.apply(KVEvents("a", BLOCKS[8:], BLOCKS[:2]))
    index.apply(KVEvents("b", BLOCKS[4:6], cleared=True))
    index.drop_worker("b")
    index.apply(KVEvents("c", BLOCKS[:1]))
    containers = [index._holders, *index._blocks.values()]  # what grows with the blocks
    assert len(containers) == 3 and not any(gc.is_tracked(c) for c in containers)
