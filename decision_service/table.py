"""The table file: a small versioned binary format in the spirit of npy and safetensors.

Layout (all integers little-endian)::

    offset 0   8 bytes   magic b"PPDTABLE"
    offset 8   u16       format version (FORMAT_VERSION)
    offset 10  u16       reserved, 0
    offset 12  u32       header length H
    offset 16  H bytes   JSON header, space-padded so that the arrays start on a 64-byte boundary
    ...        arrays    raw little-endian arrays at the offsets the header names (64-byte aligned)
    end - 32   32 bytes  SHA-256 of every byte before it

The header holds the key (``<shape>/<model>``), a content-derived version, the axes, weights, the SLO,
the default decision, live-signal limits and provenance. The one array, ``figures``, is float64 of shape
(context, workload, qps, len(FIGURES)).

Rule 1: a file is validated completely (checksum, header, axes against arrays, finite figures) before a
``Table`` exists; a ``Table`` is therefore always good. Rule 2: writing is deterministic (sorted JSON keys,
no clock): the same spec gives the same bytes. Publishing is atomic (temp file, fsync, rename).
Rule 3: ``Table.open`` reads the whole file into private memory once and validates that copy; nothing
served reads the file again. A file changed in place under a served table (truncated, overwritten) can
therefore neither crash the reader (there is no mapping to fault on) nor change what one RPC sees
compared with another (the arrays are read-only views of immutable bytes).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from decision_service.axes import Axes, AxesError

__all__ = [
    "FIGURES",
    "FORMAT_VERSION",
    "MAGIC",
    "SUFFIX",
    "Table",
    "TableError",
    "TableSpec",
    "Weights",
    "encode_table",
    "write_table",
]

MAGIC: Final = b"PPDTABLE"
FORMAT_VERSION: Final = 1
SUFFIX: Final = ".ppdt"
FIGURES: Final = (
    "pd_ttft_ms",
    "pd_tpot_ms",
    "local_ttft_ms",
    "local_tpot_ms",
    "pd_success",
    "local_success",
    "pd_samples",
    "local_samples",
)
_PREAMBLE = struct.Struct("<8sHHI")
_ALIGN = 64
_DIGEST = 32
_DTYPE = "<f8"
_REASONS = (
    "bad_magic",
    "future_version",
    "truncated",
    "checksum",
    "header",
    "axes",
    "nan",
    "figures",
    "empty",
)

Figures = npt.NDArray[np.float64]


class TableError(Exception):
    """A table file failed validation. ``reason`` is a short stable code for logs and metrics."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in _REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class Weights:
    w_ttft: float
    w_tpot: float

    def to_json(self) -> dict[str, float]:
        return {"w_ttft": self.w_ttft, "w_tpot": self.w_tpot}


@dataclass(frozen=True, slots=True)
class TableSpec:
    """Everything a table file holds; the input of ``encode_table``.

    ``figures[c, w, q]`` holds FIGURES for one cell; a cell is measured when both sample counts are > 0.
    """

    shape: str
    model: str
    axes: Axes
    figures: Figures
    default_weights: Weights = Weights(1.0, 1.0)
    profiles: Mapping[str, Weights] = field(default_factory=dict)
    min_success: float = 0.95
    default_decision: str = "pd"
    max_decode_kv_usage: float = 0.95
    # Decode-load guard (route.py rule 5): above this many running requests on the session's decode
    # worker, LOCAL turns PD unless the prefill queue is deeper than max_prefill_queue_depth. None: off.
    max_decode_running: int | None = None
    max_prefill_queue_depth: int | None = None
    provenance: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.shape}/{self.model}"


def encode_table(spec: TableSpec) -> bytes:
    """Serialise ``spec`` (validating it first, as a reader would)."""
    figures = np.ascontiguousarray(spec.figures, dtype=_DTYPE)
    header: dict[str, Any] = {
        "format": "ppd-table",
        "key": spec.key,
        "shape": spec.shape,
        "model": spec.model,
        "axes": spec.axes.to_json(),
        "figures": list(FIGURES),
        "weights": {
            "default": spec.default_weights.to_json(),
            "profiles": {name: w.to_json() for name, w in sorted(spec.profiles.items())},
        },
        "slo": {"min_success": spec.min_success},
        "default_decision": spec.default_decision,
        "live": {
            "max_decode_kv_usage": spec.max_decode_kv_usage,
            "max_decode_running": spec.max_decode_running,
            "max_prefill_queue_depth": spec.max_prefill_queue_depth,
        },
        "provenance": dict(spec.provenance),
    }
    data = figures.tobytes()
    header["version"] = hashlib.sha256(_canonical(header) + data).hexdigest()[:16]
    # The array offset depends on the header length, which depends on the offset's digits: settle it.
    offset = 0
    while True:
        header["arrays"] = [
            {"name": "figures", "dtype": _DTYPE, "shape": list(figures.shape), "offset": offset}
        ]
        raw = _canonical(header)
        start = _align(_PREAMBLE.size + len(raw))
        if start == offset:
            break
        offset = start
    raw = raw.ljust(start - _PREAMBLE.size, b" ")
    body = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(raw)) + raw + data
    blob = body + hashlib.sha256(body).digest()
    _decode(memoryview(blob))  # never write what we would refuse to read
    return blob


