"""The shape advisor's figures and its recommendation: pure, from records to the winner.

Rule 1: a *config* is one shape x mode (``2P2D ppd``). One run (a workload of the mix at one QPS level on
        one config) gives ``Figures``: over the successful requests, the mean TTFT of Turn 1, of Turns 2+
        and of all turns, the mean TPOT of all turns (the paper's "average TPOT") and of Turns 2+; the
        success rate (completed / sent); output tokens per second; the SLO attainment (the share of
        *sent* requests that completed within every SLO target given, so a failure misses the SLO).
Rule 2: a config's figures at a QPS level are the share-weighted means of its per-workload figures
        (``combine``): each workload of the mix runs on its own at that level, as the paper ran each
        of its workloads at each level.
Rule 3 (weights): a config's score at a QPS level is the paper's S against a baseline config at the
        same level, on relative deltas: S = w_ttft * (TTFT_base - TTFT) / TTFT_base - w_tpot *
        (TPOT - TPOT_base) / TPOT_base, TTFT the mean over all turns (a shape changes Turn 1 too), TPOT
        the mean over all turns. The baseline scores 0; higher is better. A config below ``min_success``
        (default 95%, the paper's line for service degradation) cannot win that level. Where the
        baseline completed nothing at a level, that level's scores are against the first config (in the
        order given) that has figures there.
Rule 4 (SLO targets): a config's score at a level is its SLO attainment; the highest wins, a tie goes to
        the lower mean TTFT. Failures count against attainment, so ``min_success`` does not apply.
Rule 5: the winner at a level is the eligible config with the highest score; when none is eligible,
        the one with the highest success rate, flagged. The overall winner is, among the configs eligible
        at the most levels, the one with the highest mean score over the levels (then the one that wins
        more levels); it is the recommendation. Ties go to ``ppd`` (it ties a static mode where its
        table routes every request that way, and adapts where the traffic moves), then to the config
        listed first.
Rule 6 (the paper's Table 2): per (workload, QPS) cell, the winner of each objective (lowest Turn 2+
        TTFT, lowest TPOT, highest output tokens/s) among the configs that reach ``min_success`` there
        (all configs when none does); the share of cells each mode category wins (replica, x=0 = pd,
        0<x<1 = fraction:<x>, x=1 = local, and ppd on its own row). Configs that tie share the cell's
        win equally, so no listing order decides a tie: by default exact ties (within 1e-9, relative:
        the simulator repeats itself where two modes route every request alike); ``tie_within`` widens
        that to a relative margin (the report's sensitivity row: 1%, below the noise of a 10 s run).
Rule 7 (the paper's Table 1): per shape and QPS band, the mean over the band's (workload, QPS) cells of
        Turn 2+ TTFT local / pd - 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from loadgen.report.paper import BANDS, PAPER_TABLE2
from table_builder.records import Record

__all__ = [
    "CATEGORIES",
    "Config",
    "Figures",
    "LevelWinner",
    "Objective",
    "Recommendation",
    "band_changes",
    "category",
    "combine",
    "figures",
    "recommend",
    "score",
    "winner_shares",
]

#: Table 2's mode categories, in its order, then PPD (which the paper's static sweep does not have).
CATEGORIES: Final = (*PAPER_TABLE2, "PPD")


@dataclass(frozen=True, slots=True, order=True)
class Config:
    """One shape x mode."""

    shape: str
    mode: str

    @property
    def label(self) -> str:
        return f"{self.shape} {self.mode}"


def category(mode: str) -> str:
    """Table 2's category of a mode (``ppd`` is its own)."""
    if mode == "replica":
        return CATEGORIES[0]
    if mode == "pd":
        return CATEGORIES[1]
    if mode.startswith("fraction:"):
        return CATEGORIES[2]
    if mode == "local":
        return CATEGORIES[3]
    return CATEGORIES[4]


@dataclass(frozen=True, slots=True)
class Figures:
    """Rule 1: what one run (or a mix of runs, rule 2) predicts. A latency without samples is None."""

    sent: int
    success: float
    ttft1_ms: float | None
    ttft2_ms: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    tpot2_ms: float | None
    tokens_per_s: float | None
    slo_attainment: float | None = None
    local_share: float | None = None


