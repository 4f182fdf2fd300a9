"""What a refresh reports (``refresh.py``): the figures that moved beyond the confidence bound, the
answers that flipped, the cells held below the sample minimum, and the report's text and JSON.

Values only; ``refresh.py`` computes them. The bound is two-sided at ``confidence``: a figure has
drifted when its logged mean lies more than ``z_for(confidence)`` standard errors from the base.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CellDrift", "DriftReport", "FigureShift", "Flip", "HeldCell", "z_for"]


def z_for(confidence: float) -> float:
    """The two-sided normal quantile of ``confidence`` (0.99 -> 2.576)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}")
    return statistics.NormalDist().inv_cdf((1.0 + confidence) / 2.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class FigureShift:
    """One figure of one cell that moved beyond the bound (rule 5)."""

    figure: str
    base: float
    logged: float
    merged: float
    logged_samples: int
    #: |logged - base| / standard error; None when the logged values have no spread at all.
    z: float | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class CellDrift:
    cell: str
    shifts: tuple[FigureShift, ...]

    def to_json(self) -> dict[str, Any]:
        return {"cell": self.cell, "shifts": [s.to_json() for s in self.shifts]}


@dataclass(frozen=True, slots=True, kw_only=True)
class Flip:
    """A cell whose answer changed. ``before``/``after`` under the default weights (``pd``/``local``);
    ``profiles`` names the weights profiles whose answer changed; ``source`` is the cell the new answer
    is read from and ``logged`` its logged requests."""

    cell: str
    before: str
    after: str
    reason: str
    profiles: tuple[str, ...]
    source: str
    logged: int

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "profiles": list(self.profiles)}


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldCell:
    """A cell kept at its base figures: its evidence would flip an answer on too few samples (rule 4)."""

    cell: str
    logged: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class DriftReport:
    """What a refresh did: the evidence used, the cells merged, drifted, flipped and held."""

    key: str
    base_version: str
    min_samples: int
    confidence: float
    z: float
    used: int
    left_out: Mapping[str, int]
    #: Cells with logged evidence, and of those the ones whose figures changed.
    cells_with_evidence: int
    merged: int
    #: Cells the base left empty and the logs filled.
    filled: tuple[str, ...]
    #: Cells with evidence for one path only where the base is empty (not filled).
    one_path_only: tuple[str, ...]
    drifted: tuple[CellDrift, ...]
    flips: tuple[Flip, ...]
    held: tuple[HeldCell, ...]
    notes: tuple[str, ...] = ()

    def counts(self) -> dict[str, int]:
        return {
            "used": self.used,
            "cells_with_evidence": self.cells_with_evidence,
            "merged": self.merged,
            "filled": len(self.filled),
            "drifted": len(self.drifted),
            "flipped": len(self.flips),
            "held": len(self.held),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "base_version": self.base_version,
            "min_samples": self.min_samples,
            "confidence": self.confidence,
            "z": self.z,
            **self.counts(),
            "left_out": dict(self.left_out),
            "filled_cells": list(self.filled),
            "one_path_only": list(self.one_path_only),
            "drift": [d.to_json() for d in self.drifted],
            "flips": [f.to_json() for f in self.flips],
            "held_cells": [h.to_json() for h in self.held],
            "notes": list(self.notes),
        }

    def format(self, *, limit: int = 20) -> str:
        """Readable lines for the terminal (at most ``limit`` cells per list)."""
        lines = [
            f"refresh {self.key} (base version {self.base_version}): {self.used} logged requests used "
            f"in {self.cells_with_evidence} cells, {self.merged} cells changed, {len(self.filled)} filled"
            + "".join(f"; left out {n} ({why})" for why, n in self.left_out.items()),
            f"drift beyond the {self.confidence:g} bound (|logged - base| > {self.z:.2f} standard errors): "
            f"{len(self.drifted)} cell(s)",
        ]
        for d in self.drifted[:limit]:
            shifts = ", ".join(
                f"{s.figure} {s.base:.4g} -> {s.logged:.4g} (n={s.logged_samples}, "
                f"{'no spread' if s.z is None else f'z={s.z:.1f}'}; merged {s.merged:.4g})"
                for s in d.shifts
            )
            lines.append(f"  {d.cell}: {shifts}")
        lines += _more(self.drifted, limit)
        lines.append(
            f"answers flipped: {len(self.flips)} cell(s) (before -> after under the default weights)"
        )
        for f in self.flips[:limit]:
            extra = f"; profiles {', '.join(f.profiles)} flip too" if f.profiles else ""
            source = "" if f.source == f.cell else f" via {f.source}"
            if f.before == f.after:
                change = f"stays {f.before}, profiles {', '.join(f.profiles)} flip"
                extra = ""
            else:
                change = f"{f.before} -> {f.after}"
            lines.append(f"  {f.cell}: {change} ({f.reason}{source}, {f.logged} logged{extra})")
        lines += _more(self.flips, limit)
        if self.held:
            lines.append(
                f"held at the base figures (an answer would flip on fewer than {self.min_samples} "
                f"logged requests): " + ", ".join(f"{h.cell} ({h.logged})" for h in self.held[:limit])
            )
            lines += _more(self.held, limit)
        if self.one_path_only:
            lines.append(
                "empty in the base, one path logged (not filled): "
                + ", ".join(self.one_path_only[:limit])
                + (f", ... {len(self.one_path_only) - limit} more" if len(self.one_path_only) > limit else "")
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _more(items: Sequence[object], limit: int) -> list[str]:
    return [f"  ... {len(items) - limit} more"] if len(items) > limit else []
