"""Aggregation: which records count, where they land, and exact order-free means."""

from __future__ import annotations

import random

import pytest

from decision_service.axes import paper_axes
from table_builder.aggregate import CellKey, Measurements, aggregate_points, aggregate_records
from table_builder.artifact import read_artifact
from table_builder.build import axes_locator
from table_builder.records import Record
from tests.support.records import ARTIFACT as FIXTURE
from tests.support.records import make_record as record

AXES = paper_axes()
LOCATE = axes_locator(AXES)
# (small context, mid_paste, 2 QPS) in the paper axes.
CELL = CellKey(0, 6, 2)


def _aggregate(records: list[Record]) -> Measurements:
    return aggregate_records(
        records, shape="1P3D", model="llama-3.1-8b", locate=LOCATE, qps_levels=AXES.qps_levels
    )


def test_static_turn2_records_land_in_their_cell() -> None:
    records = [
        record(ttft_ms=100.0, tpot_ms=10.0),
        record(ttft_ms=200.0, tpot_ms=12.0, conversation_id="c2"),
        record(mode="local", path="local", ttft_ms=40.0, tpot_ms=11.0),
    ]
    m = aggregate_records(
        records, shape="1P3D", model="llama-3.1-8b", locate=LOCATE, qps_levels=AXES.qps_levels
    )
    assert list(m.cells) == [CELL]
    pd = m.cells[CELL]["pd"]
    assert pd.ttft_ms == 150.0
    assert pd.tpot_ms == 11.0
    assert pd.samples == 2
    assert pd.sent == 2
    assert pd.success_rate == 1.0
    assert m.cells[CELL]["local"].ttft_ms == 40.0
    assert m.tally.used == 3


def test_failed_requests_count_only_in_the_success_rate() -> None:
    records = [record(ttft_ms=100.0), record(ok=False), record(ok=False), record(ttft_ms=300.0)]
    m = aggregate_records(
        records, shape="1P3D", model="llama-3.1-8b", locate=LOCATE, qps_levels=AXES.qps_levels
    )
    pd = m.cells[CELL]["pd"]
    assert pd.ttft_ms == 200.0
    assert pd.success_rate == 0.5
    assert pd.samples == 2
    assert pd.sent == 4


def test_what_is_left_out_is_counted_by_reason() -> None:
    records = [
        record(),
        record(turn=1, n_ctx=0),
        record(mode="ppd", path="local"),
        record(mode="fraction:0.5"),
        record(shape="2P2D"),
        record(model="qwen"),
        record(target_qps=0.0),
    ]
    m = aggregate_records(
        records, shape="1P3D", model="llama-3.1-8b", locate=LOCATE, qps_levels=AXES.qps_levels
    )
    assert m.tally.used == 1
    assert m.tally.left_out == {
        "mode fraction:0.5 (only static pd, local and bidir runs are compared)": 1,
        "mode ppd (only static pd, local and bidir runs are compared)": 1,
        "other shape/model (1P3D/qwen)": 1,
        "other shape/model (2P2D/llama-3.1-8b)": 1,
        "target_qps 0 (no load level to file it under)": 1,
        "turn 1 (always PD; not part of the decision)": 1,
    }


def test_cells_follow_the_classifier_not_the_workload_name() -> None:
    records = [
        record(n_ctx=5000, n_in=16, n_out=512, target_qps=19.0),  # huge context, long_gen, snaps to 20
        record(n_ctx=2048, n_in=1024, n_out=32, target_qps=0.5),  # large, huge_paste
    ]
    m = aggregate_records(
        records, shape="1P3D", model="llama-3.1-8b", locate=LOCATE, qps_levels=AXES.qps_levels
    )
    assert sorted(m.cells) == [CellKey(1, 8, 0), CellKey(2, 2, 9)]
    assert m.tally.snapped_qps == (19.0,)


