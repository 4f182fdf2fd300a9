"""``ppd-table build|check|show``: exit codes, output, atomic publish, determinism, --png."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from decision_service.table import Figure, Table
from table_builder.cli import main
from table_builder.records import write_records
from tests.support.records import ARTIFACT
from tests.support.records import make_record as record

REPO = Path(__file__).resolve().parents[2]
TABLES = REPO / "tests" / "testdata" / "tables"
BAD = sorted(TABLES.glob("bad_*.ppdt"))


def _records(path: Path) -> Path:
    rows = []
    for i in range(3):
        rows.append(record(conversation_id=f"p{i}", ttft_ms=100.0 + i))
        rows.append(
            record(mode="local", path="local", run_id="run-local", conversation_id=f"l{i}", ttft_ms=40.0 + i)
        )
        rows.append(record(conversation_id=f"p{i}", turn=1, n_ctx=0, n_in=128, n_out=128))
    write_records(path, rows)
    return path


def _build(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "t.ppdt"
    code = main(
        [
            "build",
            "--records",
            str(_records(tmp_path / "r.jsonl")),
            "--shape",
            "1P3D",
            "--model",
            "llama-3.1-8b",
            "--out",
            str(out),
            *extra,
        ]
    )
    assert code == 0
    return out


def test_build_publishes_a_table_that_check_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _build(tmp_path)
    printed = capsys.readouterr().out
    assert "1 low-sample" in printed
    assert "left out 3 (turn 1" in printed
    assert f"wrote {out}" in printed
    assert not list(tmp_path.glob("*.tmp"))
    assert main(["check", str(out)]) == 0
    assert "ok   " in capsys.readouterr().out


def test_build_twice_gives_identical_bytes(tmp_path: Path) -> None:
    first = _build(tmp_path).read_bytes()
    second = _build(tmp_path).read_bytes()
    assert first == second


def test_build_into_a_folder_names_the_file_by_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = _records(tmp_path / "r.jsonl")
    code = main(
        [
            "build",
            "--records",
            str(records),
            "--shape",
            "1P3D",
            "--model",
            "llama-3.1-8b",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    assert code == 0
    line = json.loads(capsys.readouterr().out)
    assert line["table"] == str(tmp_path / "1P3D__llama-3.1-8b.ppdt")
    assert line["key"] == "1P3D/llama-3.1-8b"
    assert line["low_sample"] == 1


def test_build_options_land_in_the_header(tmp_path: Path) -> None:
    out = _build(
        tmp_path,
        "--slo", "0.9", "--default-decision", "local", "--weights", "1,0.5",
        "--profile", "fast=1,0.1", "--label", "hardware=H100", "--built-at", "2026-01-01T00:00:00Z",
    )  # fmt: skip
    table = Table.open(out)
    try:
        assert table.header.min_success == 0.9
        assert table.header.default_decision == "local"
        assert table.header.default_weights.w_tpot == 0.5
        assert list(table.header.profiles) == ["fast"]
        assert table.header.provenance["labels"] == {"hardware": "H100"}
        assert table.header.provenance["built_at"] == "2026-01-01T00:00:00Z"
    finally:
        table.close()


@pytest.mark.parametrize(
    ("flags", "running", "queue"),
    [((), 192, 8), (("--max-decode-running", "64", "--max-prefill-queue", "off"), 64, None),
     (("--max-decode-running", "off"), None, 8)],
)  # fmt: skip
def test_decode_guard_limits_land_in_the_header_and_show_prints_them(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: tuple[str, ...],
    running: int | None,
    queue: int | None,
) -> None:
    out = _build(tmp_path, *flags)
    table = Table.open(out)
    try:
        assert (table.header.max_decode_running, table.header.max_prefill_queue_depth) == (running, queue)
    finally:
        table.close()
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert ("decode running requests > " in shown) is (running is not None)


def test_a_negative_decode_guard_limit_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        _build(tmp_path, "--max-decode-running", "-3")
    assert info.value.code == 2


def test_build_from_the_artifact(tmp_path: Path) -> None:
    out = tmp_path / "a.ppdt"
    code = main(
        [
            "build",
            "--artifact",
            str(ARTIFACT),
            "--shape",
            "1P3D",
            "--model",
            "llama-3.1-8b",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert main(["check", str(out)]) == 0


def test_bad_records_fail_the_build_with_file_and_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(record().to_json() + "\n{oops\n")
    out = tmp_path / "t.ppdt"
    code = main(
        ["build", "--records", str(bad), "--shape", "1P3D", "--model", "llama-3.1-8b", "--out", str(out)]
    )
    assert code == 1
    assert f"{bad}:2: invalid JSON" in caplog.text
    assert not out.exists()


def test_missing_inputs_fail_the_build(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    code = main(
        [
            "build",
            "--records",
            str(tmp_path / "absent.jsonl"),
            "--shape",
            "1P3D",
            "--model",
            "m",
            "--out",
            str(tmp_path / "t.ppdt"),
        ]
    )
    assert code == 1
    assert "cannot read inputs" in caplog.text


def test_a_folder_without_records_fails_the_build(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    code = main(
        [
            "build",
            "--records",
            str(tmp_path),
            "--shape",
            "1P3D",
            "--model",
            "m",
            "--out",
            str(tmp_path / "t.ppdt"),
        ]
    )
    assert code == 1
    assert "no *.jsonl record files" in caplog.text


def test_inputs_without_a_measured_cell_write_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = tmp_path / "r.jsonl"
    write_records(records, [record()])
    out = tmp_path / "t.ppdt"
    code = main(
        ["build", "--records", str(records), "--shape", "1P3D", "--model", "llama-3.1-8b", "--out", str(out)]
    )
    assert code == 1
    assert "no table written: empty" in caplog.text
    assert not out.exists()


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_check_rejects_each_bad_fixture_with_its_reason(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", str(path)]) == 1
    reason = path.stem.removeprefix("bad_").split("--")[0]  # bad_<reason>[--<check>].ppdt
    assert capsys.readouterr().out.startswith(f"FAIL {path}: {reason}: ")


def test_check_a_folder_fails_if_any_table_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(TABLES)]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL ") == len(BAD)
    assert out.count("ok   ") == 1


def test_check_missing_and_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "absent.ppdt")]) == 1
    assert "unreadable" in capsys.readouterr().out
    assert main(["check", str(tmp_path)]) == 1
    assert "no .ppdt files found" in capsys.readouterr().out


def test_show_prints_the_grid_per_context(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(TABLES / "good.ppdt"), "--scores"]) == 0
    out = capsys.readouterr().out
    for ctx in ("small", "large", "huge"):
        assert f"context {ctx} " in out
    assert "huge_paste" in out
    assert "P?" in out  # (small, short_gen) has no data: the table default answers
    assert "L~" in out  # (small, tiny) at 10 QPS comes from the nearest measured level
    assert "L!" in out  # PD fails at 20 QPS in the large context
    assert "local in " in out


def test_show_weights_change_the_grid(capsys: pytest.CaptureFixture[str]) -> None:
    main(["show", str(TABLES / "good.ppdt")])
    default = capsys.readouterr().out
    main(["show", str(TABLES / "good.ppdt"), "--weights", "0.05,1"])
    tpot_heavy = capsys.readouterr().out
    assert "(given)" in tpot_heavy
    assert default.count(" L") > tpot_heavy.count(" L")


def test_show_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(TABLES / "good.ppdt"), "--profile", "tpot"]) == 0
    assert "(profile tpot)" in capsys.readouterr().out
    assert main(["show", str(TABLES / "good.ppdt"), "--profile", "nope"]) == 1
    assert "unknown profile 'nope'" in capsys.readouterr().out


def test_show_a_bad_table_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(TABLES / "bad_checksum.ppdt")]) == 1
    assert "checksum" in capsys.readouterr().out


def test_show_png(tmp_path: Path) -> None:
    png = tmp_path / "grid.png"
    assert main(["show", str(TABLES / "good.ppdt"), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_m_table_builder_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "table_builder", "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0
    assert "usage: ppd-table" in done.stdout


@pytest.mark.parametrize("command", ["build", "check", "show", "sweep"])
def test_help_on_every_command(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert f"usage: ppd-table {command}" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["build", "--records", "x", "--artifact", "y", "--shape", "1P3D", "--model", "m", "--out", "o"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(["show", "x", "--weights", "0,0"])
    assert "not both zero" in capsys.readouterr().err


# --- the third mode (issue 17) ----------------------------------------------------------------------


def _bidir_table(tmp_path: Path, *, unused: bool = False) -> Path:
    """good.ppdt's figures plus BIDIR figures that win in (large, mid_bal) at every QPS level."""
    import dataclasses

    from decision_service.table import Figure, write_table
    from tests.support.tables import synthetic_spec

    spec = synthetic_spec()
    fig = spec.figures.copy()
    fig[1, 5, :, Figure.BIDIR_TTFT_MS] = fig[1, 5, :, Figure.LOCAL_TTFT_MS] / 2
    fig[1, 5, :, Figure.BIDIR_TPOT_MS] = fig[1, 5, :, Figure.PD_TPOT_MS]
    fig[1, 5, :, Figure.BIDIR_SUCCESS] = 1.0
    fig[1, 5, :, Figure.BIDIR_SAMPLES] = 40
    if unused:
        fig[2, 0, 0, [Figure.BIDIR_TTFT_MS, Figure.BIDIR_TPOT_MS, Figure.BIDIR_SAMPLES]] = (9.0, 9.0, 5)
    return write_table(tmp_path / "bidir.ppdt", dataclasses.replace(spec, figures=fig))


