"""The record schema: round trips, and every kind of bad line reported with its file and line number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from table_builder.records import (
    FIELDS,
    BadRecord,
    Record,
    RecordError,
    RecordsError,
    RecordWriter,
    read_records,
    scan_records,
    write_records,
)


def good(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "run_id": "r1",
        "shape": "1P3D",
        "model": "llama-3.1-8b",
        "mode": "pd",
        "target_qps": 2.0,
        "workload": "large_mid_paste",
        "conversation_id": "c1",
        "turn": 2,
        "n_in": 256,
        "n_out": 64,
        "n_ctx": 2048,
        "path": "pd",
        "ttft_ms": 85.5,
        "tpot_ms": 9.25,
        "e2e_ms": 668.0,
        "ok": True,
        "error": None,
        "start_time": 1.5,
    }
    obj.update(changes)
    return obj


def test_round_trip_is_exact_and_in_schema_order() -> None:
    record = Record.from_dict(good())
    text = record.to_json()
    assert list(json.loads(text)) == list(FIELDS)
    assert Record.from_json(text) == record
    assert "\n" not in text
    assert " " not in text


def test_json_integers_are_accepted_for_float_fields() -> None:
    record = Record.from_dict(good(target_qps=2, ttft_ms=80, start_time=0))
    assert type(record.target_qps) is float
    assert record.target_qps == 2.0
    assert type(record.ttft_ms) is float


def test_failed_request_round_trips() -> None:
    obj = good(ok=False, error="timeout after 30 s", ttft_ms=None, tpot_ms=None, e2e_ms=None)
    assert Record.from_json(json.dumps(obj)).error == "timeout after 30 s"


BAD_LINES: list[tuple[str, str, str]] = [
    ("invalid_json", '{"run_id": "r1",', "invalid JSON"),
    ("not_an_object", "[1, 2, 3]", "expected a JSON object"),
    ("nan", json.dumps(good()).replace("85.5", "NaN"), "NaN is not a valid number"),
    ("infinity", json.dumps(good()).replace("85.5", "Infinity"), "Infinity is not a valid number"),
    (
        "missing_field",
        json.dumps({k: v for k, v in good().items() if k != "n_ctx"}),
        "missing field(s): n_ctx",
    ),
    ("unknown_field", json.dumps(good(ttft=1.0)), "unknown field(s): ttft"),
    ("float_for_int", json.dumps(good(n_in=256.0)), "field 'n_in' must be int"),
    ("bool_for_int", json.dumps(good(turn=True)), "field 'turn' must be int"),
    ("string_for_float", json.dumps(good(ttft_ms="85")), "field 'ttft_ms' must be float|null"),
    ("int_for_bool", json.dumps(good(ok=1)), "field 'ok' must be bool"),
    ("null_for_str", json.dumps(good(workload=None)), "field 'workload' must be str"),
    ("empty_str", json.dumps(good(run_id="")), "field 'run_id' must not be empty"),
    ("unknown_mode", json.dumps(good(mode="xpd")), "mode 'xpd' is not one of"),
    ("bad_fraction", json.dumps(good(mode="fraction:1.5")), "fraction must lie in [0, 1]"),
    ("nan_fraction", json.dumps(good(mode="fraction:abc")), "fraction is not a number"),
    ("unknown_path", json.dumps(good(path="ppd")), "path 'ppd' is not one of"),
    ("negative_qps", json.dumps(good(target_qps=-1.0)), "target_qps must be >= 0"),
    ("turn_zero", json.dumps(good(turn=0)), "turn must be >= 1"),
    ("negative_tokens", json.dumps(good(n_in=-1)), "n_in must lie in [0,"),
    ("absurd_tokens", json.dumps(good(n_ctx=10**9)), "n_ctx must lie in [0,"),
    ("ctx_on_turn_one", json.dumps(good(turn=1, n_ctx=5)), "n_ctx must be 0 on turn 1"),
    ("negative_latency", json.dumps(good(tpot_ms=-1.0)), "tpot_ms must be >= 0"),
    ("negative_start", json.dumps(good(start_time=-1.0)), "start_time must be >= 0"),
    ("ok_with_error", json.dumps(good(error="boom")), "ok is true but error is set"),
    ("ok_without_e2e", json.dumps(good(e2e_ms=None)), "ok is true but e2e_ms is null"),
    ("failed_without_error", json.dumps(good(ok=False)), "ok is false but error is null or empty"),
    ("blank_line", "   ", "blank line"),
]


@pytest.mark.parametrize(("kind", "line", "reason"), BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_each_bad_record_kind_is_reported_with_its_line_number(
    tmp_path: Path, kind: str, line: str, reason: str
) -> None:
    path = tmp_path / f"{kind}.jsonl"
    ok_line = json.dumps(good())
    path.write_text(f"{ok_line}\n{ok_line}\n{line}\n{ok_line}\n", encoding="utf-8")
    records, problems = scan_records(path)
    assert len(records) == 3
    assert len(problems) == 1
    assert problems[0].path == str(path)
    assert problems[0].line == 3
    assert reason in problems[0].reason
    with pytest.raises(RecordsError) as info:
        read_records([path])
    assert f"{path}:3: " in str(info.value)


def test_a_cut_short_last_line_is_reported_not_dropped(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    ok_line = json.dumps(good())
    path.write_text(f"{ok_line}\n{ok_line[:40]}", encoding="utf-8")
    _, problems = scan_records(path)
    assert [p.line for p in problems] == [2]
    assert "writer interrupted" in problems[0].reason


def test_non_utf8_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(good()).encode() + b'\n{"run_id": "\xff"}\n')
    records, problems = scan_records(path)
    assert len(records) == 1
    assert [p.line for p in problems] == [2]
    assert "not UTF-8" in problems[0].reason


def test_every_bad_line_across_files_is_listed(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("{}\n" + json.dumps(good()) + "\n{}\n", encoding="utf-8")
    b.write_text("nope\n", encoding="utf-8")
    with pytest.raises(RecordsError) as info:
        read_records([a, b])
    assert [(p.path, p.line) for p in info.value.problems] == [(str(a), 1), (str(a), 3), (str(b), 1)]


def test_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        read_records([tmp_path / "absent.jsonl"])


def test_constructor_validates_too() -> None:
    with pytest.raises(RecordError, match="turn must be >= 1"):
        Record(**{**good(), "turn": 0})


def test_writers_round_trip(tmp_path: Path) -> None:
    records = [Record.from_dict(good(conversation_id=f"c{i}", start_time=float(i))) for i in range(5)]
    whole = tmp_path / "sub" / "whole.jsonl"
    write_records(whole, records)
    assert read_records([whole]) == records
    appended = tmp_path / "appended.jsonl"
    with RecordWriter(appended) as writer:
        for record in records[:2]:
            writer.write(record)
    with RecordWriter(appended) as writer:
        for record in records[2:]:
            writer.write(record)
    assert appended.read_bytes() == whole.read_bytes()
    assert not list(tmp_path.glob("**/*.tmp"))


def test_bad_record_str() -> None:
    assert str(BadRecord("f.jsonl", 7, "boom")) == "f.jsonl:7: boom"
