"""The gateway's request log and the table builder's reader share one record schema.

The gateway may not import ``table_builder`` (import-linter contract), so ``gateway/request_log.py``
keeps its own copy of the schema; these tests fail when the two drift apart.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gateway.request_log import RequestLog, RequestRecord
from table_builder.records import FIELDS, Record, RecordsError, read_records


def _record(**changes: object) -> RequestRecord:
    base = RequestRecord(
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


def _write(path: Path, records: list[RequestRecord]) -> None:
    log = RequestLog(str(path))
    for record in records:
        log.write(record)
    log.close()


def test_gateway_record_fields_are_the_schema_fields_in_order() -> None:
    assert [f.name for f in dataclasses.fields(RequestRecord)] == list(FIELDS)
    assert [f.name for f in dataclasses.fields(Record)] == list(FIELDS)


def test_table_builder_reads_what_the_gateway_logs(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    written = [
        _record(turn=1, n_ctx=0, path="pd"),
        _record(),
        _record(ok=False, error="upstream_timeout", ttft_ms=None, tpot_ms=None),
    ]
    _write(path, written)
    read = read_records([path])
    assert [r.to_dict() for r in read] == [dataclasses.asdict(r) for r in written]


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
