"""The reproduction report's records, on the virtual-time cluster simulation (``simulator.core.cluster``).

Three experiments, all on the same seeded arrivals so modes are compared on identical traffic:

1. the QPS sweep: every shape x mode (pd, local, ppd) x QPS level, for the chosen workload (plus the
   optional ``stress_qps`` levels on 1P3D, where PD's success rate starts to drop in the simulation);
2. the w_tpot sweep (Figure 6): 1P3D, ``ppd`` with weights (w_ttft=1, w_tpot=w) for each w, plus the
   static PD baseline, at one QPS;
3. the link sweep (Figure 5): 1P3D, ``pd`` and ``ppd`` over each interconnect of the profile, at one QPS;
4. Figure 6 in the paper's own setting: the w_tpot sweep again, on 1P3D at QPS 8 and 16, over the
   prefill-heavy multi-turn ShareGPT conversations (those whose Turn 2+ turns together have more than
   ``balanced_up_to`` (2) input tokens per output token, the decision service's own prefill-heavy
   boundary); the paper used 500 such conversations from ShareGPT and WildChat, the bundled ShareGPT
   has a few hundred. Experiment ``wtpot-paper@<qps>``, one per QPS level.

``ppd`` routes with the decision service's own rule over the table found for the shape in ``tables``
(``simulator.core.routing.TableRouter``); a shape without a table gets no ``ppd`` runs, and the manifest
says so. Records go to ``<out>/<experiment>/<run_id>.jsonl`` (written atomically), the manifest to
``<out>/manifest.json``. The simulator is imported only here, and only when a run is asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from loadgen.report.comparison import MANIFEST_NAME, PAPER_WTPOT_EXPERIMENT, Manifest, RunInfo
from loadgen.sharegpt import SHAREGPT_WORKLOAD, sharegpt_pool
from loadgen.tokens import llama3_counter
from ppd import catalog
from ppd.placement import Placement, PlacementSettings
from table_builder.records import Record, write_records

__all__ = [
    "PAPER_QPS",
    "PREFILL_HEAVY_WORKLOAD",
    "ReproduceSettings",
    "find_table",
    "prefill_heavy_lists",
    "reproduce",
    "run_records",
    "simulate_cluster",
    "turn_lists",
]

if TYPE_CHECKING:
    from simulator.core.cluster import ClusterResult

logger = logging.getLogger(__name__)

PAPER_QPS: Final = (0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0)
#: The workload name its records carry.
PREFILL_HEAVY_WORKLOAD: Final = "sharegpt-prefill-heavy"


@dataclass(frozen=True, slots=True)
class ReproduceSettings:
    seed: int = 0
    duration_s: float = 10.0
    workload: str = SHAREGPT_WORKLOAD
    shapes: tuple[str, ...] = ("1P3D", "2P2D", "3P1D")
    modes: tuple[str, ...] = ("pd", "local", "ppd")
    qps_levels: tuple[float, ...] = PAPER_QPS
    #: Extra QPS levels for ``wtpot_shape`` only, beyond the paper's grid: where PD starts to fail.
    stress_qps: tuple[float, ...] = ()
    tables: Path = Path("tables")
    profile: str = "llama-3.1-8b-h100"
    model: str = "llama-3.1-8b"
    sharegpt_conversations: int = 1000
    # Geometric: the simulated TPOT cost of local prefill is tiny relative to its TTFT gain, so the
    # crossing of the relative-delta score lies far above the paper's 1-6.
    wtpot_values: tuple[float, ...] = (1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0)
    wtpot_qps: float = 4.0
    wtpot_shape: str = "1P3D"
    #: Figure 6 in the paper's setting: w_tpot values (empty: not run), QPS levels, seconds per point,
    #: and how many ShareGPT conversations are scanned for prefill-heavy ones (the whole pool by default).
    paper_wtpot_values: tuple[float, ...] = (1.0, 3.0, 6.0, 12.0, 24.0)
    paper_wtpot_qps: tuple[float, ...] = (8.0, 16.0)
    paper_wtpot_duration_s: float = 30.0
    paper_wtpot_scan: int = 100_000
    links: tuple[str, ...] = ("nvlink", "ib_ndr", "ib_hdr", "100gbe")
    link_qps: float = 1.0
    link_duration_s: float = 60.0
    #: The placement section's shared-prefix workloads (``loadgen.report.placement``): one whose groups
    #: are few and reused (P idle at the table's levels), one with many prompts (P busy from QPS 8).
    placement_shared_workloads: tuple[str, ...] = (
        "shared2048_8x16_small_mid_bal",
        "shared4096_64x4_small_small_bal",
    )


def find_table(tables: Path, shape: str, model: str) -> Path | None:
    """The table file under ``tables`` whose key is ``<shape>/<model>`` (None when there is none)."""
    from decision_service.table import Table, TableError

    wanted = f"{shape}/{model}"
    candidates = sorted(tables.rglob("*.ppdt"), key=lambda p: (len(p.parts), p)) if tables.is_dir() else []
    for path in candidates:  # shallowest first: tables/X wins over tables/example/X
        try:
            table = Table.open(path)
        except (TableError, OSError) as exc:
            logger.warning("skipping %s: %s", path, exc)
            continue
        try:
            if table.key == wanted:
                return path
        finally:
            table.close()
    return None


def turn_lists(settings: ReproduceSettings) -> list[list[tuple[int, int]]]:
    if settings.workload == SHAREGPT_WORKLOAD:
        pool = sharegpt_pool(llama3_counter(), seed=settings.seed, count=settings.sharegpt_conversations)
        return [
            [(t.n_in, t.n_out) for t in pool.conversation(i).turns] for i in range(len(pool.conversations))
        ]
    workload = catalog.parse_workload(settings.workload)
    return [[(workload.first.n_in, workload.first.n_out), (workload.second.n_in, workload.second.n_out)]]


def prefill_heavy_lists(settings: ReproduceSettings) -> list[list[tuple[int, int]]]:
    """The (n_in, n_out) turns of every prefill-heavy multi-turn ShareGPT conversation in the seeded pool.

    Prefill-heavy as the decision service classifies a turn (``paper_axes``): the conversation's Turn 2+
    turns together have more than ``balanced_up_to`` input tokens per output token.
    """
    from decision_service.axes import paper_axes

    ratio = paper_axes().classifier.balanced_up_to
    pool = sharegpt_pool(llama3_counter(), seed=settings.seed, count=settings.paper_wtpot_scan)
    out = []
    for i in range(len(pool.conversations)):
        turns = [(t.n_in, t.n_out) for t in pool.conversation(i).turns]
        later = turns[1:]
        if later and sum(n_in for n_in, _ in later) > ratio * sum(n_out for _, n_out in later):
            out.append(turns)
    return out


@dataclass(frozen=True, slots=True)
class _Run:
    experiment: str
    run_id: str
    shape: str
    mode: str
    qps: float
    duration_s: float
    link: str = "nvlink"
    w_tpot: float | None = None
    table: Path | None = None
    workload: str | None = None  # None: the settings' workload


def _plan(settings: ReproduceSettings, tables: dict[str, Path | None]) -> list[_Run]:
    runs: list[_Run] = []
    for shape in settings.shapes:
        for mode in settings.modes:
            if mode == "ppd" and tables.get(shape) is None:
                continue
            levels = settings.qps_levels + (settings.stress_qps if shape == settings.wtpot_shape else ())
            table = tables.get(shape)
            runs += [
                _Run("qps", f"qps-{shape}-{mode}-{q:g}", shape, mode, q, settings.duration_s, table=table)
                for q in levels
            ]
    shape = settings.wtpot_shape
    if settings.wtpot_values and tables.get(shape) is not None:
        runs.append(_Run("wtpot", "wtpot-pd", shape, "pd", settings.wtpot_qps, settings.duration_s))
        runs += [
            _Run("wtpot", f"wtpot-{w:g}", shape, "ppd", settings.wtpot_qps, settings.duration_s, w_tpot=w,
                 table=tables[shape])
            for w in settings.wtpot_values
        ]  # fmt: skip
    if settings.paper_wtpot_values and tables.get(shape) is not None:
        for q in settings.paper_wtpot_qps:
            experiment, duration = f"{PAPER_WTPOT_EXPERIMENT}@{q:g}", settings.paper_wtpot_duration_s
            runs.append(
                _Run(
                    experiment, f"{experiment}-pd", shape, "pd", q, duration, workload=PREFILL_HEAVY_WORKLOAD
                )
            )
            runs += [
                _Run(
                    experiment,
                    f"{experiment}-{w:g}",
                    shape,
                    "ppd",
                    q,
                    duration,
                    w_tpot=w,
                    table=tables[shape],
                    workload=PREFILL_HEAVY_WORKLOAD,
                )
                for w in settings.paper_wtpot_values
            ]
    for link in settings.links:
        for mode in ("pd", "ppd"):
            if mode == "ppd" and tables.get(shape) is None:
                continue
            run_id = f"link-{link}-{mode}"
            table = tables.get(shape)
            runs.append(
                _Run(
                    "bandwidth",
                    run_id,
                    shape,
                    mode,
                    settings.link_qps,
                    settings.link_duration_s,
                    link,
                    table=table,
                )
            )
    return runs


def _simulate(
    run: _Run, settings: ReproduceSettings, lists: Sequence[Sequence[tuple[int, int]]]
) -> list[Record]:
    result = simulate_cluster(
        lists,
        shape=run.shape,
        mode=run.mode,
        qps=run.qps,
        duration_s=run.duration_s,
        workload=run.workload or settings.workload,
        seed=settings.seed,
        run_id=run.run_id,
        profile=settings.profile,
        model=settings.model,
        table=run.table,
        weights=None if run.w_tpot is None else (1.0, run.w_tpot),
        link=run.link,
    )
    return run_records(result)


def run_records(result: ClusterResult) -> list[Record]:
    """A virtual-time run's records, as the reports read them (``simulate_cluster``'s result)."""
    return [Record.from_dict(r) for r in result.records]


def simulate_cluster(
    lists: Sequence[Sequence[tuple[int, int]]],
    *,
    shape: str,
    mode: str,
    qps: float,
    duration_s: float,
    workload: str,
    seed: int,
    run_id: str,
    profile: str,
    model: str,
    table: Path | None = None,
    weights: tuple[float, float] | None = None,
    link: str = "nvlink",
    placement: Placement = "least_loaded",
) -> ClusterResult:
    """One run on the virtual-time cluster, the reports' one simulation driver (``ppd-bench report
    --run``, ``ppd-bench plan``): Poisson arrivals of conversations with the given turn lists (cycled),
    ``shape`` in ``mode`` (``ppd`` routed by ``table`` with ``weights`` = (w_ttft, w_tpot), the table's
    own weights when None), legs placed by ``placement`` (ppd/placement.py); the cluster's result
    (records as dicts, ``run_records`` reads them; P's prefix-cache hits per request, the legs
    placement moved, each engine's busy time). A shared-prefix ``workload``
    (``shared<L>_<G>x<C>_<turn1>_<class>``) makes its own two-turn conversations, each group's behind
    its shared prompt; ``lists`` is not used then."""
    from decision_service.table import Weights
    from simulator.core.cluster import ClusterConfig, simulate
    from simulator.core.profile import load_profile
    from simulator.core.routing import TableRouter
    from simulator.core.topology import Topology
    from simulator.core.workload import shared_prefix_conversations, turn_list_conversations

    if catalog.is_shared_prefix(workload):
        conversations = shared_prefix_conversations(workload, qps, duration_s, seed)
    else:
        conversations = turn_list_conversations(lists, qps, duration_s, workload=workload, seed=seed)
    router = None
    if mode == "ppd" and table is not None:
        router = TableRouter.open(str(table), None if weights is None else Weights(*weights))
    config = ClusterConfig(
        topology=Topology.parse(shape),
        mode=mode,
        link=link,
        target_qps=qps,
        run_id=run_id,
        model=model,
        placement=PlacementSettings(placement),
    )
    return simulate(load_profile(profile), config, conversations, router)


def _link_gb_s(profile: str, link: str) -> float:
    from simulator.core.profile import load_profile

    return float(load_profile(profile).link(link).bandwidth_bytes_per_s) / 1e9


def reproduce(settings: ReproduceSettings, out: Path, *, progress: bool = False) -> Manifest:
    """Run the three experiments into ``out``; returns the manifest it wrote."""
    tables = {
        shape: find_table(settings.tables, shape, settings.model)
        for shape in {*settings.shapes, settings.wtpot_shape}
    }
    notes = [
        f"Workload {settings.workload}; {settings.duration_s:g} s of Poisson arrivals per point "
        f"({settings.link_duration_s:g} s for the link sweep); 30 s request timeout; "
        f"profile {settings.profile}. w_tpot weighs relative deltas as in the paper; on this workload a "
        "local append-prefill costs little TPOT, so the crossing lies far above the paper's 1-6 (on "
        "prefill-heavy conversations it comes within them: Figure 6 in the paper's setting).",
    ]
    for shape, path in sorted(tables.items()):
        notes.append(
            f"{shape}: " + (f"ppd routes with {path}." if path else "no table found, so no ppd runs.")
        )
    lists = turn_lists(settings)
    plan = _plan(settings, tables)
    heavy = prefill_heavy_lists(settings) if any(r.workload == PREFILL_HEAVY_WORKLOAD for r in plan) else []
    if heavy:
        notes.append(
            f"Figure 6 in the paper's setting: {len(heavy)} prefill-heavy multi-turn ShareGPT conversations "
            f"(seed {settings.seed}), {settings.paper_wtpot_duration_s:g} s of arrivals per point."
        )
    runs: dict[str, RunInfo] = {}
    from tqdm import tqdm

    with tqdm(total=len(plan), unit="run", desc="simulating", disable=not progress) as bar:
        for run in plan:
            records = _simulate(run, settings, heavy if run.workload == PREFILL_HEAVY_WORKLOAD else lists)
            write_records(out / run.experiment / f"{run.run_id}.jsonl", records)
            if run.experiment == "wtpot" or run.experiment.startswith(PAPER_WTPOT_EXPERIMENT):
                runs[run.run_id] = RunInfo(experiment=run.experiment, w_tpot=run.w_tpot)
            elif run.experiment == "bandwidth":
                runs[run.run_id] = RunInfo(
                    experiment="bandwidth", link_gb_s=_link_gb_s(settings.profile, run.link), link=run.link
                )
            bar.update(1)
    manifest = Manifest(
        engine=f"virtual-time cluster simulation (simulator.core.cluster, {settings.profile})",
        seed=settings.seed,
        notes=" ".join(notes),
        runs=runs,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    return manifest
