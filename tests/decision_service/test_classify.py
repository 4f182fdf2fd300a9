"""The live classifier: (n_ctx, n_in, n_out, qps) -> the cell of the paper's axes."""

from __future__ import annotations

import pytest

from decision_service.axes import paper_axes
from decision_service.classify import context_class, qps_index, workload_class


@pytest.mark.parametrize(
    ("n_in", "n_out", "expected"),
    [
        (8, 64, "tiny"),
        # The benchmark's "tiny" turn (16 in, 32 out) has r = 0.5: the live rule calls it balanced.
        (16, 32, "small_bal"),
        (32, 256, "short_gen"),
        (32, 512, "long_gen"),
        (64, 1024, "very_long_gen"),
        (64, 64, "small_bal"),
        (128, 128, "mid_bal"),
        (256, 64, "mid_paste"),
        (512, 64, "big_paste"),
        (1024, 32, "huge_paste"),
        (5, 0, "mid_paste"),  # n_out 0 counts as 1: r = 5
        (0, 0, "tiny"),
        (10, 65, "short_gen"),
    ],
)
def test_workload_classes_of_the_paper(n_in: int, n_out: int, expected: str) -> None:
    axes = paper_axes()
    assert axes.workloads[workload_class(axes, n_in, n_out)].name == expected


@pytest.mark.parametrize(
    ("n_ctx", "expected"), [(0, "small"), (512, "small"), (513, "large"), (4096, "large"), (4097, "huge")]
)
def test_context_classes(n_ctx: int, expected: str) -> None:
    axes = paper_axes()
    assert axes.context_classes[context_class(axes, n_ctx)] == expected


@pytest.mark.parametrize(
    ("qps", "level"), [(0.0, 0.5), (0.75, 0.5), (0.8, 1.0), (3.0, 2.0), (3.1, 4.0), (99.0, 20.0)]
)
def test_qps_snaps_to_nearest_level_ties_down(qps: float, level: float) -> None:
    axes = paper_axes()
    assert axes.qps_levels[qps_index(axes, qps)] == level
