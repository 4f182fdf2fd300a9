"""Shared-prefix workloads in the virtual-time cluster: their conversations, and the prefix cache
hits a group's shared system prompt gives (simulator.core.workload, cluster, kv_cache.PrefixedBlocks)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from simulator.core.cluster import ClusterConfig, ClusterResult, simulate
from simulator.core.profile import Profile
from simulator.core.topology import Topology
from simulator.core.workload import (
    Conversation,
    SharedPrefix,
    Turn,
    shared_prefix_conversations,
    synthetic_conversations,
)

NAME = "shared2048_3x4_small_mid_bal"


def _run(profile: Profile, conversations: list[Conversation], mode: str = "pd") -> ClusterResult:
    config = ClusterConfig(topology=Topology.parse("1P1D"), mode=mode)
    return simulate(profile, config, conversations)


def _spaced(conversations: list[Conversation]) -> list[Conversation]:
    """The same conversations, each starting when the one before has long finished (one at a time)."""
    return [replace(c, start=10.0 * i) for i, c in enumerate(conversations)]


def test_conversations_open_with_their_groups_prompt_in_turn_one() -> None:
    convs = shared_prefix_conversations(NAME, qps=4.0, duration_s=10.0, seed=3, turns=3)
    assert convs == shared_prefix_conversations(NAME, qps=4.0, duration_s=10.0, seed=3, turns=3)
    assert len(convs) > 12
    assert [c.prefix for c in convs[:13]] == [
        SharedPrefix(g, 2048) for g in (0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 3)
    ]
    assert {c.turns for c in convs} == {(Turn(2048 + 128, 128), Turn(128, 128), Turn(128, 128))}
    assert len({c.conversation_id for c in convs}) == len(convs)
    assert {c.workload for c in convs} == {NAME}


@pytest.mark.parametrize(
    ("name", "turns", "fragment"),
    [
        ("shared2048_3x4_small_nope", 2, "unknown synthetic workload 'small_nope'"),
        ("shared4_3x4_small_tiny", 2, "it must be 16..8192"),
        ("sharedx_3x4_small_tiny", 2, "expected shared<L>_<G>x<C>_<turn1>_<class>"),
        (NAME, 0, "turns must be at least 1"),
    ],
)
def test_bad_names_and_turns_are_refused(name: str, turns: int, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        shared_prefix_conversations(name, qps=1.0, duration_s=1.0, turns=turns)


def test_a_groups_second_conversation_hits_the_shared_prompt_on_the_same_worker(profile: Profile) -> None:
    block = profile.scheduler.block_size
    convs = shared_prefix_conversations(NAME, qps=4.0, duration_s=10.0, seed=3, turns=1)
    # Group 0's first and second conversation, one after the other on the cluster's one P and one D.
    group0 = [c for c in convs if c.prefix == SharedPrefix(0, 2048)][:2]
    first = _run(profile, _spaced(group0[:1])).engine_stats["P0"]
    both = _run(profile, _spaced(group0)).engine_stats["P0"]
    assert first.prefix_cache_hits == 0
    # The second prefill finds every full block of the 2048-token prompt (and nothing of its own).
    assert both.prefix_cache_hits - first.prefix_cache_hits == 2048 // block * block
    # Its Turn 1 prefill is shorter for it.
    records = _run(profile, _spaced(group0)).records
    assert records[1]["ttft_ms"] < records[0]["ttft_ms"]


def test_groups_and_workloads_never_share_a_block(profile: Profile) -> None:
    convs = shared_prefix_conversations(NAME, qps=4.0, duration_s=10.0, seed=3, turns=1)
    one_per_group = [next(c for c in convs if c.prefix == SharedPrefix(g, 2048)) for g in range(4)]
    assert _run(profile, _spaced(one_per_group)).engine_stats["P0"].prefix_cache_hits == 0
    # Group 0 of another shared-prefix workload in the same run is another prompt.
    other = shared_prefix_conversations("shared2048_3x4_small_tiny", qps=4.0, duration_s=10.0, turns=1)
    mixed = [one_per_group[0], other[0]]
    assert mixed[1].prefix == mixed[0].prefix
    assert _run(profile, _spaced(mixed)).engine_stats["P0"].prefix_cache_hits == 0


def test_plain_synthetic_conversations_see_the_same_cluster_as_before(profile: Profile) -> None:
    """Without a prefix a conversation's blocks are its stream alone: no hits across conversations."""
    convs = synthetic_conversations("large_mid_bal", qps=2.0, duration_s=5.0, seed=1)
    result = _run(profile, _spaced([replace(c, turns=c.turns[:1]) for c in convs]))
    assert result.engine_stats["P0"].prefix_cache_hits == 0


def test_later_turns_on_d_reuse_the_prompt_and_the_history(profile: Profile) -> None:
    convs = shared_prefix_conversations(NAME, qps=4.0, duration_s=10.0, seed=3, turns=2)
    group0 = [c for c in convs if c.prefix == SharedPrefix(0, 2048)][:2]
    result = _run(profile, _spaced(group0), mode="local")
    assert all(r["ok"] for r in result.records)
    turn2 = [r for r in result.records if r["turn"] == 2]
    assert [r["path"] for r in turn2] == ["local", "local"]
    assert {r["n_ctx"] for r in turn2} == {2048 + 128 + 128}
