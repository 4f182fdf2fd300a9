"""The gateway's request log: one line per request in the benchmark record schema (ppd/records.py),
which the table builder's reader takes as it is."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gateway.request_log import RequestLog
from ppd.records import UncheckedRecord
from table_builder.records import RecordsError, read_records


def _record(**changes: object) -> UncheckedRecord:
    base = UncheckedRecord(
        run_id="r1",
        shape="2P2D",
        model="meta-llama/Llama-3.1-8B-Instruct",
        mode="ppd",
        target_qps=2.0,
        workload="small_tiny",
        conversation_id="c1",
        turn=2,
        n_in=12,
        n_out=5,
        n_ctx=11,
        path="local",
        ttft_ms=12.5,
        tpot_ms=3.25,
        e2e_ms=30.0,
        ok=True,
        error=None,
        start_time=1_700_000_000.5,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def _write(path: Path, records: list[UncheckedRecord]) -> None:
    log = RequestLog(str(path))
    for record in records:
        log.write(record)
    log.close()


def test_lines_are_compact_json_in_schema_order(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    _write(path, [_record(error="caf\u00e9", ok=False)])
    line = path.read_text(encoding="utf-8")
    assert line.startswith('{"run_id":"r1","shape":"2P2D",')
    assert line.endswith('"error":"caf\\u00e9","start_time":1700000000.5}\n')


def test_table_builder_reads_what_the_gateway_logs(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    written = [
        _record(turn=1, n_ctx=0, path="pd"),
        _record(),
        _record(ok=False, error="upstream_timeout", ttft_ms=None, tpot_ms=None),
    ]
    _write(path, written)
    read = read_records([path])
    assert [r.to_dict() for r in read] == [r.to_dict() for r in written]


def test_a_successful_non_streamed_request_logged_without_ttft_is_readable(tmp_path: Path) -> None:
    # The gateway measures no TTFT for a non-streamed request and logs ttft_ms=null with ok=true.
    path = tmp_path / "requests.jsonl"
    _write(path, [_record(ttft_ms=None, tpot_ms=None)])
    assert len(read_records([path])) == 1


def test_a_log_with_the_default_target_qps_is_readable(tmp_path: Path) -> None:
    # gateway/settings.py leaves [log] target_qps at 0 (production traffic has no fixed rate).
    path = tmp_path / "requests.jsonl"
    _write(path, [_record(target_qps=0.0)])
    assert read_records([path])[0].target_qps == 0.0
    _write(tmp_path / "bad.jsonl", [_record(target_qps=-1.0)])
    with pytest.raises(RecordsError, match="target_qps"):
        read_records([tmp_path / "bad.jsonl"])


def test_the_log_writes_what_happened_even_when_a_reader_would_refuse_it(tmp_path: Path) -> None:
    # No run_id configured: the line is still written (the reader names the problem).
    path = tmp_path / "requests.jsonl"
    _write(path, [_record(run_id="")])
    with pytest.raises(RecordsError, match="run_id"):
        read_records([path])
