"""The axes of a decision table: context classes, workload classes, QPS levels.

Rule 1: every threshold the decision depends on lives here as data read from a table header;
the server never assumes the paper's numbers. ``paper_axes()`` is only the table builder's default.
Rule 2: nothing here knows about files, sockets or clocks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ppd.catalog import TURN2_CLASSES

__all__ = ["Axes", "AxesError", "Classifier", "WorkloadClass", "paper_axes"]


class AxesError(ValueError):
    """The axes of a header are inconsistent (unsorted edges, wrong class counts, ...)."""


@dataclass(frozen=True, slots=True)
class WorkloadClass:
    """One Turn-2 workload class and the (n_in, n_out) its benchmark runs used."""

    name: str
    n_in: int
    n_out: int


@dataclass(frozen=True, slots=True)
class Classifier:
    """How a live (n_in, n_out) maps to a workload class, by r = n_in / max(n_out, 1).

    r < ``decode_heavy_below``: decode-heavy, split by n_out on ``decode_out_edges``;
    r <= ``balanced_up_to``: balanced, split by n_in on ``balanced_in_edges``;
    else prefill-heavy, split by n_in on ``prefill_in_edges``. Each split has one class more than edges;
    an edge is inclusive (``n <= edge`` falls in the class before it).
    """

    decode_heavy_below: float
    balanced_up_to: float
    decode_out_edges: tuple[int, ...]
    decode_classes: tuple[str, ...]
    balanced_in_edges: tuple[int, ...]
    balanced_classes: tuple[str, ...]
    prefill_in_edges: tuple[int, ...]
    prefill_classes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Axes:
    """Context classes (upper edges, inclusive), workload classes, QPS levels."""

    context_edges: tuple[int, ...]
    context_classes: tuple[str, ...]
    workloads: tuple[WorkloadClass, ...]
    classifier: Classifier
    qps_levels: tuple[float, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.context_classes), len(self.workloads), len(self.qps_levels))

    def workload_names(self) -> tuple[str, ...]:
        return tuple(w.name for w in self.workloads)

    def validate(self) -> None:
        """Raise AxesError unless every list is sorted, sized and named consistently."""
        _increasing("context edges", self.context_edges)
        if len(self.context_classes) != len(self.context_edges) + 1:
            raise AxesError(
                f"{len(self.context_edges)} context edges need {len(self.context_edges) + 1} classes, "
                f"got {len(self.context_classes)}"
            )
        _unique("context classes", self.context_classes)
        names = self.workload_names()
        _unique("workload classes", names)
        if not names:
            raise AxesError("no workload classes")
        if not self.qps_levels:
            raise AxesError("no QPS levels")
        _increasing("QPS levels", self.qps_levels)
        if not all(math.isfinite(q) and q > 0 for q in self.qps_levels):
            raise AxesError("QPS levels must be finite and positive")
        c = self.classifier
        if not (0 < c.decode_heavy_below <= c.balanced_up_to) or not math.isfinite(c.balanced_up_to):
            raise AxesError("classifier ratios must satisfy 0 < decode_heavy_below <= balanced_up_to < inf")
        for label, edges, classes in (
            ("decode-heavy", c.decode_out_edges, c.decode_classes),
            ("balanced", c.balanced_in_edges, c.balanced_classes),
            ("prefill-heavy", c.prefill_in_edges, c.prefill_classes),
        ):
            _increasing(f"{label} edges", edges)
            if len(classes) != len(edges) + 1:
                raise AxesError(
                    f"{label}: {len(edges)} edges need {len(edges) + 1} classes, got {len(classes)}"
                )
            unknown = [n for n in classes if n not in names]
            if unknown:
                raise AxesError(f"{label} classifier names unknown workload classes {unknown}")

    def to_json(self) -> dict[str, Any]:
        c = self.classifier
        return {
            "context": {"edges": list(self.context_edges), "classes": list(self.context_classes)},
            "workload": {
                "classes": [{"name": w.name, "n_in": w.n_in, "n_out": w.n_out} for w in self.workloads],
                "classifier": {
                    "decode_heavy_below": c.decode_heavy_below,
                    "balanced_up_to": c.balanced_up_to,
                    "decode_out_edges": list(c.decode_out_edges),
                    "decode_classes": list(c.decode_classes),
                    "balanced_in_edges": list(c.balanced_in_edges),
                    "balanced_classes": list(c.balanced_classes),
                    "prefill_in_edges": list(c.prefill_in_edges),
                    "prefill_classes": list(c.prefill_classes),
                },
            },
            "qps_levels": list(self.qps_levels),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Axes:
        """Parse and validate the ``axes`` object of a table header; AxesError on any problem."""
        try:
            ctx = raw["context"]
            wl = raw["workload"]
            c = wl["classifier"]
            axes = cls(
                context_edges=tuple(int(e) for e in ctx["edges"]),
                context_classes=tuple(str(n) for n in ctx["classes"]),
                workloads=tuple(
                    WorkloadClass(str(w["name"]), int(w["n_in"]), int(w["n_out"])) for w in wl["classes"]
                ),
                classifier=Classifier(
                    decode_heavy_below=float(c["decode_heavy_below"]),
                    balanced_up_to=float(c["balanced_up_to"]),
                    decode_out_edges=tuple(int(e) for e in c["decode_out_edges"]),
                    decode_classes=tuple(str(n) for n in c["decode_classes"]),
                    balanced_in_edges=tuple(int(e) for e in c["balanced_in_edges"]),
                    balanced_classes=tuple(str(n) for n in c["balanced_classes"]),
                    prefill_in_edges=tuple(int(e) for e in c["prefill_in_edges"]),
                    prefill_classes=tuple(str(n) for n in c["prefill_classes"]),
                ),
                qps_levels=tuple(float(q) for q in raw["qps_levels"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AxesError(f"malformed axes: {exc!r}") from exc
        axes.validate()
        return axes


def _increasing(label: str, values: Sequence[float]) -> None:
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise AxesError(f"{label} must be strictly increasing, got {list(values)}")


def _unique(label: str, names: Sequence[str]) -> None:
    if len(set(names)) != len(names):
        raise AxesError(f"{label} must be unique, got {list(names)}")


def paper_axes() -> Axes:
    """The grid of the paper's public artifact (docs/architecture.md, "Reference facts")."""
    # The nine classes and their benchmark shapes have one definition: the workload catalog.
    workloads = tuple(WorkloadClass(name, shape.n_in, shape.n_out) for name, shape in TURN2_CLASSES.items())
    return Axes(
        context_edges=(512, 4096),
        context_classes=("small", "large", "huge"),
        workloads=workloads,
        classifier=Classifier(
            decode_heavy_below=0.25,
            balanced_up_to=2.0,
            decode_out_edges=(64, 256, 512),
            decode_classes=("tiny", "short_gen", "long_gen", "very_long_gen"),
            balanced_in_edges=(64,),
            balanced_classes=("small_bal", "mid_bal"),
            prefill_in_edges=(256, 512),
            prefill_classes=("mid_paste", "big_paste", "huge_paste"),
        ),
        qps_levels=(0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0),
    )
