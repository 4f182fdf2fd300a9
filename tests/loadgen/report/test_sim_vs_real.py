"""``ppd-bench sim-vs-real``: the ratios, the simulated re-run of a folder, the section and the command."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from loadgen.cli import main
from loadgen.report.real_vllm import MANIFEST_NAME, RealRun, RealVllmManifest
from loadgen.report.sim_vs_real import comparison_rows, ratio, sim_vs_real_section, simulate_runs
from table_builder.records import Record, write_records


def test_a_ratio_needs_both_sides() -> None:
    assert ratio(150.0, 100.0) == 1.5
    assert ratio(None, 100.0) is None
    assert ratio(100.0, None) is None
    assert ratio(1.0, 0.0) is None


def _record(run_id: str, mode: str, conv: int, turn: int) -> Record:
    return Record(
        run_id=run_id, shape="1P1D", model="tiny-llama-cpu", mode=mode, target_qps=1.0, workload="sharegpt",
        conversation_id=f"c{conv}-rabc", turn=turn, n_in=40, n_out=20, n_ctx=0 if turn == 1 else 100,
        path="pd" if turn == 1 or mode == "pd" else "local", ttft_ms=100.0 * turn, tpot_ms=10.0,
        e2e_ms=100.0 * turn + 190.0, ok=True, error=None, start_time=float(conv),
    )  # fmt: skip


def _folder(tmp_path: Path, modes: tuple[str, ...] = ("pd", "local")) -> Path:
    folder = tmp_path / "effect"
    runs = []
    for mode in modes:
        run_id = f"L1-{mode}-q1"
        write_records(
            folder / "runs" / f"{run_id}.jsonl",
            [_record(run_id, mode, c, t) for c in range(3) for t in (1, 2)],
        )
        runs.append(RealRun(run_id, "L1", mode, 1.0, "0.1 0.1 0.1"))
    manifest = RealVllmManifest(
        engine="test", model="tiny", profile="p", topology="1P1D", cores={}, seed=0, workload="sharegpt",
        duration_s=3.0, timeout_s=30.0, capacity_qps=1.0, capacity_measured=False, probe=(), table="none",
        runs=tuple(runs), turns=2, max_output_tokens=16, max_context_tokens=600, conversations=10,
    )  # fmt: skip
    (folder / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    return folder


def test_the_runs_are_simulated_with_the_same_arrivals_and_compared(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    assert sim_vs_real_section(folder, tmp_path / "out") == []
    simulated = simulate_runs(folder, "llama-3.1-8b-h100", link="nvlink")
    assert set(simulated) == {"L1-pd-q1", "L1-local-q1"}
    assert all(r.mode == "pd" for r in simulated["L1-pd-q1"])
    assert (folder / "sim" / "L1-pd-q1.jsonl").exists()
    section = sim_vs_real_section(folder, tmp_path / "out")
    assert "profile llama-3.1-8b-h100, link nvlink" in "\n".join(section)
    assert (tmp_path / "out" / "sim_vs_real.png").exists()


def test_local_share_is_compared_for_ppd_only(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    manifest = RealVllmManifest.from_json((folder / MANIFEST_NAME).read_text("utf-8"))
    real = {r.run_id: [_record(r.run_id, r.mode, 0, 2)] for r in manifest.runs}
    rows, within, compared = comparison_rows(manifest, real, real)
    assert not any(row[3] == "local share" for row in rows)
    assert within == compared > 0  # a run against itself: every ratio 1
    ppd = dataclasses.replace(manifest, runs=(RealRun("x", "L1", "ppd", 1.0, "0 0 0"),))
    rows, _, _ = comparison_rows(ppd, {"x": [_record("x", "ppd", 0, 2)]}, {})
    assert any(row[3] == "local share" and row[6] == "-" for row in rows)  # nothing simulated: no ratio


def test_a_ppd_run_without_its_table_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path, modes=("ppd",))
    with pytest.raises(FileNotFoundError, match="1P1D/tiny-llama-cpu"):
        simulate_runs(folder, "llama-3.1-8b-h100", link="nvlink")


def test_the_command_prints_the_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _folder(tmp_path)
    assert (
        main(["sim-vs-real", "--real", str(folder), "--profile", "llama-3.1-8b-h100", "--link", "nvlink"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "| L1 | 1 | pd | Turn 2+ TTFT mean |" in printed
    assert "within +-25%:" in printed
