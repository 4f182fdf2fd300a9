"""The analytic engine: deployment shapes, seeded records, PD failing under overload."""

from __future__ import annotations

import pytest

from ppd.catalog import parse_workload
from table_builder.analytic import AnalyticEngine, parse_shape
from table_builder.sweep import GridPoint


@pytest.mark.parametrize(("shape", "sizes"), [("1P3D", (1, 3)), ("2P2D", (2, 2)), ("3P1D", (3, 1))])
def test_parse_shape(shape: str, sizes: tuple[int, int]) -> None:
    assert parse_shape(shape) == sizes


@pytest.mark.parametrize("shape", ["1P", "0P3D", "P3D", "1p3d"])
def test_parse_shape_rejects(shape: str) -> None:
    with pytest.raises(ValueError, match="not <n>P<m>D"):
        parse_shape(shape)


def test_analytic_engine_is_seeded_and_pd_fails_under_overload() -> None:
    point = GridPoint("1P3D", "llama-3.1-8b", "pd", parse_workload("large_huge_paste"), 20.0)
    engine = AnalyticEngine(conversations=30, seed=1)
    records = engine.run(point)
    assert records == engine.run(point)
    assert records != AnalyticEngine(conversations=30, seed=2).run(point)
    assert any(not r.ok for r in records)
    local = engine.run(GridPoint("1P3D", "llama-3.1-8b", "local", parse_workload("small_mid_paste"), 1.0))
    assert all(r.ok for r in local)
    assert {r.path for r in local if r.turn == 2} == {"local"}
    assert {r.n_ctx for r in local if r.turn == 2} == {256}
