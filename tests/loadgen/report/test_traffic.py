"""The experiments' seeded conversations: a mix of synthetic workloads, and a load ramp of mixes."""

from __future__ import annotations

import pytest

from loadgen.report.traffic import mix_conversations, ramp_conversations


def test_mix_conversations_cycle_the_workloads_and_shift_by_offset() -> None:
    convs = mix_conversations(("small_huge_paste", "large_mid_bal"), 4.0, 10.0, seed=1, offset_s=50.0)
    assert [c.workload for c in convs[:4]] == ["small_huge_paste", "large_mid_bal"] * 2
    assert all(50.0 <= c.start < 60.0 for c in convs)
    assert convs[0].turns[1].n_in == 1024
    assert convs[1].turns[0].n_in == 1024
    assert len({c.conversation_id for c in convs}) == len(convs)
    assert mix_conversations(("small_huge_paste",), 4.0, 10.0, seed=1) == mix_conversations(
        ("small_huge_paste",), 4.0, 10.0, seed=1
    )
    with pytest.raises(ValueError, match="at least one workload"):
        mix_conversations((), 4.0, 10.0, seed=1)
    with pytest.raises(ValueError, match="nope"):
        mix_conversations(("nope",), 4.0, 10.0, seed=1)


def test_a_ramp_holds_each_level_for_its_step() -> None:
    convs = ramp_conversations(("small_mid_bal",), (2.0, 20.0), 30.0, seed=3)
    first = [c for c in convs if c.start < 30.0]
    second = [c for c in convs if c.start >= 30.0]
    assert max(c.start for c in convs) < 60.0
    assert 30 <= len(first) <= 100
    assert 450 <= len(second) <= 750
    assert len({c.conversation_id for c in convs}) == len(convs)