def test_check_counts_the_bidir_cells(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(_bidir_table(tmp_path, unused=True))]) == 0
    out = capsys.readouterr().out
    assert "11 with bidir figures (format 2), 1 of them unused (no pd/local pair)" in out
    assert main(["check", str(TABLES / "good.ppdt")]) == 0
    assert capsys.readouterr().out.endswith("169/270 cells measured\n")  # a format-1 line, as it was


def test_check_rejects_bad_bidir_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.tables import _resign

    blob = _bidir_table(tmp_path).read_bytes()
    table = Table.from_bytes(blob)
    offset = table.raw_header["arrays"][0]["offset"]
    fig = np.array(table.figures)
    fig[1, 5, 3, Figure.BIDIR_SUCCESS] = 1.5
    bad = tmp_path / "bad.ppdt"
    bad.write_bytes(_resign(blob[:offset] + fig.astype("<f8").tobytes()))
    assert main(["check", str(bad)]) == 1
    assert "figures: success rates must be within 0..1" in capsys.readouterr().out


def test_show_shows_the_third_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _bidir_table(tmp_path)
    assert main(["show", str(path), "--scores"]) == 0
    out = capsys.readouterr().out
    assert " B+" in out
    assert "bidir in 10" in out
    assert "B = bidir" in out
    assert "turn local into pd or bidir" in out
    assert main(["show", str(path), "--no-bidir"]) == 0
    plain = capsys.readouterr().out
    assert " B" not in plain
    assert "B = bidir" not in plain
    main(["show", str(TABLES / "good.ppdt")])
    assert "B = bidir" not in capsys.readouterr().out