@dataclass(frozen=True, slots=True)
class Objective:
    """What the operator wants: weights (rule 3) or, when either target is set, SLO targets (rule 4)."""

    w_ttft: float = 1.0
    w_tpot: float = 1.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    min_success: float = 0.95

    @property
    def uses_slo(self) -> bool:
        return self.slo_ttft_ms is not None or self.slo_tpot_ms is not None

    def describe(self) -> str:
        if self.uses_slo:
            targets = [f"TTFT <= {self.slo_ttft_ms:g} ms"] if self.slo_ttft_ms is not None else []
            targets += [f"TPOT <= {self.slo_tpot_ms:g} ms"] if self.slo_tpot_ms is not None else []
            return (
                f"SLO attainment: the share of sent requests that completed with {' and '.join(targets)}; "
                "the highest wins (a tie goes to the lower mean TTFT)"
            )
        return (
            f"S = {self.w_ttft:g} * (TTFT_base - TTFT) / TTFT_base - {self.w_tpot:g} * (TPOT - TPOT_base) / "
            f"TPOT_base against the baseline config at the same QPS (TTFT and TPOT: means over all turns); "
            f"the highest wins among the configs with at least {100 * self.min_success:g}% success"
        )


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _meets(r: Record, objective: Objective) -> bool:
    if not r.ok:
        return False
    if objective.slo_ttft_ms is not None and (r.ttft_ms is None or r.ttft_ms > objective.slo_ttft_ms):
        return False
    return objective.slo_tpot_ms is None or r.tpot_ms is None or r.tpot_ms <= objective.slo_tpot_ms


def figures(records: Sequence[Record], objective: Objective) -> Figures:
    """Rule 1 over one run's records."""
    good = [r for r in records if r.ok]
    later = [r for r in good if r.turn > 1]
    span = (
        max(r.start_time + (r.e2e_ms or 0.0) / 1000.0 for r in records) - min(r.start_time for r in records)
        if records
        else 0.0
    )
    return Figures(
        sent=len(records),
        success=len(good) / len(records) if records else 0.0,
        ttft1_ms=_mean([r.ttft_ms for r in good if r.turn == 1 and r.ttft_ms is not None]),
        ttft2_ms=_mean([r.ttft_ms for r in later if r.ttft_ms is not None]),
        ttft_ms=_mean([r.ttft_ms for r in good if r.ttft_ms is not None]),
        tpot_ms=_mean([r.tpot_ms for r in good if r.tpot_ms is not None]),
        tpot2_ms=_mean([r.tpot_ms for r in later if r.tpot_ms is not None]),
        tokens_per_s=math.fsum(r.n_out for r in good) / span if span > 0 else None,
        slo_attainment=(
            sum(_meets(r, objective) for r in records) / len(records)
            if objective.uses_slo and records
            else None
        ),
        local_share=sum(r.path == "local" for r in later) / len(later) if later else None,
    )


def _weighted(pairs: Iterable[tuple[float, float | None]]) -> float | None:
    usable = [(w, v) for w, v in pairs if v is not None and w > 0]
    total = math.fsum(w for w, _ in usable)
    return math.fsum(w * v for w, v in usable) / total if total > 0 else None


def combine(parts: Sequence[tuple[float, Figures]]) -> Figures:
    """Rule 2: the share-weighted mean of (share, figures) pairs; a figure no part has stays None."""

    def of(name: str) -> float | None:
        return _weighted((w, getattr(f, name)) for w, f in parts)

    return Figures(
        sent=sum(f.sent for _, f in parts),
        success=of("success") or 0.0,
        ttft1_ms=of("ttft1_ms"),
        ttft2_ms=of("ttft2_ms"),
        ttft_ms=of("ttft_ms"),
        tpot_ms=of("tpot_ms"),
        tpot2_ms=of("tpot2_ms"),
        tokens_per_s=of("tokens_per_s"),
        slo_attainment=of("slo_attainment"),
        local_share=of("local_share"),
    )


def score(fig: Figures, base: Figures | None, objective: Objective) -> float | None:
    """Rule 3 (or rule 4's attainment); None when a figure it needs is missing."""
    if objective.uses_slo:
        return fig.slo_attainment
    if base is None or not base.ttft_ms or not base.tpot_ms or fig.ttft_ms is None or fig.tpot_ms is None:
        return None
    return (
        objective.w_ttft * (base.ttft_ms - fig.ttft_ms) / base.ttft_ms
        - objective.w_tpot * (fig.tpot_ms - base.tpot_ms) / base.tpot_ms
    )


@dataclass(frozen=True, slots=True)
class LevelWinner:
    """Rule 5 at one QPS level."""

    qps: float
    winner: Config
    score: float | None
    runner_up: Config | None
    runner_up_score: float | None
    eligible: bool  # False: no config reached min_success; the winner is the most successful one


@dataclass(frozen=True, slots=True)
class Recommendation:
    objective: Objective
    baseline: Config
    levels: tuple[LevelWinner, ...]
    overall: Config
    overall_mean_score: float | None
    eligible_levels: int
    scores: Mapping[Config, Mapping[float, float | None]] = field(default_factory=dict)


def _eligible(fig: Figures, objective: Objective) -> bool:
    return objective.uses_slo or fig.success >= objective.min_success


