"""The real-vLLM section: figures per mode, the verdict, the manifest, the rendered section."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadgen.report.real_vllm import (
    MANIFEST_NAME,
    ModeFigures,
    RealRun,
    RealVllmManifest,
    mode_figures,
    real_vllm_section,
    verdict,
)
from loadgen.report.report import load_inputs, write_report
from table_builder.records import Record, write_records
from tests.loadgen.report.records_factory import paper_like


def _record(
    run_id: str, mode: str, turn: int, *, ttft: float, tpot: float, path: str, ok: bool = True
) -> Record:
    return Record(
        run_id=run_id, shape="1P1D", model="tiny-llama-cpu", mode=mode, target_qps=1.0, workload="sharegpt",
        conversation_id=f"{run_id}-{turn}-{ttft}", turn=turn, n_in=40, n_out=20,
        n_ctx=0 if turn == 1 else 200, path=path, ttft_ms=ttft if ok else None, tpot_ms=tpot if ok else None,
        e2e_ms=ttft + 19 * tpot if ok else None, ok=ok, error=None if ok else "timeout",
        start_time=float(turn),
    )  # fmt: skip


def test_figures_count_turn_two_and_later_and_successes_only() -> None:
    records = [
        _record("r", "ppd", 1, ttft=500.0, tpot=10.0, path="pd"),
        _record("r", "ppd", 2, ttft=100.0, tpot=12.0, path="local"),
        _record("r", "ppd", 3, ttft=300.0, tpot=14.0, path="pd"),
        _record("r", "ppd", 2, ttft=0.0, tpot=0.0, path="pd", ok=False),
    ]
    fig = mode_figures(records)
    assert fig.sent == 4
    assert fig.success == 0.75
    assert fig.ttft_mean_ms == 200.0  # turn 1 and the failure are out
    assert fig.ttft_p90_ms == pytest.approx(280.0)
    assert fig.tpot_mean_ms == 12.0
    assert fig.local_share == 0.5


def test_no_records_have_no_figures() -> None:
    fig = mode_figures([])
    assert (fig.sent, fig.success, fig.ttft_mean_ms, fig.tpot_mean_ms, fig.local_share) == (
        0,
        0.0,
        None,
        None,
        None,
    )


def _fig(ttft: float | None, tpot: float | None) -> ModeFigures:
    return ModeFigures(
        sent=10, success=1.0, ttft_mean_ms=ttft, ttft_p90_ms=ttft, tpot_mean_ms=tpot, local_share=None
    )


def test_verdict_needs_lower_ttft_and_tpot_within_fifteen_percent() -> None:
    assert verdict(_fig(600.0, 50.0), _fig(100.0, 55.0)).startswith("PASS (TTFT -83%, TPOT +10%)")
    assert verdict(_fig(600.0, 50.0), _fig(100.0, 60.0)).startswith("FAIL")  # +20% TPOT
    assert verdict(_fig(600.0, 50.0), _fig(700.0, 40.0)).startswith("FAIL")  # slower TTFT
    assert verdict(_fig(None, 50.0), _fig(100.0, 40.0)).startswith("n/a")
    assert verdict(_fig(600.0, 50.0), _fig(100.0, None)).startswith("n/a")


@given(pd=st.floats(1.0, 1e4), ppd=st.floats(1.0, 1e4), tpot=st.floats(1.0, 100.0), cost=st.floats(0.0, 0.3))
def test_verdict_passes_exactly_when_both_conditions_hold(
    pd: float, ppd: float, tpot: float, cost: float
) -> None:
    passed = verdict(_fig(pd, tpot), _fig(ppd, tpot * (1 + cost))).startswith("PASS")
    assert passed == (ppd < pd and tpot * (1 + cost) / tpot - 1 <= 0.15)


def _manifest(runs: tuple[RealRun, ...]) -> RealVllmManifest:
    return RealVllmManifest(
        engine="real vLLM (test)", model="tiny", profile="tiny-llama-cpu on this CPU (2 cores)",
        topology="1P1D", cores={"P0": "0", "D0": "1"}, seed=3, workload="sharegpt multi-turn",
        duration_s=20.0, timeout_s=30.0, capacity_qps=2.0, capacity_measured=True,
        probe=((1.0, 1.0, 200.0), (2.0, 1.0, 300.0), (4.0, 0.5, None)), table="ppd routes with a test table",
        runs=runs,
    )  # fmt: skip


def test_the_manifest_round_trips_and_a_broken_one_is_named() -> None:
    manifest = _manifest((RealRun("L1-pd-q1", "L1", "pd", 1.0, "0.5 0.4 0.3"),))
    assert RealVllmManifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(ValueError, match=MANIFEST_NAME):
        RealVllmManifest.from_json('{"engine": "x"}')


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "effect"
    runs = []
    for level, qps in (("L1", 0.5), ("L2", 1.0)):
        for mode, ttft, tpot, path in (("pd", 600.0, 50.0, "pd"), ("local", 50.0, 70.0, "local"),
                                       ("ppd", 80.0, 52.0, "local")):  # fmt: skip
            run_id = f"{level}-{mode}-q{qps:g}"
            recs = [_record(run_id, mode, 1, ttft=900.0, tpot=tpot, path="pd")]
            recs += [_record(run_id, mode, 2, ttft=ttft, tpot=tpot, path=path)]
            write_records(folder / "runs" / f"{run_id}.jsonl", recs)
            runs.append(RealRun(run_id, level, mode, qps, "1.00 2.00 3.00"))
    (folder / MANIFEST_NAME).write_text(_manifest(tuple(runs)).to_json(), encoding="utf-8")
    return folder


def test_the_section_names_engine_profile_seed_and_workload_and_draws_its_plot(tmp_path: Path) -> None:
    lines = real_vllm_section(_folder(tmp_path), tmp_path / "out")
    text = "\n".join(lines)
    for needle in ("real vLLM (test)", "tiny-llama-cpu on this CPU", "seed 3", "sharegpt multi-turn",
                   "P0 on cores 0", "D0 on cores 1", "1.00 2.00 3.00", "measured by a pd ramp"):  # fmt: skip
        assert needle in text
    rows = [line for line in lines if line.startswith("| L")]
    assert len(rows) == 6 + 2  # 2 levels x 3 modes, then one verdict per level
    assert sum("PASS (TTFT -87%, TPOT +4%)" in line for line in rows) == 2
    assert (tmp_path / "out" / "real_vllm.png").stat().st_size > 0


def test_a_level_without_ppd_gets_no_verdict(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    manifest = RealVllmManifest.from_json((folder / MANIFEST_NAME).read_text("utf-8"))
    kept = tuple(r for r in manifest.runs if not (r.level == "L2" and r.mode == "ppd"))
    (folder / MANIFEST_NAME).write_text(dataclasses.replace(manifest, runs=kept).to_json(), encoding="utf-8")
    rows = [line for line in real_vllm_section(folder, tmp_path / "out") if line.startswith("| L")]
    assert len(rows) == 5 + 1


def test_the_report_carries_the_section_when_given_a_folder(tmp_path: Path) -> None:
    records, _ = paper_like()
    write_records(tmp_path / "sim" / "a.jsonl", records)
    inputs = load_inputs(tmp_path / "sim")
    path = write_report(inputs, tmp_path / "out", real_vllm=_folder(tmp_path))
    assert "## PPD on real vLLM" in path.read_text("utf-8")
    plain = write_report(inputs, tmp_path / "plain")
    assert "## PPD on real vLLM" not in plain.read_text("utf-8")
