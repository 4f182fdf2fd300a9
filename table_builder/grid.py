"""The decision grid of a table: what the router answers in every cell, for ``ppd-table show``.

The grid asks the decision service's own ``Router`` (never a re-implementation of the rule) with one
representative Turn-2 query per cell: an n_ctx inside the context class, an (n_in, n_out) that the
table's classifier maps to the workload class, the QPS level itself. A workload class that no
(n_in, n_out) reaches is shown as unreachable.

A table with the bidirectional mode's figures (format version 2) is asked as a caller with
CAPABILITY_BIDIR by default, so the grid shows the third path (``B``); ``bidir=False`` asks as a caller
without it. A table without the figures gives the same grid either way, printed as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from decision_service.axes import Axes
from decision_service.classify import CompiledClassifier
from decision_service.header import Figure, TableHeader, Weights
from decision_service.route import Query, Reason, Router
from decision_service.table import Table

__all__ = [
    "BIDIR_LEGEND",
    "LEGEND",
    "Grid",
    "GridCell",
    "decision_grid",
    "format_grid",
    "has_bidir",
    "live_limits",
    "probe_shapes",
]

_MARK: Final = {
    Reason.TABLE: "",
    Reason.WEIGHTS: "",
    Reason.PD_FAILED_IN_CELL: "!",
    Reason.LOCAL_FAILED_IN_CELL: "!",
    Reason.NEAREST_CELL: "~",
    Reason.DEFAULT: "?",
    Reason.LIVE_SIGNAL: "*",
    Reason.TURN_ONE: "",
    Reason.BIDIR_FAILED_IN_CELL: "!",
}

LEGEND: Final = (
    "L = local (append-prefill on the decode worker), P = pd; "
    "! = the other mode missed the success SLO in this cell, ~ = answered from the nearest measured "
    "QPS level, ? = no data for this context and workload: the table's default, - = no request maps here"
)
#: Printed after LEGEND when the grid was asked as a caller that can serve BIDIR.
BIDIR_LEGEND: Final = (
    "B = bidir (vLLM's bidirectional KV mode: P pulls the history's KV from D and appends), asked as a "
    "caller with CAPABILITY_BIDIR; ! also marks a cell where bidir missed the success SLO"
)

_POWERS: Final = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, slots=True)
class GridCell:
    local: bool
    reason: Reason
    score: float
    bidir: bool = False

    def symbol(self, *, scores: bool = False) -> str:
        text = ("B" if self.bidir else "L" if self.local else "P") + _MARK[self.reason]
        if scores and self.reason in (Reason.TABLE, Reason.WEIGHTS, Reason.NEAREST_CELL):
            text += f"{self.score:+.2f}"
        return text


@dataclass(frozen=True, slots=True)
class Grid:
    """``cells[c][w][q]``; ``None`` where no request maps to the workload class."""

    key: str
    version: str
    weights: Weights
    weights_label: str
    axes: Axes
    cells: tuple[tuple[tuple[GridCell | None, ...], ...], ...]
    #: The live-signal limits of the header, as a sentence (they override the cells at run time).
    live: str | None = None
    #: Asked as a caller with CAPABILITY_BIDIR, of a table with BIDIR figures.
    bidir: bool = False


def live_limits(header: TableHeader) -> str:
    """The header's live-signal limits in words."""
    parts = [f"decode KV usage > {header.max_decode_kv_usage:g}"]
    if header.max_decode_running is not None:
        guard = f"decode running requests > {header.max_decode_running}"
        if header.max_prefill_queue_depth is not None:
            guard += f" (unless the prefill queue is > {header.max_prefill_queue_depth})"
        parts.append(guard)
    return "live signals turn local into pd: " + "; ".join(parts)


def _context_probe(axes: Axes, c: int) -> int:
    edges = axes.context_edges
    if not edges:
        return 0
    return edges[c] if c < len(edges) else edges[-1] + 1


def probe_shapes(axes: Axes) -> tuple[tuple[int, int] | None, ...]:
    """Per workload class an (n_in, n_out) the classifier maps to it (its benchmark shape if possible)."""
    classifier = CompiledClassifier(axes)
    found: list[tuple[int, int] | None] = []
    for w, wl in enumerate(axes.workloads):
        if classifier.workload(wl.n_in, wl.n_out) == w:
            found.append((wl.n_in, wl.n_out))
            continue
        hits = [
            (n_in, n_out)
            for n_out in _POWERS[1:]
            for n_in in _POWERS
            if classifier.workload(n_in, n_out) == w
        ]
        target = (math.log2(wl.n_in + 1), math.log2(wl.n_out + 1))
        found.append(
            min(
                hits,
                key=lambda s: (
                    (math.log2(s[0] + 1) - target[0]) ** 2 + (math.log2(s[1] + 1) - target[1]) ** 2,
                    s,
                ),
            )
            if hits
            else None
        )
    return tuple(found)


