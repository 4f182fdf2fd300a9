from __future__ import annotations

import re

import pytest

from loadgen.tokens import llama3_counter
from loadgen.workloads import (
    SYNTHETIC_WORKLOADS,
    Conversation,
    ConversationPool,
    SharedPrefixWorkload,
    SyntheticWorkload,
    Turn,
    WorkloadError,
    parse_synthetic_name,
    single_token_words,
)
from ppd.catalog import TURN1_SETTINGS, TURN2_CLASSES

COUNTER = llama3_counter()
WORDS = single_token_words(COUNTER)


def test_there_are_the_papers_18_workloads() -> None:
    assert len(SYNTHETIC_WORKLOADS) == 18
    assert "large_mid_paste" in SYNTHETIC_WORKLOADS
    assert (TURN2_CLASSES["huge_paste"].n_in, TURN2_CLASSES["huge_paste"].n_out) == (1024, 32)
    assert (TURN1_SETTINGS["small"].n_in, TURN1_SETTINGS["small"].n_out) == (128, 128)
    assert (TURN1_SETTINGS["large"].n_in, TURN1_SETTINGS["large"].n_out) == (1024, 1024)


def test_the_huge_context_extension_is_accepted_too() -> None:
    conv = SyntheticWorkload(name="huge_tiny", words=WORDS).conversation(0)
    assert [(t.n_in, t.n_out) for t in conv.turns] == [(4096, 1024), (16, 32)]


@pytest.mark.parametrize("name", SYNTHETIC_WORKLOADS)
def test_every_turn_has_exactly_the_token_count_it_claims(name: str) -> None:
    conv = SyntheticWorkload(name=name, words=WORDS, seed=3).conversation(0)
    turn1, cls = parse_synthetic_name(name)
    expected = [TURN1_SETTINGS[turn1], TURN2_CLASSES[cls]]
    assert [(t.n_in, t.n_out) for t in conv.turns] == [(e.n_in, e.n_out) for e in expected]
    for turn in conv.turns:
        assert COUNTER.count(turn.content) == turn.n_in


def test_same_seed_same_conversations_different_seed_different_text() -> None:
    a = SyntheticWorkload(name="small_tiny", words=WORDS, seed=1)
    b = SyntheticWorkload(name="small_tiny", words=WORDS, seed=1)
    c = SyntheticWorkload(name="small_tiny", words=WORDS, seed=2)
    assert a.conversation(5) == b.conversation(5)
    assert a.conversation(5).turns != c.conversation(5).turns
    assert a.conversation(5).turns[0].content != a.conversation(6).turns[0].content


def test_more_turns_repeat_the_class_sizes_up_to_sixteen() -> None:
    conv = SyntheticWorkload(name="large_big_paste", words=WORDS, turns=16).conversation(0)
    assert len(conv.turns) == 16
    assert {(t.n_in, t.n_out) for t in conv.turns[1:]} == {(512, 64)}
    with pytest.raises(WorkloadError, match=r"1\.\.16"):
        SyntheticWorkload(name="large_big_paste", words=WORDS, turns=17)


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(WorkloadError, match=r"mid_paste.*sharegpt"):
        SyntheticWorkload(name="medium_tiny", words=WORDS)
    with pytest.raises(WorkloadError):
        parse_synthetic_name("small_gigantic")


def test_a_tokenizer_without_single_token_words_is_refused() -> None:
    class Chars:
        def count(self, text: str) -> int:
            return len(text)

    with pytest.raises(WorkloadError, match="single-token"):
        single_token_words(Chars())


def _conv(i: int, turns: int = 3) -> Conversation:
    return Conversation(id=f"c{i}", turns=tuple(Turn(f"q{j}", 1, 1) for j in range(turns)))


def test_pool_is_a_seeded_permutation_that_cycles_with_unique_ids() -> None:
    pool = ConversationPool(name="p", conversations=[_conv(i) for i in range(5)], seed=7)
    first_lap = [pool.conversation(i).id for i in range(5)]
    assert sorted(first_lap) == [f"c{i}" for i in range(5)]
    assert pool.conversation(5).id == f"{first_lap[0]}~1"
    again = ConversationPool(name="p", conversations=[_conv(i) for i in range(5)], seed=7)
    assert [again.conversation(i).id for i in range(5)] == first_lap


def test_pool_can_cut_conversations_to_fewer_turns() -> None:
    pool = ConversationPool(name="p", conversations=[_conv(0, 5)], turns=2)
    assert len(pool.conversation(0).turns) == 2
    with pytest.raises(WorkloadError):
        ConversationPool(name="p", conversations=[])


SHARED = "shared1024_3x2_small_mid_bal"


def test_shared_prefix_conversations_share_their_groups_prompt_and_only_it() -> None:
    workload = SharedPrefixWorkload(name=SHARED, words=WORDS, seed=5, turns=3)
    convs = [workload.conversation(i) for i in range(9)]
    prefixes = [c.prefix for c in convs]
    assert all(p is not None for p in prefixes)
    by_group = {0: [0, 3], 1: [1, 4], 2: [2, 5], 3: [6], 4: [7], 5: [8]}
    for group, members in by_group.items():
        assert {prefixes[i] for i in members} == {workload.prefix(group)}
        assert workload.prefix(group).id == f"{SHARED}-s5-g{group}"
    texts = [workload.prefix(g).content for g in by_group]
    assert len(set(texts)) == len(texts)  # no two groups share a prompt, the next round neither
    assert len({t[:60] for t in texts}) == len(texts)  # nor its start
    # The conversations' own turns are their own: a group shares its prompt, nothing after it.
    assert convs[0].turns[0].content != convs[3].turns[0].content
    assert len({c.id for c in convs}) == 9


def test_shared_prefix_token_counts_are_exact() -> None:
    workload = SharedPrefixWorkload(name="shared2048_2x4_large_tiny", words=WORDS, seed=1)
    conv = workload.conversation(3)
    assert conv.prefix is not None
    assert COUNTER.count(conv.prefix.content) == conv.prefix.n_tokens == 2048
    assert [(t.n_in, t.n_out) for t in conv.turns] == [(1024, 1024), (16, 32)]
    for turn in conv.turns:
        assert COUNTER.count(turn.content) == turn.n_in


def test_shared_prefix_text_is_seeded() -> None:
    a = SharedPrefixWorkload(name=SHARED, words=WORDS, seed=1)
    b = SharedPrefixWorkload(name=SHARED, words=WORDS, seed=1)
    c = SharedPrefixWorkload(name=SHARED, words=WORDS, seed=2)
    assert a.conversation(4) == b.conversation(4)
    assert a.prefix(1) != c.prefix(1)
    assert a.conversation(4).turns != c.conversation(4).turns


@pytest.mark.parametrize(
    ("name", "turns", "fragment"),
    [
        ("shared2048_4x8_medium_tiny", 2, "unknown synthetic workload 'medium_tiny'"),
        ("shared8_4x8_small_tiny", 2, "it must be 16..8192"),
        ("shared2048_4x8", 2, "expected shared<L>_<G>x<C>_<turn1>_<class>"),
        ("shared2048_4x8_small_tiny", 17, "1..16"),
    ],
)
def test_bad_shared_prefix_workloads_are_refused_with_the_reason(
    name: str, turns: int, fragment: str
) -> None:
    with pytest.raises(WorkloadError, match=re.escape(fragment)):
        SharedPrefixWorkload(name=name, words=WORDS, turns=turns)
    with pytest.raises(WorkloadError, match="non-empty word list"):
        SharedPrefixWorkload(name=SHARED, words=())
