"""The paper's comparisons, computed from benchmark records (the figures behind ``ppd-bench report``).

Rule 1: pure. Input: ``Record`` values plus a ``Manifest`` that says which experiment each run belongs
        to (the QPS sweep, the w_tpot sweep, the link-bandwidth sweep) and with which seed.
Rule 2: a point is one (shape, mode, QPS) group of one experiment; Turn 2+ figures use successful
        Turn 2+ requests; the failure rate is 1 - completed / sent; a figure without samples is None.
Rule 3: QPS bands follow the paper's Table 1: low 0.5-2, medium 4-8, high 12-20 (``paper.BANDS``).
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from loadgen.report.paper import BANDS, HIGH_QPS
from loadgen.summary import percentile
from table_builder.records import Record

__all__ = [
    "MANIFEST_NAME",
    "MODE_ORDER",
    "PAPER_WTPOT_EXPERIMENT",
    "Acceptance",
    "Check",
    "Manifest",
    "ManifestError",
    "Point",
    "RunInfo",
    "SweepPoint",
    "Winners",
    "acceptance",
    "band_changes",
    "bandwidth_points",
    "failure_rates",
    "paper_wtpot_experiments",
    "pareto",
    "points",
    "winners",
    "wtpot_points",
]

MODE_ORDER: Final = ("pd", "local", "ppd", "replica")
#: The manifest file beside the records (see ``Manifest``).
MANIFEST_NAME: Final = "manifest.json"
QPS_EXPERIMENT: Final = "qps"
WTPOT_EXPERIMENT: Final = "wtpot"
#: Figure 6 in the paper's setting: one experiment per QPS level, ``wtpot-paper@<qps>``.
PAPER_WTPOT_EXPERIMENT: Final = "wtpot-paper"
BANDWIDTH_EXPERIMENT: Final = "bandwidth"


class ManifestError(ValueError):
    """manifest.json is malformed; the message names the field."""


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What one run id was: its experiment and the parameter it varied."""

    experiment: str = QPS_EXPERIMENT
    w_tpot: float | None = None
    link_gb_s: float | None = None
    link: str | None = None


@dataclass(frozen=True, slots=True)
class Manifest:
    """``manifest.json`` beside the records: how they were produced (engine, seed) and run labels."""

    engine: str = "unknown engine"
    seed: int | None = None
    notes: str = ""
    runs: Mapping[str, RunInfo] = field(default_factory=dict)

    def info(self, run_id: str) -> RunInfo:
        return self.runs.get(run_id, RunInfo())

    def to_json(self) -> str:
        runs = {
            k: {
                n: getattr(v, n)
                for n in ("experiment", "w_tpot", "link_gb_s", "link")
                if getattr(v, n) is not None
            }
            for k, v in sorted(self.runs.items())
        }
        doc = {"engine": self.engine, "seed": self.seed, "notes": self.notes, "runs": runs}
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"manifest is not JSON: {exc.msg} at line {exc.lineno}") from None
        if not isinstance(doc, dict):
            raise ManifestError("manifest must be a JSON object")
        runs: dict[str, RunInfo] = {}
        for run_id, raw in (doc.get("runs") or {}).items():
            if not isinstance(raw, dict):
                raise ManifestError(f"runs.{run_id} must be an object")
            try:
                runs[run_id] = RunInfo(
                    experiment=str(raw.get("experiment", QPS_EXPERIMENT)),
                    w_tpot=_opt_float(raw.get("w_tpot")),
                    link_gb_s=_opt_float(raw.get("link_gb_s")),
                    link=None if raw.get("link") is None else str(raw["link"]),
                )
            except (TypeError, ValueError):
                raise ManifestError(f"runs.{run_id}: w_tpot and link_gb_s must be numbers") from None
        seed = doc.get("seed")
        if seed is not None and type(seed) is not int:
            raise ManifestError("seed must be an integer or null")
        return cls(
            engine=str(doc.get("engine", "unknown engine")),
            seed=seed,
            notes=str(doc.get("notes", "")),
            runs=runs,
        )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True, slots=True)
class Point:
    """One (shape, mode, QPS) group of one experiment."""

    shape: str
    mode: str
    qps: float
    sent: int
    ok: int
    ttft2_mean_ms: float | None
    ttft2_p99_ms: float | None
    ttft_p99_ms: float | None
    tpot2_mean_ms: float | None
    e2e_mean_ms: float | None
    tokens_per_s: float | None
    local_share: float | None
    workloads: tuple[str, ...]

    @property
    def success_rate(self) -> float:
        return self.ok / self.sent if self.sent else 0.0


