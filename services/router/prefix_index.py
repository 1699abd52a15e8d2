"""Which prefix blocks each worker holds, exactly as its KV events say.

Workers publish a ``KVEvents`` message whenever blocks enter or leave their prefix
cache. Because router and workers hash blocks with the same function
(``common.hashing``), a request's block hashes can be looked up directly: no guessing
from text, and an evicted prefix stops attracting requests as soon as it is gone.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.hashing import BlockHash
from common.protocol import KVEvents


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, set[BlockHash]] = {}

    def apply(self, events: KVEvents) -> None:
        held = self._blocks.setdefault(events.worker_id, set())
        if events.cleared:
            held.clear()
        held.difference_update(events.evicted)
        held.update(events.stored)

    def drop_worker(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def total_blocks(self) -> int:
        """Block hashes held, summed over workers (a block two workers hold counts twice)."""
        return sum(len(held) for held in self._blocks.values())

    def matched_blocks(self, worker_id: str, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a prompt the worker has cached."""
        held = self._blocks.get(worker_id)
        if not held:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in held:
                break
            count += 1
        return count