def test_means_do_not_depend_on_record_order() -> None:
    rng = random.Random(5)
    records = [
        record(
            ttft_ms=round(rng.uniform(1, 1000), 3),
            tpot_ms=round(rng.uniform(5, 20), 3),
            conversation_id=f"c{i}",
        )
        for i in range(500)
    ]
    first = _aggregate(records)
    rng.shuffle(records)
    assert _aggregate(records) == first


def test_artifact_points_are_weighted_by_their_counts() -> None:
    points = read_artifact([FIXTURE]).points
    m = aggregate_points(points, shape="1P3D", locate=LOCATE, qps_levels=AXES.qps_levels)
    mid_paste_8 = m.cells[CellKey(0, 6, 5)]
    assert mid_paste_8["pd"].ttft_ms == 90.0
    assert mid_paste_8["local"].ttft_ms == 40.0
    assert mid_paste_8["pd"].samples == 80
    failed = m.cells[CellKey(1, 8, 9)]["pd"]
    assert failed.ttft_ms is None
    assert failed.success_rate == 0.0
    assert failed.sent == 191
    # large_tiny's benchmark shape (16, 32) is a balanced request for the live classifier, but the point
    # is named for tiny, so it fills the tiny cell, not small_bal's.
    assert set(m.cells[CellKey(1, 0, 1)]) == {"pd"}
    assert CellKey(1, 4, 1) not in m.cells
    other = aggregate_points(points, shape="2P2D", locate=LOCATE, qps_levels=AXES.qps_levels)
    assert other.cells == {}
    assert other.tally.left_out == {"other shape (1P3D)": 7}


@pytest.mark.parametrize(
    ("workload", "n_in", "n_out", "expected"),
    [
        ("small_tiny", 16, 32, "tiny"),  # named for tiny, with tiny's benchmark shape: the tiny cell
        ("huge_tiny", 16, 32, "tiny"),
        ("sharegpt", 16, 32, "small_bal"),  # not a synthetic run: classified like a live request
        ("small_tiny", 17, 32, "small_bal"),  # the name and the shape disagree: the shape decides
        ("small_nonsense", 16, 32, "small_bal"),
        ("", 16, 32, "small_bal"),
        ("large_mid_paste", 256, 64, "mid_paste"),
        ("small_bal", 64, 64, "small_bal"),  # a bare class name is not a synthetic workload name
        ("prod_tiny", 16, 32, "small_bal"),  # not a Turn-1 setting: a renamed run, classified
        (None, 16, 32, "small_bal"),
        ("shared2048_4x8_small_tiny", 16, 32, "tiny"),  # a shared-prefix run files like its class
        ("shared2048_4x8_large_mid_paste", 256, 64, "mid_paste"),
        ("shared2048_4x8_small_tiny", 17, 32, "small_bal"),
        ("shared9_4x8_small_tiny", 16, 32, "small_bal"),  # malformed (prompt too short): classified
    ],
)
def test_synthetic_runs_file_under_the_class_they_are_named_for(
    workload: str | None, n_in: int, n_out: int, expected: str
) -> None:
    key = LOCATE(n_ctx=256, n_in=n_in, n_out=n_out, qps=4.0, workload=workload)
    assert AXES.workload_names()[key.workload] == expected


def test_bidir_records_are_the_third_compared_mode() -> None:
    bidir = record(run_id="run-bidir", ttft_ms=70.0, tpot_ms=10.5)
    object.__setattr__(bidir, "mode", "bidir")  # Record's mode grammar is ppd/modes.py's business
    m = _aggregate([record(), record(mode="local", path="local", ttft_ms=40.0), bidir])
    assert set(m.cells[CELL]) == {"pd", "local", "bidir"}
    assert (m.cells[CELL]["bidir"].ttft_ms, m.cells[CELL]["bidir"].sent) == (70.0, 1)
    assert m.tally.used == 3
    assert m.tally.left_out == {}
