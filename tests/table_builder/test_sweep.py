"""The sweep: grid points to records, resume after interruption, same bytes whatever happened."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from decision_service.table import Table
from ppd.catalog import parse_workload
from table_builder.analytic import AnalyticEngine
from table_builder.cli import main
from table_builder.records import Record, read_records
from table_builder.sweep import GridPoint, SweepError, SweepPlan, point_path, run_sweep
from tests.support.polling import wait_until

REPO = Path(__file__).resolve().parents[2]

PLAN = SweepPlan(
    shapes=("1P3D",),
    model="llama-3.1-8b",
    modes=("pd", "local"),
    workloads=(parse_workload("small_mid_paste"), parse_workload("large_huge_paste")),
    qps_levels=(1.0, 20.0),
)
ENGINE = AnalyticEngine(duration_s=2.0, seed=3)
GRID = [
    "--engine",
    "analytic",
    "--shape",
    "1P3D",
    "--workloads",
    "small_mid_paste,large_huge_paste",
    "--qps",
    "1,20",
]
SWEEP = ["sweep", *GRID, "--duration", "2", "--seed", "3", "--min-samples", "2", "--quiet"]


class StopSweepError(Exception):
    pass


@dataclass(frozen=True)
class FlakyEngine:
    """The analytic engine under the same name and settings, interrupted at its ``stop_at``-th point."""

    inner: AnalyticEngine
    stop_at: int
    ran: list[GridPoint]

    @property
    def name(self) -> str:
        return self.inner.name

    def settings(self) -> Mapping[str, Any]:
        return self.inner.settings()

    def run(self, point: GridPoint) -> list[Record]:
        if len(self.ran) == self.stop_at:
            raise StopSweepError
        self.ran.append(point)
        return self.inner.run(point)


def _tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.glob("records/**/*.jsonl"))}


def test_every_point_writes_its_records(tmp_path: Path) -> None:
    files = run_sweep(PLAN, ENGINE, tmp_path)
    assert len(files["1P3D"]) == 8
    for point in PLAN.points():
        records = read_records([point_path(tmp_path, point)])
        assert {r.run_id for r in records} == {point.run_id}
        assert {r.mode for r in records} == {point.mode}
        assert len([r for r in records if r.turn == 1]) == max(1, round(point.qps * 2.0))


def test_an_interrupted_sweep_resumes_where_it_stopped(tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    run_sweep(PLAN, ENGINE, clean)
    resumed = tmp_path / "resumed"
    first: list[GridPoint] = []
    with pytest.raises(StopSweepError):
        run_sweep(PLAN, FlakyEngine(ENGINE, stop_at=3, ran=first), resumed)
    assert len(_tree(resumed)) == 3
    # A point cut short mid-write, as a crash of an older writer would leave it, runs again too.
    damaged = point_path(resumed, first[0])
    damaged.write_bytes(damaged.read_bytes()[:-40])
    second: list[GridPoint] = []
    run_sweep(PLAN, FlakyEngine(ENGINE, stop_at=99, ran=second), resumed)
    assert first[0] in second
    assert len(second) == 8 - 2
    assert set(first[1:]).isdisjoint(second)
    assert _tree(resumed) == _tree(clean)


def test_parallel_points_give_the_same_records(tmp_path: Path) -> None:
    run_sweep(PLAN, ENGINE, tmp_path / "one")
    run_sweep(PLAN, ENGINE, tmp_path / "two", jobs=2)
    assert _tree(tmp_path / "one") == _tree(tmp_path / "two")


def test_other_settings_in_the_same_folder_are_refused(tmp_path: Path) -> None:
    run_sweep(PLAN, ENGINE, tmp_path)
    with pytest.raises(SweepError, match="other settings"):
        run_sweep(PLAN, AnalyticEngine(duration_s=2.0, seed=4), tmp_path)


def test_progress_counts_finished_points(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    run_sweep(PLAN, ENGINE, tmp_path, progress=lambda done, total: seen.append((done, total)))
    run_sweep(PLAN, ENGINE, tmp_path, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(0, 8), (8, 8)]


def test_cli_sweep_publishes_a_table_and_rebuilds_the_same_bytes(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    assert main([*SWEEP, "--out", str(out)]) == 0
    table_path = out / "1P3D__llama-3.1-8b.ppdt"
    first = table_path.read_bytes()
    table = Table.open(table_path)
    try:
        assert table.header.provenance["labels"]["engine"] == "analytic"
        assert table.header.provenance["labels"]["seed"] == "3"
    finally:
        table.close()
    # Rerun: every point is finished, nothing runs, the same table is published again.
    assert main([*SWEEP, "--out", str(out)]) == 0
    assert table_path.read_bytes() == first
    # The records of the sweep, built by hand, give the same bytes too.
    rebuilt = tmp_path / "rebuilt.ppdt"
    records = [str(p) for p in sorted(out.glob("records/1P3D/**/*.jsonl"))]
    build = [
        "build",
        "--records",
        *records,
        "--shape",
        "1P3D",
        "--model",
        "llama-3.1-8b",
        "--min-samples",
        "2",
    ]
    assert (
        main(
            [
                *build,
                "--label",
                "engine=analytic",
                "--label",
                "conversations=20",
                "--label",
                "duration_s=2.0",
                "--label",
                "seed=3",
                "--out",
                str(rebuilt),
            ]
        )
        == 0
    )
    assert rebuilt.read_bytes() == first


def test_cli_sweep_publish_elsewhere_and_refusals(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tables = tmp_path / "tables"
    tables.mkdir()
    assert main([*SWEEP, "--out", str(tmp_path / "s"), "--publish", str(tables)]) == 0
    assert (tables / "1P3D__llama-3.1-8b.ppdt").is_file()
    assert main([*SWEEP, "--out", str(tmp_path / "s"), "--seed", "9"]) == 1
    assert "other settings" in caplog.text
    assert main([*SWEEP, "--out", str(tmp_path / "t"), "--modes", "ppd"]) == 2
    assert main([*SWEEP, "--out", str(tmp_path / "t"), "--shape", "1P"]) == 2
    assert main([*SWEEP, "--out", str(tmp_path / "t"), "--workloads", "medium_tiny"]) == 2


def test_no_build_only_runs_points(tmp_path: Path) -> None:
    assert main([*SWEEP, "--out", str(tmp_path), "--no-build"]) == 0
    assert len(_tree(tmp_path)) == 8
    assert not list(tmp_path.glob("*.ppdt"))


def test_workload_groups() -> None:
    from ppd.catalog import HUGE_WORKLOADS, WORKLOADS
    from ppd.catalog import select_workloads as _workloads

    assert _workloads("all") == WORKLOADS
    assert len(WORKLOADS) == 18
    assert _workloads("all,huge,small_tiny") == (*WORKLOADS, *HUGE_WORKLOADS)
    assert [w.name for w in _workloads("huge_tiny,small_tiny")] == ["huge_tiny", "small_tiny"]
    assert HUGE_WORKLOADS[0].turn2_context == 5120


def test_sigterm_stops_a_sweep_like_ctrl_c_keeping_its_finished_points(tmp_path: Path) -> None:
    # Without its handler a `kill` ends the process at once: no engine.close(), so the vllm-cpu
    # engine's stack of real workers would be left running.
    out = tmp_path / "sweep"
    argv = [sys.executable, "-m", "table_builder", "sweep", "--engine", "sim", "--shape", "1P3D",
            "--workloads", "all", "--qps", "all", "--duration", "10", "--jobs", "1", "--quiet",
            "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_until(lambda: any(out.rglob("*.jsonl")), deadline_s=300, what="the first finished point")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    finished = list(out.rglob("*.jsonl"))
    assert 0 < len(finished) < 18 * 10 * 3
    assert all(read_records([path]) for path in finished)  # whole points only


def test_a_dry_run_prints_the_grid_and_its_duration_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep"
    argv = ["sweep", "--engine", "analytic", "--shape", "1P3D,2P2D", "--workloads", "small_mid_bal",
            "--qps", "2,4", "--duration", "5", "--out", str(out), "--quiet"]  # fmt: skip
    assert main([*argv, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "analytic: 8 points = 2 shape(s) x 2 mode(s) x 1 workload(s) x 2 QPS level(s)" in plan
    assert "0 already in" in plan
    assert "2P2D_local_small_mid_bal_4" in plan
    assert "8 x 5 s of arrivals, run in simulated time" in plan
    assert not out.exists()
    assert main([*argv, "--no-build", "--shape", "1P3D"]) == 0  # the 1P3D half runs
    capsys.readouterr()
    assert main([*argv, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "4 already in" in plan
    assert "1P3D_pd_small_mid_bal_2  (done)" in plan
    assert "2P2D_pd_small_mid_bal_2  (done)" not in plan