def _point(shape: str, mode: str, qps: float, group: Sequence[Record]) -> Point:
    good = [r for r in group if r.ok]
    later = [r for r in good if r.turn > 1]
    ttft2 = [r.ttft_ms for r in later if r.ttft_ms is not None]
    runs: dict[str, list[Record]] = defaultdict(list)
    for r in group:
        runs[r.run_id].append(r)
    rates = []
    for run in runs.values():  # tokens/s per run, averaged: runs of one point may not overlap in time
        span = max(r.start_time + (r.e2e_ms or 0.0) / 1000.0 for r in run) - min(r.start_time for r in run)
        if span > 0:
            rates.append(sum(r.n_out for r in run if r.ok) / span)
    return Point(
        shape=shape,
        mode=mode,
        qps=qps,
        sent=len(group),
        ok=len(good),
        ttft2_mean_ms=_mean(ttft2),
        ttft2_p99_ms=percentile(ttft2, 99),
        ttft_p99_ms=percentile([r.ttft_ms for r in good if r.ttft_ms is not None], 99),
        tpot2_mean_ms=_mean([r.tpot_ms for r in later if r.tpot_ms is not None]),
        e2e_mean_ms=_mean([r.e2e_ms for r in good if r.e2e_ms is not None]),
        tokens_per_s=_mean(rates),
        local_share=(sum(r.path == "local" for r in later) / len(later)) if later else None,
        workloads=tuple(sorted({r.workload for r in group})),
    )


def _mode_key(mode: str) -> tuple[int, str]:
    return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), mode)


def points(records: Iterable[Record], manifest: Manifest, experiment: str = QPS_EXPERIMENT) -> list[Point]:
    """The experiment's points, sorted by shape, mode (pd, local, ppd, replica, others) and QPS."""
    groups: dict[tuple[str, str, float], list[Record]] = defaultdict(list)
    for r in records:
        if manifest.info(r.run_id).experiment == experiment:
            groups[(r.shape, r.mode, r.target_qps)].append(r)
    keys = sorted(groups, key=lambda k: (k[0], _mode_key(k[1]), k[2]))
    return [_point(*key, groups[key]) for key in keys]


def band_changes(pts: Sequence[Point], shape: str, mode: str) -> dict[str, float | None]:
    """Per QPS band: mean over the band's QPS levels of (mode / pd - 1) in Turn 2+ mean TTFT."""
    by = {(p.mode, p.qps): p for p in pts if p.shape == shape}
    out: dict[str, float | None] = {}
    for name, low, high in BANDS:
        changes = []
        for (m, q), p in by.items():
            base = by.get(("pd", q))
            if m != mode or not low <= q <= high or base is None:
                continue
            if p.ttft2_mean_ms is not None and base.ttft2_mean_ms:
                changes.append(p.ttft2_mean_ms / base.ttft2_mean_ms - 1.0)
        out[name] = _mean(changes)
    return out


def failure_rates(
    pts: Sequence[Point], min_qps: float = HIGH_QPS[0]
) -> dict[tuple[str, str], dict[float, float]]:
    """(shape, mode) -> {QPS: failure rate} at every measured QPS level from ``min_qps`` up (stress too)."""
    out: dict[tuple[str, str], dict[float, float]] = defaultdict(dict)
    for p in pts:
        if p.qps >= min_qps:
            out[(p.shape, p.mode)][p.qps] = 1.0 - p.success_rate
    return dict(out)


@dataclass(frozen=True, slots=True)
class Winners:
    test_points: int
    tpot_best: Mapping[str, int]
    ttft_best: Mapping[str, int]
    full_success: Mapping[str, int]


