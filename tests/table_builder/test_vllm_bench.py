"""vLLM benchmark output files -> records (table_builder/vllm_bench.py, vllm_run.py) and
``ppd-table import-vllm-bench`` end to end: the records build a table, bad files fail with the reason."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decision_service.header import Figure
from decision_service.table import Table
from table_builder.cli import main
from table_builder.records import read_records
from table_builder.vllm_bench import RunLabels, VllmBenchError, read_vllm_bench
from tests.support.vllm_bench import (
    MULTI_TURN,
    MULTI_TURN_CONVERSATIONS,
    REAL_APPEND,
    REAL_SUMMARY,
    SERVE_APPEND,
    SERVE_LOCAL,
    SERVE_PD,
    SERVE_SUMMARY,
    SERVE_TRUNCATED,
    load,
    write_json,
)

LABELS = RunLabels(shape="1P3D", model="llama-3.1-8b", mode="pd")


def _labels(**changes: Any) -> RunLabels:
    fields: dict[str, Any] = {"shape": "1P3D", "model": "llama-3.1-8b", "mode": "pd", **changes}
    return RunLabels(**fields)


def test_a_serve_result_becomes_one_record_per_request_with_the_given_labels() -> None:
    got = read_vllm_bench([SERVE_PD], _labels(context_tokens=256))
    assert len(got.records) == 6
    assert got.caveats == ()
    (info,) = got.files
    assert (info.format, info.requests, info.failed) == ("vllm bench serve", 6, 1)
    r = got.records[0]
    assert (r.shape, r.model, r.mode, r.path, r.target_qps, r.workload) == (
        "1P3D",
        "llama-3.1-8b",
        "pd",
        "pd",
        2.0,
        "vllm-bench-serve",
    )
    assert (r.turn, r.n_ctx, r.n_in, r.n_out, r.ok) == (2, 256, 256, 64, True)
    failed = got.records[3]
    assert (failed.ok, failed.ttft_ms, failed.e2e_ms) == (False, None, None)
    assert failed.error == "aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected"


def test_an_append_result_file_holds_one_run_per_line() -> None:
    got = read_vllm_bench([SERVE_APPEND], _labels(workload="chat"))
    assert got.files[0].runs == (
        "openai-chat-4.0qps-Llama-3.1-8B-Instruct-20261201-170001",
        "openai-chat-8.0qps-Llama-3.1-8B-Instruct-20261201-170102",
    )
    assert [r.target_qps for r in got.records] == [4.0, 4.0, 8.0, 8.0]
    assert {r.workload for r in got.records} == {"chat"}
    assert [r.ok for r in got.records] == [True, True, False, True]
    assert got.records[2].error == "Internal Server Error"


def test_a_file_written_by_vllm_itself_is_read_with_its_failures() -> None:
    got = read_vllm_bench([REAL_APPEND], _labels(context_tokens=256))
    (info,) = got.files
    assert (info.runs, info.requests, info.failed) == (
        (
            "vllm-2.0qps-Llama-3.1-8B-Instruct-20261201-171718",
            "vllm-8.0qps-Llama-3.1-8B-Instruct-20261201-171754",
        ),
        16,
        3,
    )
    assert [r.target_qps for r in got.records] == [2.0] * 8 + [8.0] * 8
    assert {r.error for r in got.records if not r.ok} == {"Internal Server Error"}
    ok = [r for r in got.records if r.ok]
    assert all(r.n_out == 32 and r.n_ctx == 256 and r.ttft_ms and r.tpot_ms for r in ok)
    # the server's prompt_tokens replace the dataset's 512 where the tokenizer re-aligned the prompt
    assert {r.n_in for r in got.records} <= set(range(240, 257))


def test_a_file_vllm_saved_without_save_detailed_is_refused_naming_the_flag() -> None:
    with pytest.raises(VllmBenchError, match=r"no per-request data: .*--save-result --save-detailed"):
        read_vllm_bench([REAL_SUMMARY], LABELS)


def test_multi_turn_stats_become_records_and_the_missing_failures_are_said() -> None:
    got = read_vllm_bench([MULTI_TURN], _labels(mode="local", qps=4.0))
    assert [(r.turn, r.n_ctx, r.ok) for r in got.records] == [
        (1, 0, True),
        (1, 0, True),
        (2, 256, True),
        (2, 256, True),
        (2, 256, False),
    ]
    assert {(r.run_id, r.path, r.target_qps, r.workload) for r in got.records} == {
        ("multi_turn_stats", "local", 4.0, "vllm-multi-turn")
    }
    (caveat,) = got.caveats
    assert "failed turns" in caveat


@pytest.mark.parametrize(
    ("path", "labels", "message"),
    [
        (SERVE_SUMMARY, {}, r"serve_summary_only.json: no per-request data: .*--save-detailed"),
        (SERVE_TRUNCATED, {}, r"serve_truncated.json: invalid JSON: .*cut short"),
        (
            MULTI_TURN_CONVERSATIONS,
            {"qps": 2.0},
            r"conversations output \(--output-file\).*--stats-json-output",
        ),
        (MULTI_TURN, {}, r"multi_turn_stats.json: the multi-turn benchmark's stats do not record the load"),
        (MULTI_TURN, {"qps": 2.0, "context_tokens": 64}, r"--context-tokens is for vllm bench serve"),
        (SERVE_PD, {"qps": 4.0}, r"the run's request_rate is 2 but --qps says 4"),
    ],
)
def test_an_unusable_file_is_refused_with_its_path_and_reason(
    path: Path, labels: dict[str, Any], message: str
) -> None:
    with pytest.raises(VllmBenchError, match=message):
        read_vllm_bench([path], _labels(**labels))


def test_an_infinite_request_rate_needs_qps(tmp_path: Path) -> None:
    doc = load(SERVE_PD)
    doc["request_rate"] = "inf"
    path = write_json(tmp_path / "burst.json", doc)
    with pytest.raises(VllmBenchError, match=r"request_rate is inf .* give --qps"):
        read_vllm_bench([path], LABELS)
    got = read_vllm_bench([path], _labels(qps=16.0))
    assert {r.target_qps for r in got.records} == {16.0}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"empty file"),
        (b"\xff\xfe{}", r"not UTF-8 text"),
        (b'"hello"', r"not a vLLM benchmark output: .* got a JSON str"),
        (
            b'[{"benchmark": {"name": "vLLM benchmark"}, "model": {}, "metric": {}}]',
            r"PyTorch-format summary",
        ),
        (b"[1, 2]", r"request 0: expected an object"),
    ],
)
def test_files_that_are_not_vllm_outputs_are_refused(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(VllmBenchError, match=message):
        read_vllm_bench([path], _labels(qps=2.0))


def test_an_append_result_file_cut_short_names_its_last_line(tmp_path: Path) -> None:
    text = SERVE_APPEND.read_text(encoding="utf-8")
    path = tmp_path / "append.json"
    path.write_text(text[: len(text) - 40], encoding="utf-8")
    with pytest.raises(VllmBenchError, match=r"append.json: line 2: invalid JSON: .*cut short"):
        read_vllm_bench([path], LABELS)


def test_a_file_mixing_both_formats_is_refused(tmp_path: Path) -> None:
    first = SERVE_APPEND.read_text(encoding="utf-8").splitlines()[0]
    path = tmp_path / "mixed.json"
    path.write_text(first + "\n" + json.dumps(load(MULTI_TURN)) + "\n", encoding="utf-8")
    with pytest.raises(VllmBenchError, match=r"mixes vllm bench serve and vllm multi-turn"):
        read_vllm_bench([path], _labels(qps=4.0))


def test_every_bad_file_is_listed_and_the_same_run_twice_is_refused(tmp_path: Path) -> None:
    copy = tmp_path / "copy.json"
    copy.write_bytes(SERVE_PD.read_bytes())
    with pytest.raises(VllmBenchError) as caught:
        read_vllm_bench([SERVE_PD, SERVE_SUMMARY, copy, tmp_path / "absent.json"], LABELS)
    lines = str(caught.value).splitlines()
    assert len(lines) == 3
    assert "serve_summary_only.json: no per-request data" in lines[0]
    assert f"copy.json: the same content as {SERVE_PD}" in lines[1]
    assert "absent.json: cannot read" in lines[2]


def test_a_request_the_record_schema_refuses_is_reported_where_it_sits(tmp_path: Path) -> None:
    doc = load(SERVE_PD)
    doc["latencies"][1] = doc["ttfts"][1] / 2  # ends before its first token: a negative TPOT
    path = write_json(tmp_path / "bad.json", doc)
    with pytest.raises(VllmBenchError, match=r"bad.json: request 1: tpot_ms must be >= 0"):
        read_vllm_bench([path], LABELS)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mode": "ppd"}, r"mode 'ppd' cannot be imported: .*only static pd or local"),
        ({"mode": "fraction:0.5"}, r"cannot be imported"),
        ({"shape": ""}, r"shape must not be empty"),
        ({"workload": ""}, r"workload must not be empty"),
        ({"qps": 0.0}, r"qps must be a finite number > 0"),
        ({"qps": float("inf")}, r"qps must be a finite number > 0"),
        ({"context_tokens": -1}, r"context tokens must be >= 0"),
    ],
)
def test_labels_that_no_file_could_honestly_carry_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(VllmBenchError, match=message):
        _labels(**changes)


@settings(max_examples=40, deadline=None)
@given(cut=st.floats(min_value=0.0, max_value=0.999))
def test_a_result_cut_anywhere_is_refused_never_read_in_part(cut: float) -> None:
    data = SERVE_PD.read_bytes()
    text = data[: int(len(data) * cut)].decode("utf-8")
    # a fresh folder per example: hypothesis cannot reuse a function-scoped tmp_path
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cut.json"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(VllmBenchError):
            read_vllm_bench([path], LABELS)


# --- ppd-table import-vllm-bench ---------------------------------------------------------------------


def _import(tmp_path: Path, name: str, *args: str) -> tuple[int, Path]:
    out = tmp_path / name
    code = main(["import-vllm-bench", *args, "--shape", "1P3D", "--model", "llama-3.1-8b", "--out", str(out)])
    return code, out


def test_import_then_build_fills_the_cell_and_picks_the_faster_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, pd = _import(tmp_path, "pd.jsonl", str(SERVE_PD), "--mode", "pd", "--context-tokens", "256")
    assert code == 0
    printed = capsys.readouterr().out
    assert "serve_pd_detailed.json: vllm bench serve, 1 run(s), 6 requests (1 failed)" in printed
    assert f"wrote {pd}: 6 records (6 of Turn 2+)" in printed
    code, local = _import(
        tmp_path, "local.jsonl", str(SERVE_LOCAL), "--mode", "local", "--context-tokens", "256"
    )
    assert code == 0
    assert len(read_records([pd, local])) == 12
    table_path = tmp_path / "t.ppdt"
    args = ["build", "--records", str(pd), str(local), "--shape", "1P3D", "--model", "llama-3.1-8b"]
    assert main([*args, "--out", str(table_path), "--min-samples", "5", "--slo", "0.8"]) == 0
    table = Table.open(table_path)
    axes = table.header.axes
    cell = (
        axes.context_classes.index("small"),
        axes.workload_names().index("mid_paste"),
        axes.qps_levels.index(2.0),
    )
    assert table.measured(*cell)
    row = table.figures[cell]
    assert row[Figure.LOCAL_TTFT_MS] < row[Figure.PD_TTFT_MS]  # 41 ms vs 103 ms in the files
    assert row[Figure.PD_SUCCESS] == pytest.approx(5 / 6)
    assert (row[Figure.PD_SAMPLES], row[Figure.LOCAL_SAMPLES]) == (6, 6)


def test_import_prints_json_and_the_multi_turn_caveat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _import(tmp_path, "mt.jsonl", str(MULTI_TURN), "--mode", "local", "--qps", "2", "--json")
    assert code == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert (summary["records"], summary["turn2plus"]) == (5, 3)
    assert summary["files"][0]["format"] == "vllm multi-turn"
    assert "note: vllm multi-turn: failed turns" in captured.err
    assert len(read_records([out])) == 5


def test_import_of_single_turn_requests_says_tables_leave_them_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _import(tmp_path, "t1.jsonl", str(SERVE_PD), "--mode", "pd")
    assert code == 0
    captured = capsys.readouterr()
    assert "6 records (0 of Turn 2+)" in captured.out
    assert "every record is Turn 1, which tables leave out" in captured.err
    assert {r.turn for r in read_records([out])} == {1}


def test_import_of_a_file_without_save_detailed_fails_naming_the_flag(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    code, out = _import(tmp_path, "x.jsonl", str(SERVE_SUMMARY), "--mode", "pd")
    assert code == 1
    assert "rerun `vllm bench serve --save-result --save-detailed`" in caplog.text
    assert not out.exists()


def test_import_refuses_a_mode_a_benchmark_client_cannot_know(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "import-vllm-bench",
                str(SERVE_PD),
                "--mode",
                "ppd",
                "--shape",
                "1P3D",
                "--model",
                "m",
                "--out",
                "x",
            ]
        )
    assert exited.value.code == 2
    assert "invalid choice: 'ppd'" in capsys.readouterr().err


def test_import_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["import-vllm-bench", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--mode", "--shape", "--model", "--qps", "--context-tokens", "--workload", "--out"):
        assert flag in text


def test_the_same_files_give_the_same_bytes(tmp_path: Path) -> None:
    _, first = _import(tmp_path, "a.jsonl", str(SERVE_APPEND), str(SERVE_PD), "--mode", "pd")
    _, second = _import(tmp_path, "b.jsonl", str(SERVE_APPEND), str(SERVE_PD), "--mode", "pd")
    assert first.read_bytes() == second.read_bytes()
