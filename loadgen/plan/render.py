"""The shape advisor's report: ``report.md``, ``plan.png`` (the predicted figures per QPS) and
``plan_score.png`` (each config's score per QPS), and ``plan.json`` (every figure, for other tools).

Rule 1: the report states the setting, the rule that picked the winner (``Objective.describe``), the
        overall recommendation, the winner per QPS level, every config's predicted figures per level,
        and the notes of the runs (shapes without a table).
Rule 2: "Held against the paper": the winner shares per objective next to the paper's Table 2 (among
        the paper's categories, and again with PPD as a contender) with the largest gap in points, and
        the x=0 to x=1 Turn 2+ TTFT change per shape and QPS band next to its Table 1. Always written;
        it says when the run is not in the paper's setting (4 GPUs, its 18 workloads, its 10 QPS levels,
        replica and a fraction mode run).
matplotlib is imported only when a PNG is drawn (``section.save_png``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from loadgen.plan.recommend import (
    CATEGORIES,
    Config,
    Figures,
    Recommendation,
    band_changes,
    winner_shares,
)
from loadgen.plan.runner import PlanRuns, PlanSettings
from loadgen.report.paper import BANDS, PAPER_TABLE1, PAPER_TABLE2
from loadgen.report.reproduce import PAPER_QPS
from loadgen.report.section import md_table, ms, save_png
from ppd.catalog import WORKLOADS

__all__ = ["REPORT_NAME", "PaperCheck", "paper_check", "write_report"]

REPORT_NAME: Final = "report.md"
_OBJECTIVES: Final = ("ttft", "tpot", "throughput")
#: The sensitivity row: configs within 1% of the best share a cell's win (below a 10 s run's noise).
NEAR_TIE: Final = 0.01


@dataclass(frozen=True, slots=True)
class PaperCheck:
    """Rule 2's figures: our winner shares, the largest gap to Table 2 (points), Table 1's changes."""

    shares: Mapping[str, Mapping[str, float]]
    shares_with_ppd: Mapping[str, Mapping[str, float]]
    largest_gap_points: float
    shares_near_ties: Mapping[str, Mapping[str, float]]
    largest_gap_near_ties_points: float
    bands: Mapping[str, Mapping[str, float]]
    paper_setting: bool


def _paper_setting(settings: PlanSettings) -> bool:
    names = {c.name for c in settings.components}
    return (
        settings.gpus == 4
        and names == {w.name for w in WORKLOADS}
        and tuple(sorted(settings.qps)) == PAPER_QPS
        and settings.replica
        and any(m.startswith("fraction:") for m in settings.modes)
    )


def _gap(shares: Mapping[str, Mapping[str, float]]) -> float:
    """The largest gap to the paper's Table 2 over its categories and objectives, in points."""
    return 100.0 * max(
        abs(shares[obj][cat] - PAPER_TABLE2[cat][i])
        for i, obj in enumerate(_OBJECTIVES)
        for cat in PAPER_TABLE2
    )


