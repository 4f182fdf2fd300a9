"""The report's --run path: the three experiments on the virtual-time cluster simulation, at CI size."""

from __future__ import annotations

import shutil
from pathlib import Path

from loadgen.cli import main
from loadgen.report.comparison import Manifest
from loadgen.report.reproduce import (
    PREFILL_HEAVY_WORKLOAD,
    ReproduceSettings,
    find_table,
    prefill_heavy_lists,
    reproduce,
)
from table_builder.records import read_records

ROOT = Path(__file__).resolve().parents[3]
GOOD = ROOT / "tests" / "testdata" / "tables" / "good.ppdt"


def _tables(tmp_path: Path) -> Path:
    folder = tmp_path / "tables"
    folder.mkdir()
    shutil.copy(GOOD, folder / "1P3D__llama-3.1-8b.ppdt")
    (folder / "junk.ppdt").write_bytes(b"not a table")
    return folder


def test_find_table_matches_the_key_and_skips_bad_files(tmp_path: Path) -> None:
    tables = _tables(tmp_path)
    assert find_table(tables, "1P3D", "llama-3.1-8b") == tables / "1P3D__llama-3.1-8b.ppdt"
    assert find_table(tables, "2P2D", "llama-3.1-8b") is None
    assert find_table(tmp_path / "missing", "1P3D", "llama-3.1-8b") is None


def test_reproduce_runs_every_experiment_with_the_same_seeded_traffic(tmp_path: Path) -> None:
    settings = ReproduceSettings(
        seed=2, duration_s=2.0, workload="large_mid_paste", shapes=("1P3D", "2P2D"), qps_levels=(1.0, 4.0),
        tables=_tables(tmp_path), wtpot_values=(1.0, 8.0), links=("nvlink", "100gbe"), link_duration_s=2.0,
        stress_qps=(30.0,), paper_wtpot_values=(1.0, 6.0), paper_wtpot_qps=(8.0,), paper_wtpot_duration_s=2.0,
        paper_wtpot_scan=300,
    )  # fmt: skip
    out = tmp_path / "records"
    manifest = reproduce(settings, out)
    assert Manifest.from_json((out / "manifest.json").read_text("utf-8")) == manifest
    assert manifest.seed == 2
    assert "2P2D: no table found, so no ppd runs" in manifest.notes
    qps = read_records(sorted((out / "qps").glob("*.jsonl")))
    assert {(r.shape, r.mode) for r in qps} == {("1P3D", "pd"), ("1P3D", "local"), ("1P3D", "ppd"),
                                              ("2P2D", "pd"), ("2P2D", "local")}  # fmt: skip
    by_mode = {m: sorted(r.conversation_id for r in qps if r.mode == m and r.shape == "1P3D" and r.turn == 1)
               for m in ("pd", "local", "ppd")}  # fmt: skip
    assert by_mode["pd"] == by_mode["local"] == by_mode["ppd"]  # identical arrivals for every mode
    assert {r.path for r in qps if r.mode == "local" and r.turn == 2} == {"local"}
    assert {r.target_qps for r in qps if r.shape == "1P3D"} == {4.0, 30.0}  # stress level on 1P3D only
    assert {r.target_qps for r in qps if r.shape == "2P2D"} == {4.0}  # (2 s at QPS 1: no arrival, seed 2)
    assert manifest.runs["wtpot-8"].w_tpot == 8.0
    assert manifest.runs["link-100gbe-pd"].link_gb_s == 10.0
    assert len(list((out / "bandwidth").glob("*.jsonl"))) == 4
    # Figure 6 in the paper's setting: static PD and each w_tpot on the same prefill-heavy conversations
    assert manifest.runs["wtpot-paper@8-6"].w_tpot == 6.0
    assert manifest.runs["wtpot-paper@8-pd"].experiment == "wtpot-paper@8"
    paper = read_records(sorted((out / "wtpot-paper@8").glob("*.jsonl")))
    assert {r.mode for r in paper} == {"pd", "ppd"}
    assert {r.workload for r in paper} == {PREFILL_HEAVY_WORKLOAD}
    assert {r.target_qps for r in paper} == {8.0}
    later: dict[str, list[tuple[int, int]]] = {}
    for r in paper:
        if r.turn >= 2:
            later.setdefault(f"{r.run_id}/{r.conversation_id}", []).append((r.n_in, r.n_out))
    assert later
    # a whole conversation is prefill-heavy (turns cut by the end of a run still count towards it)
    heavy = prefill_heavy_lists(settings)
    assert heavy
    assert all(sum(t[0] for t in c[1:]) > 2 * sum(t[1] for t in c[1:]) for c in heavy)


def test_report_run_writes_records_and_the_report(tmp_path: Path) -> None:
    argv = [
        "report", "--run", "--records", str(tmp_path / "rec"), "--out", str(tmp_path / "out"),
        "--tables", str(_tables(tmp_path)), "--shapes", "1P3D", "--qps", "2", "--duration", "2",
        "--workload", "small_mid_bal", "--wtpot", "1,4", "--link-duration", "2", "--no-progress",
        "--paper-wtpot", "1", "--paper-wtpot-qps", "8",
    ]  # fmt: skip
    assert main(argv) == 0
    text = (tmp_path / "out" / "report.md").read_text("utf-8")
    assert "virtual-time cluster simulation" in text
    assert "seed 0" in text
    assert "small_mid_bal" in text.split("\n", 3)[2]  # the provenance line names the workloads
    assert "## Figure 6 in the paper's setting" in text
    assert "QPS 8:" in text
    assert (tmp_path / "out" / "figure6_paper_setting.png").stat().st_size > 0
    assert "## Prefix-aware placement" in text  # its runs are part of --run unless --no-placement
    assert "| 1P3D: within 2% of least loaded | PASS |" in text
    assert "#### shared4096_64x4_small_small_bal, 1P3D" in text  # and the shared-prefix family's Turn 1
    assert (tmp_path / "out" / "placement_shared.png").stat().st_size > 0


def test_reproduce_feeds_real_sharegpt_turns(tmp_path: Path) -> None:
    settings = ReproduceSettings(
        duration_s=3.0, shapes=("1P3D",), modes=("local",), qps_levels=(4.0,), tables=tmp_path,
        sharegpt_conversations=20, wtpot_values=(), links=(), paper_wtpot_values=(),
    )  # fmt: skip
    reproduce(settings, tmp_path / "rec")
    records = read_records(sorted((tmp_path / "rec" / "qps").glob("*.jsonl")))
    assert {r.workload for r in records} == {"sharegpt"}
    assert max(r.turn for r in records) > 2
