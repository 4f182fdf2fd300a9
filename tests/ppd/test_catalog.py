from __future__ import annotations

import re

import pytest

from decision_service.axes import paper_axes
from ppd.catalog import (
    HUGE_WORKLOADS,
    TURN1_SETTINGS,
    TURN2_CLASSES,
    WORKLOADS,
    SharedPrefixSpec,
    named_class,
    parse_shared_prefix,
    parse_workload,
    select_workloads,
)


def test_the_papers_turn1_settings_and_classes() -> None:
    assert {k: (v.n_in, v.n_out) for k, v in TURN1_SETTINGS.items()} == {
        "small": (128, 128),
        "large": (1024, 1024),
        "huge": (4096, 1024),
    }
    assert (TURN2_CLASSES["tiny"].n_in, TURN2_CLASSES["tiny"].n_out) == (16, 32)
    assert len(WORKLOADS) == 18
    assert len(HUGE_WORKLOADS) == 9


def test_the_default_table_axes_take_their_classes_from_the_catalog() -> None:
    axes = paper_axes()
    assert [(w.name, w.n_in, w.n_out) for w in axes.workloads] == [
        (name, shape.n_in, shape.n_out) for name, shape in TURN2_CLASSES.items()
    ]


def test_names_parse_and_groups_select() -> None:
    w = parse_workload("large_mid_paste")
    assert (w.turn2_context, w.second.n_in) == (2048, 256)
    assert select_workloads("all,huge,all") == WORKLOADS + HUGE_WORKLOADS
    with pytest.raises(ValueError, match="unknown synthetic workload"):
        parse_workload("medium_tiny")


def test_shared_prefix_names_parse_round_trip_and_name_their_class() -> None:
    spec = parse_shared_prefix("shared2048_4x8_small_mid_bal")
    assert spec == SharedPrefixSpec(2048, 4, 8, "small", "mid_bal")
    assert spec.name == "shared2048_4x8_small_mid_bal"
    assert spec.workload == parse_workload("small_mid_bal")
    assert parse_shared_prefix("shared16_1x1_huge_very_long_gen").turn2 == "very_long_gen"
    assert named_class("shared2048_4x8_large_tiny") == "tiny"
    assert named_class("large_tiny") == "tiny"
    assert named_class("sharegpt") is None
    assert named_class("shared2048_4x8_medium_tiny") is None


def test_conversations_go_round_robin_over_the_groups_and_a_prompt_never_serves_more_than_c() -> None:
    spec = parse_shared_prefix("shared1024_3x2_small_tiny")
    groups = [spec.group_of(i) for i in range(14)]
    assert groups == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]
    assert max(groups.count(g) for g in set(groups)) == 2
    with pytest.raises(ValueError, match=">= 0"):
        spec.group_of(-1)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("shared", "expected shared<L>_<G>x<C>_<turn1>_<class>"),
        ("shared2k_4x8_small_tiny", "expected shared<L>_<G>x<C>_<turn1>_<class>"),
        ("shared2048_4_small_tiny", "expected shared<L>_<G>x<C>_<turn1>_<class>"),
        ("shared2048_4x8_medium_tiny", "unknown synthetic workload 'medium_tiny'"),
        ("shared2048_4x8_small_nope", "unknown synthetic workload 'small_nope'"),
        ("shared8_4x8_small_tiny", "8 tokens: it must be 16..8192"),
        ("shared9000_4x8_small_tiny", "9000 tokens: it must be 16..8192"),
        ("shared2048_0x8_small_tiny", "groups must be 1..10000, got 0"),
        ("shared2048_4x0_small_tiny", "conversations per group must be 1..10000, got 0"),
    ],
)
def test_bad_shared_prefix_names_say_what_is_wrong(name: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        parse_shared_prefix(name)
