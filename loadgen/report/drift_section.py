"""The drift experiment's figures and report section (``ppd-bench drift``): from the arms' records,
each arm's Turn 2+ TTFT and TPOT before and after the drift; the closed loop's Turn 2+ TTFT against
the oracle's over the same window (goal: within 10%); the share of traffic-weighted cells where a
table decides as the oracle does (goal: 90%; weights = the post-drift Turn 2 requests of the mix per
cell, cells located by the table builder's own locator); the requests that arrived after the drift
until the closed loop's table got there; the cost of exploration (the closed loop's Turn 2+ TTFT
before the drift minus the stale arm's: same arrivals and the same table, so exploration alone).
``drift.md`` and ``drift.png``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from decision_service.table import Table
from loadgen.report.drift_arms import ArmRun, DriftSettings, decision_match
from loadgen.report.section import md_table, mean, ms, save_png
from table_builder.aggregate import CellKey

__all__ = [
    "MATCH_GOAL",
    "TTFT_GOAL",
    "ArmFigures",
    "DriftFigures",
    "figures",
    "figures_json",
    "goals",
    "write_section",
]

SECTION_NAME: Final = "drift.md"
PNG_NAME: Final = "drift.png"
TTFT_GOAL: Final = 0.10  # closed loop within 10% of the oracle's Turn 2+ TTFT
MATCH_GOAL: Final = 0.90  # decides as the oracle on 90% of traffic-weighted cells
_COLOURS: Final = {"stale": "tab:red", "closed": "tab:green", "oracle": "tab:blue"}


@dataclass(frozen=True, slots=True)
class ArmFigures:
    name: str
    ttft_pre_ms: float | None
    ttft_post_ms: float | None
    tpot_pre_ms: float | None
    tpot_post_ms: float | None
    success_post: float | None
    local_share_post: float | None
    explored: int | None  # Turn 2+ requests marked explored (None: the records do not say)
    match_final: float | None  # the decision match of the table in force at the end


@dataclass(frozen=True, slots=True)
class DriftFigures:
    drift_at: float
    arms: tuple[ArmFigures, ...]
    #: The closed loop's decision match after each swap: (time, requests finished, match).
    closed_matches: tuple[tuple[float, int, float], ...]
    stale_match: float
    converged_at: float | None  # from this swap on every swap is at or above MATCH_GOAL (else the first)
    requests_to_converge: int | None  # requests that arrived after the drift until then
    stayed: bool | None  # and every later swap stayed at or above it
    closed_ttft_ms: float | None  # closed loop Turn 2+ TTFT from converged_at (else from the drift)
    oracle_ttft_ms: float | None  # the oracle's over the same window
    exploration_cost_ms: float | None  # closed minus stale Turn 2+ TTFT before the drift

    def arm(self, name: str) -> ArmFigures | None:
        return next((a for a in self.arms if a.name == name), None)

    @property
    def ttft_gap(self) -> float | None:
        if self.closed_ttft_ms is None or not self.oracle_ttft_ms:
            return None
        return self.closed_ttft_ms / self.oracle_ttft_ms - 1.0


def _turn2(records: Sequence[Mapping[str, Any]], lo: float, hi: float) -> list[Mapping[str, Any]]:
    return [r for r in records if r["turn"] >= 2 and lo <= r["start_time"] < hi]


def _ttft(records: Sequence[Mapping[str, Any]]) -> float | None:
    return mean([float(r["ttft_ms"]) for r in records if r["ok"] and r["ttft_ms"] is not None])


def _tpot(records: Sequence[Mapping[str, Any]]) -> float | None:
    return mean([float(r["tpot_ms"]) for r in records if r["ok"] and r["tpot_ms"] is not None])


def figures(
    runs: Sequence[ArmRun],
    stale: Table,
    oracle: Table | None,
    cells: Mapping[CellKey, int],
    drift_at: float,
) -> DriftFigures:
    inf = float("inf")
    arms = []
    for run in runs:
        pre, post = _turn2(run.records, 0.0, drift_at), _turn2(run.records, drift_at, inf)
        explored = None
        if any("explored" in r for r in run.records):
            explored = sum(1 for r in run.records if r["turn"] >= 2 and r.get("explored"))
        final = run.swaps[-1].table if run.swaps else stale
        arms.append(
            ArmFigures(
                name=run.name,
                ttft_pre_ms=_ttft(pre),
                ttft_post_ms=_ttft(post),
                tpot_pre_ms=_tpot(pre),
                tpot_post_ms=_tpot(post),
                success_post=sum(1 for r in post if r["ok"]) / len(post) if post else None,
                local_share_post=sum(1 for r in post if r["path"] == "local") / len(post) if post else None,
                explored=explored,
                match_final=decision_match(final, oracle, cells) if oracle is not None else None,
            )
        )
    by = {run.name: run for run in runs}
    closed = by.get("closed")
    matches: tuple[tuple[float, int, float], ...] = ()
    converged_at = requests = stayed = None
    if closed is not None and oracle is not None:
        matches = tuple((s.at, s.finished, decision_match(s.table, oracle, cells)) for s in closed.swaps)
        in_force = decision_match(stale, oracle, cells)
        before = [m for m in matches if m[0] < drift_at]
        if before:
            in_force = before[-1][2]
        after = [m for m in matches if m[0] >= drift_at]
        # Converged: from the refresh on which it and every later one match (the settling time; a
        # match it falls back from is a passing one). Already there at the drift when the table in
        # force then matched and no refresh after it falls below.
        converged_at = drift_at if in_force >= MATCH_GOAL else None
        for t, _, m in after:
            if m < MATCH_GOAL:
                converged_at = None
            elif converged_at is None:
                converged_at = t
        first = (
            drift_at if in_force >= MATCH_GOAL else next((t for t, _, m in after if m >= MATCH_GOAL), None)
        )
        if converged_at is not None:
            requests = sum(1 for r in closed.records if drift_at <= r["start_time"] < converged_at)
            stayed = True
        elif first is not None:  # it got there, and fell below again later
            converged_at = first
            requests = sum(1 for r in closed.records if drift_at <= r["start_time"] < first)
            stayed = False
    window_from = converged_at if converged_at is not None else drift_at
    closed_ttft = _ttft(_turn2(closed.records, window_from, inf)) if closed is not None else None
    oracle_run = by.get("oracle")
    oracle_ttft = _ttft(_turn2(oracle_run.records, window_from, inf)) if oracle_run is not None else None
    cost = None
    stale_run = by.get("stale")
    if closed is not None and stale_run is not None:
        a, b = _ttft(_turn2(closed.records, 0.0, drift_at)), _ttft(_turn2(stale_run.records, 0.0, drift_at))
        cost = None if a is None or b is None else a - b
    return DriftFigures(
        drift_at=drift_at,
        arms=tuple(arms),
        closed_matches=matches,
        stale_match=decision_match(stale, oracle, cells) if oracle is not None else 1.0,
        converged_at=converged_at,
        requests_to_converge=requests,
        stayed=stayed,
        closed_ttft_ms=closed_ttft,
        oracle_ttft_ms=oracle_ttft,
        exploration_cost_ms=cost,
    )


# ---------------------------------------------------------------------------------------- the section


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _converged(fig: DriftFigures) -> str:
    if fig.requests_to_converge is None or fig.converged_at is None:
        return "-"
    text = f"{fig.requests_to_converge} requests ({fig.converged_at - fig.drift_at:.1f} s)"
    return text + ("" if fig.stayed else "; fell below again later")


def goals(fig: DriftFigures) -> list[list[str]]:
    marks = {True: "PASS", False: "FAIL", None: "n/a"}
    gap = fig.ttft_gap
    closed = fig.arm("closed")
    final = None if closed is None else closed.match_final
    after = [m for t, _, m in fig.closed_matches if t >= fig.drift_at]
    # Held: it got there after the drift and every later refresh stayed there (a final table that
    # happens to match after falling back is not the goal).
    held = None if closed is None or final is None else bool(fig.stayed) and final >= MATCH_GOAL
    return [
        [
            "closed loop Turn 2+ TTFT within 10% of the oracle's",
            marks[None if gap is None else gap <= TTFT_GOAL],
            "-"
            if gap is None
            else f"{ms(fig.closed_ttft_ms)} vs {ms(fig.oracle_ttft_ms)} ms ({100 * gap:+.1f}%)",
        ],
        [
            "closed loop decides as the oracle on >= 90% of traffic-weighted cells",
            marks[held],
            f"{sum(1 for m in after if m >= MATCH_GOAL)} of {len(after)} refreshes after the drift; "
            f"final table {_pct(final)}; stale table {_pct(fig.stale_match)}",
        ],
        [
            "requests after the drift until it gets there",
            marks[None if closed is None else fig.requests_to_converge is not None and bool(fig.stayed)],
            _converged(fig),
        ],
        [
            "cost of exploration (closed minus stale Turn 2+ TTFT before the drift)",
            "stated",
            "-" if fig.exploration_cost_ms is None else f"{fig.exploration_cost_ms:+.1f} ms",
        ],
    ]


def write_section(
    settings: DriftSettings,
    runs: Sequence[ArmRun],
    fig: DriftFigures,
    out: Path,
    *,
    notes: Sequence[str] = (),
) -> Path:
    """``drift.md`` (a report section) and ``drift.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    n_requests = max((len(r.records) for r in runs), default=0)
    caption = (
        f"virtual-time cluster {settings.shape}, {settings.profile}, seed {settings.seed}; mix "
        f"{'+'.join(settings.workloads)} at {settings.qps:g} QPS for {settings.duration_s:g} s "
        f"({n_requests} requests per arm); drift {'; '.join(settings.drift)}"
    )
    lines = ["## Drift: stale table vs closed loop vs oracle", "", f"What was run: {caption}.", ""]
    lines += [f"- {note}" for note in notes]
    lines += [""] if notes else []
    lines += md_table(["goal", "result", "measured"], goals(fig))
    rows = [
        [
            a.name,
            ms(a.ttft_pre_ms),
            ms(a.ttft_post_ms),
            ms(a.tpot_pre_ms),
            ms(a.tpot_post_ms),
            _pct(a.success_post),
            _pct(a.local_share_post),
            "-" if a.explored is None else str(a.explored),
            _pct(a.match_final),
        ]
        for a in fig.arms
    ]
    header = ["arm", "TTFT2 before (ms)", "TTFT2 after", "TPOT2 before", "TPOT2 after", "success after"]
    lines += md_table([*header, "local after", "explored", "match vs oracle (final table)"], rows)
    if fig.closed_matches:
        lines += ["The closed loop's refreshes (time, requests finished, decision match vs the oracle):", ""]
        lines += md_table(
            ["t (s)", "finished", "match"], [[f"{t:.1f}", str(n), _pct(m)] for t, n, m in fig.closed_matches]
        )
    save_png(
        out / PNG_NAME,
        "Turn 2+ TTFT, TPOT and decisions across a drift",
        caption,
        _drawing(settings, runs, fig),
        panels=3,
    )
    lines += [f"![drift]({PNG_NAME})", ""]
    path = out / SECTION_NAME
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _drawing(settings: DriftSettings, runs: Sequence[ArmRun], fig: DriftFigures) -> Callable[[Any], None]:
    """Per time bucket, each arm's Turn 2+ TTFT and TPOT; each table's decision match over time."""
    drift_at = fig.drift_at
    bucket = float(max(1, round(settings.duration_s / 30)))

    def per_bucket(ax: Any, value: Callable[[Sequence[Mapping[str, Any]]], float | None], label: str) -> None:
        for run in runs:
            xs, ys = [], []
            t = 0.0
            while t < settings.duration_s + bucket:
                y = value(_turn2(run.records, t, t + bucket))
                if y is not None:
                    xs.append(t + bucket / 2)
                    ys.append(y)
                t += bucket
            ax.plot(xs, ys, marker=".", label=run.name, color=_COLOURS.get(run.name))
        ax.axvline(drift_at, color="gray", linestyle="--", label="drift")
        ax.set_xlabel("arrival time (s)")
        ax.set_ylabel(f"{label} per {bucket:g} s (ms)")
        ax.legend(loc="upper left", fontsize=7)

    def draw(axes: Any) -> None:
        per_bucket(axes[0], _ttft, "mean Turn 2+ TTFT")
        per_bucket(axes[1], _tpot, "mean Turn 2+ TPOT")
        ax = axes[2]
        end = settings.duration_s
        ax.step([0.0, end], [fig.stale_match] * 2, where="post", color=_COLOURS["stale"], label="stale")
        if fig.closed_matches:
            ts = [0.0, *[m[0] for m in fig.closed_matches], end]
            first = fig.stale_match  # the table in force before the first refresh
            ms_ = [first, *[m[2] for m in fig.closed_matches], fig.closed_matches[-1][2]]
            ax.step(ts, ms_, where="post", color=_COLOURS["closed"], label="closed loop")
        ax.step(
            [0.0, drift_at, end],
            [fig.stale_match, 1.0, 1.0],
            where="post",
            color=_COLOURS["oracle"],
            label="oracle",
        )
        ax.axhline(MATCH_GOAL, color="black", linewidth=0.5, linestyle=":")
        ax.axvline(drift_at, color="gray", linestyle="--")
        ax.set_ylim(0.0, 1.05)
        ax.set_xlabel("virtual time (s)")
        ax.set_ylabel("decisions as the post-drift oracle (traffic-weighted)")
        ax.legend(loc="lower right", fontsize=7)

    return draw


def figures_json(fig: DriftFigures) -> dict[str, Any]:
    out = dataclasses.asdict(fig)
    out["ttft_gap"] = fig.ttft_gap
    return out
