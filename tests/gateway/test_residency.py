"""gateway/residency.py (pure): resident block sets from KV event batches, sequence gaps, resyncs,
the budget per worker; and psi.with_resident (ψ scored on the resident context)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.psi import Psi, TokenCount, with_resident
from gateway.residency import (
    MAX_MARKS,
    Applied,
    KvTracking,
    Residency,
    marks_from_text,
    marks_text,
    prefix_marks,
)
from gateway.settings import Settings, SettingsError
from ppd.kv_events import AllBlocksCleared, BlockHasher, BlockRemoved, BlockStored, EventBatch


def stored(*hashes: int, medium: str | None = "GPU") -> EventBatch:
    return EventBatch(0.0, (BlockStored(tuple(hashes), None, (), 16, medium=medium),))


def removed(*hashes: int) -> EventBatch:
    return EventBatch(0.0, (BlockRemoved(tuple(hashes)),))


def test_stores_and_removals_in_sequence_give_the_resident_prefix() -> None:
    r = Residency(["D0"], max_blocks=100)
    assert r.resident_blocks("D0", [1]) is None  # nothing heard yet: unknown
    assert r.apply("D0", 0, stored(1, 2, 3)) is Applied.OK
    assert r.resident_blocks("D0", [1, 2, 3, 4]) == 3
    assert r.apply("D0", 1, removed(2)) is Applied.OK
    assert r.resident_blocks("D0", [1, 2, 3]) == 1  # a prefix: block 3 alone does not count
    assert r.apply("D0", 2, EventBatch(0.0, (AllBlocksCleared(),))) is Applied.OK
    assert r.resident_blocks("D0", [1]) == 0
    assert r.resident_blocks("D9", [1]) is None  # not a tracked worker


def test_a_prompts_marks_are_its_chain_after_1_2_4_blocks_and_its_last() -> None:
    chain = list(range(100, 111))  # 11 blocks
    assert prefix_marks(chain) == ((1, 100), (2, 101), (4, 103), (8, 107), (11, 110))
    assert prefix_marks(chain[:8]) == ((1, 100), (2, 101), (4, 103), (8, 107))
    assert prefix_marks([]) == ()
    assert len(prefix_marks(list(range(1 << 16)))) == 17 <= MAX_MARKS


@given(st.lists(st.integers(-(2**63), 2**64 - 1), max_size=5000))
def test_marks_read_back_as_a_session_keeps_them(chain: list[int]) -> None:
    marks = prefix_marks(chain)
    assert marks_from_text(marks_text(marks)) == marks
    assert len(marks_text(marks)) <= 22 * len(marks) + 10 * len(marks)  # a few hundred bytes


@pytest.mark.parametrize(
    "text", ["1:2,", "1", "1:2,1:3", "a:1", "1:--2", f"1:{2**64}", ",".join(f"{i}:0" for i in range(1, 66))]
)
def test_anything_but_marks_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        marks_from_text(text)


def test_the_resident_prefix_by_marks_is_rounded_down_to_a_mark() -> None:
    chain = list(range(1, 12))  # 11 blocks
    marks = prefix_marks(chain)
    r = Residency(["P0"], max_blocks=100)
    assert r.resident_by_marks("P0", marks) is None  # unsynced: unknown
    r.apply("P0", 0, stored(*chain[:6]))  # six blocks: marks 1, 2 and 4 held, 8 not
    assert r.resident_by_marks("P0", marks) == 4
    assert r.resident_blocks("P0", chain) == 6  # the exact answer, which marks round down
    r.apply("P0", 1, stored(*chain[6:]))
    assert r.resident_by_marks("P0", marks) == 11
    r.apply("P0", 2, removed(chain[1]))  # block 2 gone: nothing past block 1 is a prefix any more
    assert r.resident_by_marks("P0", marks) == 1
    assert r.resident_by_marks("P0", ()) == 0
    assert r.resident_by_marks("D9", marks) is None


def test_a_gap_makes_the_worker_unknown_until_a_full_resync() -> None:
    r = Residency(["D0"], max_blocks=100)
    r.apply("D0", 0, stored(1))
    assert r.apply("D0", 2, stored(2)) is Applied.GAP
    assert r.resident_blocks("D0", [1]) is None
    assert not r.synced("D0")
    assert r.apply("D0", 3, stored(3)) is Applied.UNSYNCED
    # A replay whose buffer no longer starts at 0 cannot resync.
    assert not r.resync("D0", [(1, stored(9)), (2, stored(2))])
    assert r.resync("D0", [(0, stored(1)), (1, removed(1)), (2, stored(2)), (3, stored(3))])
    assert r.resident_blocks("D0", [2, 3]) == 2
    assert r.resident_blocks("D0", [1]) == 0
    assert r.apply("D0", 3, stored(3)) is Applied.DUPLICATE  # the live copy of a replayed batch
    assert r.apply("D0", 4, stored(4)) is Applied.OK


def test_joining_late_is_a_gap_and_an_empty_replay_is_a_fresh_publisher() -> None:
    r = Residency(["D0"], max_blocks=100)
    assert r.apply("D0", 5, stored(1)) is Applied.GAP
    assert r.resync("D0", [])
    assert r.resident_blocks("D0", [1]) == 0


def test_a_streamed_resync_answers_nothing_until_its_end() -> None:
    r = Residency(["D0"], max_blocks=100)
    r.apply("D0", 0, stored(1))
    r.begin_resync("D0")
    assert r.resident_blocks("D0", [1]) is None
    r.apply_events("D0", stored(1).events)
    r.apply_events("D0", stored(2).events)
    assert r.resident_blocks("D0", [1, 2]) is None  # half a replay is not an answer
    assert r.apply("D0", 2, stored(3)) is Applied.UNSYNCED
    r.end_resync("D0", 2)
    assert r.resident_blocks("D0", [1, 2]) == 2
    assert r.apply("D0", 1, stored(2)) is Applied.DUPLICATE
    assert r.admit("D0", 2) is Applied.OK  # the caller applies the events (in slices)
    r.apply_events("D0", stored(3).events)
    assert r.resident_blocks("D0", [1, 2, 3]) == 3


def test_a_restarted_publisher_starts_over_from_seq_0() -> None:
    r = Residency(["D0"], max_blocks=100)
    r.apply("D0", 0, stored(1))
    r.apply("D0", 1, stored(2))
    assert r.apply("D0", 0, stored(7)) is Applied.RESTART
    assert r.resident_blocks("D0", [1]) == 0
    assert r.resident_blocks("D0", [7]) == 1
    r.lost("D0")  # a lost connection: unknown, until the publisher restarts or a resync
    assert r.apply("D0", 0, stored(8)) is Applied.RESTART
    assert r.synced("D0")


def test_the_budget_forgets_the_oldest_blocks_and_other_tiers_are_ignored() -> None:
    r = Residency(["D0"], max_blocks=3)
    r.apply("D0", 0, stored(1, 2, 3))
    r.apply("D0", 1, stored(4))
    assert r.tracked_blocks("D0") == 3
    assert r.state("D0").dropped == 1
    assert r.resident_blocks("D0", [1, 2]) == 0  # under-estimated, never over
    r.apply("D0", 2, stored(9, medium="CPU"))
    assert r.resident_blocks("D0", [9]) == 0


def test_tracking_computes_the_prompts_hashes() -> None:
    hasher = BlockHasher("7", block_size=4)
    r = Residency(["D0"], max_blocks=10)
    kv = KvTracking(r, hasher)
    tokens = list(range(10))
    assert kv.resident_tokens("D0", tokens) is None
    r.apply("D0", 0, stored(*hasher.chain(tokens[:4])))
    assert kv.resident_tokens("D0", tokens) == 4


def test_with_resident_moves_the_evicted_context_into_new_input() -> None:
    psi = Psi(TokenCount(50, "exact"), 100, 1000)
    assert with_resident(psi, 1000) == psi
    assert with_resident(psi, 4096) == psi  # a prompt block beyond the context is not context
    part = with_resident(psi, 640)
    assert (part.n_in.tokens, part.n_ctx, part.n_evicted, part.n_in.source) == (410, 640, 360, "exact")
    cold = with_resident(psi, 0)
    assert (cold.n_in.tokens, cold.n_ctx, cold.n_evicted) == (1050, 0, 1000)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=60), st.integers(1, 8))
def test_tracked_blocks_never_exceed_the_budget(ops: list[tuple[bool, int]], budget: int) -> None:
    r = Residency(["D0"], max_blocks=budget)
    for seq, (store, h) in enumerate(ops):
        r.apply("D0", seq, stored(h) if store else removed(h))
        assert r.tracked_blocks("D0") <= budget


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"block_size": 0}, "must be positive"),
        ({"endpoints": "tcp://x:1"}, "must be tables"),
        ({"endpoints": {"D0": ""}}, "ZMQ endpoints"),
        ({"endpoints": {"D0": "tcp://x:1"}, "replay_endpoints": {"D1": "tcp://x:2"}}, "needs an entry"),
        ({"nope": 1}, "unknown setting"),
        ({"max_message_bytes": 0}, "must be positive"),
        ({"replay_timeout_s": -1.0}, "must be positive"),
    ],
)
def test_kv_events_settings_are_checked(section: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_mapping({"kv_events": section})


def test_kv_events_are_off_by_default() -> None:
    kv = Settings.from_mapping({}).kv_events
    assert (kv.endpoints, kv.hash_seed, kv.block_size) == ({}, "", 16)
    assert (kv.max_message_bytes, kv.max_replay_bytes, kv.max_pending_bytes) == (4 << 20, 256 << 20, 64 << 20)
