"""What a decision table says besides its figures: one value type, ``TableHeader``.

Rule 1: ``TableHeader`` is the one place that lists the header's fields: their place in the JSON header
(``to_json``), the defaults a writer gets, and the checks a reader makes (``from_json``). The file format
(table.py) writes and reads it; the table builder fills one; ``ppd-table show``, DescribeTable and the
router read one. A new field is a field here (its JSON place and its check), the builder's flag that
sets it, and the code that uses it.
Rule 2: ``Figure`` names the columns of the figures array (the last axis of ``figures[c, w, q]``); code
indexes a cell's row by name, never by a bare number. Columns are only ever appended, each group with a
new format version: ``FIGURES_OF_VERSION[v]`` is the header's ``figures`` list of a version-``v`` file
(version 1: PD and LOCAL; version 2 adds the bidirectional mode, BIDIR). A reader gives every table all
columns; those its file's version lacks read as zero (no samples).
Rule 3: nothing here knows about files, sockets or clocks; a bad header raises ``HeaderError`` (or
``AxesError``, ``KeyError``, ``TypeError``, ``ValueError`` for a malformed one), which the file reader
turns into its ``TableError``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final

from decision_service.axes import Axes
from ppd.placement import PLACEMENTS

__all__ = [
    "BIDIR_FIGURES",
    "DECISIONS",
    "FIGURES",
    "FIGURES_OF_VERSION",
    "Figure",
    "HeaderError",
    "TableHeader",
    "Weights",
]

#: The two answers a table can default to.
DECISIONS: Final = ("pd", "local")


class Figure(IntEnum):
    """The figures of one cell, in their order along the array's last axis.

    Means over completed Turn-2+ requests (``*_TTFT_MS``, ``*_TPOT_MS``), completed / sent
    (``*_SUCCESS``), and requests sent (``*_SAMPLES``; a cell is measured when PD's and LOCAL's are
    > 0). ``BIDIR_*`` (format version 2): the bidirectional KV mode's figures; a cell has them when
    ``BIDIR_SAMPLES`` > 0, and only then may the router answer BIDIR there.
    """

    PD_TTFT_MS = 0
    PD_TPOT_MS = 1
    LOCAL_TTFT_MS = 2
    LOCAL_TPOT_MS = 3
    PD_SUCCESS = 4
    LOCAL_SUCCESS = 5
    PD_SAMPLES = 6
    LOCAL_SAMPLES = 7
    BIDIR_TTFT_MS = 8
    BIDIR_TPOT_MS = 9
    BIDIR_SUCCESS = 10
    BIDIR_SAMPLES = 11

    @property
    def label(self) -> str:
        """The name in the header's ``figures`` list (and in the proto's ``CellFigures``)."""
        return self.name.lower()


#: The header's ``figures`` list of the newest format: ``Figure`` labels in array order.
FIGURES: Final = tuple(f.label for f in Figure)
#: The bidirectional mode's columns (format version 2).
BIDIR_FIGURES: Final = (
    Figure.BIDIR_TTFT_MS,
    Figure.BIDIR_TPOT_MS,
    Figure.BIDIR_SUCCESS,
    Figure.BIDIR_SAMPLES,
)
#: The header's ``figures`` list of each format version: a prefix of ``FIGURES``.
FIGURES_OF_VERSION: Final = {1: FIGURES[: Figure.BIDIR_TTFT_MS], 2: FIGURES}
#: Column groups the reader checks together.
LATENCIES: Final = (Figure.PD_TTFT_MS, Figure.PD_TPOT_MS, Figure.LOCAL_TTFT_MS, Figure.LOCAL_TPOT_MS)
BIDIR_LATENCIES: Final = (Figure.BIDIR_TTFT_MS, Figure.BIDIR_TPOT_MS)
SUCCESS_RATES: Final = (Figure.PD_SUCCESS, Figure.LOCAL_SUCCESS, Figure.BIDIR_SUCCESS)


class HeaderError(ValueError):
    """A header field holds a value the format does not allow."""


@dataclass(frozen=True, slots=True)
class Weights:
    w_ttft: float
    w_tpot: float

    def to_json(self) -> dict[str, float]:
        return {"w_ttft": self.w_ttft, "w_tpot": self.w_tpot}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], name: str) -> Weights:
        w = cls(float(raw["w_ttft"]), float(raw["w_tpot"]))
        if not (math.isfinite(w.w_ttft) and math.isfinite(w.w_tpot)) or w.w_ttft < 0 or w.w_tpot < 0:
            raise HeaderError(f"weights {name!r} must be finite and non-negative")
        if w.w_ttft == 0 and w.w_tpot == 0:
            raise HeaderError(f"weights {name!r} are both zero")
        return w


@dataclass(frozen=True, slots=True, kw_only=True)
class TableHeader:
    """Everything a table file holds besides its figures (and the content-derived version).

    Where each field lives in the JSON header: ``key``, ``shape``, ``model``, ``axes``,
    ``default_decision`` and ``provenance`` at the top; ``weights.default`` and ``weights.profiles``;
    ``slo.min_success``; ``live.max_decode_kv_usage``, ``live.max_decode_running`` and
    ``live.max_prefill_queue_depth``. The defaults are what a writer gets when it does not say; the
    table builder has its own (``table_builder.build.default_header``).
    """

    shape: str
    model: str
    axes: Axes
    #: Weights of the score S = w_ttft * delta_ttft - w_tpot * delta_tpot when the caller gives none.
    default_weights: Weights = Weights(1.0, 1.0)
    #: Named weights a caller may ask for instead.
    profiles: Mapping[str, Weights] = field(default_factory=dict)
    #: The success SLO: a mode below it in a cell loses to one that met it (route.py rule 2).
    min_success: float = 0.95
    #: The answer for a (context, workload) without any measurement (route.py rule 3).
    default_decision: str = "pd"
    #: A live decode KV usage above this turns LOCAL into PD (route.py rule 4).
    max_decode_kv_usage: float = 0.95
    #: Decode-load guard (route.py rule 5): above this many running requests on the session's decode
    #: worker, LOCAL turns PD unless the prefill queue is deeper than ``max_prefill_queue_depth``.
    #: None: off (also what a table written before the guard existed reads as).
    max_decode_running: int | None = None
    max_prefill_queue_depth: int | None = None
    #: Where the figures came from (free-form JSON; the builder writes inputs, runs, labels, counts).
    provenance: Mapping[str, Any] = field(default_factory=dict)
    #: Which P (and Turn-1 D) the measured runs placed legs on (ppd/placement.py): ``least_loaded``
    #: (also what a table written before the field existed reads as) or ``prefix``. Written only when
    #: not ``least_loaded``, so the files of earlier tables stay the same bytes.
    placement: str = "least_loaded"

    @property
    def key(self) -> str:
        return f"{self.shape}/{self.model}"

    def to_json(self, format_version: int = max(FIGURES_OF_VERSION)) -> dict[str, Any]:
        """The JSON header object of a ``format_version`` file, without what the file layer adds
        (``version``, ``arrays``)."""
        return {
            "format": "ppd-table",
            "key": self.key,
            "shape": self.shape,
            "model": self.model,
            "axes": self.axes.to_json(),
            "figures": list(FIGURES_OF_VERSION[format_version]),
            "weights": {
                "default": self.default_weights.to_json(),
                "profiles": {name: w.to_json() for name, w in sorted(self.profiles.items())},
            },
            "slo": {"min_success": self.min_success},
            "default_decision": self.default_decision,
            "live": {
                "max_decode_kv_usage": self.max_decode_kv_usage,
                "max_decode_running": self.max_decode_running,
                "max_prefill_queue_depth": self.max_prefill_queue_depth,
            },
            "provenance": dict(self.provenance),
        } | ({"placement": self.placement} if self.placement != "least_loaded" else {})

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], format_version: int = max(FIGURES_OF_VERSION)) -> TableHeader:
        """Read and check the JSON header object of a ``format_version`` file (the file layer checks
        ``version`` and ``arrays``)."""
        for key in ("key", "shape", "model", "default_decision"):
            if not isinstance(raw[key], str) or not raw[key]:
                raise HeaderError(f"header field {key!r} must be a non-empty string")
        if raw["key"] != f"{raw['shape']}/{raw['model']}":
            raise HeaderError(f"key {raw['key']!r} is not shape/model")
        if raw["default_decision"] not in DECISIONS:
            raise HeaderError(f"default_decision must be 'pd' or 'local', got {raw['default_decision']!r}")
        expected = list(FIGURES_OF_VERSION[format_version])
        if list(raw["figures"]) != expected:
            raise HeaderError(
                f"figures {raw['figures']} differ from this reader's {expected} "
                f"(format version {format_version})"
            )
        axes = Axes.from_json(raw["axes"])
        weights = raw["weights"]
        default_weights = Weights.from_json(weights["default"], "default")
        profiles = {str(n): Weights.from_json(w, n) for n, w in weights["profiles"].items()}
        min_success = float(raw["slo"]["min_success"])
        live = raw["live"]
        kv_limit = float(live["max_decode_kv_usage"])
        placement = raw.get("placement", "least_loaded")
        if placement not in PLACEMENTS:
            raise HeaderError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        if not (0.0 <= min_success <= 1.0) or not (0.0 <= kv_limit <= 1.0):
            raise HeaderError("slo.min_success and live.max_decode_kv_usage must be within 0..1")
        return cls(
            shape=raw["shape"],
            model=raw["model"],
            axes=axes,
            default_weights=default_weights,
            profiles=profiles,
            min_success=min_success,
            default_decision=raw["default_decision"],
            max_decode_kv_usage=kv_limit,
            max_decode_running=_optional_count(live, "max_decode_running"),
            max_prefill_queue_depth=_optional_count(live, "max_prefill_queue_depth"),
            provenance=raw.get("provenance", {}),
            placement=placement,
        )


def _optional_count(live: Mapping[str, Any], key: str) -> int | None:
    """A whole number >= 0, or None when absent (tables written before the field existed) or null."""
    value = live.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HeaderError(f"live.{key} must be a whole number >= 0 or null, got {value!r}")
    return value
