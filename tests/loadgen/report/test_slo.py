"""``ppd-bench slo``: the fixed-weights arms end to end at CI size, the windowed figures, and the SLO
arm (``ppd.slo``) against fixed weights on a ramp that presses its target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadgen.cli import main
from loadgen.report.slo import ArmSlo, SloFigures, SloSettings, run_slo, windows
from table_builder.records import read_records

ROOT = Path(__file__).resolve().parents[3]
TABLE = ROOT / "tables" / "3P1D__llama-3.1-8b.ppdt"
# CI size: 10 s per step, the peak held for two steps (about 5 s of CPU per arm). At this size the
# TPOT P99 (all turns, 5 s windows) of fixed w_tpot=1 climbs to about 19 ms at the peak and that of
# w_tpot=16 to 17: a 17.5 ms target is pressed there and a fixed weight can hold it.
CI = SloSettings(levels=(2.0, 7.0, 7.0, 2.0), step_s=10.0, window_s=5.0, tpot_p99_ms=17.5, table=TABLE)


def _with(**changes: Any) -> SloSettings:
    fields = {name: getattr(CI, name) for name in SloSettings.__dataclass_fields__}
    return SloSettings(**{**fields, **changes})


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("slo")
    fig, path = run_slo(_with(run_slo_arm=False, fixed_w_tpot=(1.0, 1000.0)), out)
    assert path == out / "slo.md"
    return out, fig


def test_fixed_arms_end_to_end(fixed_run: tuple[Path, Any]) -> None:
    out, fig = fixed_run
    local, pd = fig.arm("fixed w_tpot=1"), fig.arm("fixed w_tpot=1000")
    assert local is not None
    assert pd is not None
    assert fig.arm("slo") is None
    # Same arrivals; w_tpot=1 keeps the append-prefills local (TTFT), 1000 sends them to P (TPOT).
    assert local.ttft_ms < pd.ttft_ms
    assert local.tpot_p99_ms > pd.tpot_p99_ms
    assert len(local.windows) == 8
    assert [w.qps for w in local.windows] == [2.0, 2.0, 7.0, 7.0, 7.0, 7.0, 2.0, 2.0]
    assert {w.local_share for w in pd.windows} - {None} == {0.0}
    text = (out / "slo.md").read_text("utf-8")
    assert "| fixed w_tpot=1 |" in text
    assert (out / "slo.png").stat().st_size > 10_000
    assert json.loads((out / "slo.json").read_text("utf-8"))["target_ms"] == CI.tpot_p99_ms
    assert {r.run_id for r in read_records([out / "records" / "fixed_w_tpot1.jsonl"])} == {
        "slo-fixed-w_tpot1"
    }


def test_windows_count_p99_and_violations() -> None:
    settings = _with(levels=(1.0,), step_s=10.0, window_s=5.0, tpot_p99_ms=20.0)
    rows = [
        {
            "turn": 2,
            "ok": True,
            "start_time": 1.0 + i * 0.01,
            "tpot_ms": float(i),
            "ttft_ms": 10.0,
            "path": "local",
        }
        for i in range(1, 101)
    ]
    rows.append({"turn": 1, "ok": True, "start_time": 6.0, "tpot_ms": 99.0, "ttft_ms": 1.0, "path": "pd"})
    first, second = windows(rows, settings)
    assert first.tpot_p99_ms == 99.0
    assert first.ttft_ms == 10.0
    assert first.local_share == 1.0
    # The TPOT P99 is every turn's (what the controller holds); TTFT and the local share Turn 2+'s.
    assert second.tpot_p99_ms == 99.0
    assert second.ttft_ms is None
    assert second.local_share is None


def test_slo_arm_holds_the_target_better_than_fixed_weights(tmp_path: Path) -> None:
    fig, _ = run_slo(_with(fixed_w_tpot=(1.0,)), tmp_path)
    slo, fixed = fig.arm("slo"), fig.arm("fixed w_tpot=1")
    assert slo is not None
    assert fixed is not None
    assert fixed.violations > 0  # the ramp presses the target
    assert slo.violations < fixed.violations
    assert min(w.local_share for w in slo.windows if w.local_share is not None) < 1.0


def test_cli_help_bad_arguments_and_a_small_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["slo", "--help"])
    assert exc.value.code == 0
    assert "--tpot-p99-ms" in capsys.readouterr().out
    for bad in (["--levels", "2,x"], ["--levels", "0"], ["--fixed-w-tpot", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(["slo", "--out", "x", *bad])
        assert exc.value.code == 2
    args = ["slo", "--out", str(tmp_path), "--levels", "2", "--step", "5", "--no-slo-arm", "--no-progress"]
    assert main([*args, "--table", str(TABLE), "--fixed-w-tpot", "1"]) == 0
    assert "slo section:" in capsys.readouterr().out
    assert (tmp_path / "slo.md").exists()


def test_the_holding_fixed_arm_is_the_lowest_w_tpot_whatever_the_order() -> None:
    def arm(name: str, violations: int) -> ArmSlo:
        return ArmSlo(name=name, windows=(), violations=violations, ttft_ms=1.0, tpot_p99_ms=1.0, failed=0)

    fig = SloFigures(
        target_ms=25.0, arms=(arm("fixed w_tpot=16", 0), arm("fixed w_tpot=4", 0), arm("slo", 0))
    )
    assert fig.holding_fixed is not None
    assert fig.holding_fixed.name == "fixed w_tpot=4"
    none = SloFigures(target_ms=25.0, arms=(arm("fixed w_tpot=1", 3),))
    assert none.holding_fixed is None
