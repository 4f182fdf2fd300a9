"""Record factory and fixture paths for the table builder tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

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