def winners(pts: Sequence[Point], modes: Sequence[str] = ("pd", "local", "ppd")) -> Winners:
    """Per-metric winner counts over the (shape, QPS) test points where every mode was measured."""
    by: dict[tuple[str, float], dict[str, Point]] = defaultdict(dict)
    for p in pts:
        if p.mode in modes:
            by[(p.shape, p.qps)][p.mode] = p
    tpot = dict.fromkeys(modes, 0)
    ttft = dict.fromkeys(modes, 0)
    full = dict.fromkeys(modes, 0)
    n = 0
    for group in by.values():
        if set(group) != set(modes):
            continue
        n += 1
        for metric, counts in (("tpot2_mean_ms", tpot), ("ttft2_mean_ms", ttft)):
            values = {m: getattr(p, metric) for m, p in group.items() if getattr(p, metric) is not None}
            if values:
                best = min(values.values())
                for m, v in values.items():
                    counts[m] += v == best
        for m, p in group.items():
            full[m] += p.ok == p.sent
    return Winners(test_points=n, tpot_best=tpot, ttft_best=ttft, full_success=full)


def pareto(pts: Sequence[Point]) -> list[Point]:
    """Points no other point beats on both tokens/s (higher) and P99 TTFT (lower)."""
    usable = [p for p in pts if p.tokens_per_s is not None and p.ttft_p99_ms is not None]

    def dominated(p: Point) -> bool:
        return any(
            q.tokens_per_s >= p.tokens_per_s  # type: ignore[operator]
            and q.ttft_p99_ms <= p.ttft_p99_ms  # type: ignore[operator]
            and (q.tokens_per_s > p.tokens_per_s or q.ttft_p99_ms < p.ttft_p99_ms)  # type: ignore[operator]
            for q in usable
        )

    return [p for p in usable if not dominated(p)]


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One setting of a sweep (a w_tpot value or a link bandwidth) for one mode."""

    value: float | None
    label: str
    mode: str
    point: Point


def wtpot_points(
    records: Iterable[Record], manifest: Manifest, experiment: str = WTPOT_EXPERIMENT
) -> list[SweepPoint]:
    """A w_tpot sweep (``experiment``): static PD (value None) first, then by increasing w_tpot."""
    return _sweep(records, manifest, experiment, lambda info: info.w_tpot, "w_tpot")


def paper_wtpot_experiments(manifest: Manifest) -> list[tuple[float, str]]:
    """The (QPS, experiment) of each Figure-6-in-the-paper's-setting sweep in ``manifest``, by QPS."""
    prefix = f"{PAPER_WTPOT_EXPERIMENT}@"
    names = {info.experiment for info in manifest.runs.values() if info.experiment.startswith(prefix)}
    return sorted((float(name.removeprefix(prefix)), name) for name in names)


def bandwidth_points(records: Iterable[Record], manifest: Manifest) -> list[SweepPoint]:
    """The link sweep, fastest link first."""
    out = _sweep(records, manifest, BANDWIDTH_EXPERIMENT, lambda info: info.link_gb_s, "GB/s")
    return sorted(out, key=lambda s: (_mode_key(s.mode), -(s.value or 0.0)))


def _sweep(
    records: Iterable[Record], manifest: Manifest, experiment: str, param: Any, unit: str
) -> list[SweepPoint]:
    groups: dict[tuple[float | None, str], list[Record]] = defaultdict(list)
    labels: dict[tuple[float | None, str], str] = {}
    for r in records:
        info = manifest.info(r.run_id)
        if info.experiment != experiment:
            continue
        value = param(info)
        key = (value, r.mode)
        groups[key].append(r)
        labels[key] = info.link or (r.mode if value is None else f"{unit}={value:g}")
    keys = sorted(groups, key=lambda k: (k[0] is not None, k[0] or 0.0, _mode_key(k[1])))
    out = []
    for key in keys:
        group = groups[key]
        first = group[0]
        out.append(
            SweepPoint(key[0], labels[key], key[1], _point(first.shape, first.mode, first.target_qps, group))
        )
    return out


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    passed: bool | None  # None: not enough data to say
    detail: str


@dataclass(frozen=True, slots=True)
class Acceptance:
    checks: tuple[Check, ...]


