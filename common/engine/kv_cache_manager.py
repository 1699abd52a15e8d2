"""Block tables: which blocks hold which sequence's KV.

The manager is the only caller of ``BlockPool``. It turns scheduler decisions ("give this
sequence room for k more tokens") into block allocations, finds cached prefixes, shares
blocks between forked sequences, and copies a shared partial block before a sequence
writes into it (copy-on-write). The runner performs the copies it reports.

Two holds that are not a running sequence's: a *reservation* (blocks for KV arriving from
another worker, held under a key until a sequence adopts them or they are released) and a
*lend* (an extra reference on blocks a transfer is reading, so neither a preemption nor an
abort can hand them to someone else before the transfer ends).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.block_pool import Block, BlockPool
from common.engine.request import Sequence
from common.hashing import BlockHash, hash_prefix_blocks


@dataclass(slots=True)
class _Table:
    blocks: list[Block] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    blocks: list[Block]
    num_tokens: int


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[str, _Table] = {}
        self._reserved: dict[str, _Table] = {}  # by request id: KV still arriving
        self._copies: list[tuple[int, int]] = []  # (src, dst) block ids, for the runner

    def block_ids(self, seq: Sequence) -> list[int]:
        return [b.block_id for b in self._tables[seq.seq_id].blocks]

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest run of leading full blocks already in the prefix cache.

        At least one token is left uncomputed: its logits are what the step samples from.
        """
        if not self.pool.enable_caching:
            return CachedPrefix([], 0)
        hashes = self._hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        found: list[Block] = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            block = self.pool.lookup(block_hash, tokens)
            if block is None:
                break
            found.append(block)
        return CachedPrefix(found, len(found) * self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: CachedPrefix | None = None) -> int:
        """Free-queue blocks that ``allocate`` would consume."""
        table = self._tables.get(seq.seq_id)
        have = (len(table.blocks) if table else 0) + (len(prefix.blocks) if prefix else 0)
        computed = seq.num_computed_tokens + (prefix.num_tokens if prefix else 0)
        need = max(0, -(-(computed + num_new_tokens) // self.block_size) - have)
        if prefix:  # hits sitting in the free queue leave it when referenced
            need += sum(1 for b in prefix.blocks if b.ref_cnt == 0)
        if table and self._needs_copy(table, seq):
            need += 1
        return need

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        return self.blocks_needed(seq, num_new_tokens, prefix) <= self.pool.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: CachedPrefix | None = None) -> None:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` (check ``can_allocate`` first).

        With ``prefix`` (admission only), the sequence first takes the cached blocks and
        its computed-token count advances past them.
        """
        if not self.can_allocate(seq, num_new_tokens, prefix):
            raise MemoryError(f"no room for {num_new_tokens} tokens of {seq.seq_id}")
        table = self._tables.setdefault(seq.seq_id, _Table())
        if prefix and prefix.blocks:
            self.pool.touch(prefix.blocks)
            table.blocks.extend(prefix.blocks)
            table.num_cached_blocks = len(table.blocks)
            seq.num_computed_tokens += prefix.num_tokens
        if self._needs_copy(table, seq):
            self._copy_on_write(table, seq.num_computed_tokens // self.block_size)
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        if total > len(table.blocks):
            table.blocks.extend(self.pool.allocate(total - len(table.blocks)))

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer every block that is now full of computed tokens to the prefix cache."""
        table = self._tables[seq.seq_id]
        full = min(seq.num_computed_tokens // self.block_size, len(table.blocks))
        if full <= table.num_cached_blocks:
            return
        hashes = self._hashes(seq)
        for i in range(table.num_cached_blocks, full):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            self.pool.cache(table.blocks[i], hashes[i], tokens)
        table.num_cached_blocks = full

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's computed tokens (they held only rejected
        draft tokens: private, never cached), tail first."""
        table = self._tables[seq.seq_id]
        keep = -(-seq.num_computed_tokens // self.block_size)
        if len(table.blocks) > keep:
            self.pool.free(reversed(table.blocks[keep:]))
            del table.blocks[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent``; writes into a shared block copy it first."""
        src = self._tables[parent.seq_id]
        self.pool.touch(src.blocks)
        self._tables[child.seq_id] = _Table(list(src.blocks), src.num_cached_blocks)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first so the tail is evicted first."""
        table = self._tables.pop(seq.seq_id, None)
        if table is not None:
            self.pool.free(reversed(table.blocks))

    def reserve(self, request_id: str, num_blocks: int) -> list[int] | None:
        """Hold ``num_blocks`` fresh blocks for a request whose KV is arriving; their ids,
        or None when too few are free."""
        if request_id in self._reserved:
            raise ValueError(f"{request_id!r} already holds a reservation")
        if num_blocks > self.pool.num_free_blocks:
            return None
        table = self._reserved[request_id] = _Table(self.pool.allocate(num_blocks))
        return [b.block_id for b in table.blocks]

    def adopt(self, request_id: str, seq: Sequence) -> None:
        """The request's reserved blocks become ``seq``'s (which holds none yet)."""
        if seq.seq_id in self._tables:
            raise ValueError(f"{seq.seq_id!r} already holds blocks")
        self._tables[seq.seq_id] = self._reserved.pop(request_id)

    def release(self, request_id: str) -> bool:
        """Give back the request's reserved blocks; False when it holds none."""
        table = self._reserved.pop(request_id, None)
        if table is not None:
            self.pool.free(reversed(table.blocks))
        return table is not None

    def lend(self, block_ids: list[int]) -> None:
        """One more reference on each block, until ``give_back``: a transfer reads them."""
        self.pool.touch(self.pool.blocks[i] for i in block_ids)

    def give_back(self, block_ids: list[int]) -> None:
        self.pool.free(reversed([self.pool.blocks[i] for i in block_ids]))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def _needs_copy(self, table: _Table, seq: Sequence) -> bool:
        """The next token lands in a partial block that another sequence also references."""
        if not table.blocks or seq.num_computed_tokens % self.block_size == 0:
            return False
        index = seq.num_computed_tokens // self.block_size
        return index < len(table.blocks) and table.blocks[index].ref_cnt > 1

    def _copy_on_write(self, table: _Table, index: int) -> None:
        shared = table.blocks[index]
        (private,) = self.pool.allocate(1)
        self._copies.append((shared.block_id, private.block_id))
        self.pool.free([shared])
        table.blocks[index] = private

    def _hashes(self, seq: Sequence) -> list[BlockHash]:
        """Hashes of the sequence's full blocks, each computed once, when its block fills."""
        hashes = seq.block_hashes
        done = len(hashes) * self.block_size
        if seq.num_tokens - done >= self.block_size:
            hashes.extend(hash_prefix_blocks(seq.token_ids[done:], self.block_size,
                                             parent=hashes[-1] if hashes else None))
        return hashes
