"""Which prefix blocks each worker holds, exactly as its KV events say.

Workers publish a ``KVEvents`` message whenever blocks enter or leave their prefix
cache. Because router and workers hash blocks with the same function
(``common.hashing``), a request's block hashes can be looked up directly: no guessing
from text, and an evicted prefix stops attracting requests as soon as it is gone.

Two views of the same facts, kept in step by every change: each worker's blocks, and
each block's holders as a bit mask over worker slots. The second lets ``matches`` find
every worker's cached prefix of a prompt in one walk down the prompt's blocks, touching
only the workers that hold its first block, however many workers there are.

Both are dicts of bytes to ``None`` or to an int, never sets: CPython's garbage collector
does not track a dict that holds only such atomic values, but it walks every set on each
full collection, which with a million indexed blocks paused the router ~85 ms at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from common.hashing import BlockHash
from common.protocol import KVEvents


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, dict[BlockHash, None]] = {}  # worker -> its blocks (a set)
        self._holders: dict[BlockHash, int] = {}  # block -> bit mask of the slots holding it
        self._slots: dict[str, int] = {}  # worker -> its slot, while it is indexed
        self._workers: dict[int, str] = {}  # slot -> worker
        self._free: list[int] = []  # slots of dropped workers, for reuse
        # The last ``matches`` answer, for the same list of hashes while nothing changed:
        # one placement asks twice (the shortlist, then the step that scores the prefix).
        self._version = 0
        self._memo: tuple[Sequence[BlockHash], int, dict[str, int]] | None = None

    def apply(self, events: KVEvents) -> None:
        self._version += 1
        held = self._blocks.setdefault(events.worker_id, {})
        bit = 1 << self._slot(events.worker_id)
        if events.cleared:
            self._unset(held, bit)
            held.clear()
        gone = [block_hash for block_hash in dict.fromkeys(events.evicted) if block_hash in held]
        self._unset(gone, bit)
        for block_hash in gone:
            del held[block_hash]
        holders = self._holders
        for block_hash in events.stored:
            if block_hash not in held:
                held[block_hash] = None
                holders[block_hash] = holders.get(block_hash, 0) | bit

    def drop_worker(self, worker_id: str) -> None:
        self._version += 1
        held = self._blocks.pop(worker_id, None)
        slot = self._slots.pop(worker_id, None)
        if slot is None:
            return
        self._unset(held or (), 1 << slot)
        del self._workers[slot]
        self._free.append(slot)

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

    def matches(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """``matched_blocks`` of every worker at once, for those with at least one block
        (the caller must not change the dict: the same one answers a repeated question)."""
        memo = self._memo
        if memo is not None and memo[0] is hashes and memo[1] == self._version:
            return memo[2]
        found = self._matches(hashes)
        self._memo = (hashes, self._version, found)
        return found

    def _matches(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        found: dict[str, int] = {}
        if not hashes:
            return found
        holders = self._holders
        live = holders.get(hashes[0], 0)  # the workers still matching, as a mask
        depth = 1
        for block_hash in itertools.islice(hashes, 1, None):
            if not live:
                break
            still = live & holders.get(block_hash, 0)
            if still != live:
                self._name(live & ~still, depth, found)
            live, depth = still, depth + 1
        self._name(live, depth, found)
        return found

    def _name(self, mask: int, depth: int, found: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            found[self._workers[low.bit_length() - 1]] = depth
            mask ^= low

    def _slot(self, worker_id: str) -> int:
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slots)
            self._slots[worker_id] = slot
            self._workers[slot] = worker_id
        return slot

    def _unset(self, blocks: Iterable[BlockHash], bit: int) -> None:
        holders = self._holders
        for block_hash in blocks:
            left = holders[block_hash] & ~bit
            if left:
                holders[block_hash] = left
            else:
                del holders[block_hash]
