"""KV blocks: chained block hashes, the block pool and its prefix cache (LRU, pins, prefix acquire)."""

from __future__ import annotations

from simulator.core.kv_cache import BlockPool, StreamBlocks, TokenBlocks


def test_chained_hashes_identify_prefixes() -> None:
    a = TokenBlocks(list(range(64)))
    b = TokenBlocks([*range(32), 999, *range(33, 64)])
    assert a.block_hash(0) == b.block_hash(0)
    assert a.block_hash(1) == b.block_hash(1)
    assert a.block_hash(2) != b.block_hash(2)
    # Same block content after a different prefix: a different hash (chain).
    c = TokenBlocks([*range(100, 116), *range(16, 32)])
    assert c.block_hash(1) != a.block_hash(1)
    assert StreamBlocks(1).block_hash(3) != StreamBlocks(2).block_hash(3)
    assert StreamBlocks(1).block_hash(3) == StreamBlocks(1).block_hash(3)


def test_lru_evicts_least_recently_released_tail_first() -> None:
    pool = BlockPool(4)
    s1, s2 = StreamBlocks(1), StreamBlocks(2)
    assert pool.allocate(2)
    for i in range(2):
        assert pool.register(s1.block_hash(i))
    pool.release([s1.block_hash(0), s1.block_hash(1)])
    assert pool.num_free == 4
    assert pool.num_cached == 2
    assert pool.usage() == 0.0
    assert pool.allocate(2)
    pool.release_private(2)
    assert pool.allocate(3)  # needs one eviction: the tail block of s1 goes first
    assert pool.match(s1, 2) == 1
    assert not pool.allocate(2)  # only one left; no change
    assert pool.num_free == 1
    assert pool.match(s2, 5) == 0


def test_register_refuses_duplicates_and_acquire_pins() -> None:
    pool = BlockPool(8)
    s = StreamBlocks(7)
    pool.allocate(1)
    assert pool.register(s.block_hash(0))
    assert not pool.register(s.block_hash(0))
    pool.release([s.block_hash(0)])
    assert pool.acquire(s, 1) == [s.block_hash(0)]
    assert pool.ref_count(s.block_hash(0)) == 1
    assert not pool.reset_prefix_cache()
    pool.release([s.block_hash(0)])
    assert pool.reset_prefix_cache()
    assert pool.num_cached == 0


def test_acquire_prefix_is_match_then_acquire() -> None:
    pools = BlockPool(16), BlockPool(16)
    s = StreamBlocks(3)
    for pool in pools:
        pool.allocate(5)
        assert pool.register_many(s.block_hashes(0, 5), 5) == list(s.block_hashes(0, 5))
        pool.release(list(s.block_hashes(0, 5)))
        pool.acquire(s, 2)  # blocks 0-1 held, 2-4 idle: both paths through the counting
    a, b = pools
    assert a.acquire_prefix(s, 4) == b.acquire(s, b.match(s, 4)) == list(s.block_hashes(0, 4))
    assert a.acquire_prefix(StreamBlocks(4), 4) == [] == b.acquire(StreamBlocks(4), 0)
    assert a.acquire_prefix(s, 0) == []
    for h in s.block_hashes(0, 5):
        assert a.ref_count(h) == b.ref_count(h)
    assert (a.num_free, a.num_cached) == (b.num_free, b.num_cached) == (12, 5)
