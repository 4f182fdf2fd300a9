"""The table file: a small versioned binary format in the spirit of npy and safetensors.

Layout (all integers little-endian)::

    offset 0   8 bytes   magic b"PPDTABLE"
    offset 8   u16       format version (1 or 2; FORMAT_VERSION is the newest)
    offset 10  u16       reserved, 0
    offset 12  u32       header length H
    offset 16  H bytes   JSON header, space-padded so that the arrays start on a 64-byte boundary
    ...        arrays    raw little-endian arrays at the offsets the header names (64-byte aligned)
    end - 32   32 bytes  SHA-256 of every byte before it

The JSON header is a ``TableHeader`` (header.py: the key ``<shape>/<model>``, the axes, weights, the
SLO, the default decision, live-signal limits, provenance; its fields and checks are listed there only)
plus what this layer adds: a content-derived ``version`` and the ``arrays`` list. The one array,
``figures``, is float64 of shape (context, workload, qps, F), F = len(FIGURES_OF_VERSION[version]):
8 columns in version 1 (PD and LOCAL), 12 in version 2 (plus the bidirectional mode, BIDIR).

Versions: a writer writes the lowest version that holds its figures: version 1 when no cell has BIDIR
samples (so a two-mode table is the same bytes, and the same content version, as before version 2
existed), version 2 otherwise. A reader reads both; a version-1 table gets the BIDIR columns as zeros
(no samples anywhere), which the router treats exactly like a table without the mode.

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
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from decision_service.axes import AxesError
from decision_service.header import (
    BIDIR_LATENCIES,
    FIGURES,
    FIGURES_OF_VERSION,
    LATENCIES,
    SUCCESS_RATES,
    Figure,
    HeaderError,
    TableHeader,
    Weights,
)

__all__ = [
    "DIGEST_SIZE",
    "FIGURES",
    "FIGURES_OF_VERSION",
    "FORMAT_VERSION",
    "MAGIC",
    "PREAMBLE",
    "SUFFIX",
    "Figure",
    "Table",
    "TableError",
    "TableHeader",
    "TableSpec",
    "Weights",
    "encode_table",
    "write_table",
]

MAGIC: Final = b"PPDTABLE"
#: The newest format version this code reads and writes (see "Versions" above).
FORMAT_VERSION: Final = 2
SUFFIX: Final = ".ppdt"
#: magic, format version, reserved, header length (the layout above).
PREAMBLE: Final = struct.Struct("<8sHHI")
#: The trailing SHA-256.
DIGEST_SIZE: Final = 32
_ALIGN = 64
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
class TableSpec:
    """Everything a table file holds; the input of ``encode_table``.

    ``figures[c, w, q]`` holds one cell's row, indexed by ``Figure``: all ``len(FIGURES)`` columns, or
    the 8 of format version 1; a cell is measured when PD's and LOCAL's sample counts are > 0.
    """

    header: TableHeader
    figures: Figures


def encode_table(spec: TableSpec) -> bytes:
    """Serialise ``spec`` (validating it first, as a reader would)."""
    figures = np.ascontiguousarray(spec.figures, dtype=_DTYPE)
    format_version = _version_for(figures)
    figures = np.ascontiguousarray(figures[..., : len(FIGURES_OF_VERSION[format_version])])
    header = spec.header.to_json(format_version)
    data = figures.tobytes()
    header["version"] = hashlib.sha256(_canonical(header) + data).hexdigest()[:16]
    # The array offset depends on the header length, which depends on the offset's digits: settle it.
    offset = 0
    while True:
        header["arrays"] = [
            {"name": "figures", "dtype": _DTYPE, "shape": list(figures.shape), "offset": offset}
        ]
        raw = _canonical(header)
        start = _align(PREAMBLE.size + len(raw))
        if start == offset:
            break
        offset = start
    raw = raw.ljust(start - PREAMBLE.size, b" ")
    body = PREAMBLE.pack(MAGIC, format_version, 0, len(raw)) + raw + data
    blob = body + hashlib.sha256(body).digest()
    _decode(memoryview(blob))  # never write what we would refuse to read
    return blob


def _version_for(figures: Figures) -> int:
    """The lowest format version that holds ``figures``: 2 when a cell has BIDIR samples, else 1."""
    columns = figures.shape[-1] if figures.ndim == 4 else -1
    if columns not in (len(FIGURES_OF_VERSION[1]), len(FIGURES)):
        raise TableError(
            "figures", f"figures have shape {figures.shape}; the last axis must be 8 or {len(FIGURES)}"
        )
    if columns == len(FIGURES) and (figures[..., Figure.BIDIR_SAMPLES] > 0).any():
        return 2
    return 1


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
    that release tables explicitly; it only drops the arrays.

    ``header`` is what the table says (``TableHeader``); ``raw_header`` the JSON header object exactly as
    stored, ``version`` and ``arrays`` included (DescribeTable hands it out as is). ``figures`` always
    has every ``Figure`` column, whatever ``format_version`` the file has (see "Versions").
    """

    __slots__ = ("figures", "format_version", "header", "key", "path", "raw_header", "version")

    def __init__(self, parsed: _Parsed, path: Path | None) -> None:
        self.path = path
        self.header = parsed.header
        self.raw_header = parsed.raw_header
        self.figures = parsed.figures
        self.format_version = parsed.format_version
        self.key = parsed.header.key
        self.version: str = parsed.raw_header["version"]

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
        return bool(row[Figure.PD_SAMPLES] > 0 and row[Figure.LOCAL_SAMPLES] > 0)

    def has_bidir(self, c: int, w: int, q: int) -> bool:
        """Whether cell (c, w, q) has the bidirectional mode's figures (never in a version-1 file)."""
        return bool(self.figures[c, w, q, Figure.BIDIR_SAMPLES] > 0)

    def close(self) -> None:
        """Drop the arrays. Arrays of a closed table must not be used any more."""
        self.figures = np.empty((0, 0, 0, len(FIGURES)))

    def __repr__(self) -> str:
        return f"Table(key={self.key!r}, version={self.version!r}, path={str(self.path)!r})"


