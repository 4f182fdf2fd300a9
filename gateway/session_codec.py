"""Sessions as bytes for a shared store, from the dataclass's own fields: pure, no transport.

Rule 1 (generic): the encoding is built from `dataclasses.fields(Session)` and their type hints, so a
field added to `Session` travels with no change here, as long as its type is built from None, bool,
int, float, str, tuples (`tuple[X, ...]`, `tuple[X, Y]`), lists, dicts with str keys, and unions of
these. A field of any other type is refused when the codec is built (at start-up), never at run time.
Rule 2 (versioned): one JSON object `{"v": VERSION, "f": {field: value}}`. Fields an older replica
does not know are ignored, fields it misses take their defaults, so replicas of two versions can
share one store during a rolling update (`Session.answer_key` came so, with VERSION unchanged: an
older replica ignores it, and reads an entry under a sent key "s:" never, as it never looks one up).
Another `v`, bad JSON, or values of the wrong shape are a
`CodecError` (the store counts them and treats the entry as missing).
Rule 3 (bounded, never trusted): an entry is data another process wrote (another replica, another
version, anyone with access to Redis), so decoding checks every value before the gateway uses it, and
fails only with a `CodecError` (its `reason` a metric label): at most `Bounds.max_bytes` (`too_large`),
JSON (`not_json`: NaN, Infinity and numbers past a double are not) nested at most `Bounds.max_depth`
levels (`too_deep`), of this version (`version`), every integer in 0..`Bounds.max_int` (every integer
a session holds is a count; the bound keeps a turn number inside the RouteRequest's int32), every float
finite and at most `Bounds.max_float` in size, and each field's own check (`field`). `session_codec()`
adds the Session's checks: its id is a client identifier (limits.py rule 1: printable ASCII, bounded,
so echoing it in `X-PPD-Session-Id` is safe), its worker a worker id (pool.py rule 4), its
`decode_kv_params` empty or a JSON object within the depth bound (it is parsed again for P), its
`prompt_marks` what `residency.marks_from_text` reads (at most `MAX_MARKS` pairs).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import orjson

from gateway.limits import is_client_id, json_depth_exceeds
from gateway.pool import is_worker_id
from gateway.residency import marks_from_text
from gateway.sessions import Session

__all__ = ["VERSION", "Bounds", "CodecError", "DataclassCodec", "session_codec"]

#: The encoding's version tag; bump it when the envelope (not a field) changes meaning.
VERSION = 1

T = TypeVar("T")
_Convert = Callable[[Any], Any]


class CodecError(ValueError):
    """Bytes that are not an entry of this codec's version and dataclass; `reason` says which check
    failed (too_large, not_json, too_deep, version, field)."""

    def __init__(self, message: str, *, reason: str = "field") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Bounds:
    """Rule 3's limits on a decoded entry."""

    # The whole entry; a Session's is a few hundred bytes (plus D's kv_transfer_params in bidir mode).
    max_bytes: int = 1 << 20
    # JSON nesting: the envelope is level 1, its field object 2, a field's list 3.
    max_depth: int = 16
    # Every integer (all counts): a turn number (turns + 1) still fits the RouteRequest's int32.
    max_int: int = 2**31 - 2
    # Every float (a wall-clock time in seconds is about 1.7e9).
    max_float: float = 1e15


# A field's own check: the problem with a decoded value, or None when it is fine.
FieldCheck = Callable[[Any], str | None]


class DataclassCodec(Generic[T]):
    """Encodes and decodes instances of one (frozen) dataclass."""

    def __init__(
        self, cls: type[T], *, bounds: Bounds = Bounds(), checks: Mapping[str, FieldCheck] | None = None
    ) -> None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        self._cls = cls
        self.bounds = bounds
        hints = typing.get_type_hints(cls)
        self._fields: dict[str, _Convert] = {}
        for f in dataclasses.fields(cls):
            if f.init:
                self._fields[f.name] = _converter(hints[f.name], f"{cls.__name__}.{f.name}", bounds)
        self._checks = dict(checks or {})
        unknown = set(self._checks) - set(self._fields)
        if unknown:
            raise TypeError(f"checks for fields {cls.__name__} does not have: {sorted(unknown)}")

    def encode(self, value: T) -> bytes:
        data = {name: getattr(value, name) for name in self._fields}
        return json.dumps({"v": VERSION, "f": data}, separators=(",", ":"), allow_nan=False).encode()

    def decode(self, raw: bytes) -> T:
        b = self.bounds
        if len(raw) > b.max_bytes:
            raise CodecError(f"{len(raw)} bytes, over the limit of {b.max_bytes}", reason="too_large")
        try:
            envelope = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise CodecError(f"not JSON: {_short(str(exc))}", reason="not_json") from None
        if json_depth_exceeds(raw, b.max_depth):
            raise CodecError(f"JSON nested deeper than {b.max_depth} levels", reason="too_deep")
        if not isinstance(envelope, dict) or envelope.get("v") != VERSION:
            version = envelope.get("v") if isinstance(envelope, dict) else None
            raise CodecError(f"not a version {VERSION} entry (v={_short(repr(version))})", reason="version")
        data = envelope.get("f")
        if not isinstance(data, dict):
            raise CodecError("entry has no field object")
        kwargs = {name: convert(data[name]) for name, convert in self._fields.items() if name in data}
        for name, check in self._checks.items():
            problem = check(kwargs[name]) if name in kwargs else None
            if problem is not None:
                raise CodecError(f"{self._cls.__name__}.{name}: {problem}")
        try:
            return self._cls(**kwargs)
        except TypeError as exc:  # a required field missing
            raise CodecError(str(exc)) from None


