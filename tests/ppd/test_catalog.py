from __future__ import annotations

import pytest

from decision_service.axes import paper_axes
from ppd.catalog import (
    HUGE_WORKLOADS,
    TURN1_SETTINGS,
    TURN2_CLASSES,
    WORKLOADS,
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
