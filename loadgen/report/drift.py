"""``ppd-bench drift``: does the table follow the deployment when the hardware drifts? (issue 14, item 4)

One seeded workload, a mix of synthetic two-turn workloads arriving as one Poisson process at one QPS,
runs on the virtual-time cluster (``simulator.core.cluster``) with drift events (``simulator.core.drift``,
e.g. ``100:decode=2``: from 100 s the decode workers take twice as long per step). Three arms see the
very same arrivals and the same drift:

- ``stale``: the table built before the drift (by default the shipped table of the shape), all along;
- ``closed``: the closed loop. An exploration share epsilon of Turn 2+ requests takes the other path
  (``ppd.explore`` through ``ClusterConfig.explore``), and every ``refresh_every`` finished requests
  the table is refreshed from the run's own records (``table_builder.refresh.refresh_table`` on the
  stale table as base, the last ``window`` records as evidence) and swapped into the router
  (``TableRouter.use_table``), in virtual time;
- ``oracle``: the stale table until the drift, then a table built with the sweep machinery
  (``table_builder.sweep.run_sweep`` + ``build_from_records`` on ``SimEngine(drift=...)`` with the
  events moved to 0 s) on the post-drift cluster; only the cells the mix visits (its workloads at its
  QPS, pd and local), with the stale table's engine settings (point duration, seed, timeout), so the
  two tables differ by the drift alone. The sweep folder is resumable (``<out>/oracle-sweep``).

Figures (``DriftFigures``): each arm's Turn 2+ TTFT and TPOT before and after the drift; the closed
loop's Turn 2+ TTFT against the oracle's over the same window (goal: within 10%); the share of
traffic-weighted cells where a table decides as the oracle does (goal: 90%; weights = the post-drift
Turn 2 requests of the mix per cell, cells located by the table builder's own locator); the requests
that arrived after the drift until the closed loop's table got there; the cost of exploration (the
closed loop's Turn 2+ TTFT before the drift minus the stale arm's, same arrivals and same table).

``ppd.explore`` and ``table_builder.refresh`` land from their own branches; until they are in the tree,
``closed`` reports that it cannot run (``ClosedLoopUnavailableError``) and the other two arms still do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from decision_service.route import Router
from decision_service.table import Table, encode_table, write_table
from loadgen.report.reproduce import find_table
from loadgen.report.section import md_table, mean, ms, save_png
from loadgen.report.traffic import mix_conversations
from ppd import catalog
from table_builder.aggregate import CellKey
from table_builder.build import (
    BuildOptions,
    axes_locator,
    build_from_records,
    default_header,
    table_file_name,
)
from table_builder.records import Record, read_records, write_records

__all__ = [
    "ARMS",
    "ClosedLoopUnavailableError",
    "DriftFigures",
    "DriftSettings",
    "RefreshLoop",
    "TableSwap",
    "add_parser",
    "cluster_config",
    "decision_match",
    "run_drift",
    "traffic_cells",
]

logger = logging.getLogger(__name__)

ARMS: Final = ("stale", "closed", "oracle")
SECTION_NAME: Final = "drift.md"
PNG_NAME: Final = "drift.png"
TTFT_GOAL: Final = 0.10  # closed loop within 10% of the oracle's Turn 2+ TTFT
MATCH_GOAL: Final = 0.90  # decides as the oracle on 90% of traffic-weighted cells
_COLOURS: Final = {"stale": "tab:red", "closed": "tab:green", "oracle": "tab:blue"}


class ClosedLoopUnavailableError(RuntimeError):
    """The closed-loop arm needs ``ppd.explore`` and ``table_builder.refresh``, which are not installed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DriftSettings:
    shape: str = "3P1D"
    model: str = "llama-3.1-8b"
    profile: str = "llama-3.1-8b-h100"
    #: The synthetic two-turn workloads of the mix, taken in turn by successive conversations.
    workloads: tuple[str, ...] = ("small_huge_paste", "small_big_paste", "small_mid_paste", "small_mid_bal")
    qps: float = 8.0
    duration_s: float = 300.0
    #: Drift events in ``simulator.core.drift``'s text form; the earliest one is "the drift".
    drift: tuple[str, ...] = ("100:decode=2",)
    seed: int = 0
    tables: Path = Path("tables")
    #: The stale table; default: the table of (shape, model) under ``tables``.
    stale_table: Path | None = None
    #: Seconds of arrivals per oracle sweep point; default: the stale table's own (its provenance).
    oracle_duration_s: float | None = None
    timeout_s: float = 30.0
    arms: tuple[str, ...] = ARMS
    # The closed loop.
    epsilon: float = 0.1
    explore_seed: int = 0
    refresh_every: int = 100
    #: Records a refresh reads: the last ``window`` finished (0 = all since the start).
    window: int = 1600
    min_samples: int = 20
    confidence: float = 0.95

    @property
    def drift_at(self) -> float:
        from simulator.core.drift import parse_drift

        return min(parse_drift(text).at_s for text in self.drift)


