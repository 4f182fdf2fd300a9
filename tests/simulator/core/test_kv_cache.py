"""Block pool / prefix cache rules and the three KV link modes."""

from __future__ import annotations

import pytest

from simulator.core.kv_cache import BlockPool, StreamBlocks, TokenBlocks
from simulator.core.link import Link, TransferMode
from simulator.core.profile import LinkSpec


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


SPEC = LinkSpec("test", bandwidth_bytes_per_s=1e9, latency_s=0.0)


def test_shared_link_is_processor_sharing() -> None:
    link = Link(SPEC, TransferMode.SHARED_LINK)
    a = link.start(0.0, 1_000_000_000)  # 1 s alone
    b = link.start(0.5, 250_000_000)  # from 0.5 s both get half: b needs 0.5 s, a finishes at 1.25 s
    assert link.next_completion_at() == pytest.approx(1.0)
    done = link.completions_until(1.0)
    assert [d.transfer_id for d in done] == [b]
    assert done[0].at == pytest.approx(1.0)
    assert link.next_completion_at() == pytest.approx(1.25)
    done = link.completions_until(2.0)
    assert [d.transfer_id for d in done] == [a]
    assert done[0].at == pytest.approx(1.25)
    assert link.active == 0
    assert link.next_completion_at() is None


def test_shared_link_latency_and_cancel() -> None:
    link = Link(LinkSpec("l", 1e9, 0.01), TransferMode.SHARED_LINK)
    a = link.start(0.0, 1_000_000_000)
    b = link.start(0.0, 1_000_000_000)
    assert link.cancel(a, 0.5)
    assert not link.cancel(a, 0.5)
    # b had 0.25 GB at 0.5 s, then the whole link: done at 1.25 s + 10 ms latency.
    assert link.next_completion_at() == pytest.approx(1.26)
    assert [d.transfer_id for d in link.completions_until(1.3)] == [b]


def test_async_link_has_no_contention() -> None:
    link = Link(SPEC, TransferMode.ASYNC)
    link.start(0.0, 1_000_000_000)
    link.start(0.0, 1_000_000_000)
    done = link.completions_until(1.0)
    assert [d.at for d in done] == [pytest.approx(1.0), pytest.approx(1.0)]


def test_blocking_mode_reports_the_decode_stall() -> None:
    nvlink = LinkSpec("nvlink", 149e9, 0.0)
    link = Link(LinkSpec("100gbe", 10e9, 0.0), TransferMode.BLOCKING_ON_DECODE, physical=nvlink)
    n = 5115 * 131_072
    link.start(0.0, n)
    (done,) = link.completions_until(1.0)
    assert done.at == pytest.approx(n / 149e9)
    assert done.stall_s == pytest.approx(n / 10e9 - n / 149e9)
