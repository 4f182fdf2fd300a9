"""Benchmark records: the one JSONL schema between load generator, gateway log and table builder.

One line per request. Rules this module keeps:

1. A record is a frozen value. Every field is required, in the order of ``FIELDS``; unknown fields are
   an error (a typo such as ``"ttft"`` must not silently become "no data").
2. Types are exact: integers are JSON integers (not floats, not booleans), floats are finite (NaN and
   infinities are refused even though Python's ``json`` accepts them), ``ok`` is a JSON boolean.
3. The reader never skips a line silently: every bad line (invalid JSON, wrong type, missing field,
   inconsistent values, blank line, a last line cut short by an interrupted writer) is reported with its
   file and 1-based line number. ``read_records`` raises :class:`RecordsError` listing all of them;
   ``scan_records`` returns the good records and the list of problems for callers that want both.
4. ``to_json`` is deterministic (schema order, compact separators), so the same records give the same
   bytes.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, Self

__all__ = [
    "FIELDS",
    "MODES",
    "PATHS",
    "BadRecord",
    "Record",
    "RecordError",
    "RecordWriter",
    "RecordsError",
    "parse_mode",
    "read_records",
    "scan_records",
    "write_records",
]

#: Static routing modes; ``fraction:<x>`` (0 <= x <= 1) is the one parametrised mode.
MODES: Final = frozenset({"pd", "local", "ppd", "replica"})
#: The path a single request actually took.
PATHS: Final = frozenset({"pd", "local", "replica"})

_STR = "str"
_INT = "int"
_FLOAT = "float"
_OPT_FLOAT = "float|null"
_BOOL = "bool"
_OPT_STR = "str|null"

#: Field name -> JSON type, in the order records are written.
# gateway/request_log.py (RequestRecord) writes this schema too: change both together;
# tests/table_builder/test_gateway_request_log.py checks that they agree.
FIELDS: Final[Mapping[str, str]] = {
    "run_id": _STR,
    "shape": _STR,
    "model": _STR,
    "mode": _STR,
    "target_qps": _FLOAT,
    "workload": _STR,
    "conversation_id": _STR,
    "turn": _INT,
    "n_in": _INT,
    "n_out": _INT,
    "n_ctx": _INT,
    "path": _STR,
    "ttft_ms": _OPT_FLOAT,
    "tpot_ms": _OPT_FLOAT,
    "e2e_ms": _OPT_FLOAT,
    "ok": _BOOL,
    "error": _OPT_STR,
    "start_time": _FLOAT,
}

# Far beyond any context window; a larger count is a bug upstream, not a measurement.
_MAX_TOKENS: Final = 10_000_000


class RecordError(ValueError):
    """One record is invalid; ``reason`` says why in words an operator can act on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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


