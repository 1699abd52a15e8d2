"""The block pool: sole owner of every KV-cache block's bookkeeping.

Guarantees:
- A block is either referenced (``ref_cnt > 0``) or in the free queue, never both.
- The free queue is LRU: ``allocate`` takes from its front, ``free`` appends to its back,
  so a freed block keeps its cached contents as long as possible.
- A block in the prefix-cache index holds the KV of exactly the tokens stored with it;
  ``lookup`` confirms a hit by comparing those tokens, not by trusting the hash alone.
- Taking a cached block out of the free queue to reuse it evicts it from the index.
Every change to the index is recorded as a ``KVEvent`` (drained by ``take_events``), which
is how the router learns what each worker holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.hashing import BlockHash


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is in the prefix-cache index
    token_ids: tuple[int, ...] | None = None  # the tokens whose KV a cached block holds


@dataclass(frozen=True, slots=True)
class KVEvent:
    stored: bool  # True: block_hash became available; False: it was evicted
    block_hash: BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self._events: list[KVEvent] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (front first)."""
        return list(self._free)

    def allocate(self, count: int) -> list[Block]:
        """Take ``count`` blocks from the front of the free queue, evicting cached ones."""
        if count > len(self._free):
            raise MemoryError(f"asked for {count} blocks, {len(self._free)} free")
        taken = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (a prefix-cache hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; unreferenced ones join the free queue's back,
        in the order given (pass a request's blocks tail first so its tail is evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Block | None:
        """The cached block holding exactly ``token_ids`` under ``block_hash``, if any."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache(self, block: Block, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Enter a full, computed block into the prefix-cache index.

        If another block already holds this prefix the index keeps the older one; this
        block stays private to its request and returns to the pool uncached.
        """
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._cached[block_hash] = block
        self._events.append(KVEvent(stored=True, block_hash=block_hash))

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash the prefix cache holds now (a snapshot for a router)."""
        return list(self._cached)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request references; returns how many."""
        dropped = [b for b in self._free.values() if b.block_hash is not None]
        for block in dropped:
            self._evict(block)
        return len(dropped)

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        self._events.append(KVEvent(stored=False, block_hash=block.block_hash))
        block.block_hash, block.token_ids = None, None