def paper_check(runs: PlanRuns, settings: PlanSettings) -> PaperCheck:
    """Rule 2 over the runs' per-(workload, QPS) cells."""
    min_success = settings.objective.min_success
    shares = winner_shares(runs.cells, min_success, with_ppd=False)
    near = winner_shares(runs.cells, min_success, with_ppd=False, tie_within=NEAR_TIE)
    return PaperCheck(
        shares=shares,
        shares_with_ppd=winner_shares(runs.cells, min_success, with_ppd=True),
        largest_gap_points=_gap(shares),
        shares_near_ties=near,
        largest_gap_near_ties_points=_gap(near),
        bands=band_changes(runs.cells),
        paper_setting=_paper_setting(settings),
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _score(value: float | None, slo: bool) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if slo else f"{value:+.3f}"


def _margin(best: float | None, second: float | None) -> float | None:
    return None if best is None or second is None else best - second


def _mix(settings: PlanSettings) -> str:
    total = sum(c.share for c in settings.components)
    return ", ".join(f"{c.name} {100 * c.share / total:.0f}%" for c in settings.components)


def _within(points: float) -> str:
    return "within" if points <= 10.0 else "**not** within"


def _paper_lines(check: PaperCheck) -> list[str]:
    lines = [
        "## Held against the paper",
        "",
        (
            "This run is in the paper's setting: 4 GPUs, its 18 synthetic workloads, its 10 QPS levels, "
            "with the all-replica shape and a fraction mode so every category of its Table 2 competes."
            if check.paper_setting
            else "This run is **not** in the paper's setting (4 GPUs, its 18 workloads, its 10 QPS levels, "
            "`--replica` and a `fraction:<x>` mode), so the comparison below is indicative only."
        ),
        "",
        "Winner shares per objective (the paper's Table 2): the share of (workload, QPS) cells where a "
        "config of that category has the lowest Turn 2+ TTFT, the lowest TPOT, the highest output tokens/s, "
        "among the configs that reach the success floor in that cell. Ours among the paper's categories "
        "(PPD left out, as the paper's static sweep has no PPD) / the paper's (it also had hybrid "
        "replica + P/D configs, which won the rest of its cells).",
        "",
    ]
    rows = []
    for cat in PAPER_TABLE2:
        row = [cat]
        for i, obj in enumerate(_OBJECTIVES):
            row.append(f"{_pct(check.shares[obj][cat])} / {_pct(PAPER_TABLE2[cat][i])}")
        row += [_pct(check.shares_near_ties[obj][cat]) for obj in _OBJECTIVES]
        rows.append(row)
    header = ["category", "Turn 2 TTFT (ours / paper)", "TPOT", "throughput"]
    lines += md_table([*header, *(f"{h}, ties within 1%" for h in ("TTFT", "TPOT", "throughput"))], rows)
    lines += [
        f"Largest gap to Table 2: {check.largest_gap_points:.1f} points ({_within(check.largest_gap_points)} "
        f"10 points); {check.largest_gap_near_ties_points:.1f} points "
        f"({_within(check.largest_gap_near_ties_points)} 10) when configs within 1% of the best share a "
        "cell's win (the last three columns: such margins are below the noise of a 10 s run on real GPUs, "
        "so the paper's measurements would split them by chance).",
        "",
        "With PPD (`ppd` on the shapes with a table) as a contender too:",
        "",
    ]
    rows = [[cat, *(_pct(check.shares_with_ppd[obj][cat]) for obj in _OBJECTIVES)] for cat in CATEGORIES]
    lines += md_table(["category", "Turn 2 TTFT", "TPOT", "throughput"], rows)
    lines += [
        "Turn 2+ TTFT from x=0 (pd) to x=1 (local) per shape and QPS band (the paper's Table 1), mean over "
        "the mix's workloads and the band's levels: ours / the paper's.",
        "",
    ]
    rows = []
    for shape, per in check.bands.items():
        paper = PAPER_TABLE1.get(shape)
        row = [shape]
        for i, (band, _, _) in enumerate(BANDS):
            ours = per.get(band)
            row.append(
                f"{'-' if ours is None else f'{100 * ours:+.1f}%'} / "
                f"{'-' if paper is None else f'{100 * paper[i]:+.1f}%'}"
            )
        rows.append(row)
    lines += md_table(["shape", *(f"{name} ({low:g}-{high:g})" for name, low, high in BANDS)], rows)
    return lines


def _render(
    rec: Recommendation,
    combined: Mapping[Config, Mapping[float, Figures]],
    runs: PlanRuns,
    settings: PlanSettings,
    check: PaperCheck,
) -> list[str]:
    slo = rec.objective.uses_slo
    levels = sorted({q for per in combined.values() for q in per})
    best_score = _score(rec.overall_mean_score, slo)
    lines = [
        f"# Which shape for {settings.gpus} GPUs: `ppd-bench plan`",
        "",
        f"Virtual-time cluster simulation, profile {settings.profile}, model {settings.model}; splits "
        f"{', '.join(sorted({c.shape for c in runs.configs}, key=lambda s: (s.endswith('R'), s)))}; modes "
        f"{', '.join(settings.modes)}; mix {_mix(settings)}; QPS {', '.join(f'{q:g}' for q in levels)}; "
        f"{settings.duration_s:g} s of Poisson arrivals per run, seed {settings.seed}; {runs.runs} runs.",
        "",
        "## Recommendation",
        "",
        f"**{rec.overall.label}**: mean score {best_score} over the QPS levels, reaching the success floor "
        f"at {rec.eligible_levels} of {len(levels)} levels.",
        "",
        f"Rule: {rec.objective.describe()}." + ("" if slo else f" Baseline: {rec.baseline.label}."),
        "The overall winner is, among the configs that reach the floor at the most levels, the one with "
        "the highest mean score over the levels.",
        "",
        "## Winner per QPS level",
        "",
    ]
    rows = []
    for w in rec.levels:
        rows.append(
            [
                f"{w.qps:g}",
                w.winner.label + ("" if w.eligible else " (none reaches the success floor)"),
                _score(w.score, slo),
                w.runner_up.label if w.runner_up else "-",
                _score(w.runner_up_score, slo),
                _score(_margin(w.score, w.runner_up_score), slo),
            ]
        )
    lines += md_table(["QPS", "winner", "score", "runner-up", "score", "margin"], rows)
    lines += [
        "A margin of 0 is a tie (two configs that route every request alike predict the same figures); "
        "a tie goes to ppd (it adapts where the traffic moves), then to the config listed first.",
        "",
    ]
    lines += [
        "## Predicted figures per config and QPS",
        "",
        "Means over the successful requests, share-weighted over the mix; success = completed / sent. "
        "Figures: `plan.png` (the figures), `plan_score.png` (the scores).",
        "",
        "![predicted figures](plan.png)",
        "",
        "![scores](plan_score.png)",
        "",
    ]
    rows = []
    for c, per in combined.items():
        for q in sorted(per):
            f = per[q]
            rows.append(
                [
                    c.label,
                    f"{q:g}",
                    ms(f.ttft1_ms),
                    ms(f.ttft2_ms),
                    ms(f.tpot_ms),
                    _pct(f.success),
                    _pct(f.local_share),
                    _score(rec.scores.get(c, {}).get(q), slo),
                ]
            )
    lines += md_table(
        [
            "config",
            "QPS",
            "Turn 1 TTFT ms",
            "Turn 2+ TTFT ms",
            "TPOT ms",
            "success",
            "Turn 2+ local",
            "SLO attainment" if slo else "S",
        ],
        rows,
    )
    lines += ["## Notes", "", *(f"- {n}" for n in runs.notes), ""] if runs.notes else []
    return lines + _paper_lines(check)


def _draw(combined: Mapping[Config, Mapping[float, Figures]], rec: Recommendation, out: Path) -> list[Path]:
    panels = (
        ("ttft1_ms", "Turn 1 TTFT (ms)"),
        ("ttft2_ms", "Turn 2+ TTFT (ms)"),
        ("tpot_ms", "TPOT (ms)"),
        ("success", "success rate"),
    )

    shapes = sorted({c.shape for c in combined})
    modes = list(dict.fromkeys(c.mode for c in combined))
    dashes = ("-", "--", ":", "-.")

    def style(c: Config) -> dict[str, Any]:
        """One colour per shape, one line style per mode."""
        return {
            "color": f"C{shapes.index(c.shape) % 10}",
            "linestyle": dashes[modes.index(c.mode) % len(dashes)],
        }

    def figures_axes(axes: Any) -> None:
        for ax, (name, title) in zip(axes, panels, strict=True):
            for c, per in combined.items():
                qs = sorted(q for q in per if getattr(per[q], name) is not None)
                ax.plot(qs, [getattr(per[q], name) for q in qs], marker="o", ms=3, label=c.label, **style(c))
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("QPS")
        axes[0].legend(fontsize=6)

    def score_axes(axes: Any) -> None:
        ax = axes[0]
        for c, per in rec.scores.items():
            qs = sorted(q for q, s in per.items() if s is not None)
            ax.plot(qs, [per[q] for q in qs], marker="o", ms=3, label=c.label, **style(c))
        ax.set_xlabel("QPS")
        ax.set_ylabel("SLO attainment" if rec.objective.uses_slo else "S against the baseline")
        ax.legend(fontsize=6)

    caption = f"recommended: {rec.overall.label}"
    return [
        save_png(out / "plan.png", "Predicted figures per shape x mode", caption, figures_axes, panels=4),
        save_png(out / "plan_score.png", "Score per shape x mode", rec.objective.describe(), score_axes),
    ]


def write_report(
    rec: Recommendation,
    combined: Mapping[Config, Mapping[float, Figures]],
    runs: PlanRuns,
    settings: PlanSettings,
    out: Path,
) -> Path:
    """``report.md``, the PNGs and ``plan.json`` into ``out``; returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    check = paper_check(runs, settings)
    path = out / REPORT_NAME
    path.write_text("\n".join(_render(rec, combined, runs, settings, check)) + "\n", "utf-8")
    _draw(combined, rec, out)
    doc = _doc(rec, combined, check)
    doc["cells"] = {
        f"{name}@{qps:g}": {c.label: asdict(f) for c, f in per.items()}
        for (name, qps), per in runs.cells.items()
    }
    (out / "plan.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def _doc(
    rec: Recommendation, combined: Mapping[Config, Mapping[float, Figures]], check: PaperCheck
) -> dict[str, Any]:
    def levels(per: Mapping[float, Any]) -> dict[str, Any]:
        return {f"{q:g}": (asdict(v) if isinstance(v, Figures) else v) for q, v in sorted(per.items())}

    return {
        "recommendation": rec.overall.label,
        "rule": rec.objective.describe(),
        "baseline": rec.baseline.label,
        "winners": {f"{w.qps:g}": w.winner.label for w in rec.levels},
        "figures": {c.label: levels(per) for c, per in combined.items()},
        "scores": {c.label: levels(per) for c, per in rec.scores.items()},
        "paper": {
            "winner_shares": check.shares,
            "winner_shares_with_ppd": check.shares_with_ppd,
            "largest_gap_points": check.largest_gap_points,
            "winner_shares_ties_within_1pct": check.shares_near_ties,
            "largest_gap_ties_within_1pct_points": check.largest_gap_near_ties_points,
            "table1": check.bands,
        },
    }
