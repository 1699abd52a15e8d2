"""Block pool and KV-cache manager: exact block ids, eviction order, refcounts, no leaks."""

from __future__ import annotations

import pytest

from common.engine.block_pool import BlockPool
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.request import Request
from common.hashing import hash_block, hash_prefix_blocks
from common.sampling_params import SamplingParams

BS = 4


def seq_of(tokens: list[int], request_id: str = "r", n: int = 1):
    return Request(request_id, tokens, SamplingParams(n=n), max_tokens=16).seqs[0]


def manager(num_blocks: int = 8, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, caching), BS)


def test_allocate_takes_blocks_in_order_and_free_returns_them_tail_first():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert [x.block_id for x in a] == [0, 1]
    assert [x.block_id for x in b] == [2, 3, 4]
    assert pool.num_free_blocks == 1
    pool.free(reversed(b))
    assert pool.free_block_ids() == [5, 4, 3, 2]
    pool.free(reversed(a))
    assert pool.free_block_ids() == [5, 4, 3, 2, 1, 0]
    assert all(x.ref_cnt == 0 for x in pool.blocks)


def test_over_free_and_over_allocate_are_errors():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError):
        pool.free([block])
    with pytest.raises(MemoryError):
        pool.allocate(3)


def test_hash_chain_is_stable_and_depends_on_parent():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert h1 == hash_block(None, [1, 2, 3, 4])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_prefix_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], BS) == [h1, hash_block(h1, [5, 6, 7, 8])]
    # Literal digests pin the encoding: router and workers on any machine, and any later
    # version of this code, must agree (changing it invalidates every index).
    assert h1.hex() == "49d21b926d235be14cd959fe2ade0dc2"
    assert hash_block(h1, [5, 6, 7, 8]).hex() == "1fdc61476e6ec4978cf10a8c5936aa48"


def test_sequence_allocation_and_cache_hit_shares_blocks():
    kv = manager()
    a = seq_of(list(range(10)), "a")  # 2 full blocks + 2 tokens
    kv.allocate(a, 10)
    assert kv.block_ids(a) == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)
    b = seq_of(list(range(8)) + [99, 98, 97], "b")
    prefix = kv.find_cached_prefix(b)
    assert [x.block_id for x in prefix.blocks] == [0, 1] and prefix.num_tokens == 8
    kv.allocate(b, 3, prefix)
    assert kv.block_ids(b) == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 8


def test_hit_is_confirmed_by_tokens_not_hash_alone():
    kv = manager()
    a = seq_of([1, 2, 3, 4, 5], "a")
    kv.allocate(a, 5)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    kv.pool.blocks[0].token_ids = (9, 9, 9, 9)  # as if the hash had collided
    assert kv.find_cached_prefix(seq_of([1, 2, 3, 4, 5], "b")).num_tokens == 0


def test_at_least_one_token_is_left_to_compute():
    kv = manager()
    a = seq_of(list(range(8)), "a")
    kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    kv.free(a)
    again = seq_of(list(range(8)), "b")
    assert kv.find_cached_prefix(again).num_tokens == 4  # the last block is recomputed


def test_lru_eviction_order_and_events():
    kv = manager(num_blocks=4)
    a, b = seq_of([1, 2, 3, 4, 5], "a"), seq_of([6, 7, 8, 9, 10], "b")
    for s in (a, b):
        kv.allocate(s, 5)
        s.num_computed_tokens = 5
        kv.cache_computed_blocks(s)
    ha, hb = a.block_hashes[0], b.block_hashes[0]
    assert [(e.stored, e.block_hash) for e in kv.pool.take_events()] == [(True, ha), (True, hb)]
    kv.free(a)  # frees blocks 1 (partial) then 0
    kv.free(b)  # frees blocks 3 then 2
    assert kv.pool.free_block_ids() == [1, 0, 3, 2]
    c = seq_of([11, 12, 13, 14, 15, 16, 17, 18, 19], "c")
    kv.allocate(c, 9)  # needs 3 blocks: takes 1, 0 (evicting a's block) and 3
    assert kv.block_ids(c) == [1, 0, 3]
    assert [(e.stored, e.block_hash) for e in kv.pool.take_events()] == [(False, ha)]
    assert kv.find_cached_prefix(seq_of([6, 7, 8, 9, 0], "d")).num_tokens == 4  # b survives


def test_fork_shares_blocks_and_copy_on_write_of_partial_block():
    kv = manager()
    parent = seq_of(list(range(6)), "r", n=3)  # blocks: [0 full, 1 partial]
    kv.allocate(parent, 6)
    parent.num_computed_tokens = 6
    children = parent.request.fork(parent)
    for child in children:
        kv.fork(parent, child)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]
    for s in [parent, *children]:
        s.token_ids.append(100 + s.choice)
    kv.allocate(parent, 1)  # writes into the shared partial block: copies it
    assert kv.block_ids(parent) == [0, 2]
    assert kv.take_copies() == [(1, 2)]
    kv.allocate(children[0], 1)
    assert kv.block_ids(children[0]) == [0, 3]
    kv.allocate(children[1], 1)  # last holder of block 1 writes in place
    assert kv.block_ids(children[1]) == [0, 1]
    assert kv.take_copies() == [(1, 3)]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [3, 1, 1, 1]
    for s in [parent, *children]:
        kv.free(s)
    assert kv.pool.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_can_allocate_counts_hits_taken_from_the_free_queue():
    kv = manager(num_blocks=3)
    a = seq_of(list(range(9)), "a")
    kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    kv.free(a)
    b = seq_of(list(range(8)) + [50, 51, 52, 53, 54], "b")  # 2 cached blocks + 5 new tokens
    prefix = kv.find_cached_prefix(b)
    assert prefix.num_tokens == 8
    assert kv.blocks_needed(b, 5, prefix) == 4  # 2 new + 2 hits leaving the free queue
    assert not kv.can_allocate(b, 5, prefix)
    assert kv.can_allocate(b, 4, prefix)


def test_caching_disabled_never_hits():
    kv = manager(caching=False)
    a = seq_of(list(range(9)), "a")
    kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    assert kv.find_cached_prefix(seq_of(list(range(9)), "b")).num_tokens == 0
    assert kv.pool.take_events() == []