# ---------------------------------------------------------------------------------------- the loop


@dataclass(frozen=True, slots=True)
class TableSwap:
    """The router got ``table`` at virtual time ``at`` (after ``finished`` requests had finished)."""

    at: float
    finished: int
    table: Table


#: base table, evidence records -> the refreshed table.
Refresh = Callable[[Table, Sequence[Record]], Table]


class TableUser(Protocol):
    """What the loop swaps a table into (``simulator.core.routing.TableRouter``)."""

    def use_table(self, table: Table) -> None: ...


class RefreshLoop:
    """The closed loop's refresh, as a record observer of the cluster: every ``every`` finished requests
    the table is refreshed from the last ``window`` records (0 = all) on ``base`` and swapped into the
    router. ``swaps`` keeps each table with its time, for the figures."""

    def __init__(
        self, router: TableUser, base: Table, refresh: Refresh, *, every: int, window: int = 0
    ) -> None:
        if every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {every}")
        self._router = router
        self._base = base
        self._refresh = refresh
        self._every = every
        self._window = window
        self.records: list[Record] = []
        self.swaps: list[TableSwap] = []

    def finished(self, record: dict[str, Any], now: float) -> None:
        self.records.append(Record.from_dict(record))
        if len(self.records) % self._every:
            return
        evidence = self.records[-self._window :] if self._window else self.records
        table = self._refresh(self._base, evidence)
        self._router.use_table(table)
        self.swaps.append(TableSwap(now, len(self.records), table))


class SwitchAt:
    """The oracle arm's switch: the router gets ``table`` with the first request finished at or after
    ``at`` (requests finish many times a second, so within one step of the drift)."""

    def __init__(self, router: TableUser, table: Table, at: float) -> None:
        self._router, self._table, self._at = router, table, at
        self.swaps: list[TableSwap] = []

    def finished(self, record: dict[str, Any], now: float) -> None:
        del record
        if not self.swaps and now >= self._at:
            self._router.use_table(self._table)
            self.swaps.append(TableSwap(now, 0, self._table))


def refresh_with_module(*, min_samples: int, confidence: float) -> Refresh:
    """``table_builder.refresh.refresh_table`` as a :data:`Refresh` (ClosedLoopUnavailableError if absent)."""
    try:
        from table_builder import refresh as module  # type: ignore[attr-defined,unused-ignore]
    except ImportError as exc:
        raise ClosedLoopUnavailableError(
            f"the closed loop needs table_builder.refresh (issue 14 item 2): {exc}"
        ) from None

    def refresh(base: Table, records: Sequence[Record]) -> Table:
        result = module.refresh_table(base, records, min_samples=min_samples, confidence=confidence)
        return Table.from_bytes(encode_table(result.spec))

    return refresh


def explore_settings(*, epsilon: float, seed: int) -> Any:
    """``ppd.explore.ExploreSettings`` (ClosedLoopUnavailableError when the module is absent)."""
    try:
        from ppd import explore as module  # type: ignore[attr-defined,unused-ignore]
    except ImportError as exc:
        raise ClosedLoopUnavailableError(
            f"the closed loop needs ppd.explore (issue 14 item 1): {exc}"
        ) from None
    return module.ExploreSettings(epsilon=epsilon, seed=seed)


# ---------------------------------------------------------------------------------------- traffic


def traffic_cells(table: Table, conversations: Sequence[Any], qps: float, since: float) -> Counter[CellKey]:
    """Turn 2+ requests per cell of ``table``'s axes, of the conversations started at or after ``since``."""
    locate = axes_locator(table.header.axes)
    cells: Counter[CellKey] = Counter()
    for conv in conversations:
        if conv.start < since:
            continue
        n_ctx = 0
        for k, turn in enumerate(conv.turns):
            if k:
                cells[
                    locate(n_ctx=n_ctx, n_in=turn.n_in, n_out=turn.n_out, qps=qps, workload=conv.workload)
                ] += 1
            n_ctx += turn.n_in + turn.n_out
    return cells


def decision_match(table: Table, oracle: Table, cells: Mapping[CellKey, int]) -> float:
    """Share of the traffic (``cells``: requests per cell) where ``table`` decides as ``oracle`` does
    (default weights, no live signals)."""
    total = sum(cells.values())
    if not total:
        return 1.0
    mine, theirs = Router(table), Router(oracle)
    same = sum(
        n
        for key, n in cells.items()
        if mine.cell(key.context, key.workload, key.qps).verdict.local
        == theirs.cell(key.context, key.workload, key.qps).verdict.local
    )
    return same / total


# ---------------------------------------------------------------------------------------- the arms


@dataclass(slots=True)
class ArmRun:
    name: str
    records: list[dict[str, Any]]
    swaps: list[TableSwap] = field(default_factory=list)


def cluster_config(settings: DriftSettings, run_id: str, **extra: Any) -> Any:
    """The arms' ``ClusterConfig``: mode ppd with the drift; ``extra`` adds e.g. ``explore``."""
    from simulator.core.cluster import ClusterConfig
    from simulator.core.drift import parse_drift
    from simulator.core.topology import Topology

    return ClusterConfig(
        topology=Topology.parse(settings.shape),
        mode="ppd",
        timeout_s=settings.timeout_s,
        target_qps=settings.qps,
        run_id=run_id,
        model=settings.model,
        drift=tuple(parse_drift(text) for text in settings.drift),
        **extra,
    )


def run_arm(
    name: str,
    settings: DriftSettings,
    conversations: Sequence[Any],
    stale: Table,
    *,
    oracle: Table | None = None,
    refresh: Refresh | None = None,
) -> ArmRun:
    """One arm on the virtual-time cluster (the closed loop with ``refresh`` and exploration)."""
    from simulator.core.cluster import simulate
    from simulator.core.profile import load_profile
    from simulator.core.routing import TableRouter

    router = TableRouter(stale)
    profile = load_profile(settings.profile)
    run_id = f"drift-{name}"
    if name == "stale":
        result = simulate(profile, cluster_config(settings, run_id), conversations, router)
        return ArmRun(name, result.records)
    if name == "oracle":
        if oracle is None:
            raise ValueError("the oracle arm needs the oracle table")
        switch = SwitchAt(router, oracle, settings.drift_at)
        result = simulate(profile, cluster_config(settings, run_id), conversations, router, switch)
        return ArmRun(name, result.records, switch.swaps)
    if name == "closed":
        if refresh is None:
            refresh = refresh_with_module(min_samples=settings.min_samples, confidence=settings.confidence)
        explore = explore_settings(epsilon=settings.epsilon, seed=settings.explore_seed)
        loop = RefreshLoop(router, stale, refresh, every=settings.refresh_every, window=settings.window)
        config = cluster_config(settings, run_id, explore=explore)
        result = simulate(profile, config, conversations, router, loop)
        return ArmRun(name, result.records, loop.swaps)
    raise ValueError(f"unknown arm {name!r}; known: {', '.join(ARMS)}")


def build_oracle(
    settings: DriftSettings, stale: Table, out: Path, *, progress: Callable[[str], None] | None = None
) -> Table:
    """The post-drift table from the sweep machinery, on the cells the mix visits (resumable in ``out``)."""
    from simulator.core.drift import parse_drift
    from simulator.tools.sweep_engine import SimEngine
    from table_builder.sweep import GridPoint, SweepPlan, run_sweep

    labels = stale.header.provenance.get("labels", {})
    duration = settings.oracle_duration_s or float(labels.get("duration_s", 10.0))
    at_zero = tuple(
        _event_text(dataclasses.replace(parse_drift(text), at_s=0.0)) for text in sorted(settings.drift)
    )
    engine = SimEngine(
        duration_s=duration,
        seed=int(labels.get("seed", 0)),
        profile=settings.profile,
        link=str(labels.get("link", "nvlink")),
        timeout_s=float(labels.get("timeout_s", settings.timeout_s)),
        drift=at_zero,
    )
    workloads = tuple(catalog.parse_workload(name) for name in dict.fromkeys(settings.workloads))
    plan = SweepPlan((settings.shape,), settings.model, ("pd", "local"), workloads, (settings.qps,))
    done = [0]

    def advance(point: GridPoint) -> None:
        done[0] += 1
        if progress is not None:
            progress(f"oracle sweep {done[0]}/{len(plan.points())}: {point.run_id}")

    files = run_sweep(plan, engine, out, advance=advance)
    header = dataclasses.replace(default_header(settings.shape, settings.model), axes=stale.header.axes)
    options = BuildOptions(
        header=header,
        min_samples=1,
        labels={"engine": engine.name, **{k: str(v) for k, v in sorted(engine.settings().items())}},
    )
    result = build_from_records(read_records(files[settings.shape]), options)
    path = write_table(out / table_file_name(settings.shape, settings.model), result.spec)
    return Table.open(path)


def _event_text(event: Any) -> str:
    parts = [
        f"{k}={getattr(event, k):g}" for k in ("link", "decode", "prefill") if getattr(event, k) is not None
    ]
    return f"{event.at_s:g}:" + ",".join(parts)


# ---------------------------------------------------------------------------------------- figures


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
    converged_at: float | None  # first swap after the drift at or above MATCH_GOAL
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
        if in_force >= MATCH_GOAL:
            converged_at = drift_at
        else:
            converged_at = next((t for t, _, m in after if m >= MATCH_GOAL), None)
        if converged_at is not None:
            requests = sum(1 for r in closed.records if drift_at <= r["start_time"] < converged_at)
            stayed = all(m >= MATCH_GOAL for t, _, m in after if t >= converged_at)
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


def _goals(fig: DriftFigures) -> list[list[str]]:
    marks = {True: "PASS", False: "FAIL", None: "n/a"}
    gap = fig.ttft_gap
    closed = fig.arm("closed")
    final = None if closed is None else closed.match_final
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
            marks[None if final is None else final >= MATCH_GOAL],
            f"final table {_pct(final)}; stale table {_pct(fig.stale_match)}",
        ],
        [
            "requests after the drift until it gets there",
            marks[None if closed is None else fig.requests_to_converge is not None],
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
    lines += md_table(["goal", "result", "measured"], _goals(fig))
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


# ---------------------------------------------------------------------------------------- the run


def run_drift(
    settings: DriftSettings,
    out: Path,
    *,
    progress: Callable[[str], None] | None = None,
    refresh: Refresh | None = None,
) -> tuple[DriftFigures, Path]:
    """Run the arms into ``out`` (records per arm, the oracle's sweep and table) and write the section."""
    say = progress or (lambda _line: None)
    for arm in settings.arms:
        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    stale_path = settings.stale_table or find_table(settings.tables, settings.shape, settings.model)
    if stale_path is None:
        raise FileNotFoundError(f"no table {settings.shape}/{settings.model} under {settings.tables}")
    stale = Table.open(stale_path)
    notes = [f"stale table: {stale_path} (version {stale.version})"]
    oracle = None
    if "oracle" in settings.arms or "closed" in settings.arms:
        oracle = build_oracle(settings, stale, out / "oracle-sweep", progress=say)
        notes.append(
            f"oracle table: {oracle.path} (version {oracle.version}), swept in {out / 'oracle-sweep'}"
        )
    conversations = mix_conversations(settings.workloads, settings.qps, settings.duration_s, settings.seed)
    cells = traffic_cells(stale, conversations, settings.qps, settings.drift_at)
    runs = []
    for arm in settings.arms:
        say(f"arm {arm}: {len(conversations)} conversations on {settings.shape} ...")
        try:
            run = run_arm(arm, settings, conversations, stale, oracle=oracle, refresh=refresh)
        except ClosedLoopUnavailableError as exc:
            say(f"arm {arm}: skipped ({exc})")
            notes.append(f"arm {arm} not run: {exc}")
            continue
        write_records(out / "records" / f"{arm}.jsonl", [Record.from_dict(r) for r in run.records])
        runs.append(run)
    if "closed" in settings.arms:
        notes.append(
            f"closed loop: epsilon {settings.epsilon:g}, a refresh every {settings.refresh_every} finished "
            f"requests from the last {settings.window or 'all'} records, min samples {settings.min_samples}, "
            f"confidence {settings.confidence:g}"
        )
    fig = figures(runs, stale, oracle, cells, settings.drift_at)
    path = write_section(settings, runs, fig, out, notes=notes)
    (out / "drift.json").write_text(json.dumps(_figures_json(fig), indent=2) + "\n", encoding="utf-8")
    return fig, path


def _figures_json(fig: DriftFigures) -> dict[str, Any]:
    out = dataclasses.asdict(fig)
    out["ttft_gap"] = fig.ttft_gap
    return out


# ---------------------------------------------------------------------------------------- the command


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _events(text: str) -> tuple[str, ...]:
    from simulator.core.drift import DriftError, parse_drift

    events = tuple(x.strip() for x in text.split(";") if x.strip())
    try:
        for event in events:
            parse_drift(event)
    except DriftError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not events:
        raise argparse.ArgumentTypeError("at least one drift event")
    return events


def _workloads(text: str) -> tuple[str, ...]:
    names = _names(text)
    try:
        for name in names:
            catalog.parse_workload(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not names:
        raise argparse.ArgumentTypeError("at least one workload")
    return names


def _arms(text: str) -> tuple[str, ...]:
    arms = _names(text)
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(f"arms are {', '.join(ARMS)}; got {text!r}")
    return arms


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    import sys

    del environ
    defaults = DriftSettings()
    settings = DriftSettings(
        shape=args.shape,
        model=args.model,
        workloads=args.workloads or defaults.workloads,
        qps=args.qps,
        duration_s=args.duration,
        drift=args.drift or defaults.drift,
        seed=args.seed,
        tables=args.tables,
        stale_table=args.stale_table,
        oracle_duration_s=args.oracle_duration,
        arms=args.arms,
        epsilon=args.epsilon,
        explore_seed=args.explore_seed,
        refresh_every=args.refresh_every,
        window=args.window,
        min_samples=args.min_samples,
        confidence=args.confidence,
    )
    if settings.drift_at >= settings.duration_s:
        logger.error(
            "the drift (%g s) comes after the end of the run (%g s)", settings.drift_at, settings.duration_s
        )
        return 2

    def say(line: str) -> None:
        if not args.no_progress:
            print(line, file=sys.stderr, flush=True)

    fig, path = run_drift(settings, args.out, progress=say)
    print(f"drift section: {path}")
    for row in _goals(fig):
        print("| " + " | ".join(row) + " |")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``drift`` subcommand of ``ppd-bench``."""
    d = DriftSettings()
    parser = sub.add_parser(
        "drift",
        help="stale table vs closed loop vs oracle across a hardware drift, on the virtual-time simulator",
        description="Runs one seeded mix of synthetic two-turn workloads through the virtual-time cluster "
        "with drift events, three times on the same arrivals: the stale table (built before the drift), "
        "the closed loop (exploration + a table refreshed from the run's own records every K requests), "
        "and an oracle table built by the sweep on the post-drift cluster (only the cells the mix visits). "
        "Writes drift.md (a report section), drift.png, drift.json and each arm's records into --out.",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the section, figures and records")
    parser.add_argument("--shape", default=d.shape, help=f"deployment shape (default {d.shape})")
    parser.add_argument("--model", default=d.model, help=f"model label of the tables (default {d.model})")
    parser.add_argument(
        "--workloads", type=_workloads, default=None,
        help=f"comma-separated synthetic workloads of the mix (default {','.join(d.workloads)})",
    )  # fmt: skip
    parser.add_argument(
        "--qps", type=_positive, default=d.qps, help=f"conversations per second (default {d.qps:g})"
    )
    parser.add_argument(
        "--duration",
        type=_positive,
        default=d.duration_s,
        help=f"seconds of arrivals (default {d.duration_s:g})",
    )
    parser.add_argument(
        "--drift", type=_events, default=None,
        help="drift events AT:KEY=FACTOR[,...] separated by ';', keys link (bandwidth factor), decode and "
        f"prefill (step-time factors) (default {';'.join(d.drift)})",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the arrivals (default 0)")
    parser.add_argument(
        "--tables", type=Path, default=d.tables, help="where the stale table is found (default tables/)"
    )
    parser.add_argument(
        "--stale-table", type=Path, default=None, help="the stale table file (default: from --tables)"
    )
    parser.add_argument(
        "--oracle-duration", type=_positive, default=None,
        help="seconds of arrivals per oracle sweep point (default: the stale table's, per its provenance)",
    )  # fmt: skip
    parser.add_argument(
        "--arms", type=_arms, default=d.arms, help="arms to run (default stale,closed,oracle)"
    )
    loop = parser.add_argument_group("closed loop")
    loop.add_argument(
        "--epsilon", type=float, default=d.epsilon, help=f"exploration share (default {d.epsilon:g})"
    )
    loop.add_argument("--explore-seed", type=int, default=d.explore_seed, help="seed of the exploration draw")
    loop.add_argument(
        "--refresh-every", type=int, default=d.refresh_every,
        help=f"finished requests between refreshes (default {d.refresh_every})",
    )  # fmt: skip
    loop.add_argument(
        "--window",
        type=int,
        default=d.window,
        help=f"records a refresh reads, the latest (default {d.window}; 0 = all)",
    )
    loop.add_argument(
        "--min-samples",
        type=int,
        default=d.min_samples,
        help=f"refresh: no flip below (default {d.min_samples})",
    )
    loop.add_argument(
        "--confidence",
        type=float,
        default=d.confidence,
        help=f"refresh: drift bound (default {d.confidence:g})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(handler=_command)
