"""Record factory and fixture paths for the table builder tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from decision_service.table import Table
from table_builder.build import BuildOptions, build_from_records, default_header
from table_builder.records import Record

ARTIFACT = Path(__file__).resolve().parent.parent / "table_builder" / "data" / "artifact"

MakeRecord = Callable[..., Record]


def make_record(**changes: Any) -> Record:
    """A good Turn-2 record of a static pd run in cell (small, mid_paste, 2 QPS); override any field."""
    fields: dict[str, Any] = {
        "run_id": "run-pd",
        "shape": "1P3D",
        "model": "llama-3.1-8b",
        "mode": "pd",
        "target_qps": 2.0,
        "workload": "small_mid_paste",
        "conversation_id": "c1",
        "turn": 2,
        "n_in": 256,
        "n_out": 64,
        "n_ctx": 256,
        "path": "pd",
        "ttft_ms": 100.0,
        "tpot_ms": 10.0,
        "e2e_ms": 730.0,
        "ok": True,
        "error": None,
        "start_time": 1_767_225_600.0,
    }
    fields.update(changes)
    if not fields["ok"]:
        fields.update(ttft_ms=None, tpot_ms=None, e2e_ms=None, error=fields["error"] or "timeout after 30 s")
    return Record(**fields)


# --- a base table and request-log lines for the refresh tests (table_builder, deploy) ---------------


def base_records(n: int = 4, *, pd_ttft: float = 100.0, local_ttft: float = 40.0) -> list[Record]:
    """n static pd and n static local Turn-2 records in make_record's cell (two TTFT values, mean as
    given)."""
    out = []
    for i in range(n):
        spread = 10.0 if i % 2 else -10.0
        out.append(make_record(conversation_id=f"p{i}", ttft_ms=pd_ttft + spread, tpot_ms=10.0))
        out.append(
            make_record(
                run_id="run-local",
                mode="local",
                path="local",
                conversation_id=f"l{i}",
                ttft_ms=local_ttft + spread,
                tpot_ms=11.0,
            )
        )
    return out


def base_table(records: list[Record] | None = None) -> Table:
    built = build_from_records(
        records or base_records(), BuildOptions(header=default_header("1P3D", "llama-3.1-8b"), min_samples=2)
    )
    return Table.from_bytes(built.encode())


def logged(
    path: str, n: int, *, ttft: float, tpot: float = 11.0, start: float = 1_767_300_000.0, **kw: Any
) -> list[Record]:
    """n ppd-mode log lines that took ``path`` (TTFT alternating ttft +- 5)."""
    return [
        make_record(
            run_id="gateway",
            mode="ppd",
            path=path,
            conversation_id=f"g{path}{i}",
            ttft_ms=ttft + (5.0 if i % 2 else -5.0),
            tpot_ms=tpot,
            start_time=start + i,
            **kw,
        )
        for i in range(n)
    ]