def _levels(levels: Sequence[float]) -> str:
    return ", ".join(f"{q:g}" for q in levels)


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def acceptance(
    pts: Sequence[Point],
    wtpot: Sequence[SweepPoint],
    links: Sequence[SweepPoint],
    shape: str = "1P3D",
    grid_max_qps: float = 20.0,
) -> Acceptance:
    """The issue's acceptance figures (PPD vs PD on ``shape``, the w_tpot and link sweeps).

    TTFT and TPOT are averaged over the QPS levels up to ``grid_max_qps`` (the paper's grid); the
    success-rate check looks at every level, stress levels included.
    """
    by = {(p.mode, p.qps): p for p in pts if p.shape == shape}
    measured = sorted(q for (m, q) in by if m == "pd" and ("ppd", q) in by)
    common = [q for q in measured if q <= grid_max_qps]
    checks: list[Check] = []

    def avg(mode: str, attr: str) -> float | None:
        values = [getattr(by[(mode, q)], attr) for q in common]
        return _mean([v for v in values if v is not None]) if None not in values else None

    pd_ttft, ppd_ttft = avg("pd", "ttft2_mean_ms"), avg("ppd", "ttft2_mean_ms")
    if pd_ttft and ppd_ttft is not None:
        cut = 1.0 - ppd_ttft / pd_ttft
        checks.append(
            Check(
                "PPD cuts mean Turn 2+ TTFT vs PD by >= 50%",
                cut >= 0.5,
                f"{pd_ttft:.1f} -> {ppd_ttft:.1f} ms ({_pct(-cut)}), mean over QPS {_levels(common)}",
            )
        )
    else:
        checks.append(
            Check("PPD cuts mean Turn 2+ TTFT vs PD by >= 50%", None, f"no PD and PPD points on {shape}")
        )
    pd_tpot, ppd_tpot = avg("pd", "tpot2_mean_ms"), avg("ppd", "tpot2_mean_ms")
    if pd_tpot and ppd_tpot is not None:
        rise = ppd_tpot / pd_tpot - 1.0
        checks.append(
            Check(
                "PPD mean TPOT within +15% of PD",
                rise <= 0.15,
                f"{pd_tpot:.2f} -> {ppd_tpot:.2f} ms ({_pct(rise)})",
            )
        )
    else:
        checks.append(Check("PPD mean TPOT within +15% of PD", None, f"no TPOT figures on {shape}"))
    weak = [q for q in measured if by[("pd", q)].success_rate < 0.95]
    if weak:
        held = all(by[("ppd", q)].success_rate == 1.0 for q in weak)

        def rates(q: float) -> str:
            local = by.get(("local", q))
            text = f"QPS {q:g}: PD {by[('pd', q)].success_rate:.1%} / PPD {by[('ppd', q)].success_rate:.1%}"
            return text + (f" (static local {local.success_rate:.1%})" if local is not None else "")

        detail = ", ".join(rates(q) for q in weak)
        checks.append(Check("where PD's success rate < 95%, PPD stays at 100%", held, detail))
    else:
        checks.append(
            Check(
                "where PD's success rate < 95%, PPD stays at 100%",
                None,
                "PD never dropped below 95% in these runs",
            )
        )
    shares = [(s.value, s.point.local_share) for s in wtpot if s.value is not None and s.mode == "ppd"]
    if len(shares) >= 2 and all(v is not None for _, v in shares):
        values = [v for _, v in shares if v is not None]
        monotone = all(b <= a for a, b in itertools.pairwise(values)) and values[-1] < values[0]
        checks.append(
            Check(
                "raising w_tpot lowers the local share monotonically",
                monotone,
                ", ".join(f"w_tpot={w:g}: {100 * (v or 0):.0f}%" for w, v in shares),
            )
        )
    else:
        checks.append(Check("raising w_tpot lowers the local share monotonically", None, "no w_tpot sweep"))
    checks.append(_link_check(links))
    return Acceptance(tuple(checks))


def _link_check(links: Sequence[SweepPoint]) -> Check:
    name = "PD's Turn 2+ TTFT rises as the link slows while PPD's stays flat"
    series: dict[str, list[float]] = defaultdict(list)
    for s in links:  # fastest link first per mode
        if s.point.ttft2_mean_ms is not None:
            series[s.mode].append(s.point.ttft2_mean_ms)
    pd, ppd = series.get("pd", []), series.get("ppd", [])
    if len(pd) < 2 or len(ppd) < 2:
        return Check(name, None, "no link sweep")
    rises = all(b >= a for a, b in itertools.pairwise(pd)) and pd[-1] > pd[0]
    spread = max(ppd) / min(ppd) - 1.0
    flat = spread <= 0.10
    detail = f"PD {pd[0]:.1f} -> {pd[-1]:.1f} ms ({_pct(pd[-1] / pd[0] - 1)}); PPD spread {100 * spread:.1f}%"
    return Check(name, rises and flat, detail)
