"""Synthetic but plausible tables for tests, and the bad fixtures (one per failure mode)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from decision_service.axes import paper_axes
from decision_service.table import (
    DIGEST_SIZE,
    PREAMBLE,
    Figure,
    TableHeader,
    TableSpec,
    Weights,
    encode_table,
)

PROFILES = {"ttft": Weights(1.0, 0.2), "tpot": Weights(0.2, 1.0), "balanced": Weights(1.0, 1.0)}


def synthetic_spec(
    *, seed: int = 7, holes: bool = True, shape: str = "1P3D", model: str = "llama-3.1-8b"
) -> TableSpec:
    """Figures that follow the paper's shape: LOCAL cuts TTFT more as QPS grows, costs some TPOT,
    PD fails at the highest QPS of the large context. With ``holes`` some cells are unmeasured."""
    axes = paper_axes()
    rng = np.random.default_rng(seed)
    nc, nw, nq = axes.shape
    fig = np.zeros((nc, nw, nq, len(Figure)))
    for c in range(nc):
        for w, wl in enumerate(axes.workloads):
            for q, level in enumerate(axes.qps_levels):
                pd_ttft = 60.0 + 8.0 * level * (1 + c) + wl.n_in * 0.05
                local_ttft = pd_ttft * (0.35 + 0.02 * rng.random())
                pd_tpot = 9.0 + 0.1 * level
                local_tpot = pd_tpot * (1.0 + 0.004 * wl.n_in / 16 + 0.01 * rng.random())
                pd_ok = 0.80 if (c == 1 and level >= 20) else 1.0
                fig[c, w, q] = row(
                    pd_ttft_ms=pd_ttft,
                    pd_tpot_ms=pd_tpot,
                    local_ttft_ms=local_ttft,
                    local_tpot_ms=local_tpot,
                    pd_success=pd_ok,
                    local_success=1.0,
                    pd_samples=40,
                    local_samples=40,
                )
    if holes:
        fig[0, 0, 6, SAMPLES] = 0  # (small, tiny) has no data at 10 QPS: nearest level answers
        fig[0, 1, :, SAMPLES] = 0  # (small, short_gen) has no data at all: the default answers
        fig[2, :, :, SAMPLES] = 0  # huge contexts were never measured
    header = TableHeader(
        shape=shape,
        model=model,
        axes=axes,
        profiles=PROFILES,
        provenance={"source": "tests/support/tables.py", "seed": seed},
    )
    return TableSpec(header, fig)


#: The sample-count columns: zero them and a cell is unmeasured.
SAMPLES = [Figure.PD_SAMPLES, Figure.LOCAL_SAMPLES]


def row(
    *,
    pd_ttft_ms: float,
    pd_tpot_ms: float,
    local_ttft_ms: float,
    local_tpot_ms: float,
    pd_success: float,
    local_success: float,
    pd_samples: float,
    local_samples: float,
    bidir_ttft_ms: float = 0.0,
    bidir_tpot_ms: float = 0.0,
    bidir_success: float = 0.0,
    bidir_samples: float = 0.0,
) -> list[float]:
    """One cell's figures, by name, in the array's order (no BIDIR figures unless given)."""
    named = {
        Figure.PD_TTFT_MS: pd_ttft_ms,
        Figure.PD_TPOT_MS: pd_tpot_ms,
        Figure.LOCAL_TTFT_MS: local_ttft_ms,
        Figure.LOCAL_TPOT_MS: local_tpot_ms,
        Figure.PD_SUCCESS: pd_success,
        Figure.LOCAL_SUCCESS: local_success,
        Figure.PD_SAMPLES: pd_samples,
        Figure.LOCAL_SAMPLES: local_samples,
        Figure.BIDIR_TTFT_MS: bidir_ttft_ms,
        Figure.BIDIR_TPOT_MS: bidir_tpot_ms,
        Figure.BIDIR_SUCCESS: bidir_success,
        Figure.BIDIR_SAMPLES: bidir_samples,
    }
    return [named[f] for f in Figure]


def with_header(spec: TableSpec, **changes: Any) -> TableSpec:
    """``spec`` with some of its header fields changed."""
    return dataclasses.replace(spec, header=dataclasses.replace(spec.header, **changes))


def _resign(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def _header_of(blob: bytes) -> tuple[dict[str, Any], int]:
    """The JSON header of a table file and its (padded) length."""
    *_, hlen = PREAMBLE.unpack_from(blob, 0)
    return json.loads(blob[PREAMBLE.size : PREAMBLE.size + hlen]), hlen


def _array_offset(blob: bytes) -> int:
    offset: int = _header_of(blob)[0]["arrays"][0]["offset"]
    return offset


def patch_header(blob: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """Rewrite the JSON header in place (same length, space padded) and re-sign the file."""
    header, hlen = _header_of(blob)
    edit(header)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    assert len(raw) <= hlen, "patched header grew past its padding"
    start = PREAMBLE.size
    body = blob[:start] + raw.ljust(hlen, b" ") + blob[start + hlen : -DIGEST_SIZE]
    return _resign(body)


def _nan_figures(blob: bytes) -> bytes:
    at = _array_offset(blob) + 8 * Figure.PD_TPOT_MS  # cell (0, 0, 0)
    body = bytearray(blob[:-DIGEST_SIZE])
    body[at : at + 8] = struct.pack("<d", float("nan"))
    return _resign(bytes(body))


def _wrong_axes(header: dict[str, Any]) -> None:
    header["axes"]["qps_levels"] = header["axes"]["qps_levels"][:-1]


def _future_version(blob: bytes) -> bytes:
    magic, _, reserved, hlen = PREAMBLE.unpack_from(blob, 0)
    return _resign(PREAMBLE.pack(magic, 99, reserved, hlen) + blob[PREAMBLE.size : -DIGEST_SIZE])


def _with_figures(edit: Callable[[np.ndarray], None], *, holes: bool = False) -> bytes:
    """A good table whose figure array `edit` changed in place after encoding (re-signed)."""
    spec = synthetic_spec(holes=holes)
    blob = encode_table(spec)
    fig = spec.figures[..., : len(_header_of(blob)[0]["figures"])].copy()  # the columns the file holds
    edit(fig)
    return _resign(blob[: _array_offset(blob)] + fig.astype("<f8").tobytes())


def _empty_cells() -> bytes:
    def unmeasure(fig: np.ndarray) -> None:
        fig[..., SAMPLES] = 0

    return _with_figures(unmeasure)


def _set_figure(index: Figure, value: float) -> Callable[[np.ndarray], None]:
    def edit(fig: np.ndarray) -> None:
        fig[1, 4, 3, index] = value  # (large, mid_bal, 4 QPS): a measured cell

    return edit


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        section = header
        for key in path[:-1]:
            section = section[key]
        section[path[-1]] = value

    return edit


def bad_fixtures() -> dict[str, bytes]:
    """One corrupt file per TableError reason; the key is the reason the reader must give."""
    good = encode_table(synthetic_spec())
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    return {
        "bad_magic": b"NOTATABL" + good[8:],
        "future_version": _future_version(good),
        "truncated": good[: len(good) - 100],
        "checksum": bytes(flipped),
        "axes": patch_header(good, _wrong_axes),
        "nan": _nan_figures(good),
        "empty": _empty_cells(),
        "header": patch_header(good, lambda h: h.pop("model")),
        "figures": _with_figures(_set_figure(Figure.LOCAL_TPOT_MS, -1.0)),
    }


def bad_cases() -> dict[str, tuple[str, bytes, str]]:
    """More corrupt files, one per check behind the `figures` and `header` reasons:
    "<reason>--<check>" -> (the reason the reader must give, the bytes, a phrase its message must hold).
    The file name is `bad_<reason>--<check>.ppdt`: what precedes "--" is the reason, as for the others."""
    good = encode_table(synthetic_spec())
    return {
        "figures--success_above_one": (
            "figures",
            _with_figures(_set_figure(Figure.PD_SUCCESS, 1.5)),
            "success rates must be within 0..1",
        ),
        "figures--zero_ttft": (
            "figures",
            _with_figures(_set_figure(Figure.PD_TTFT_MS, 0.0)),
            "zero TTFT or TPOT",
        ),
        "figures--zero_tpot": (
            "figures",
            _with_figures(_set_figure(Figure.PD_TPOT_MS, 0.0)),
            "zero TTFT or TPOT",
        ),
        "header--key_mismatch": (
            "header",
            patch_header(good, _set(("key",), "2P2D/llama-3.1-8b")),
            "is not shape/model",
        ),
        "header--default_decision": (
            "header",
            patch_header(good, _set(("default_decision",), "maybe")),
            "default_decision must be 'pd' or 'local'",
        ),
        "header--min_success_above_one": (
            "header",
            patch_header(good, _set(("slo", "min_success"), 1.5)),
            "must be within 0..1",
        ),
        "header--kv_limit_negative": (
            "header",
            patch_header(good, _set(("live", "max_decode_kv_usage"), -0.5)),
            "must be within 0..1",
        ),
        "header--array_dtype": (
            "header",
            patch_header(good, lambda h: h["arrays"][0].update(dtype="<f4")),
            "expected one <f8 array 'figures'",
        ),
        "header--array_offset": (
            "header",
            patch_header(good, lambda h: h["arrays"][0].update(offset=h["arrays"][0]["offset"] - 64)),
            "does not end where the content ends",
        ),
    }


def write_fixtures(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for reason, blob in bad_fixtures().items():
        path = folder / f"bad_{reason}.ppdt"
        path.write_bytes(blob)
        paths[reason] = path
    for name, (_, blob, _) in bad_cases().items():
        path = folder / f"bad_{name}.ppdt"
        path.write_bytes(blob)
        paths[name] = path
    good = folder / "good.ppdt"
    good.write_bytes(encode_table(synthetic_spec()))
    paths["good"] = good
    return paths


def decided_everywhere(table: Any, *, local: bool) -> Any:
    """A copy of ``table`` (a ``decision_service.table.Table``) whose every measured cell decides
    ``local`` (or PD) under any weights: the other mode's TTFT doubled and TPOT raised, both modes
    meeting the success SLO. For tests of table swaps and decision-match figures."""
    from decision_service.table import Table

    fig = np.array(table.figures, copy=True)
    measured = (fig[..., Figure.PD_SAMPLES] > 0) & (fig[..., Figure.LOCAL_SAMPLES] > 0)
    win, lose = ("LOCAL", "PD") if local else ("PD", "LOCAL")
    for metric in ("TTFT_MS", "TPOT_MS"):
        w, lo = Figure[f"{win}_{metric}"], Figure[f"{lose}_{metric}"]
        fig[..., lo] = np.where(measured, fig[..., w] * 2.0, fig[..., lo])
    for ok in (Figure.PD_SUCCESS, Figure.LOCAL_SUCCESS):
        fig[..., ok] = np.where(measured, 1.0, fig[..., ok])
    return Table.from_bytes(encode_table(TableSpec(table.header, fig)))
