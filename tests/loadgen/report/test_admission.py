"""``ppd-bench admission`` at CI size: the capacity search, the two arms on a ramp past capacity (the
arm without admission collapses, the arm with it keeps its goodput and its served TTFT within the
SLO), the section and figures written, and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.cli import main
from loadgen.report.admission import AdmissionExperiment, run_admission

# CI size: 20 s steps (the arm without admission needs that long to collapse), 40 ShareGPT
# conversations, a coarse capacity search (about 10 s of CPU).
CI = AdmissionExperiment(conversations=40, capacity_levels=(10.0, 20.0, 30.0), ramp=(1.0, 2.0), step_s=20.0)


def test_admission_keeps_goodput_and_ttft_past_capacity(tmp_path: Path) -> None:
    fig, path = run_admission(CI, tmp_path)
    assert path == tmp_path / "admission.md"
    assert fig.capacity_qps in CI.capacity_levels
    on, off = fig.step("admission", 2.0), fig.step("no admission", 2.0)
    assert on is not None
    assert off is not None
    assert off.shed_share == 0.0
    assert on.shed_share > 0.0
    assert on.goodput > off.goodput
    assert on.ttft_p99_ms is not None
    assert on.ttft_p99_ms <= CI.ttft_slo_ms
    assert off.ttft_p99_ms is not None
    assert off.ttft_p99_ms > CI.ttft_slo_ms
    text = path.read_text()
    assert "| goal | result | measured |" in text
    assert (tmp_path / "admission.png").stat().st_size > 0
    saved = json.loads((tmp_path / "admission.json").read_text())
    assert saved["capacity_qps"] == fig.capacity_qps


def test_a_capacity_search_that_never_fits_is_refused(tmp_path: Path) -> None:
    tight = AdmissionExperiment(conversations=20, capacity_levels=(30.0,), step_s=10.0, ttft_slo_ms=1.0)
    with pytest.raises(ValueError, match="lower --capacity-levels"):
        run_admission(tight, tmp_path)


def test_cli_help_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["admission", "--help"])
    assert exc.value.code == 0
    assert "--ttft-slo-ms" in capsys.readouterr().out
    for bad in (["--ramp", "1,x"], ["--capacity-levels", "0"], ["--high-share", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(["admission", "--out", "x", *bad])
        assert exc.value.code == 2
