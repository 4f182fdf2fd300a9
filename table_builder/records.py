"""Benchmark records files: the reader and the writers of the JSONL schema in ``ppd/records.py``.

One line per request. Rules this module keeps:

1. The reader never skips a line silently: every bad line (invalid JSON, wrong type, missing field,
   inconsistent values, blank line, a last line cut short by an interrupted writer) is reported with its
   file and 1-based line number. ``read_records`` raises :class:`RecordsError` listing all of them;
   ``scan_records`` returns the good records and the list of problems for callers that want both.
2. Writing is deterministic (``Record.to_json``) and a whole file is written atomically.

The schema itself (``FIELDS``, ``PATHS``, ``Record``, ``RecordError``) is re-exported from
``ppd.records`` for the table builder's modules.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from ppd.records import FIELDS, PATHS, Record, RecordError

__all__ = [
    "FIELDS",
    "PATHS",
    "BadRecord",
    "Record",
    "RecordError",
    "RecordWriter",
    "RecordsError",
    "parse_line",
    "read_records",
    "scan_records",
    "write_records",
]


@dataclass(frozen=True, slots=True)
class BadRecord:
    """Where a bad record sits and what is wrong with it."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


class RecordsError(ValueError):
    """A records file holds bad lines; ``problems`` lists every one (file, line, reason)."""

    def __init__(self, problems: list[BadRecord]) -> None:
        self.problems = problems
        shown = "\n".join(f"  {p}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"{len(problems)} bad record(s):\n{shown}{more}")


def parse_line(raw: bytes, complete: bool) -> tuple[Record | None, str]:
    """One JSONL line's record, or why it is bad; `complete`: the line ended with its newline."""
    try:
        text = raw.decode("utf-8").rstrip("\n").removesuffix("\r")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text: {exc.reason} at byte {exc.start}"
    if not text.strip():
        return None, "blank line (one JSON record per line expected)"
    try:
        return Record.from_json(text), ""
    except RecordError as exc:
        last = "" if complete else " (last line has no newline: was the writer interrupted?)"
        return None, exc.reason + last


def scan_records(path: str | os.PathLike[str]) -> tuple[list[Record], list[BadRecord]]:
    """All good records of a JSONL file and every bad line, each with its 1-based line number."""
    p = Path(path)
    records: list[Record] = []
    problems: list[BadRecord] = []
    with p.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            record, reason = parse_line(raw, raw.endswith(b"\n"))
            if record is not None:
                records.append(record)
            else:
                problems.append(BadRecord(str(p), number, reason))
    return records, problems


def read_records(paths: Iterable[str | os.PathLike[str]]) -> list[Record]:
    """Every record of the given JSONL files, in file order; raises :class:`RecordsError` on any bad line.

    An unreadable file raises ``OSError`` as usual.
    """
    records: list[Record] = []
    problems: list[BadRecord] = []
    for path in paths:
        good, bad = scan_records(path)
        records.extend(good)
        problems.extend(bad)
    if problems:
        raise RecordsError(problems)
    return records


class RecordWriter:
    """Appends records to a JSONL file, one line each, flushed per record.

    Use as a context manager. ``os.fsync`` runs on close so a finished file survives a crash.
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = True) -> None:
        self._path = Path(path)
        self._fh: IO[str] = self._path.open("a" if append else "w", encoding="utf-8", newline="\n")

    def write(self, record: Record) -> None:
        self._fh.write(record.to_json() + "\n")
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def write_records(path: str | os.PathLike[str], records: Iterable[Record]) -> None:
    """Write a whole JSONL file atomically: temp file in the same folder, fsync, rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # A unique sibling opened with "x" (not mkstemp, whose 0600 mode would stick to the result).
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("x", encoding="utf-8", newline="\n") as fh:
            for record in records:
                fh.write(record.to_json() + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
