"""Optional JSONL request log in the benchmark record schema (`ppd/records.py`), so production traffic
can feed the table builder. One line per client request; written by the event loop, flushed on close.
Lines are written unchecked (`UncheckedRecord`): the log says what happened, the table builder's
reader checks it.
"""

from __future__ import annotations

import json
from typing import IO

from ppd.records import UncheckedRecord

__all__ = ["RequestLog"]


class RequestLog:
    def __init__(self, path: str) -> None:
        self._file: IO[str] | None = open(path, "a", encoding="utf-8", buffering=64 * 1024)  # noqa: SIM115
        self.written = 0

    def write(self, record: UncheckedRecord) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record.to_dict(), separators=(",", ":")) + "\n")
        self.written += 1

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
