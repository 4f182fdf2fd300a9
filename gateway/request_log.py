"""Optional JSONL request log in the benchmark record schema, so production traffic can feed the
table builder. One line per client request; written by the event loop, flushed on close.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import IO

__all__ = ["RequestLog", "RequestRecord"]


# Same schema as table_builder/records.py (FIELDS, Record): change both together (the gateway may not
# import table_builder); tests/table_builder/test_gateway_request_log.py checks that they agree.
@dataclass(frozen=True, slots=True)
class RequestRecord:
    run_id: str
    shape: str
    model: str
    mode: str
    target_qps: float
    workload: str
    conversation_id: str
    turn: int
    n_in: int
    n_out: int
    n_ctx: int
    path: str
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    ok: bool
    error: str | None
    start_time: float


class RequestLog:
    def __init__(self, path: str) -> None:
        self._file: IO[str] | None = open(path, "a", encoding="utf-8", buffering=64 * 1024)  # noqa: SIM115
        self.written = 0

    def write(self, record: RequestRecord) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")
        self.written += 1

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