def test_show_png_draws_the_third_path(tmp_path: Path) -> None:
    path = _bidir_table(tmp_path)
    with_bidir, without = tmp_path / "b.png", tmp_path / "p.png"
    assert main(["show", str(path), "--png", str(with_bidir)]) == 0
    assert main(["show", str(path), "--no-bidir", "--png", str(without)]) == 0
    assert with_bidir.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert with_bidir.read_bytes() != without.read_bytes()


def test_qps_levels_give_each_of_a_small_engines_levels_its_own_column(tmp_path: Path) -> None:
    # Records at 0.1 and 0.2 conversations/s: on the paper's axis both snap to the 0.5 column.
    rows = [
        record(
            target_qps=qps,
            mode=mode,
            path=mode,
            run_id=f"run-{mode}-{qps}",
            conversation_id=f"{mode}{qps}{i}",
            ttft_ms=ttft + i,
        )
        for qps, ttft in ((0.1, 100.0), (0.2, 300.0))
        for mode in ("pd", "local")
        for i in range(3)
    ]
    write_records(tmp_path / "r.jsonl", rows)
    argv = ["build", "--records", str(tmp_path / "r.jsonl"), "--shape", "1P3D", "--model", "llama-3.1-8b"]
    assert main([*argv, "--out", str(tmp_path / "paper.ppdt")]) == 0
    assert main([*argv, "--out", str(tmp_path / "own.ppdt"), "--qps-levels", "0.1,0.2,0.4"]) == 0
    own = Table.open(tmp_path / "own.ppdt")
    assert own.header.axes.qps_levels == (0.1, 0.2, 0.4)
    samples = own.figures[..., Figure.PD_SAMPLES]
    c, w = (int(x[0]) for x in np.nonzero(samples[..., 0]))
    assert own.figures[c, w, 0, Figure.PD_TTFT_MS] == pytest.approx(101.0)
    assert own.figures[c, w, 1, Figure.PD_TTFT_MS] == pytest.approx(301.0)
    paper = Table.open(tmp_path / "paper.ppdt")
    assert paper.header.axes.qps_levels[0] == 0.5
    assert paper.figures[c, w, 0, Figure.PD_SAMPLES] == 6  # both levels in one column


def test_unordered_qps_levels_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "build",
                "--records",
                "x.jsonl",
                "--shape",
                "1P1D",
                "--model",
                "m",
                "--out",
                "o.ppdt",
                "--qps-levels",
                "0.4,0.1",
            ]
        )
    assert exc.value.code == 2
    assert "strictly increasing" in capsys.readouterr().err