def write_table(path: str | os.PathLike[str], spec: TableSpec) -> Path:
    """Publish ``spec`` at ``path`` atomically (temp file in the same folder, fsync, rename)."""
    target = Path(path)
    blob = encode_table(spec)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(blob)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


class Table:
    """A validated table held in private, immutable memory (see Rule 3). ``close()`` is kept for callers
    that release tables explicitly; it only drops the arrays."""

    __slots__ = (
        "axes",
        "default_decision",
        "default_weights",
        "figures",
        "header",
        "key",
        "max_decode_kv_usage",
        "max_decode_running",
        "max_prefill_queue_depth",
        "min_success",
        "model",
        "path",
        "profiles",
        "shape",
        "version",
    )

    def __init__(self, parsed: _Parsed, path: Path | None) -> None:
        self.path = path
        self.header = parsed.header
        self.axes = parsed.axes
        self.figures = parsed.figures
        h = parsed.header
        self.key: str = h["key"]
        self.shape: str = h["shape"]
        self.model: str = h["model"]
        self.version: str = h["version"]
        self.default_weights = parsed.default_weights
        self.profiles = parsed.profiles
        self.min_success: float = h["slo"]["min_success"]
        self.default_decision: str = h["default_decision"]
        self.max_decode_kv_usage: float = h["live"]["max_decode_kv_usage"]
        self.max_decode_running: int | None = parsed.max_decode_running
        self.max_prefill_queue_depth: int | None = parsed.max_prefill_queue_depth

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Table:
        """Read ``path`` into memory and validate that copy; raise TableError (never anything else for
        bad content). A file being rewritten while it is read fails its checksum and is rejected."""
        p = Path(path)
        with open(p, "rb") as fh:
            blob = fh.read()
        if not blob:
            raise TableError("empty", f"{p} is an empty file")
        return cls(_decode(memoryview(blob)), p)

    @classmethod
    def from_bytes(cls, blob: bytes) -> Table:
        return cls(_decode(memoryview(bytes(blob))), None)

    def measured(self, c: int, w: int, q: int) -> bool:
        row = self.figures[c, w, q]
        return bool(row[6] > 0 and row[7] > 0)

    def close(self) -> None:
        """Drop the arrays. Arrays of a closed table must not be used any more."""
        self.figures = np.empty((0, 0, 0, len(FIGURES)))

    def __repr__(self) -> str:
        return f"Table(key={self.key!r}, version={self.version!r}, path={str(self.path)!r})"


@dataclass(frozen=True, slots=True)
class _Parsed:
    header: dict[str, Any]
    axes: Axes
    figures: Figures
    default_weights: Weights
    profiles: dict[str, Weights]
    max_decode_running: int | None
    max_prefill_queue_depth: int | None


