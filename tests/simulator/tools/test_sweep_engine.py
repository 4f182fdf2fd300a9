"""The ``sim`` sweep engine over the simulator's virtual-time cluster, at a small size."""

from __future__ import annotations

from pathlib import Path

import pytest

from decision_service.table import Table
from ppd.catalog import parse_workload
from simulator.tools.sweep_engine import SimEngine
from table_builder.cli import main
from table_builder.sweep import GridPoint

ENGINE = SimEngine(duration_s=2.0, seed=5)


def _point(mode: str, workload: str = "large_mid_paste", qps: float = 4.0) -> GridPoint:
    return GridPoint("1P3D", "llama-3.1-8b", mode, parse_workload(workload), qps)


def test_records_follow_the_schema_and_the_point() -> None:
    records = ENGINE.run(_point("local"))
    assert records
    assert {r.run_id for r in records} == {"1P3D_local_large_mid_paste_4"}
    assert {(r.shape, r.model, r.mode, r.target_qps, r.workload) for r in records} == {
        ("1P3D", "llama-3.1-8b", "local", 4.0, "large_mid_paste")
    }
    second = [r for r in records if r.turn == 2]
    assert second
    assert {r.path for r in second} == {"local"}
    assert {(r.n_in, r.n_out, r.n_ctx) for r in second} == {(256, 64, 2048)}


def test_pd_and_local_see_the_same_arrivals_and_runs_repeat() -> None:
    pd, local = ENGINE.run(_point("pd")), ENGINE.run(_point("local"))
    first_turns = sorted(r.start_time for r in pd if r.turn == 1)
    assert first_turns == sorted(r.start_time for r in local if r.turn == 1)
    assert ENGINE.run(_point("pd")) == pd
    assert SimEngine(duration_s=2.0, seed=6).run(_point("pd")) != pd


def test_cli_sweep_on_the_simulator(tmp_path: Path) -> None:
    args = ["sweep", "--engine", "sim", "--shape", "1P3D", "--workloads", "small_mid_paste,large_huge_paste"]
    args += ["--qps", "2,16", "--duration", "2", "--min-samples", "2", "--quiet", "--out", str(tmp_path)]
    assert main(args) == 0
    table = Table.open(tmp_path / "1P3D__llama-3.1-8b.ppdt")
    try:
        labels = table.header.provenance["labels"]
        assert labels["engine"] == "sim"
        assert labels["profile"] == "llama-3.1-8b-h100"
        assert table.measured(0, 6, 2)  # small context, mid_paste, 2 QPS
        assert table.measured(1, 8, 8)  # large context, huge_paste, 16 QPS
    finally:
        table.close()


def test_huge_context_workloads_fill_the_huge_context_class(tmp_path: Path) -> None:
    records = ENGINE.run(_point("pd", "huge_mid_paste", 1.0))
    assert {r.n_ctx for r in records if r.turn == 2} == {5120}
    args = ["sweep", "--engine", "sim", "--shape", "1P3D", "--workloads", "huge_big_paste", "--qps", "2"]
    args += ["--duration", "2", "--min-samples", "2", "--quiet", "--out", str(tmp_path)]
    assert main(args) == 0
    table = Table.open(tmp_path / "1P3D__llama-3.1-8b.ppdt")
    try:
        assert table.measured(2, 7, 2)  # huge context, big_paste, 2 QPS
    finally:
        table.close()


def test_a_sweep_folder_of_another_simulator_is_not_resumed(tmp_path: Path) -> None:
    from table_builder.sweep import SweepError, SweepPlan, run_sweep

    empty = SweepPlan(("1P3D",), "llama-3.1-8b", ("pd",), (), (1.0,))
    run_sweep(empty, SimEngine(simulator="0123456789abcdef"), tmp_path)
    with pytest.raises(SweepError, match="other settings"):
        run_sweep(empty, SimEngine(), tmp_path)
    assert len(SimEngine().simulator) == 16


def test_a_drifted_engine_measures_the_drifted_cluster_and_says_so(tmp_path: Path) -> None:
    drifted = SimEngine(duration_s=2.0, seed=5, drift=("0:link=0.01",))
    assert "drift" not in ENGINE.settings()  # sweeps without drift keep their settings (and folders)
    assert drifted.settings()["drift"] == ["0:link=0.01"]
    slow = [r.ttft_ms for r in drifted.run(_point("pd")) if r.turn == 2 and r.ttft_ms is not None]
    fast = [r.ttft_ms for r in ENGINE.run(_point("pd")) if r.turn == 2 and r.ttft_ms is not None]
    assert sum(slow) / len(slow) > sum(fast) / len(fast) + 100.0  # 2,304 tokens over a 1.5 GB/s link
    from table_builder.sweep import SweepError, SweepPlan, run_sweep

    empty = SweepPlan(("1P3D",), "llama-3.1-8b", ("pd",), (), (1.0,))
    run_sweep(empty, drifted, tmp_path)
    with pytest.raises(SweepError, match="other settings"):
        run_sweep(empty, ENGINE, tmp_path)


def test_the_sim_engine_runs_the_bidir_static_mode() -> None:
    records = ENGINE.run(_point("bidir"))
    assert {(r.mode, r.turn, r.path) for r in records} == {("bidir", 1, "pd"), ("bidir", 2, "bidir")}
    assert all(r.ok for r in records)
    assert ENGINE.modes == ("pd", "local", "bidir")


def test_a_sweep_runs_every_mode_the_engine_runs_unless_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = ["sweep", "--shape", "1P3D", "--workloads", "large_mid_paste", "--qps", "2", "--duration", "2"]
    args += ["--min-samples", "2", "--quiet", "--no-build"]
    assert main([*args, "--engine", "sim", "--out", str(tmp_path / "sim")]) == 0
    assert sorted(p.name for p in (tmp_path / "sim" / "records" / "1P3D").iterdir()) == [
        "bidir",
        "local",
        "pd",
    ]
    assert main([*args, "--engine", "analytic", "--out", str(tmp_path / "a")]) == 0
    assert sorted(p.name for p in (tmp_path / "a" / "records" / "1P3D").iterdir()) == ["local", "pd"]
    assert main([*args, "--engine", "analytic", "--modes", "bidir", "--out", str(tmp_path / "b")]) == 2
    assert "the analytic engine runs the static modes pd,local; got --modes bidir" in caplog.text
    assert main([*args, "--engine", "sim", "--modes", "pd,bidir", "--out", str(tmp_path / "c")]) == 0
    assert sorted(p.name for p in (tmp_path / "c" / "records" / "1P3D").iterdir()) == ["bidir", "pd"]


def test_a_sweep_with_prefix_placement_places_by_prefix_and_the_table_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = SimEngine(duration_s=2.0, seed=5, placement="prefix")
    assert "placement" not in ENGINE.settings()  # sweeps before placement keep their settings (and folders)
    assert prefix.settings()["placement"] == "prefix"
    args = ["sweep", "--shape", "2P2D", "--workloads", "large_mid_paste", "--qps", "2", "--duration", "2"]
    args += ["--min-samples", "1", "--quiet", "--modes", "pd,local"]
    assert main([*args, "--engine", "sim", "--placement", "prefix", "--out", str(tmp_path)]) == 0
    table = Table.open(tmp_path / "2P2D__llama-3.1-8b.ppdt")
    try:
        assert table.header.placement == "prefix"
    finally:
        table.close()
    assert main([*args, "--engine", "analytic", "--placement", "prefix", "--out", str(tmp_path / "a")]) == 2
    assert (
        "the analytic engine does not model placement; --placement prefix needs one that does" in caplog.text
    )