def has_bidir(table: Table) -> bool:
    """Whether any cell of ``table`` has the bidirectional mode's figures."""
    return bool((table.figures[..., Figure.BIDIR_SAMPLES] > 0).any())


def decision_grid(
    table: Table, *, weights: Weights | None = None, profile: str | None = None, bidir: bool = True
) -> Grid:
    """Ask the router every cell of ``table`` under the default weights, a profile, or given weights;
    with ``bidir`` (and BIDIR figures in the table) as a caller that can serve BIDIR."""
    router = Router(table)
    bidir = bidir and has_bidir(table)
    header = table.header
    axes = header.axes
    if weights is not None:
        used, label = weights, "given"
    elif profile is not None:
        used, label = header.profiles[profile], f"profile {profile}"
    else:
        used, label = header.default_weights, "table default"
    shapes = probe_shapes(axes)
    rows = []
    for c in range(len(axes.context_classes)):
        n_ctx = _context_probe(axes, c)
        per_workload: list[tuple[GridCell | None, ...]] = []
        for shape in shapes:
            if shape is None:
                per_workload.append(tuple(None for _ in axes.qps_levels))
                continue
            n_in, n_out = shape
            cells: list[GridCell | None] = []
            for level in axes.qps_levels:
                v = router.route(
                    Query(turn=2, n_in=n_in, n_out=n_out, n_ctx=n_ctx, qps=level, weights=used, bidir=bidir)
                )
                cells.append(GridCell(v.local, v.reason, v.score, v.bidir))
            per_workload.append(tuple(cells))
        rows.append(tuple(per_workload))
    live = live_limits(header)
    if bidir:
        live = live.replace("turn local into pd:", "turn local into pd or bidir (the better):")
    return Grid(table.key, table.version, used, label, axes, tuple(rows), live, bidir)


def _context_range(axes: Axes, c: int) -> str:
    edges = axes.context_edges
    lower = edges[c - 1] if c > 0 else None
    upper = edges[c] if c < len(edges) else None
    if lower is None and upper is None:
        return "any n_ctx"
    if lower is None:
        return f"n_ctx <= {upper}"
    if upper is None:
        return f"n_ctx > {lower}"
    return f"{lower} < n_ctx <= {upper}"


def format_grid(grid: Grid, *, scores: bool = False) -> str:
    """Plain-text tables, one per context class: workload classes down, QPS levels across."""
    axes = grid.axes
    w = grid.weights
    lines = [
        f"table {grid.key}  version {grid.version}  "
        f"weights w_ttft={w.w_ttft:g} w_tpot={w.w_tpot:g} ({grid.weights_label})",
    ]
    name_width = max(len("workload"), *(len(n) for n in axes.workload_names()))
    head = [f"{q:g}" for q in axes.qps_levels]
    bodies = [
        [[cell.symbol(scores=scores) if cell is not None else "-" for cell in row] for row in plane]
        for plane in grid.cells
    ]
    width = max(len(x) for x in [*head, *(s for body in bodies for row in body for s in row)])
    for c, ctx in enumerate(axes.context_classes):
        body = bodies[c]
        lines.append("")
        lines.append(f"context {ctx} ({_context_range(axes, c)})")
        lines.append(f"{'workload':<{name_width}}  QPS " + " ".join(f"{h:>{width}}" for h in head))
        for wl, row in zip(axes.workload_names(), body, strict=True):
            lines.append(f"{wl:<{name_width}}      " + " ".join(f"{s:>{width}}" for s in row))
    local = sum(1 for plane in grid.cells for row in plane for cell in row if cell is not None and cell.local)
    asked = sum(1 for plane in grid.cells for row in plane for cell in row if cell is not None)
    lines.append("")
    if grid.bidir:
        bidir = sum(
            1 for plane in grid.cells for row in plane for cell in row if cell is not None and cell.bidir
        )
        lines.append(f"local in {local} of {asked} cells, bidir in {bidir}")
    else:
        lines.append(f"local in {local} of {asked} cells")
    if grid.live is not None:
        lines.append(grid.live)
    lines.append(LEGEND)
    if grid.bidir:
        lines.append(BIDIR_LEGEND)
    return "\n".join(lines)