@dataclass(frozen=True, slots=True)
class _Parsed:
    header: TableHeader
    raw_header: Mapping[str, Any]
    figures: Figures
    format_version: int


def _decode(buf: memoryview) -> _Parsed:
    size = len(buf)
    if size == 0:
        raise TableError("empty", "no bytes")
    if size < len(MAGIC) or bytes(buf[: len(MAGIC)]) != MAGIC:
        if size < len(MAGIC) and MAGIC.startswith(bytes(buf)):
            raise TableError("truncated", f"{size} bytes, shorter than the preamble")
        raise TableError("bad_magic", f"not a PPD table (magic {bytes(buf[:8])!r}, expected {MAGIC!r})")
    if size < PREAMBLE.size:
        raise TableError("truncated", f"{size} bytes, shorter than the preamble")
    _, version, _, header_len = PREAMBLE.unpack_from(buf, 0)
    if version > FORMAT_VERSION:
        raise TableError(
            "future_version", f"format version {version}; this reader knows up to {FORMAT_VERSION}"
        )
    if version < 1:
        raise TableError("header", f"format version {version} does not exist")
    header_end = PREAMBLE.size + header_len
    if size < header_end + DIGEST_SIZE:
        raise TableError("truncated", f"{size} bytes, but the header alone needs {header_end + DIGEST_SIZE}")
    body = buf[: size - DIGEST_SIZE]
    _verify_digest(buf, header_end)
    try:
        header = json.loads(bytes(buf[PREAMBLE.size : header_end]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TableError("header", f"header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise TableError("header", "header is not a JSON object")
    try:
        return _interpret(header, body, version)
    except HeaderError as exc:
        raise TableError("header", str(exc)) from exc
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, AxesError):
            raise TableError("axes", str(exc)) from exc
        raise TableError("header", f"malformed header: {exc!r}") from exc


def _interpret(raw: dict[str, Any], body: memoryview, format_version: int) -> _Parsed:
    if not isinstance(raw["version"], str) or not raw["version"]:
        raise TableError("header", "header field 'version' must be a non-empty string")
    header = TableHeader.from_json(raw, format_version)
    columns = FIGURES_OF_VERSION[format_version]
    arrays = raw["arrays"]
    if len(arrays) != 1 or arrays[0]["name"] != "figures" or arrays[0]["dtype"] != _DTYPE:
        raise TableError("header", f"expected one {_DTYPE} array 'figures', got {arrays}")
    spec = arrays[0]
    shape = tuple(int(n) for n in spec["shape"])
    expected = (*header.axes.shape, len(columns))
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
    if len(columns) < len(FIGURES):
        # An older file: the columns it lacks read as zero (no samples), in a read-only private copy.
        full = np.zeros((*header.axes.shape, len(FIGURES)), dtype=_DTYPE)
        full[..., : len(columns)] = figures
        full.flags.writeable = False
        figures = full
    _check_figures(figures)
    return _Parsed(header, raw, figures, format_version)


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
    if (figures[..., SUCCESS_RATES] > 1).any():
        raise TableError("figures", "success rates must be within 0..1")
    has_bidir = figures[..., Figure.BIDIR_SAMPLES] > 0
    if (figures[..., BIDIR_LATENCIES][has_bidir] <= 0).any():
        raise TableError("figures", "a cell with BIDIR samples has a zero BIDIR TTFT or TPOT")
    measured = (figures[..., Figure.PD_SAMPLES] > 0) & (figures[..., Figure.LOCAL_SAMPLES] > 0)
    if not measured.any():
        raise TableError("empty", "no cell has measurements for both modes")
    positive = figures[..., LATENCIES][measured]
    if (positive <= 0).any():
        raise TableError("figures", "a measured cell has a zero TTFT or TPOT")


def _verify_digest(buf: memoryview, header_end: int) -> None:
    size = len(buf)
    if hashlib.sha256(buf[: size - DIGEST_SIZE]).digest() != bytes(buf[size - DIGEST_SIZE :]):
        declared = _declared_size(bytes(buf[PREAMBLE.size : header_end]))
        if declared is not None and declared > size:
            raise TableError("truncated", f"{size} bytes, but the header describes {declared}")
        raise TableError("checksum", "SHA-256 of the content does not match the stored digest")


def _declared_size(raw_header: bytes) -> int | None:
    """The file size the header describes, or None when the header cannot tell (best effort)."""
    try:
        spec = json.loads(raw_header)["arrays"][0]
        return int(spec["offset"]) + int(np.prod(spec["shape"])) * 8 + DIGEST_SIZE
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def _canonical(header: Mapping[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN
