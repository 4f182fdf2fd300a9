"""The shape advisor's runs: every P:D split of the GPUs x mode x workload of the mix x QPS level, on the
virtual-time cluster, through the reports' one simulation driver (``reproduce.simulate_cluster``).

Rule 1: the splits of N GPUs are ``kP(N-k)D`` for k = 1..N-1 (at least one of each), plus ``NR`` (every
        GPU a replica, mode ``replica``) when asked. ``ppd`` runs only on a shape with a table in
        ``tables`` (``reproduce.find_table``); the others get the static modes only, and the notes say so.
Rule 2: the mix's workloads: a synthetic two-turn workload of ``ppd.catalog``, ``sharegpt`` (seeded
        multi-turn ShareGPT conversations), or a request log of ours (the benchmark record schema the
        gateway's ``request_log`` writes): its conversations' turn sizes (new input and output tokens,
        turn by turn) replayed as the mix's ``request-log`` workload.
Rule 3: one run = one workload at one QPS level on one config. All configs of a (workload, QPS) cell run
        on the same arrivals (common random numbers), seeded by (seed, workload, QPS), so a run's figures
        depend only on its own settings: ``--jobs`` changes how fast, never what.
Rule 4: runs go to ``jobs`` worker processes in a fixed order; each returns only its figures
        (``recommend.figures``), collected in that order.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from loadgen.plan.recommend import Config, Figures, Objective, combine, figures
from loadgen.report.reproduce import find_table, run_records, simulate_cluster
from loadgen.sharegpt import SHAREGPT_WORKLOAD, sharegpt_pool
from loadgen.tokens import llama3_counter
from ppd import catalog
from table_builder.records import Record

__all__ = [
    "REQUEST_LOG_WORKLOAD",
    "Component",
    "Plan",
    "PlanRuns",
    "PlanSettings",
    "component",
    "log_component",
    "make_plan",
    "run_plan",
    "splits",
]

#: The workload name of a request log's conversations in the mix.
REQUEST_LOG_WORKLOAD: Final = "request-log"
TurnLists = tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True, slots=True)
class Component:
    """One workload of the mix: its name, its share, the turn sizes of its conversations (cycled)."""

    name: str
    share: float
    lists: TurnLists


def component(name: str, share: float, *, seed: int, conversations: int) -> Component:
    """Rule 2 for a catalog workload or ``sharegpt`` (``conversations`` seeded ShareGPT ones).

    Raises ``ValueError`` (from ``ppd.catalog``) for an unknown name.
    """
    if name == SHAREGPT_WORKLOAD:
        pool = sharegpt_pool(llama3_counter(), seed=seed, count=conversations)
        lists = tuple(
            tuple((t.n_in, t.n_out) for t in pool.conversation(i).turns)
            for i in range(len(pool.conversations))
        )
        return Component(name, share, lists)
    w = catalog.parse_workload(name)
    return Component(name, share, (((w.first.n_in, w.first.n_out), (w.second.n_in, w.second.n_out)),))


def log_component(records: Sequence[Record], share: float) -> Component:
    """Rule 2 for a request log: each conversation's turns 1, 2, ... in order, up to the first turn the
    log lacks. Raises ``ValueError`` when no conversation starts at Turn 1."""
    turns: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
    for r in records:
        turns[r.conversation_id].setdefault(r.turn, (r.n_in, r.n_out))
    lists = []
    for conversation in sorted(turns):
        by_turn = turns[conversation]
        sizes = []
        k = 1
        while k in by_turn:
            sizes.append(by_turn[k])
            k += 1
        if sizes:
            lists.append(tuple(sizes))
    if not lists:
        raise ValueError("the request log holds no conversation that starts at Turn 1")
    return Component(REQUEST_LOG_WORKLOAD, share, tuple(lists))


def splits(gpus: int, *, replica: bool = False) -> list[str]:
    """Rule 1's shapes, fewest prefill workers first."""
    if gpus < 2:
        raise ValueError(f"{gpus} GPUs cannot be split: P/D needs at least one prefill and one decode GPU")
    return [f"{p}P{gpus - p}D" for p in range(1, gpus)] + ([f"{gpus}R"] if replica else [])


@dataclass(frozen=True, slots=True)
class PlanSettings:
    gpus: int
    components: tuple[Component, ...]
    qps: tuple[float, ...]
    objective: Objective
    modes: tuple[str, ...] = ("pd", "local", "ppd")
    replica: bool = False
    duration_s: float = 10.0
    seed: int = 0
    jobs: int = 1
    tables: Path = Path("tables")
    profile: str = "llama-3.1-8b-h100"
    model: str = "llama-3.1-8b"


