"""Per-cell figures -> the decision service's ``TableSpec`` -> table bytes, with a summary.

Rules:

1. The table format and its validation are the decision service's (``decision_service.table``, the
   header's fields in ``decision_service.header``); this module only fills a ``TableSpec`` from a
   ``TableHeader`` and figures. ``check`` reads files back with the server's own reader.
2. Deterministic: no clock, no environment, no dict-order or input-order dependence. The build time in
   the provenance comes from the inputs (newest record start time, newest artifact timestamp) or from an
   explicit option, so the same inputs always give the same bytes.
3. A cell goes into the table as measured only when both static modes sent Turn-2+ requests there and
   at least one of them completed some. Figures per mode (``Figure``):

   - ``*_ttft_ms`` / ``*_tpot_ms``: means over completed Turn-2+ requests;
   - ``*_success``: completed / sent;
   - ``*_samples``: requests sent (the count behind the success rate).

   A mode that completed nothing in a measured cell (it failed outright, e.g. PD overloaded at 20 QPS)
   has no latency of its own: its TTFT is censored at the request timeout and its TPOT copied from the
   other mode. The success rate (0) already forces the decision; the censored figures only keep the
   score finite. Each such cell is listed in the summary and the provenance.
4. Cells that are not measured keep zeros (the format's "no data"); the router answers them from the
   nearest measured QPS level or the table default. The summary lists them, never silently.
5. The third mode, ``bidir`` (vLLM's bidirectional KV mode): its figures go into a measured cell (rule 3)
   where ``bidir`` records sent Turn-2+ requests, by the same definitions; a ``bidir`` that completed
   nothing is censored like a mode of rule 3 (TTFT at the timeout, PD's TPOT, success 0). Where no
   ``bidir`` record landed the cell has no BIDIR figures (samples 0), and a table without any is written
   as format version 1, the same bytes as before the mode existed. The summary counts the cells with
   BIDIR figures.

It stays whole (about 460 lines): the rules above are one pass over the cells, and the summary and
provenance it writes are that pass's own account of what each cell got.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import numpy as np

from decision_service.axes import Axes, paper_axes
from decision_service.classify import CompiledClassifier
from decision_service.header import BIDIR_FIGURES, Figure, TableHeader, Weights
from decision_service.table import TableSpec, encode_table
from ppd.catalog import TURN1_SETTINGS, is_shared_prefix, named_class
from table_builder.aggregate import (
    COMPARED_MODES,
    CellKey,
    Locator,
    Measurements,
    ModeFigures,
    aggregate_points,
    aggregate_records,
)
from table_builder.artifact import ArtifactPoint
from table_builder.records import Record

__all__ = [
    "BUILDER_VERSION",
    "DEFAULT_PROFILES",
    "BuildOptions",
    "BuildResult",
    "BuildSummary",
    "CellNote",
    "axes_locator",
    "bidir_figures",
    "build_from_artifact",
    "build_from_records",
    "cell_row",
    "default_header",
    "iso_from_start_time",
    "spec_from_measurements",
    "table_file_name",
]

#: Goes into every table's provenance; bump when the build rules change the bytes for the same inputs.
BUILDER_VERSION: Final = "table_builder/1"

#: Named weights profiles every table carries unless told otherwise (w_ttft, w_tpot).
DEFAULT_PROFILES: Final[Mapping[str, Weights]] = {
    "balanced": Weights(1.0, 1.0),
    "ttft": Weights(1.0, 0.2),
    "tpot": Weights(0.2, 1.0),
}

# Start times below this are virtual (simulated) clocks, not Unix time: no calendar date for them.
_EPOCH_2001: Final = 978_307_200.0


def default_header(shape: str, model: str) -> TableHeader:
    """The header a build writes unless told otherwise (also the defaults of ``ppd-table``'s flags).

    ``TableHeader``'s own defaults, plus the paper's axes, ``DEFAULT_PROFILES`` and the decode-load
    guard (decision_service.route rule 5) on: 192 running requests is where, on the simulated H100
    1P3D/3P1D clusters, keeping append-prefills on a loaded decode worker starts to cost more (long
    answers timing out) than sending them through an idle P (docs/performance/reproduction.md,
    "Overload"), unless the prefill queue is deeper than 8.
    """
    return TableHeader(
        shape=shape,
        model=model,
        axes=paper_axes(),
        profiles=dict(DEFAULT_PROFILES),
        max_decode_running=192,
        max_prefill_queue_depth=8,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildOptions:
    """Everything a build needs besides its inputs. ``header`` lands in the table as it is, except its
    provenance, which the build writes (see ``spec_from_measurements``)."""

    header: TableHeader
    #: A cell whose modes sent fewer Turn-2+ requests than this is flagged low-sample (still used).
    min_samples: int = 20
    #: Censored TTFT of a mode that completed nothing in a cell (the benchmark's request timeout).
    timeout_ms: float = 30_000.0
    #: Free-form labels for the provenance, e.g. {"hardware": "H100", "engine": "sim"}.
    labels: Mapping[str, str] = field(default_factory=dict)
    #: ISO 8601 build time; by default taken from the inputs, never from the clock.
    built_at: str | None = None


@dataclass(frozen=True, slots=True)
class CellNote:
    """One cell of the summary: where it is and why it is listed."""

    context: str
    workload: str
    qps: float
    detail: str

    def label(self) -> str:
        return f"{self.context}/{self.workload}@{self.qps:g}"


@dataclass(frozen=True, slots=True)
class BuildSummary:
    """Cells filled / low-sample / missing / censored, and what the inputs held."""

    key: str
    total_cells: int
    cells_per_context: int
    filled: int
    low_sample: tuple[CellNote, ...]
    missing: tuple[CellNote, ...]
    censored: tuple[CellNote, ...]
    used: int
    left_out: Mapping[str, int]
    snapped_qps: tuple[float, ...]
    #: Workload classes whose own benchmark (n_in, n_out) the live classifier puts in another class.
    misfiled_workloads: tuple[str, ...]
    #: Measured cells that also have the bidirectional mode's figures (rule 5).
    bidir: int = 0

    def counts(self) -> dict[str, int]:
        counts = {
            "cells": self.total_cells,
            "filled": self.filled,
            "low_sample": len(self.low_sample),
            "missing": len(self.missing),
            "censored": len(self.censored),
        }
        if self.bidir:  # only then: a two-mode table keeps its bytes (rule 5)
            counts["bidir"] = self.bidir
        return counts

    def format(self, *, limit: int = 12) -> str:
        """A few readable lines for the terminal."""
        lines = [
            f"table {self.key}: {self.total_cells} cells, {self.filled} filled, "
            f"{len(self.low_sample)} low-sample, {len(self.missing)} missing"
            + (f", {self.bidir} with bidir figures" if self.bidir else ""),
            f"inputs: {self.used} used"
            + "".join(f"; left out {n} ({why})" for why, n in self.left_out.items()),
        ]
        if self.snapped_qps:
            lines.append("QPS snapped to the nearest level: " + ", ".join(f"{q:g}" for q in self.snapped_qps))
        if self.misfiled_workloads:
            lines.append(
                "benchmark shapes the live classifier puts in another class (runs named for the class "
                "still fill its cells; a live request of that shape reads the other class): "
                + ", ".join(self.misfiled_workloads)
            )
        for title, notes in (
            ("low-sample", self.low_sample),
            ("censored (a mode completed nothing)", self.censored),
        ):
            if notes:
                shown = ", ".join(f"{n.label()} ({n.detail})" for n in notes[:limit])
                more = f", ... {len(notes) - limit} more" if len(notes) > limit else ""
                lines.append(f"{title}: {shown}{more}")
        if self.missing:
            lines.append("missing: " + _group_missing(self.missing, self.cells_per_context))
        return "\n".join(lines)


def _group_missing(notes: Sequence[CellNote], cells_per_context: int) -> str:
    """``huge/* x90 (no data)``, ``small/tiny x10 (no data)``: whole contexts first, then classes."""
    by_context: dict[str, list[CellNote]] = {}
    for n in notes:
        by_context.setdefault(n.context, []).append(n)
    parts = []
    for ctx, group in by_context.items():
        if len(group) == cells_per_context:
            parts.append(f"{ctx}/* x{len(group)} ({'; '.join(sorted({n.detail for n in group}))})")
            continue
        per_workload: dict[tuple[str, str], int] = {}
        for n in group:
            per_workload[n.workload, n.detail] = per_workload.get((n.workload, n.detail), 0) + 1
        parts.extend(f"{ctx}/{wl} x{count} ({detail})" for (wl, detail), count in per_workload.items())
    return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class BuildResult:
    spec: TableSpec
    summary: BuildSummary

    def encode(self) -> bytes:
        return encode_table(self.spec)


def table_file_name(shape: str, model: str) -> str:
    """``1P3D`` + ``llama-3.1-8b`` -> ``1P3D__llama-3.1-8b.ppdt`` (the key with '/' spelled '__')."""
    return f"{shape}__{model}.ppdt".replace("/", "_")


def axes_locator(axes: Axes) -> Locator:
    """A :class:`Locator` over ``axes`` using the decision service's own classifier.

    A turn of a synthetic benchmark run named ``<turn1>_<class>`` (or a shared-prefix run
    ``shared<L>_<G>x<C>_<turn1>_<class>``) whose (n_in, n_out) is exactly that class's benchmark shape
    files under ``<class>``, even where the live classifier would say otherwise
    (the paper's ``tiny`` (16, 32) has r = 0.5, which the classifier calls balanced): the benchmark
    measured that class, as the paper's artifact files results by workload name. Every other request
    (ShareGPT, production logs, a renamed run) is classified from its token counts, like a live one.
    """
    classifier = CompiledClassifier(axes)
    by_name = {wl.name: (w, wl.n_in, wl.n_out) for w, wl in enumerate(axes.workloads)}

    def locate(*, n_ctx: int, n_in: int, n_out: int, qps: float, workload: str | None = None) -> CellKey:
        w = classifier.workload(n_in, n_out)
        if workload is not None:
            if is_shared_prefix(workload):
                name = named_class(workload) or ""
            else:
                turn1, _, name = workload.partition("_")
                name = name if turn1 in TURN1_SETTINGS else ""
            named = by_name.get(name)
            if named is not None and named[1:] == (n_in, n_out):
                w = named[0]
        return CellKey(classifier.context(n_ctx), w, classifier.qps(qps))

    return locate


def _misfiled_workloads(axes: Axes) -> tuple[str, ...]:
    classifier = CompiledClassifier(axes)
    names = axes.workload_names()
    notes = []
    for w, wl in enumerate(axes.workloads):
        got = classifier.workload(wl.n_in, wl.n_out)
        if got != w:
            notes.append(f"{wl.name} ({wl.n_in}, {wl.n_out}) is classified {names[got]}")
    return tuple(notes)


def spec_from_measurements(
    measurements: Measurements, options: BuildOptions, provenance: Mapping[str, Any]
) -> BuildResult:
    """Fill the figures array and the header; the summary says what each cell got."""
    axes = options.header.axes
    axes.validate()
    nc, nw, nq = axes.shape
    figures = np.zeros((nc, nw, nq, len(Figure)), dtype=np.float64)
    low: list[CellNote] = []
    missing: list[CellNote] = []
    censored: list[CellNote] = []
    with_bidir: list[CellNote] = []
    filled = 0
    for c in range(nc):
        for w in range(nw):
            for q in range(nq):
                note = CellNote(axes.context_classes[c], axes.workloads[w].name, axes.qps_levels[q], "")
                modes = measurements.cells.get(CellKey(c, w, q), {})
                row, problem, censor = cell_row(modes.get("pd"), modes.get("local"), options.timeout_ms)
                if row is None:
                    if problem == "no data" and "bidir" in modes:
                        problem = "only bidir measured"
                    missing.append(_with(note, problem))
                    continue
                figures[c, w, q] = row
                filled += 1
                if censor:
                    censored.append(_with(note, censor))
                bidir_row, bidir_censor = bidir_figures(modes.get("bidir"), row, options.timeout_ms)
                if bidir_row is not None:
                    figures[c, w, q, list(BIDIR_FIGURES)] = bidir_row
                    with_bidir.append(note)
                    if bidir_censor:
                        censored.append(_with(note, bidir_censor))
                fewest = min(int(row[Figure.PD_SAMPLES]), int(row[Figure.LOCAL_SAMPLES]))
                if fewest < options.min_samples:
                    low.append(_with(note, f"{fewest} < {options.min_samples} requests"))
    tally = measurements.tally
    summary = BuildSummary(
        key=options.header.key,
        total_cells=nc * nw * nq,
        cells_per_context=nw * nq,
        filled=filled - len(low),
        low_sample=tuple(low),
        missing=tuple(missing),
        censored=tuple(censored),
        used=tally.used,
        left_out=tally.left_out,
        snapped_qps=tally.snapped_qps,
        misfiled_workloads=_misfiled_workloads(axes),
        bidir=len(with_bidir),
    )
    full_provenance = {
        **provenance,
        "builder": BUILDER_VERSION,
        "labels": dict(sorted(options.labels.items())),
        "min_samples": options.min_samples,
        "censored_ttft_ms": options.timeout_ms,
        "cells": summary.counts(),
        "censored_cells": [n.label() for n in censored],
        "left_out": dict(tally.left_out),
    }
    header = dataclasses.replace(
        options.header, profiles=dict(sorted(options.header.profiles.items())), provenance=full_provenance
    )
    return BuildResult(spec=TableSpec(header, figures), summary=summary)


def _with(note: CellNote, detail: str) -> CellNote:
    return CellNote(note.context, note.workload, note.qps, detail)


def cell_row(
    pd: ModeFigures | None, local: ModeFigures | None, timeout_ms: float
) -> tuple[tuple[float, ...] | None, str, str]:
    """One cell's figures row from both modes' figures (rule 3): (row or None, why it is missing, what
    was censored). Also fills the cells ``refresh`` finds measured only in the logs."""
    if pd is None and local is None:
        return None, "no data", ""
    if pd is None or local is None:
        return None, f"only {'pd' if pd is not None else 'local'} measured", ""
    if pd.ttft_ms is None and local.ttft_ms is None:
        return None, "both modes completed nothing", ""
    pd_tpot = pd.tpot_ms if pd.tpot_ms is not None else local.tpot_ms
    local_tpot = local.tpot_ms if local.tpot_ms is not None else pd.tpot_ms
    if pd_tpot is None or local_tpot is None or pd_tpot <= 0 or local_tpot <= 0:
        return None, "no TPOT measured (single-token outputs?)", ""
    censor = []
    pd_ttft, local_ttft = pd.ttft_ms, local.ttft_ms
    if pd_ttft is None:
        pd_ttft = timeout_ms
        censor.append(f"pd completed 0/{pd.sent}")
    if local_ttft is None:
        local_ttft = timeout_ms
        censor.append(f"local completed 0/{local.sent}")
    if pd_ttft <= 0 or local_ttft <= 0:
        return None, "zero TTFT measured", ""
    by_figure = {
        Figure.PD_TTFT_MS: pd_ttft,
        Figure.PD_TPOT_MS: pd_tpot,
        Figure.LOCAL_TTFT_MS: local_ttft,
        Figure.LOCAL_TPOT_MS: local_tpot,
        Figure.PD_SUCCESS: pd.success_rate,
        Figure.LOCAL_SUCCESS: local.success_rate,
        Figure.PD_SAMPLES: float(pd.sent),
        Figure.LOCAL_SAMPLES: float(local.sent),
    }
    return tuple(by_figure.get(f, 0.0) for f in Figure), "", "; ".join(censor)


def bidir_figures(
    bidir: ModeFigures | None, row: Sequence[float], timeout_ms: float
) -> tuple[tuple[float, float, float, float] | None, str]:
    """The BIDIR columns (TTFT, TPOT, success, samples) of a measured cell's ``row`` from the ``bidir``
    mode's figures (rule 5), and what was censored; None where the mode sent nothing there."""
    if bidir is None or bidir.sent <= 0:
        return None, ""
    ttft, tpot, censor = bidir.ttft_ms, bidir.tpot_ms, ""
    if ttft is None or ttft <= 0:
        ttft, censor = timeout_ms, f"bidir completed 0/{bidir.sent}"
    if tpot is None or tpot <= 0:
        tpot = row[Figure.PD_TPOT_MS]
    return (ttft, tpot, bidir.success_rate, float(bidir.sent)), censor


def iso_from_start_time(newest: float | None) -> str | None:
    """The build time of inputs whose newest record started at ``newest`` (None for virtual clocks)."""
    if newest is None or newest < _EPOCH_2001:
        return None
    return datetime.fromtimestamp(newest, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def build_from_records(records: Sequence[Record], options: BuildOptions) -> BuildResult:
    """Records (any order, split over files in any way) -> table spec."""
    header = options.header
    axes = header.axes
    measurements = aggregate_records(
        records,
        shape=header.shape,
        model=header.model,
        locate=axes_locator(axes),
        qps_levels=axes.qps_levels,
    )
    digest = hashlib.sha256()
    for line in sorted(r.to_json() for r in records):
        digest.update(line.encode())
        digest.update(b"\n")
    used = [r for r in records if r.shape == header.shape and r.model == header.model]
    newest = max((r.start_time for r in used), default=None)
    built_at = options.built_at or iso_from_start_time(newest)
    provenance: dict[str, Any] = {
        "source": "records",
        "inputs_sha256": digest.hexdigest(),
        "runs": sorted({r.run_id for r in used if r.mode in COMPARED_MODES}),
        "newest_start_time": newest,
    }
    if built_at is not None:
        provenance["built_at"] = built_at
    return spec_from_measurements(measurements, options, provenance)


def build_from_artifact(points: Sequence[ArtifactPoint], options: BuildOptions) -> BuildResult:
    """Artifact points -> table spec."""
    shape, axes = options.header.shape, options.header.axes
    measurements = aggregate_points(
        points, shape=shape, locate=axes_locator(axes), qps_levels=axes.qps_levels
    )
    canonical = json.dumps(
        sorted(
            [
                p.source,
                p.workload.name,
                p.mode,
                p.qps,
                p.ttft_ms,
                p.tpot_ms,
                p.samples,
                p.sent,
                p.success_rate,
            ]
            for p in points
        ),
        separators=(",", ":"),
    )
    used = [p for p in points if p.shape == shape]
    stamps = [p.timestamp for p in used if p.timestamp]
    built_at = options.built_at or (max(stamps) if stamps else None)
    provenance: dict[str, Any] = {
        "source": "paper-artifact",
        "inputs_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
        "runs": sorted({p.source for p in used}),
    }
    if built_at is not None:
        provenance["built_at"] = built_at
    return spec_from_measurements(measurements, options, provenance)
