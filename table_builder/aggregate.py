"""Benchmark records or artifact points -> per-cell, per-mode Turn-2+ figures.

Rules:

1. The table compares *static* runs: mode ``pd`` (x=0) against mode ``local`` (x=1), per cell, and, where
   it was run, the bidirectional KV mode ``bidir`` (the table's third mode, format version 2). Records of
   other modes (``ppd``, ``fraction:*``, ``replica``), Turn-1 records and records of another shape or model
   are left out and counted in :class:`Tally`, never dropped silently.
2. A request lands in the cell of its own (n_ctx, n_in, n_out) and its run's target QPS, located by the
   table's axes (the decision service's ``classify`` functions, injected as a :class:`Locator`). The
   Locator also sees the run's workload name: a synthetic benchmark turn files under the class it is
   named for (as the paper's artifact files results by name), see ``build.axes_locator``.
3. Means are exact and order-free (``math.fsum`` over sorted values), so the same inputs in any order give
   the same figures, and therefore the same table bytes.
4. Failed requests count in the success rate (completed / sent) and nowhere else.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

from table_builder.artifact import ArtifactPoint
from table_builder.records import Record

__all__ = [
    "COMPARED_MODES",
    "CellKey",
    "Locator",
    "Measurements",
    "ModeFigures",
    "Tally",
    "aggregate_points",
    "aggregate_records",
]

#: The static modes a table compares: PD and LOCAL always, BIDIR where a sweep ran it.
COMPARED_MODES: Final[tuple[str, ...]] = ("pd", "local", "bidir")


@dataclass(frozen=True, slots=True, order=True)
class CellKey:
    """Indices along the table axes: context class, workload class, QPS level."""

    context: int
    workload: int
    qps: int


class Locator(Protocol):
    """Maps a request's token counts and its run's QPS to a cell of the table's axes."""

    def __call__(
        self, *, n_ctx: int, n_in: int, n_out: int, qps: float, workload: str | None = None
    ) -> CellKey: ...


@dataclass(frozen=True, slots=True)
class ModeFigures:
    """Turn-2+ figures of one static mode in one cell."""

    ttft_ms: float | None
    tpot_ms: float | None
    success_rate: float
    #: Completed Turn-2+ requests behind the TTFT mean.
    samples: int
    #: Requests sent (completed + failed).
    sent: int


@dataclass(slots=True)
class _Samples:
    ttft: list[float] = field(default_factory=list)
    ttft_weight: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tpot_weight: list[float] = field(default_factory=list)
    ok: int = 0
    sent: int = 0

    def add_latencies(self, ttft_ms: float | None, tpot_ms: float | None, weight: float) -> None:
        """Count each figure that was measured, with the number of requests it stands for."""
        if ttft_ms is not None:
            self.ttft.append(ttft_ms)
            self.ttft_weight.append(weight)
        if tpot_ms is not None:
            self.tpot.append(tpot_ms)
            self.tpot_weight.append(weight)

    def figures(self) -> ModeFigures:
        return ModeFigures(
            ttft_ms=_weighted_mean(self.ttft, self.ttft_weight),
            tpot_ms=_weighted_mean(self.tpot, self.tpot_weight),
            success_rate=self.ok / self.sent if self.sent else 0.0,
            samples=round(math.fsum(self.ttft_weight)),
            sent=self.sent,
        )


def _weighted_mean(values: list[float], weights: list[float]) -> float | None:
    total = math.fsum(sorted(weights))
    if total <= 0:
        return None
    return math.fsum(sorted(v * w for v, w in zip(values, weights, strict=True))) / total


@dataclass(frozen=True, slots=True)
class Tally:
    """What the aggregation used and what it left out, by reason."""

    used: int
    left_out: Mapping[str, int]
    #: Target QPS values that are not a level of the axes and were snapped to the nearest one.
    snapped_qps: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Measurements:
    """Per cell, per compared mode: the figures. Cells without any data are absent."""

    cells: Mapping[CellKey, Mapping[str, ModeFigures]]
    tally: Tally


def aggregate_records(
    records: Iterable[Record],
    *,
    shape: str,
    model: str,
    locate: Locator,
    qps_levels: Iterable[float],
) -> Measurements:
    """Turn-2+ records of static ``pd``, ``local`` and ``bidir`` runs of one shape and model -> per-cell
    figures."""
    levels = frozenset(qps_levels)
    samples: dict[CellKey, dict[str, _Samples]] = {}
    left_out: Counter[str] = Counter()
    snapped: set[float] = set()
    used = 0
    for r in records:
        if r.shape != shape or r.model != model:
            left_out[f"other shape/model ({r.shape}/{r.model})"] += 1
            continue
        if r.mode not in COMPARED_MODES:
            left_out[f"mode {r.mode} (only static pd, local and bidir runs are compared)"] += 1
            continue
        if r.turn < 2:
            left_out["turn 1 (always PD; not part of the decision)"] += 1
            continue
        if r.target_qps <= 0:
            left_out["target_qps 0 (no load level to file it under)"] += 1
            continue
        if r.target_qps not in levels:
            snapped.add(r.target_qps)
        key = locate(n_ctx=r.n_ctx, n_in=r.n_in, n_out=r.n_out, qps=r.target_qps, workload=r.workload)
        acc = samples.setdefault(key, {}).setdefault(r.mode, _Samples())
        acc.sent += 1
        used += 1
        if r.ok:
            acc.ok += 1
            acc.add_latencies(r.ttft_ms, r.tpot_ms, 1.0)
    return _finish(samples, Tally(used, dict(sorted(left_out.items())), tuple(sorted(snapped))))


def aggregate_points(
    points: Iterable[ArtifactPoint],
    *,
    shape: str,
    locate: Locator,
    qps_levels: Iterable[float],
) -> Measurements:
    """Artifact points of one shape -> per-cell figures (several points in one cell: count-weighted)."""
    levels = frozenset(qps_levels)
    samples: dict[CellKey, dict[str, _Samples]] = {}
    left_out: Counter[str] = Counter()
    snapped: set[float] = set()
    used = 0
    for p in points:
        if p.shape != shape:
            left_out[f"other shape ({p.shape})"] += 1
            continue
        if p.qps not in levels:
            snapped.add(p.qps)
        second = p.workload.second
        key = locate(
            n_ctx=p.workload.turn2_context,
            n_in=second.n_in,
            n_out=second.n_out,
            qps=p.qps,
            workload=p.workload.name,
        )
        acc = samples.setdefault(key, {}).setdefault(p.mode, _Samples())
        used += 1
        acc.sent += p.sent
        # The artifact gives a rate over all requests sent; keep it exact when it is one point.
        acc.ok += round(p.success_rate * p.sent)
        if p.samples:
            acc.add_latencies(p.ttft_ms, p.tpot_ms, float(p.samples))
    return _finish(samples, Tally(used, dict(sorted(left_out.items())), tuple(sorted(snapped))))


def _finish(samples: dict[CellKey, dict[str, _Samples]], tally: Tally) -> Measurements:
    cells: dict[CellKey, Mapping[str, ModeFigures]] = {
        key: {mode: samples[key][mode].figures() for mode in COMPARED_MODES if mode in samples[key]}
        for key in sorted(samples)
    }
    return Measurements(cells=cells, tally=tally)