def parse_mode(mode: str) -> float | None:
    """The local share x of a static mode: 0 for ``pd``, 1 for ``local``, x for ``fraction:x``.

    ``None`` for the modes that have no fixed share (``ppd``, ``replica``). Raises :class:`RecordError`
    for an unknown mode.
    """
    if mode == "pd":
        return 0.0
    if mode == "local":
        return 1.0
    if mode in MODES:
        return None
    if mode.startswith("fraction:"):
        try:
            x = float(mode.removeprefix("fraction:"))
        except ValueError:
            raise RecordError(f"mode {mode!r}: fraction is not a number") from None
        if not 0.0 <= x <= 1.0:
            raise RecordError(f"mode {mode!r}: fraction must lie in [0, 1]")
        return x
    raise RecordError(f"mode {mode!r} is not one of pd, local, ppd, replica, fraction:<x>")


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    """One request of a benchmark run (see the module docstring and ``docs/architecture.md``)."""

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

    def __post_init__(self) -> None:
        for name, kind in FIELDS.items():
            _check_type(name, kind, getattr(self, name))
        _check_values(self)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELDS}

    def to_json(self) -> str:
        """One compact JSON line (no newline), fields in schema order."""
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Record:
        missing = [name for name in FIELDS if name not in obj]
        if missing:
            raise RecordError(f"missing field(s): {', '.join(missing)}")
        unknown = sorted(set(obj) - set(FIELDS))
        if unknown:
            raise RecordError(f"unknown field(s): {', '.join(unknown)}")
        values = dict(obj)
        # JSON has one number type: accept 2 for a float field, never 2.0 for an int field.
        for name, kind in FIELDS.items():
            value = values[name]
            if kind in (_FLOAT, _OPT_FLOAT) and type(value) is int:
                values[name] = float(value)
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> Record:
        try:
            obj = json.loads(text, parse_constant=_refuse_constant)
        except json.JSONDecodeError as exc:
            raise RecordError(f"invalid JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(obj, dict):
            raise RecordError(f"expected a JSON object, got {type(obj).__name__}")
        return cls.from_dict(obj)


def _refuse_constant(name: str) -> Any:
    raise RecordError(f"{name} is not a valid number in a record")


def _check_type(name: str, kind: str, value: object) -> None:
    if kind == _STR:
        ok = isinstance(value, str)
    elif kind == _OPT_STR:
        ok = value is None or isinstance(value, str)
    elif kind == _INT:
        ok = type(value) is int
    elif kind == _BOOL:
        ok = type(value) is bool
    elif isinstance(value, float) and type(value) is float:
        if not math.isfinite(value):
            raise RecordError(f"field {name!r} must be finite, got {value!r}")
        ok = True
    else:
        ok = value is None and kind == _OPT_FLOAT
    if not ok:
        raise RecordError(f"field {name!r} must be {kind}, got {_json_type(value)} {value!r}")


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    return type(value).__name__


def _check_values(r: Record) -> None:
    _check_labels(r)
    _check_numbers(r)
    if r.ok:
        if r.error is not None:
            raise RecordError(f"ok is true but error is set ({r.error!r})")
        # ttft_ms may be null: a non-streamed request has no first-token time.
        if r.e2e_ms is None:
            raise RecordError("ok is true but e2e_ms is null")
    elif not r.error:
        raise RecordError("ok is false but error is null or empty: say why the request failed")


def _check_labels(r: Record) -> None:
    for name in ("run_id", "shape", "model", "workload", "conversation_id"):
        if not getattr(r, name):
            raise RecordError(f"field {name!r} must not be empty")
    parse_mode(r.mode)
    if r.path not in PATHS:
        raise RecordError(f"path {r.path!r} is not one of {', '.join(sorted(PATHS))}")


def _check_numbers(r: Record) -> None:
    if r.target_qps < 0:
        raise RecordError(f"target_qps must be >= 0 (0: no fixed load level), got {r.target_qps!r}")
    if r.turn < 1:
        raise RecordError(f"turn must be >= 1 (turns are 1-based), got {r.turn}")
    for name in ("n_in", "n_out", "n_ctx"):
        value = getattr(r, name)
        if not 0 <= value <= _MAX_TOKENS:
            raise RecordError(f"{name} must lie in [0, {_MAX_TOKENS}], got {value}")
    if r.turn == 1 and r.n_ctx != 0:
        raise RecordError(f"n_ctx must be 0 on turn 1 (nothing precedes it), got {r.n_ctx}")
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        value = getattr(r, name)
        if value is not None and value < 0:
            raise RecordError(f"{name} must be >= 0, got {value!r}")
    if r.start_time < 0:
        raise RecordError(f"start_time must be >= 0, got {r.start_time!r}")


def scan_records(path: str | os.PathLike[str]) -> tuple[list[Record], list[BadRecord]]:
    """All good records of a JSONL file and every bad line, each with its 1-based line number."""
    p = Path(path)
    records: list[Record] = []
    problems: list[BadRecord] = []
    with p.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            complete = raw.endswith(b"\n")
            try:
                text = raw.decode("utf-8").rstrip("\n").removesuffix("\r")
            except UnicodeDecodeError as exc:
                problems.append(
                    BadRecord(str(p), number, f"not UTF-8 text: {exc.reason} at byte {exc.start}")
                )
                continue
            if not text.strip():
                problems.append(BadRecord(str(p), number, "blank line (one JSON record per line expected)"))
                continue
            try:
                records.append(Record.from_json(text))
            except RecordError as exc:
                reason = exc.reason
                if not complete:
                    reason += " (last line has no newline: was the writer interrupted?)"
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
