from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from loadgen.cli import main
from loadgen.report.comparison import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    Point,
    acceptance,
    band_changes,
    bandwidth_points,
    failure_rates,
    pareto,
    points,
    winners,
    wtpot_points,
)
from loadgen.report.report import load_inputs, write_report
from table_builder.records import write_records
from tests.loadgen.report.records_factory import paper_like


def test_points_group_by_shape_mode_and_qps_and_leave_sweeps_out() -> None:
    records, manifest = paper_like()
    pts = points(records, manifest)
    assert {(p.shape, p.mode) for p in pts} == {
        (s, m) for s in ("1P3D", "2P2D") for m in ("pd", "local", "ppd")
    }
    assert [p.mode for p in pts[:3]] == ["pd", "pd", "pd"]  # pd first, then local, then ppd
    assert all(p.sent == 24 for p in pts)
    ppd = next(p for p in pts if p.mode == "ppd")
    assert ppd.local_share is not None
    assert 0.4 < ppd.local_share <= 1.0
    changes = band_changes(pts, "1P3D", "ppd")
    assert changes["low"] is not None
    assert changes["low"] < -0.5
    assert changes["medium"] is not None
    assert changes["high"] is not None


def test_failures_winners_and_pareto() -> None:
    records, manifest = paper_like()
    pts = points(records, manifest)
    rates = failure_rates(pts)
    assert rates[("1P3D", "local")] == {12.0: 0.0}
    assert rates[("1P3D", "pd")][12.0] > 0
    w = winners(pts)
    assert w.test_points == 6
    assert w.tpot_best["pd"] == 6
    assert w.ttft_best["local"] == 6
    assert w.full_success["ppd"] == 6
    front = pareto([p for p in pts if p.shape == "1P3D" and p.qps == 12.0])
    assert front


def test_acceptance_checks_pass_on_paper_like_records_and_say_na_without_data() -> None:
    records, manifest = paper_like()
    pts = points(records, manifest)
    result = acceptance(pts, wtpot_points(records, manifest), bandwidth_points(records, manifest))
    verdicts = {c.name: c.passed for c in result.checks}
    assert verdicts["PPD cuts mean Turn 2+ TTFT vs PD by >= 50%"] is True
    assert verdicts["PPD mean TPOT within +15% of PD"] is True
    assert verdicts["where PD's success rate < 95%, PPD stays at 100%"] is True
    assert verdicts["raising w_tpot lowers the local share monotonically"] is True
    assert verdicts["PD's Turn 2+ TTFT rises as the link slows while PPD's stays flat"] is True
    empty = acceptance([], [], [])
    assert all(c.passed is None for c in empty.checks)


def test_manifest_round_trips_and_rejects_bad_fields() -> None:
    _, manifest = paper_like(seed=3)
    assert Manifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(ManifestError, match="w_tpot"):
        Manifest.from_json('{"runs": {"a": {"w_tpot": "high"}}}')
    with pytest.raises(ManifestError, match="seed"):
        Manifest.from_json('{"seed": "x"}')
    with pytest.raises(ManifestError, match="not JSON"):
        Manifest.from_json("{")


def _write(folder: Path, seed: int = 0) -> None:
    records, manifest = paper_like(seed)
    folder.mkdir(parents=True, exist_ok=True)
    write_records(folder / "runs.jsonl", records)
    (folder / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")


def test_report_writes_markdown_and_every_plot(tmp_path: Path) -> None:
    _write(tmp_path / "records", seed=5)
    path = write_report(load_inputs(tmp_path / "records"), tmp_path / "out")
    text = path.read_text("utf-8")
    for heading in ("Table 1", "Figure 1", "Table 5", "Table 3", "Figure 6", "Figure 5", "Acceptance"):
        assert heading in text
    assert "test factory, seed 5" in text
    assert "| paper, x=1 (Table 1) | -57.8% | -65.2% | -73.3% |" in text
    assert "The paper's Table 5" in text
    assert "FAIL" not in text
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert pngs == ["figure1_pareto.png", "figure5_links.png", "figure6_wtpot.png", "table1_ttft_by_qps.png"]
    for name in pngs:
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in text


def test_report_cli_and_its_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "records")
    assert main(["report", "--records", str(tmp_path / "records"), "--out", str(tmp_path / "out")]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["report", "--records", str(tmp_path / "nothing"), "--out", str(tmp_path / "o2")]) == 1
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl").write_text('{"run_id": 1}\n', encoding="utf-8")
    assert main(["report", "--records", str(tmp_path / "bad"), "--out", str(tmp_path / "o3")]) == 1


def test_a_report_without_sweeps_says_so(tmp_path: Path) -> None:
    records, _ = paper_like()
    write_records(tmp_path / "r" / "a.jsonl", [r for r in records if "-" in r.run_id and r.run_id[0] in "12"])
    text = write_report(load_inputs(tmp_path / "r"), tmp_path / "out").read_text("utf-8")
    assert "No w_tpot sweep in these records." in text
    assert "No link-bandwidth sweep in these records." in text
    assert "unknown engine, seed unrecorded" in text


def _pt(mode: str, qps: float, ttft: float, ok: int) -> Point:
    return Point(shape="1P3D", mode=mode, qps=qps, sent=100, ok=ok, ttft2_mean_ms=ttft, ttft2_p99_ms=ttft,
                 ttft_p99_ms=ttft, tpot2_mean_ms=8.0, e2e_mean_ms=1000.0, tokens_per_s=1.0, local_share=None,
                 workloads=("sharegpt",))  # fmt: skip


def test_stress_levels_count_for_success_but_not_for_the_latency_means() -> None:
    pts = [_pt("pd", 4.0, 100.0, 100), _pt("ppd", 4.0, 30.0, 100), _pt("pd", 160.0, 9000.0, 80),
           _pt("ppd", 160.0, 50.0, 99)]  # fmt: skip
    checks = {c.name: c for c in acceptance(pts, [], []).checks}
    ttft = checks["PPD cuts mean Turn 2+ TTFT vs PD by >= 50%"]
    assert ttft.passed is True
    assert "100.0 -> 30.0 ms" in ttft.detail
    success = checks["where PD's success rate < 95%, PPD stays at 100%"]
    assert success.passed is False
    assert success.detail == "QPS 160: PD 80.0% / PPD 99.0%"
    # A static local run at the same level is shown beside them (is the decode tier itself saturated?).
    with_local = acceptance([*pts, _pt("local", 160.0, 60.0, 97)], [], []).checks
    detail = {c.name: c for c in with_local}["where PD's success rate < 95%, PPD stays at 100%"].detail
    assert detail == "QPS 160: PD 80.0% / PPD 99.0% (static local 97.0%)"


def test_a_small_failure_rate_is_never_printed_as_zero(tmp_path: Path) -> None:
    records, manifest = paper_like()
    first = next(i for i, r in enumerate(records) if r.run_id == "1P3D-ppd-12.0" and r.ok)
    records[first] = dataclasses.replace(records[first], ok=False, error="timeout", ttft_ms=None)
    write_records(tmp_path / "r" / "runs.jsonl", records)
    (tmp_path / "r" / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    text = write_report(load_inputs(tmp_path / "r"), tmp_path / "out").read_text("utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| 1P3D (ppd) |"))
    sent = sum(1 for r in records if r.run_id == "1P3D-ppd-12.0")
    assert f"| {100 / sent:.1f}% |" in row