def session_codec(*, max_id_length: int, bounds: Bounds = Bounds()) -> DataclassCodec[Session]:
    """The codec of `Session` entries with the Session's own checks (rule 3). Ids are checked against
    `max_id_length` but never below 64 characters: the gateway's own ids are 32 hex digits."""
    id_length = max(max_id_length, 64)

    def session_id(value: Any) -> str | None:
        ok = is_client_id(value, max_length=id_length)
        return None if ok else f"not 1 to {id_length} printable ASCII characters without spaces"

    def worker(value: Any) -> str | None:
        return None if value is None or is_worker_id(value) else "not a worker id"

    def kv_params(value: Any) -> str | None:
        if value == "":
            return None
        raw = value.encode("utf-8", "surrogatepass")
        try:
            params = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return "not JSON"
        if not isinstance(params, dict) or json_depth_exceeds(raw, bounds.max_depth):
            return f"not a JSON object nested at most {bounds.max_depth} levels"
        return None

    def marks(value: Any) -> str | None:
        try:
            marks_from_text(value)
        except ValueError as exc:
            return f"not prompt marks ({exc})"
        return None

    checks = {"id": session_id, "worker": worker, "decode_kv_params": kv_params, "prompt_marks": marks}
    return DataclassCodec(Session, bounds=bounds, checks=checks)


def _short(text: str, most: int = 120) -> str:
    """Entry content quoted in an error message (a log line), cut short."""
    return text if len(text) <= most else text[:most] + "..."


def _converter(hint: Any, where: str, bounds: Bounds) -> _Convert:
    """JSON value -> the field's Python value (lists back to tuples), checking the shape and bounds."""
    if hint is Any:
        return _any(where, bounds)
    if hint is float:
        return _float(where, bounds)
    if hint is int:
        return _int(where, bounds)
    if hint in (type(None), bool, str):
        return _exact(hint, where)
    build = _CONTAINERS.get(typing.get_origin(hint))
    if build is None:
        raise TypeError(f"{where}: type {hint!r} cannot be stored in a shared session store")
    return build(typing.get_args(hint), where, bounds)


def _union(args: tuple[Any, ...], where: str, bounds: Bounds) -> _Convert:
    options = [_converter(a, where, bounds) for a in args]

    def check(v: Any) -> Any:
        for option in options:
            try:
                return option(v)
            except CodecError:
                continue
        raise CodecError(f"{where}: {_short(repr(v))} fits none of the union's types")

    return check


def _tuple(args: tuple[Any, ...], where: str, bounds: Bounds) -> _Convert:
    if len(args) == 2 and args[1] is Ellipsis:
        item = _converter(args[0], where, bounds)
        return _sequence(lambda v: tuple(item(x) for x in v), where)
    parts = [_converter(a, where, bounds) for a in args]

    def fixed(v: list[Any]) -> Any:
        if len(v) != len(parts):
            raise CodecError(f"{where}: expected {len(parts)} items")
        return tuple(p(x) for p, x in zip(parts, v, strict=True))

    return _sequence(fixed, where)


def _list(args: tuple[Any, ...], where: str, bounds: Bounds) -> _Convert:
    item = _converter(args[0] if args else Any, where, bounds)
    return _sequence(lambda v: [item(x) for x in v], where)


def _dict(args: tuple[Any, ...], where: str, bounds: Bounds) -> _Convert:
    if args and args[0] is not str:
        raise TypeError(f"{where}: only dicts with str keys can be stored")
    value = _converter(args[1] if args else Any, where, bounds)

    def mapping(v: Any) -> Any:
        if not isinstance(v, dict):
            raise CodecError(f"{where}: expected an object")
        return {k: value(x) for k, x in v.items()}

    return mapping


_CONTAINERS: dict[Any, Callable[[tuple[Any, ...], str, Bounds], _Convert]] = {
    types.UnionType: _union,
    typing.Union: _union,
    tuple: _tuple,
    list: _list,
    dict: _dict,
}


def _exact(kind: type, where: str) -> _Convert:
    def check(v: Any) -> Any:
        if type(v) is not kind:
            raise CodecError(f"{where}: expected {kind.__name__}, got {type(v).__name__}")
        return v

    return check


def _int(where: str, bounds: Bounds) -> _Convert:
    def check(v: Any) -> Any:
        if type(v) is not int:
            raise CodecError(f"{where}: expected int, got {type(v).__name__}")
        if not 0 <= v <= bounds.max_int:
            raise CodecError(f"{where}: {_short(str(v))} is outside 0..{bounds.max_int}")
        return v

    return check


def _float(where: str, bounds: Bounds) -> _Convert:
    def check(v: Any) -> Any:
        if type(v) not in (int, float):
            raise CodecError(f"{where}: expected float, got {type(v).__name__}")
        if not abs(v) <= bounds.max_float:  # False for NaN and the infinities; exact for any int
            raise CodecError(f"{where}: {_short(str(v))} is not a finite number within {bounds.max_float:g}")
        return float(v)

    return check


def _any(where: str, bounds: Bounds) -> _Convert:
    """A value of any JSON type: its numbers within the bounds (the nesting was checked on the bytes)."""
    number = _float(where, bounds)

    def check(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: check(x) for k, x in v.items()}
        if isinstance(v, list):
            return [check(x) for x in v]
        if type(v) in (int, float):
            number(v)
        return v

    return check


def _sequence(build: Callable[[list[Any]], Any], where: str) -> _Convert:
    def check(v: Any) -> Any:
        if not isinstance(v, list):
            raise CodecError(f"{where}: expected an array, got {type(v).__name__}")
        return build(v)

    return check
