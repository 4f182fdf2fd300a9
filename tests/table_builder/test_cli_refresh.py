"""`ppd-table refresh`: help, exit codes, the report (text and JSON), the atomic publish, bad logs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from decision_service.table import Table, TableSpec, write_table
from ppd.records import UncheckedRecord
from table_builder.cli import main
from table_builder.records import write_records
from tests.support.records import base_table, logged, make_record

KEY_FILE = "1P3D__llama-3.1-8b.ppdt"


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """The offline-built table, kept apart from the folder a decision service serves."""
    folder = tmp_path / "base"
    folder.mkdir()
    table = base_table()
    return write_table(folder / KEY_FILE, TableSpec(table.header, table.figures))


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    folder = tmp_path / "logs" / "gateway-0"
    folder.mkdir(parents=True)
    write_records(folder / "requests.jsonl", logged("local", 20, ttft=400.0))
    return tmp_path / "logs"


def test_help_lists_every_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "table_builder", "refresh", "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    for flag in (
        "--logs",
        "--base",
        "--out",
        "--min-samples",
        "--confidence",
        "--qps-window",
        "--timeout-ms",
        "--replace-drifted",
        "--interference",
        "--skip-bad-lines",
        "--json",
    ):
        assert flag in result.stdout


def test_refresh_publishes_the_table_and_prints_the_report(
    base: Path, logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "served"
    assert main(["refresh", "--logs", str(logs), "--base", str(base), "--out", f"{out}/"]) == 0
    text = capsys.readouterr().out
    published = out / KEY_FILE
    table = Table.open(published)
    assert table.header.provenance["source"] == "refresh"
    assert "answers flipped: 10 cell(s)" in text
    assert "small/mid_paste@2: local -> pd (TABLE, 20 logged" in text
    assert f"wrote {published} (key 1P3D/llama-3.1-8b, version {table.version}, from base version" in text
    assert sorted(p.name for p in out.iterdir()) == [KEY_FILE]  # no temp file left behind
    # The same logs again: the same bytes.
    first = published.read_bytes()
    assert main(["refresh", "--logs", str(logs), "--base", str(base), "--out", f"{out}/"]) == 0
    assert published.read_bytes() == first


def test_replace_drifted_reaches_the_refresh(base: Path, logs: Path, tmp_path: Path) -> None:
    args = ["refresh", "--logs", str(logs), "--base", str(base), "--json"]
    assert main([*args, "--out", str(tmp_path / "plain.ppdt")]) == 0
    assert main([*args, "--out", str(tmp_path / "replaced.ppdt"), "--replace-drifted"]) == 0
    plain, replaced = Table.open(tmp_path / "plain.ppdt"), Table.open(tmp_path / "replaced.ppdt")
    assert "replace_drifted" not in plain.header.provenance
    assert replaced.header.provenance["replace_drifted"] is True


def test_interference_reaches_the_refresh(base: Path, logs: Path, tmp_path: Path) -> None:
    args = ["refresh", "--logs", str(logs), "--base", str(base), "--json"]
    assert main([*args, "--out", str(tmp_path / "plain.ppdt")]) == 0
    assert main([*args, "--out", str(tmp_path / "fitted.ppdt"), "--interference"]) == 0
    plain, fitted = Table.open(tmp_path / "plain.ppdt"), Table.open(tmp_path / "fitted.ppdt")
    assert "interference" not in plain.header.provenance
    assert isinstance(fitted.header.provenance["interference"], dict)


def test_json_report_is_one_line(
    base: Path, logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["refresh", "--logs", str(logs), "--base", str(base), "--out", str(tmp_path / "t.ppdt"), "--json"]
    assert main([*args, "--min-samples", "21", "--confidence", "0.95"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    report = json.loads(line)
    assert report["table"] == str(tmp_path / "t.ppdt")
    assert report["version"] == Table.open(tmp_path / "t.ppdt").version
    assert (report["flipped"], report["held"], report["confidence"], report["min_samples"]) == (
        0,
        1,
        0.95,
        21,
    )
    assert report["held_cells"] == [{"cell": "small/mid_paste@2", "logged": 20}]
    assert report["drift"][0]["shifts"][0]["figure"] == "local_ttft_ms"


def test_out_may_not_replace_the_base(base: Path, logs: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = base.read_bytes()
    assert main(["refresh", "--logs", str(logs), "--base", str(base), "--out", f"{base.parent}/"]) == 2
    assert "--out would replace --base" in caplog.text
    assert base.read_bytes() == before


def test_a_bad_base_is_exit_1(tmp_path: Path, logs: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "missing.ppdt"
    assert main(["refresh", "--logs", str(logs), "--base", str(missing), "--out", str(tmp_path / "o/")]) == 1
    assert "cannot read the base table" in caplog.text
    bad = tmp_path / "bad.ppdt"
    bad.write_bytes(b"not a table")
    assert main(["refresh", "--logs", str(logs), "--base", str(bad), "--out", str(tmp_path / "o/")]) == 1
    assert "bad_magic" in caplog.text
    assert not (tmp_path / "o" / KEY_FILE).exists()


def test_bad_log_lines_fail_unless_skipped(
    base: Path,
    logs: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = logs / "gateway-0" / "requests.jsonl"
    with log.open("a") as fh:
        fh.write('{"run_id": "gateway", "shape": "1P3D"')  # a line still being written
    out = tmp_path / "served"
    args = ["refresh", "--logs", str(logs), "--base", str(base), "--out", f"{out}/"]
    assert main(args) == 1
    assert f"{log}:21:" in caplog.text
    assert "--skip-bad-lines" in caplog.text
    assert not out.exists() or not list(out.iterdir())
    capsys.readouterr()
    assert main([*args, "--skip-bad-lines"]) == 0
    text = capsys.readouterr().out
    assert "skipped 1 bad log line(s)" in text
    assert "answers flipped: 10" in text
    assert (out / KEY_FILE).exists()


def test_missing_logs_are_exit_1(base: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["refresh", "--logs", str(empty), "--base", str(base), "--out", str(tmp_path / "o/")]) == 1
    assert "no *.jsonl record files" in caplog.text


@pytest.mark.parametrize(
    "extra",
    [
        ["--confidence", "1"],
        ["--confidence", "0"],
        ["--min-samples", "0"],
        ["--qps-window", "0"],
        ["--qps-window", "nan"],
        ["--timeout-ms", "0"],
        ["--timeout-ms", "inf"],
    ],
)
def test_bad_flags_are_usage_errors(extra: list[str], base: Path, logs: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["refresh", "--logs", str(logs), "--base", str(base), "--out", str(tmp_path / "o/"), *extra])
    assert exc.value.code == 2


# --- hostile logs (issue 24) -------------------------------------------------------------------------


def _report(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    (line,) = [s for s in capsys.readouterr().out.splitlines() if s.startswith("{")]
    report: dict[str, Any] = json.loads(line)
    return report


def test_a_log_given_twice_counts_once(
    base: Path, logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = logs / "gateway-0" / "requests.jsonl"
    args = ["refresh", "--base", str(base), "--min-samples", "40", "--json"]
    assert main([*args, "--logs", str(logs), "--out", str(tmp_path / "once.ppdt")]) == 0
    once = _report(capsys)
    # The folder and a file in it, the same file by two paths, and a rotated copy of its lines.
    (logs / "gateway-0" / "requests-copy.jsonl").write_bytes(log.read_bytes())
    twice = [str(logs), str(log), str(logs / "gateway-0" / ".." / "gateway-0" / "requests.jsonl")]
    assert main([*args, "--logs", *twice, "--out", str(tmp_path / "twice.ppdt")]) == 0
    report = _report(capsys)
    assert (once["used"], report["used"]) == (20, 20)
    assert report["left_out"] == {"duplicate line (the same request again)": 20}
    assert report["flipped"] == 0  # 20 logged, not 40 or 60
    assert Table.open(tmp_path / "twice.ppdt").figures.tobytes() == (
        Table.open(tmp_path / "once.ppdt").figures.tobytes()
    )


@pytest.mark.parametrize("skip", [[], ["--skip-bad-lines"]])
def test_schema_valid_lines_that_would_overflow_a_sum_do_not_stop_the_refresh(
    skip: list[str], base: Path, logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = [
        make_record(run_id="gateway", mode="ppd", path="pd", conversation_id=f"h{i}", tpot_ms=1.7e308)
        for i in range(2)
    ]
    write_records(logs / "gateway-0" / "huge.jsonl", huge)
    out = tmp_path / "t.ppdt"
    args = ["refresh", "--logs", str(logs), "--base", str(base), "--out", str(out), "--json", *skip]
    assert main(args) == 0
    report = _report(capsys)
    assert report["used"] == 22
    assert any("beyond the 30000 ms timeout" in note for note in report["notes"])
    assert math.isfinite(float(Table.open(out).figures[0, 6, 2].max()))
    assert Table.open(out).header.provenance["timeout_ms"] == 30_000.0
    capsys.readouterr()
    assert main([*args, "--timeout-ms", "60000"]) == 0
    assert Table.open(out).header.provenance["timeout_ms"] == 60_000.0


def test_production_lines_as_the_gateway_writes_them_are_evidence(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The gateway's request log as deployed: no target_qps, no workload label ([log] workload "").
    folder = tmp_path / "gateways" / "ppd-gateway-0"
    folder.mkdir(parents=True)
    lines = []
    for i in range(10):
        for turn in (1, 2):
            r = make_record(
                run_id="gateway", mode="ppd", path="pd" if turn == 1 else "local", target_qps=0.0,
                conversation_id=f"s{i}", turn=turn, n_ctx=0 if turn == 1 else 256,
                start_time=1_767_300_000.0 + i + turn / 10,
            )  # fmt: skip
            fields = {**r.to_dict(), "workload": ""}
            lines.append(json.dumps(UncheckedRecord(**fields).to_dict(), separators=(",", ":")) + "\n")
    (folder / "requests.jsonl").write_text("".join(lines))
    args = ["refresh", "--logs", str(folder.parent), "--base", str(base), "--out", str(tmp_path / "t.ppdt")]
    assert main([*args, "--skip-bad-lines", "--json"]) == 0
    report = _report(capsys)
    assert (report["skipped_lines"], report["used"]) == (0, 10)


def test_memory_stays_bounded_whatever_the_logs_hold(
    base: Path, logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad lines are counted (a few kept as examples), a line over the cap is never read whole, and a
    line repeated is one digest: the peak is the same with megabytes of such lines as without."""

    def peak(paths: list[Path]) -> int:
        args = ["refresh", "--base", str(base), "--out", str(tmp_path / "t.ppdt"), "--skip-bad-lines"]
        tracemalloc.start()
        try:
            assert main([*args, "--json", "--logs", *map(str, paths)]) == 0
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    peak([logs])  # imports and first-use caches, out of the comparison
    clean = peak([logs])
    capsys.readouterr()
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "blank.jsonl").write_bytes(b"\n" * 1_000_000)
    (hostile / "long.jsonl").write_bytes(b'{"run_id": "' + b"x" * 3_000_000 + b'"}\n' + b"y" * 2_000_000)
    line = make_record(run_id="gateway", mode="ppd", path="local", conversation_id="same").to_json()
    (hostile / "repeated.jsonl").write_text((line + "\n") * 20_000)
    assert sum(p.stat().st_size for p in hostile.iterdir()) > 10_000_000
    grown = peak([logs, hostile]) - clean
    assert grown < 2_000_000, f"peak grew by {grown} bytes"
    report = _report(capsys)
    assert report["skipped_lines"] == 1_000_002
    assert report["left_out"]["duplicate line (the same request again)"] == 19_999
