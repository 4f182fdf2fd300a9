"""Benchmark records: the one JSONL schema between the load generator, the gateway's request log,
the simulator and the table builder. A shared leaf: the gateway writes it without importing the table
builder, which reads it (``table_builder/records.py`` holds the file reader and writers).

One line per request. Rules this module keeps:

1. A record is a frozen value. Every field of ``FIELDS`` is required, in that order; unknown fields are
   an error (a typo such as ``"ttft"`` must not silently become "no data").
   ``OPTIONAL_FIELDS`` follow, each with its default: a line leaves them out exactly when they all
   hold their defaults (so a writer that never sets them writes the lines it always wrote), and a
   reader fills a missing one in with its default. Today they mark exploration (``ppd/explore.py``):
   ``explored`` (the path taken is not the one the table chose; default false) and ``propensity``
   (P(path taken | chosen path), in (0, 1]; default 1.0).
2. Types are exact: integers are JSON integers (not floats, not booleans), floats are finite (NaN and
   infinities are refused even though Python's ``json`` accepts them), ``ok`` is a JSON boolean; the
   mode follows the one grammar of :mod:`ppd.modes`.
3. ``to_json`` is deterministic (schema order, compact separators), so the same records give the same
   bytes.
4. Labels are not empty, except the ``workload`` of a production line (``target_qps`` 0, a gateway
   serving real traffic): production traffic comes from no named benchmark workload, and the table
   builder files such a line by its token counts, as the decision service classifies a live request.
   A benchmark record (``target_qps`` > 0) names its workload.
5. ``CLIENT_DISCONNECTED`` is the ``error`` of a request whose client went away before its answer
   ended: the request failed, but not because of its path or worker. ``worker_status_error`` words
   the ``error`` of a worker's error status; ``client_caused`` tells both apart from the failures of a
   path: a disconnect, or a worker's 4xx other than 408 and 429 (the request itself was refused: too
   long, bad parameters; any path would refuse it), says nothing about the path it took.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ppd.modes import ModeError, parse_mode

__all__ = [
    "CLIENT_DISCONNECTED",
    "FIELDS",
    "OPTIONAL_FIELDS",
    "PATHS",
    "Record",
    "RecordError",
    "UncheckedRecord",
    "client_caused",
    "worker_status_error",
]

#: The path a single request actually took.
PATHS: Final = frozenset({"pd", "local", "replica", "bidir"})
#: The ``error`` of a request whose client went away before its answer ended (the gateway's words):
#: no failure of the path or its worker, so no evidence about either.
CLIENT_DISCONNECTED: Final = "client disconnected"
_WORKER_STATUS = re.compile(r"worker .* answered HTTP (\d{3})")
#: 4xx statuses a worker answers because of its own state, not the request's: a path's failures.
_LOAD_STATUSES: Final = frozenset({408, 429})


def worker_status_error(worker: str, status: int) -> str:
    """The ``error`` of a request a worker answered with an error status (the gateway writes it)."""
    return f"worker {worker} answered HTTP {status}"


def client_caused(error: str | None) -> bool:
    """Rule 5: the request failed because of its client (gone, or refused as a bad request), not its path."""
    if error is None:
        return False
    if error == CLIENT_DISCONNECTED:
        return True
    match = _WORKER_STATUS.fullmatch(error)
    if match is None:
        return False
    status = int(match.group(1))
    return 400 <= status < 500 and status not in _LOAD_STATUSES


_STR = "str"
_INT = "int"
_FLOAT = "float"
_OPT_FLOAT = "float|null"
_BOOL = "bool"
_OPT_STR = "str|null"

#: Field name -> JSON type, in the order records are written.
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

#: Optional field name -> (JSON type, default), written after ``FIELDS`` unless all hold their defaults.
OPTIONAL_FIELDS: Final[Mapping[str, tuple[str, object]]] = {
    "explored": (_BOOL, False),
    "propensity": (_FLOAT, 1.0),
}

# Far beyond any context window; a larger count is a bug upstream, not a measurement.
_MAX_TOKENS: Final = 10_000_000


class RecordError(ValueError):
    """One record is invalid; ``reason`` says why in words an operator can act on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class UncheckedRecord:
    """The schema's fields in schema order, as a live writer fills them in, unchecked: the gateway's
    request log writes every request as it happened (an empty ``run_id`` included). Readers build
    :class:`Record`, which checks them."""

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
    explored: bool = False
    propensity: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in FIELDS}
        if self.explored or self.propensity != 1.0:
            out["explored"] = self.explored
            out["propensity"] = self.propensity
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Record(UncheckedRecord):
    """One request of a benchmark run, checked on construction (rules 1 and 2 of the module
    docstring; see ``docs/architecture.md``)."""

    def __post_init__(self) -> None:
        for name, kind in FIELDS.items():
            _check_type(name, kind, getattr(self, name))
        for name, (kind, _) in OPTIONAL_FIELDS.items():
            _check_type(name, kind, getattr(self, name))
        _check_values(self)

    def to_json(self) -> str:
        """One compact JSON line (no newline), fields in schema order."""
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Record:
        missing = [name for name in FIELDS if name not in obj]
        if missing:
            raise RecordError(f"missing field(s): {', '.join(missing)}")
        unknown = sorted(set(obj) - set(FIELDS) - set(OPTIONAL_FIELDS))
        if unknown:
            raise RecordError(f"unknown field(s): {', '.join(unknown)}")
        values = dict(obj)
        # JSON has one number type: accept 2 for a float field, never 2.0 for an int field.
        for name, kind in (*FIELDS.items(), *((n, k) for n, (k, _) in OPTIONAL_FIELDS.items())):
            value = values.get(name)
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
        # Rule 4: a production line (no target_qps) may leave its workload unlabelled.
        if not getattr(r, name) and not (name == "workload" and r.target_qps == 0):
            raise RecordError(f"field {name!r} must not be empty")
    try:
        parse_mode(r.mode)
    except ModeError as exc:
        raise RecordError(str(exc)) from None
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
    if not 0.0 < r.propensity <= 1.0:
        raise RecordError(f"propensity must lie in (0, 1], got {r.propensity!r}")
    if r.explored and r.turn == 1:
        raise RecordError("explored is true on turn 1 (turn 1 always takes pd; only turns 2+ explore)")