def _decode(buf: memoryview) -> _Parsed:
    size = len(buf)
    if size == 0:
        raise TableError("empty", "no bytes")
    if size < len(MAGIC) or bytes(buf[: len(MAGIC)]) != MAGIC:
        if size < len(MAGIC) and MAGIC.startswith(bytes(buf)):
            raise TableError("truncated", f"{size} bytes, shorter than the preamble")
        raise TableError("bad_magic", f"not a PPD table (magic {bytes(buf[:8])!r}, expected {MAGIC!r})")
    if size < _PREAMBLE.size:
        raise TableError("truncated", f"{size} bytes, shorter than the preamble")
    _, version, _, header_len = _PREAMBLE.unpack_from(buf, 0)
    if version > FORMAT_VERSION:
        raise TableError(
            "future_version", f"format version {version}; this reader knows up to {FORMAT_VERSION}"
        )
    if version < 1:
        raise TableError("header", f"format version {version} does not exist")
    header_end = _PREAMBLE.size + header_len
    if size < header_end + _DIGEST:
        raise TableError("truncated", f"{size} bytes, but the header alone needs {header_end + _DIGEST}")
    body = buf[: size - _DIGEST]
    _verify_digest(buf, header_end)
    try:
        header = json.loads(bytes(buf[_PREAMBLE.size : header_end]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TableError("header", f"header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise TableError("header", "header is not a JSON object")
    try:
        return _interpret(header, body)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, AxesError):
            raise TableError("axes", str(exc)) from exc
        raise TableError("header", f"malformed header: {exc!r}") from exc


def _interpret(header: dict[str, Any], body: memoryview) -> _Parsed:
    for key in ("key", "shape", "model", "version", "default_decision"):
        if not isinstance(header[key], str) or not header[key]:
            raise TableError("header", f"header field {key!r} must be a non-empty string")
    if header["key"] != f"{header['shape']}/{header['model']}":
        raise TableError("header", f"key {header['key']!r} is not shape/model")
    if header["default_decision"] not in ("pd", "local"):
        raise TableError(
            "header", f"default_decision must be 'pd' or 'local', got {header['default_decision']!r}"
        )
    if list(header["figures"]) != list(FIGURES):
        raise TableError("header", f"figures {header['figures']} differ from this reader's {list(FIGURES)}")
    axes = Axes.from_json(header["axes"])
    default_weights = _weights(header["weights"]["default"], "default")
    profiles = {str(n): _weights(w, n) for n, w in header["weights"]["profiles"].items()}
    min_success = float(header["slo"]["min_success"])
    kv_limit = float(header["live"]["max_decode_kv_usage"])
    if not (0.0 <= min_success <= 1.0) or not (0.0 <= kv_limit <= 1.0):
        raise TableError("header", "slo.min_success and live.max_decode_kv_usage must be within 0..1")
    # Absent in tables written before the decode-load guard existed: the guard is off for them.
    running_limit = _optional_count(header["live"], "max_decode_running")
    queue_limit = _optional_count(header["live"], "max_prefill_queue_depth")
    arrays = header["arrays"]
    if len(arrays) != 1 or arrays[0]["name"] != "figures" or arrays[0]["dtype"] != _DTYPE:
        raise TableError("header", f"expected one {_DTYPE} array 'figures', got {arrays}")
    spec = arrays[0]
    shape = tuple(int(n) for n in spec["shape"])
    expected = (*axes.shape, len(FIGURES))
    if shape != expected:
        raise TableError("axes", f"figures have shape {shape}, the axes need {expected}")
    offset = int(spec["offset"])
    nbytes = int(np.prod(shape)) * 8
    if offset % _ALIGN or offset + nbytes != len(body):
        raise TableError(
            "truncated" if offset + nbytes > len(body) else "header",
            f"array at {offset}+{nbytes} does not end where the content ends ({len(body)})",
        )
    figures = np.frombuffer(body, dtype=_DTYPE, count=int(np.prod(shape)), offset=offset).reshape(shape)
    _check_figures(figures)
    return _Parsed(header, axes, figures, default_weights, profiles, running_limit, queue_limit)


def _optional_count(section: dict[str, Any], key: str) -> int | None:
    value = section.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TableError("header", f"live.{key} must be a whole number >= 0 or null, got {value!r}")
    return value


def _check_figures(figures: Figures) -> None:
    if not np.isfinite(figures).all():
        bad = np.argwhere(~np.isfinite(figures))[0]
        raise TableError(
            "nan", f"non-finite figure {FIGURES[bad[3]]} in cell {tuple(int(i) for i in bad[:3])}"
        )
    if (figures < 0).any():
        bad = np.argwhere(figures < 0)[0]
        raise TableError(
            "figures", f"negative figure {FIGURES[bad[3]]} in cell {tuple(int(i) for i in bad[:3])}"
        )
    if (figures[..., 4:6] > 1).any():
        raise TableError("figures", "success rates must be within 0..1")
    measured = (figures[..., 6] > 0) & (figures[..., 7] > 0)
    if not measured.any():
        raise TableError("empty", "no cell has measurements for both modes")
    positive = figures[..., 0:4][measured]
    if (positive <= 0).any():
        raise TableError("figures", "a measured cell has a zero TTFT or TPOT")


def _verify_digest(buf: memoryview, header_end: int) -> None:
    size = len(buf)
    if hashlib.sha256(buf[: size - _DIGEST]).digest() != bytes(buf[size - _DIGEST :]):
        declared = _declared_size(bytes(buf[_PREAMBLE.size : header_end]))
        if declared is not None and declared > size:
            raise TableError("truncated", f"{size} bytes, but the header describes {declared}")
        raise TableError("checksum", "SHA-256 of the content does not match the stored digest")


def _declared_size(raw_header: bytes) -> int | None:
    """The file size the header describes, or None when the header cannot tell (best effort)."""
    try:
        spec = json.loads(raw_header)["arrays"][0]
        return int(spec["offset"]) + int(np.prod(spec["shape"])) * 8 + _DIGEST
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def _weights(raw: Mapping[str, Any], name: str) -> Weights:
    w = Weights(float(raw["w_ttft"]), float(raw["w_tpot"]))
    if not (math.isfinite(w.w_ttft) and math.isfinite(w.w_tpot)) or w.w_ttft < 0 or w.w_tpot < 0:
        raise TableError("header", f"weights {name!r} must be finite and non-negative")
    if w.w_ttft == 0 and w.w_tpot == 0:
        raise TableError("header", f"weights {name!r} are both zero")
    return w


def _canonical(header: Mapping[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN
