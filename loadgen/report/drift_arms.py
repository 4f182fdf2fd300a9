"""The drift experiment's arms (``ppd-bench drift``, issue 14 item 4): its settings, the closed loop's
refresh, the oracle's sweep, and the traffic-weighted decision match.

Three arms see the very same arrivals and the same drift (``simulator.core.drift``, e.g.
``100:decode=2``: from 100 s the decode workers take twice as long per step):

- ``stale``: the table built before the drift (by default the shipped table of the shape), all along;
- ``closed``: the closed loop. An exploration share epsilon of Turn 2+ requests takes the other path
  (``ppd.explore`` through ``ClusterConfig.explore``; the records carry ``explored`` and
  ``propensity``), and every ``refresh_every`` finished requests the table is refreshed from the run's
  own records and swapped into the router (``TableRouter.use_table``), in virtual time. Each refresh is
  ``table_builder.refresh.refresh_table`` on the *stale* (offline) table as base with the last
  ``window`` records as evidence, never on the previous refreshed table: that one already holds
  those records, and merging them again would count them twice;
- ``oracle``: the stale table until the drift, then a table built with the sweep machinery
  (``table_builder.sweep.run_sweep`` + ``build_from_records`` on ``SimEngine(drift=...)`` with the
  events moved to 0 s) on the post-drift cluster; only the cells the mix visits (its workloads at its
  QPS, pd and local), with the stale table's engine settings (point duration, seed, timeout), so the
  two tables differ by the drift alone. The sweep folder is resumable (``<out>/oracle-sweep``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from decision_service.route import Router
from decision_service.table import Table, encode_table, write_table
from ppd import catalog
from ppd.explore import ExploreSettings
from table_builder.aggregate import CellKey
from table_builder.build import (
    BuildOptions,
    axes_locator,
    build_from_records,
    default_header,
    table_file_name,
)
from table_builder.records import Record, read_records
from table_builder.refresh import refresh_table

__all__ = [
    "ARMS",
    "ArmRun",
    "DriftSettings",
    "Refresh",
    "RefreshLoop",
    "SwitchAt",
    "TableSwap",
    "TableUser",
    "build_oracle",
    "cluster_config",
    "decision_match",
    "post_drift_events",
    "refresh_from_base",
    "run_arm",
    "traffic_cells",
]

ARMS: Final = ("stale", "closed", "oracle")


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
    #: Refresh rule 7 (``refresh_table(replace_drifted=...)``): a path whose logged figures drifted
    #: beyond the bound takes them alone instead of merging with the base's pre-drift figures.
    replace_drifted: bool = True
    #: Refresh rule 8 (``refresh_table(interference=...)``): a cell's local TPOT from the decode
    #: interference its LOCAL turns cause to every request on the worker, fitted on the logs.
    interference: bool = True

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


def refresh_from_base(
    *, min_samples: int, confidence: float, replace_drifted: bool = False, interference: bool = False
) -> Refresh:
    """``table_builder.refresh.refresh_table`` as a :data:`Refresh`: the base is always the offline
    table the loop was given, the evidence the latest records (see the module docstring)."""

    def refresh(base: Table, records: Sequence[Record]) -> Table:
        result = refresh_table(
            base,
            records,
            min_samples=min_samples,
            confidence=confidence,
            replace_drifted=replace_drifted,
            interference=interference,
        )
        return Table.from_bytes(encode_table(result.spec))

    return refresh


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
            refresh = refresh_from_base(
                min_samples=settings.min_samples,
                confidence=settings.confidence,
                replace_drifted=settings.replace_drifted,
                interference=settings.interference,
            )
        explore = ExploreSettings(epsilon=settings.epsilon, seed=settings.explore_seed)
        loop = RefreshLoop(router, stale, refresh, every=settings.refresh_every, window=settings.window)
        config = cluster_config(settings, run_id, explore=explore)
        result = simulate(profile, config, conversations, router, loop)
        return ArmRun(name, result.records, loop.swaps)
    raise ValueError(f"unknown arm {name!r}; known: {', '.join(ARMS)}")


def build_oracle(
    settings: DriftSettings, stale: Table, out: Path, *, progress: Callable[[str], None] | None = None
) -> Table:
    """The post-drift table from the sweep machinery, on the cells the mix visits (resumable in ``out``)."""
    from simulator.tools.sweep_engine import SimEngine
    from table_builder.sweep import GridPoint, SweepPlan, run_sweep

    labels = stale.header.provenance.get("labels", {})
    duration = settings.oracle_duration_s or float(labels.get("duration_s", 10.0))
    at_zero = post_drift_events(settings.drift)
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


def post_drift_events(drift: Sequence[str]) -> tuple[str, ...]:
    """The drift events moved to time 0, in the order they happen: the cluster after every event, from
    the start (what the oracle's sweep measures; a later event's factors win, as in the run)."""
    from simulator.core.drift import parse_drift

    return tuple(
        _event_text(dataclasses.replace(parse_drift(text), at_s=0.0))
        for text in sorted(drift, key=lambda t: parse_drift(t).at_s)
    )


def _exact(value: float) -> str:
    """The shortest text that reads back as ``value`` (``2``, ``0.123456789``), never rounded."""
    text = repr(float(value))
    return text.removesuffix(".0")


def _event_text(event: Any) -> str:
    parts = [
        f"{k}={_exact(getattr(event, k))}"
        for k in ("link", "decode", "prefill")
        if getattr(event, k) is not None
    ]
    return f"{event.at_s:g}:" + ",".join(parts)