@dataclass(frozen=True, slots=True)
class _Task:
    component: Component
    config: Config
    qps: float
    table: Path | None
    settings: PlanSettings


@dataclass(frozen=True, slots=True)
class PlanRuns:
    """What the runs gave: per (workload, QPS) cell each config's figures, the configs in order, notes."""

    cells: Mapping[tuple[str, float], Mapping[Config, Figures]]
    configs: tuple[Config, ...]
    notes: tuple[str, ...]
    runs: int

    def combined(self, shares: Mapping[str, float]) -> dict[Config, dict[float, Figures]]:
        """Each config's figures per QPS level, share-weighted over the mix (``recommend.combine``)."""
        parts: dict[Config, dict[float, list[tuple[float, Figures]]]] = {c: {} for c in self.configs}
        for (name, qps), per in self.cells.items():
            for c, fig in per.items():
                parts[c].setdefault(qps, []).append((shares[name], fig))
        return {c: {q: combine(p) for q, p in sorted(per.items())} for c, per in parts.items()}


def _seed(seed: int, workload: str, qps: float) -> int:
    return zlib.crc32(f"{seed}/{workload}/{qps:g}".encode())


def _run(task: _Task) -> Figures:
    s, c = task.settings, task.config
    result = simulate_cluster(
        task.component.lists,
        shape=c.shape,
        mode=c.mode,
        qps=task.qps,
        duration_s=s.duration_s,
        workload=task.component.name,
        seed=_seed(s.seed, task.component.name, task.qps),
        run_id=f"plan-{c.shape}-{c.mode}-{task.component.name}-{task.qps:g}",
        profile=s.profile,
        model=s.model,
        table=task.table,
        weights=None if s.objective.uses_slo else (s.objective.w_ttft, s.objective.w_tpot),
    )
    return figures(run_records(result), s.objective)


@dataclass(frozen=True, slots=True)
class Plan:
    """What will run (rule 1): the configs in order, the table each shape's ppd routes with, the notes."""

    configs: tuple[Config, ...]
    tables: Mapping[str, Path | None]
    notes: tuple[str, ...]


def make_plan(settings: PlanSettings) -> Plan:
    """Rule 1: the configs of ``settings`` (tables looked up once, for ``ppd``)."""
    shapes = splits(settings.gpus, replica=settings.replica)
    tables = (
        {s: find_table(settings.tables, s, settings.model) for s in shapes if not s.endswith("R")}
        if "ppd" in settings.modes
        else {}
    )
    configs: list[Config] = []
    notes: list[str] = []
    for shape in shapes:
        if shape.endswith("R"):
            configs.append(Config(shape, "replica"))
            continue
        configs += [Config(shape, m) for m in settings.modes if m != "ppd" or tables.get(shape) is not None]
        if "ppd" in settings.modes:
            path = tables.get(shape)
            notes.append(
                f"{shape}: ppd routes with {path}."
                if path
                else f"{shape}: no table for {shape}/{settings.model} in {settings.tables}, "
                "so pd and local only."
            )
    return Plan(configs=tuple(configs), tables=tables, notes=tuple(notes))


def run_plan(settings: PlanSettings, plan: Plan, *, progress: bool = False) -> PlanRuns:
    """Every run of ``plan`` (rule 3), in ``settings.jobs`` processes with a progress bar."""
    from tqdm import tqdm

    tables, configs = plan.tables, plan.configs
    tasks = [
        _Task(comp, c, q, tables.get(c.shape) if c.mode == "ppd" else None, settings)
        for comp in settings.components
        for q in settings.qps
        for c in configs
    ]
    cells: dict[tuple[str, float], dict[Config, Figures]] = {}
    with tqdm(total=len(tasks), unit="run", desc="simulating", disable=not progress) as bar:
        if settings.jobs <= 1:
            results = (_run(t) for t in tasks)
            for task, fig in zip(tasks, results, strict=True):
                cells.setdefault((task.component.name, task.qps), {})[task.config] = fig
                bar.update(1)
        else:
            chunk = max(1, math.ceil(len(tasks) / (settings.jobs * 16)))
            with ProcessPoolExecutor(max_workers=settings.jobs) as pool:
                for task, fig in zip(tasks, pool.map(_run, tasks, chunksize=chunk), strict=True):
                    cells.setdefault((task.component.name, task.qps), {})[task.config] = fig
                    bar.update(1)
    return PlanRuns(cells=cells, configs=configs, notes=plan.notes, runs=len(tasks))