def _level(
    qps: float, by_config: Mapping[Config, Figures], order: Sequence[Config], baseline: Config, obj: Objective
) -> tuple[LevelWinner, dict[Config, float | None]]:
    base = by_config.get(baseline)
    if base is None or not base.ttft_ms or not base.tpot_ms:
        # The baseline has no figures here: score against the first config that has them.
        base = next((by_config[c] for c in order if c in by_config and by_config[c].ttft_ms), None)
    scores = {c: score(by_config[c], base, obj) for c in order if c in by_config}
    ranked = [c for c in order if c in by_config and scores[c] is not None and _eligible(by_config[c], obj)]

    def key(c: Config) -> tuple[float, float]:
        s = scores[c]
        ttft = by_config[c].ttft_ms
        return (-(s if s is not None else -math.inf), ttft if obj.uses_slo and ttft is not None else 0.0)

    ranked.sort(key=lambda c: (*key(c), c.mode != "ppd", order.index(c)))
    if ranked:
        best = ranked[0]
        second = ranked[1] if len(ranked) > 1 else None
        return LevelWinner(qps, best, scores[best], second, scores[second] if second else None, True), scores
    present = [c for c in order if c in by_config]
    best = max(present, key=lambda c: (by_config[c].success, -order.index(c)))
    return LevelWinner(qps, best, scores[best], None, None, False), scores


def recommend(
    table: Mapping[Config, Mapping[float, Figures]], baseline: Config, objective: Objective
) -> Recommendation:
    """Rules 3-5 over every config's figures per QPS level (``table``, configs in the order given)."""
    order = list(table)
    if not order:
        raise ValueError("no config has figures to recommend from")
    levels = sorted({q for per in table.values() for q in per})
    winners = []
    scores: dict[Config, dict[float, float | None]] = {c: {} for c in order}
    for q in levels:
        at = {c: per[q] for c, per in table.items() if q in per}
        winner, level_scores = _level(q, at, order, baseline, objective)
        winners.append(winner)
        for c, s in level_scores.items():
            scores[c][q] = s

    wins = {c: sum(w.winner == c and w.eligible for w in winners) for c in order}

    def standing(c: Config) -> tuple[int, float, int]:
        ok = [q for q in levels if q in table[c] and _eligible(table[c][q], objective)]
        values = [s for q in ok if (s := scores[c].get(q)) is not None]
        mean = _mean(values)
        return len(ok), -math.inf if mean is None else mean, wins[c]

    best = max(order, key=lambda c: (*standing(c), c.mode == "ppd", -order.index(c)))
    count, mean_score, _ = standing(best)
    return Recommendation(
        objective=objective,
        baseline=baseline,
        levels=tuple(winners),
        overall=best,
        overall_mean_score=None if mean_score == -math.inf else mean_score,
        eligible_levels=count,
        scores=scores,
    )


def winner_shares(
    cells: Mapping[tuple[str, float], Mapping[Config, Figures]],
    min_success: float,
    *,
    with_ppd: bool,
    tie_within: float = 1e-9,
) -> dict[str, dict[str, float]]:
    """Rule 6: objective (``ttft``, ``tpot``, ``throughput``) -> category -> share of cells won."""
    objectives = {
        "ttft": ("ttft2_ms", False),
        "tpot": ("tpot_ms", False),
        "throughput": ("tokens_per_s", True),
    }
    out: dict[str, dict[str, float]] = {}
    for name, (attr, higher) in objectives.items():
        won = dict.fromkeys(CATEGORIES, 0.0)
        counted = 0
        for by_config in cells.values():
            pool = {c: f for c, f in by_config.items() if with_ppd or c.mode != "ppd"}
            ok = {c: f for c, f in pool.items() if f.success >= min_success} or pool
            values: dict[Config, float] = {c: v for c, f in ok.items() if (v := getattr(f, attr)) is not None}
            if not values:
                continue
            counted += 1
            best = max(values.values()) if higher else min(values.values())
            tied = [c for c, v in values.items() if abs(v - best) <= tie_within * abs(best)]
            for c in tied:
                won[category(c.mode)] += 1.0 / len(tied)
        out[name] = {k: (v / counted if counted else 0.0) for k, v in won.items()}
    return out


def band_changes(cells: Mapping[tuple[str, float], Mapping[Config, Figures]]) -> dict[str, dict[str, float]]:
    """Rule 7: shape -> band -> mean Turn 2+ TTFT change from pd (x=0) to local (x=1)."""
    changes: dict[str, dict[str, list[float]]] = {}
    for (_, qps), by_config in cells.items():
        band = next((name for name, low, high in BANDS if low <= qps <= high), None)
        if band is None:
            continue
        for c, local in by_config.items():
            pd = by_config.get(Config(c.shape, "pd"))
            if c.mode != "local" or pd is None or not pd.ttft2_ms or local.ttft2_ms is None:
                continue
            changes.setdefault(c.shape, {}).setdefault(band, []).append(local.ttft2_ms / pd.ttft2_ms - 1.0)
    return {
        shape: {band: m for band, values in per.items() if (m := _mean(values)) is not None}
        for shape, per in sorted(changes.items())
    }
