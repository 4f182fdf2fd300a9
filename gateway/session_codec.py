"""Sessions as bytes for a shared store, from the dataclass's own fields: pure, no transport.

Rule 1 (generic): the encoding is built from `dataclasses.fields(Session)` and their type hints, so a
field added to `Session` travels with no change here, as long as its type is built from None, bool,
int, float, str, tuples (`tuple[X, ...]`, `tuple[X, Y]`), lists, dicts with str keys, and unions of
these. A field of any other type is refused when the codec is built (at start-up), never at run time.
Rule 2 (versioned): one JSON object `{"v": VERSION, "f": {field: value}}`. Fields an older replica
does not know are ignored, fields it misses take their defaults, so replicas of two versions can
share one store during a rolling update. Another `v`, bad JSON, or values of the wrong shape are a
`CodecError` (the store counts them and treats the entry as missing).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["VERSION", "CodecError", "DataclassCodec"]

#: The encoding's version tag; bump it when the envelope (not a field) changes meaning.
VERSION = 1

T = TypeVar("T")
_Convert = Callable[[Any], Any]


class CodecError(ValueError):
    """Bytes that are not an entry of this codec's version and dataclass."""


class DataclassCodec(Generic[T]):
    """Encodes and decodes instances of one (frozen) dataclass."""

    def __init__(self, cls: type[T]) -> None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        self._cls = cls
        hints = typing.get_type_hints(cls)
        self._fields: dict[str, _Convert] = {}
        for f in dataclasses.fields(cls):
            if f.init:
                self._fields[f.name] = _converter(hints[f.name], f"{cls.__name__}.{f.name}")

    def encode(self, value: T) -> bytes:
        data = {name: getattr(value, name) for name in self._fields}
        return json.dumps({"v": VERSION, "f": data}, separators=(",", ":"), allow_nan=False).encode()

    def decode(self, raw: bytes) -> T:
        try:
            envelope = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CodecError(f"not JSON: {exc}") from None
        if not isinstance(envelope, dict) or envelope.get("v") != VERSION:
            version = envelope.get("v") if isinstance(envelope, dict) else None
            raise CodecError(f"not a version {VERSION} entry (v={version!r})")
        data = envelope.get("f")
        if not isinstance(data, dict):
            raise CodecError("entry has no field object")
        kwargs = {name: convert(data[name]) for name, convert in self._fields.items() if name in data}
        try:
            return self._cls(**kwargs)
        except TypeError as exc:  # a required field missing
            raise CodecError(str(exc)) from None


def _converter(hint: Any, where: str) -> _Convert:
    """JSON value -> the field's Python value (lists back to tuples), checking the shape."""
    if hint is Any:
        return lambda v: v
    if hint is float:
        return _float(where)
    if hint in (type(None), bool, int, str):
        return _exact(hint, where)
    build = _CONTAINERS.get(typing.get_origin(hint))
    if build is None:
        raise TypeError(f"{where}: type {hint!r} cannot be stored in a shared session store")
    return build(typing.get_args(hint), where)


def _union(args: tuple[Any, ...], where: str) -> _Convert:
    options = [_converter(a, where) for a in args]

    def check(v: Any) -> Any:
        for option in options:
            try:
                return option(v)
            except CodecError:
                continue
        raise CodecError(f"{where}: {v!r} fits none of the union's types")

    return check


def _tuple(args: tuple[Any, ...], where: str) -> _Convert:
    if len(args) == 2 and args[1] is Ellipsis:
        item = _converter(args[0], where)
        return _sequence(lambda v: tuple(item(x) for x in v), where)
    parts = [_converter(a, where) for a in args]

    def fixed(v: list[Any]) -> Any:
        if len(v) != len(parts):
            raise CodecError(f"{where}: expected {len(parts)} items")
        return tuple(p(x) for p, x in zip(parts, v, strict=True))

    return _sequence(fixed, where)


def _list(args: tuple[Any, ...], where: str) -> _Convert:
    item = _converter(args[0], where) if args else _converter(Any, where)
    return _sequence(lambda v: [item(x) for x in v], where)


def _dict(args: tuple[Any, ...], where: str) -> _Convert:
    if args and args[0] is not str:
        raise TypeError(f"{where}: only dicts with str keys can be stored")
    value = _converter(args[1], where) if args else _converter(Any, where)

    def mapping(v: Any) -> Any:
        if not isinstance(v, dict):
            raise CodecError(f"{where}: expected an object")
        return {k: value(x) for k, x in v.items()}

    return mapping


_CONTAINERS: dict[Any, Callable[[tuple[Any, ...], str], _Convert]] = {
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


def _float(where: str) -> _Convert:
    def check(v: Any) -> Any:
        if type(v) not in (int, float):
            raise CodecError(f"{where}: expected float, got {type(v).__name__}")
        return float(v)

    return check


def _sequence(build: Callable[[list[Any]], Any], where: str) -> _Convert:
    def check(v: Any) -> Any:
        if not isinstance(v, list):
            raise CodecError(f"{where}: expected an array, got {type(v).__name__}")
        return build(v)

    return check
