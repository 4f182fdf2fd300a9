"""``ppd-bench bidir``: local vs PD vs vLLM's bidirectional path, per cell, on the virtual-time simulator.

Issue 17, item 4: the per-metric winners (the paper's Table 3) and the QPS sweep (its Table 1) with a
third path. One grid point = one static mode (``pd``, ``local``, ``bidir``) of one synthetic two-turn
workload (``ppd.catalog``: its Turn 1 fixes the context, its Turn-2 class the new and output tokens) at
one QPS level over one link preset, all modes of a cell on the same arrivals (common random numbers).

Rule 1: a cell's figures per mode are over its Turn 2 requests: mean TTFT and TPOT of the successful
        ones, the success rate of all sent, the sample count (what a table cell holds).
Rule 2: the routed arms are per-cell picks from these figures with the decision rule's score against
        PD (decision_service/route.py, relative deltas), S = w_ttft * (TTFT_pd - TTFT_x) / TTFT_pd -
        w_tpot * (TPOT_x - TPOT_pd) / TPOT_pd: ``ppd2`` picks among pd and
        local (the two-way table), ``ppd3`` among pd, local and bidir (the three-way one). A mode whose
        success rate is below ``min_success`` is not allowed; PD (S = 0) wins ties. These are in-sample
        picks, the answers of a table built from the very same runs, not a separate routed run.
Rule 2b: the routed arms run too: per link, a table is built from that link's static records (the table
        builder with its defaults, ``min_samples`` 1), and every cell runs again in mode ``ppd`` routed
        by it (``TableRouter`` with the same weights): ``ppd2 routed`` without the bidir capability,
        ``ppd3 routed`` with it (``ClusterConfig.ppd_bidir``). Same arrivals as the static runs.
Rule 3: a metric's winner in a cell is the mode with the lowest mean; its margin is how much lower it is
        than the best of the other two modes, relative to that (a cell missing a mode has no winner).
The module stays whole (about 460 lines): the figures, the rendering, the runs and the command share one
grid's settings and cells, in the order the section needs them, as ``slo.py`` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from loadgen.arguments import positive, positive_list
from loadgen.report.paper import BANDS
from loadgen.report.section import add_experiment_parser, md_table, mean, ms, print_section, progress_printer
from ppd.catalog import TURN2_CLASSES, parse_workload
from table_builder.records import Record, write_records

__all__ = [
    "MODES",
    "BidirSettings",
    "Cell",
    "ModeFigures",
    "add_parser",
    "arm_figures",
    "cell_of",
    "figures",
    "pick",
    "render",
    "run_bidir",
    "run_point",
    "score",
    "winners",
]

SECTION_NAME: Final = "bidir.md"
MODES: Final = ("pd", "local", "bidir")
ARMS: Final = (*MODES, "ppd2", "ppd3")
#: The arms routed by a table built from the static runs (rule 2b): name -> whether BIDIR is offered.
ROUTED: Final = {"ppd2 routed": False, "ppd3 routed": True}
_TWO_WAY: Final = ("pd", "local")


@dataclass(frozen=True, slots=True)
class BidirSettings:
    shape: str = "1P3D"
    workloads: tuple[str, ...] = (
        "small_tiny", "small_mid_bal", "small_mid_paste", "small_huge_paste", "small_long_gen",
        "large_tiny", "large_mid_bal", "large_mid_paste", "large_huge_paste", "large_long_gen",
    )  # fmt: skip
    qps: tuple[float, ...] = (1.0, 4.0, 8.0, 16.0)
    links: tuple[str, ...] = ("nvlink", "100gbe")
    duration_s: float = 10.0
    seed: int = 0
    w_ttft: float = 1.0
    w_tpot: float = 1.0
    min_success: float = 0.95
    profile: str = "llama-3.1-8b-h100"
    model: str = "llama-3.1-8b"
    timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class ModeFigures:
    ttft_ms: float | None
    tpot_ms: float | None
    success: float
    samples: int


@dataclass(frozen=True, slots=True)
class Cell:
    workload: str
    qps: float
    link: str
    modes: Mapping[str, ModeFigures]

    @property
    def context(self) -> str:
        return parse_workload(self.workload).turn1

    @property
    def turn2(self) -> str:
        return parse_workload(self.workload).turn2

    @property
    def band(self) -> str:
        return next((name for name, low, high in BANDS if low <= self.qps <= high), "other")


# ---------------------------------------------------------------------------------------- pure figures


def figures(records: Iterable[Record]) -> ModeFigures:
    """Rule 1 over one mode's records of a cell."""
    later = [r for r in records if r.turn >= 2]
    ok = [r for r in later if r.ok]
    return ModeFigures(
        ttft_ms=mean([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        tpot_ms=mean([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        success=len(ok) / len(later) if later else 0.0,
        samples=len(ok),
    )


def cell_of(workload: str, qps: float, link: str, by_mode: Mapping[str, Iterable[Record]]) -> Cell:
    return Cell(workload, qps, link, {mode: figures(records) for mode, records in by_mode.items()})


def score(cell: Cell, mode: str, settings: BidirSettings) -> float | None:
    """Rule 2's S of ``mode`` against PD in ``cell``; None when either lacks a figure or ``mode`` fails."""
    pd, x = cell.modes.get("pd"), cell.modes.get(mode)
    if pd is None or x is None or x.success < settings.min_success:
        return None
    pd_ttft, pd_tpot, x_ttft, x_tpot = pd.ttft_ms, pd.tpot_ms, x.ttft_ms, x.tpot_ms
    if not pd_ttft or not pd_tpot or x_ttft is None or x_tpot is None:
        return None
    return settings.w_ttft * (pd_ttft - x_ttft) / pd_ttft - settings.w_tpot * (x_tpot - pd_tpot) / pd_tpot


def pick(cell: Cell, allowed: Sequence[str], settings: BidirSettings) -> str:
    """Rule 2: the allowed mode with the highest S (PD, at 0, wins ties)."""
    best, best_s = "pd", 0.0
    for mode in allowed:
        s = score(cell, mode, settings)
        if s is not None and s > best_s:
            best, best_s = mode, s
    return best


def arm_figures(cell: Cell, arm: str, settings: BidirSettings) -> ModeFigures | None:
    if arm == "ppd2":
        return cell.modes.get(pick(cell, _TWO_WAY, settings))
    if arm == "ppd3":
        return cell.modes.get(pick(cell, MODES, settings))
    return cell.modes.get(arm)


def winners(cells: Sequence[Cell], metric: str, key: Callable[[Cell], str]) -> dict[str, dict[str, Any]]:
    """Rule 3 per class value of ``key``: cells won per mode and each mode's median margin (%)."""
    won: dict[str, Counter[str]] = defaultdict(Counter)
    margins: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for cell in cells:
        values = {m: getattr(cell.modes[m], metric) for m in MODES if m in cell.modes}
        if len(values) < len(MODES) or any(v is None for v in values.values()):
            continue
        best = min(MODES, key=lambda m: (values[m], MODES.index(m)))
        runner_up = min(values[m] for m in MODES if m != best)
        won[key(cell)][best] += 1
        if runner_up > 0:
            margins[key(cell)][best].append(100.0 * (runner_up - values[best]) / runner_up)
    return {
        group: {
            mode: (
                won[group][mode],
                statistics.median(margins[group][mode]) if margins[group][mode] else None,
            )
            for mode in MODES
        }
        for group in sorted(won)
    }


# ---------------------------------------------------------------------------------------- rendering


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def _change(value: float | None, base: float | None) -> str:
    return "-" if value is None or base is None or base == 0 else _pct(100.0 * (value - base) / base)


def _winner_rows(table: Mapping[str, Mapping[str, Any]], label: str) -> list[list[str]]:
    rows = []
    for group, per_mode in table.items():
        row = [f"{label} {group}"]
        for mode in MODES:
            count, margin = per_mode[mode]
            row.append(f"{count} ({'-' if margin is None else f'{margin:.1f}%'})")
        rows.append(row)
    return rows


def _class_keys() -> list[tuple[str, Callable[[Cell], str]]]:
    """The cell classes the winners are counted by (Turn-2 classes sort by name; the label gives tokens)."""
    return [
        ("context", lambda c: c.context),
        (
            "turn 2",
            lambda c: f"{c.turn2} ({TURN2_CLASSES[c.turn2].n_in} in / {TURN2_CLASSES[c.turn2].n_out} out)",
        ),
        ("QPS", lambda c: f"{c.qps:g}"),
        ("link", lambda c: c.link),
    ]


def _arm_mean(cells: Sequence[Cell], arm: str, metric: str, settings: BidirSettings) -> float | None:
    values = []
    for cell in cells:
        fig = arm_figures(cell, arm, settings)
        value = getattr(fig, metric) if fig is not None else None
        if value is not None:
            values.append(float(value))
    return mean(values)


def render(cells: Sequence[Cell], settings: BidirSettings) -> list[str]:
    """The section's Markdown lines."""
    lines = [
        "## Three paths for Turn 2+: local, PD and vLLM's bidirectional mode",
        "",
        f"Virtual-time simulator, shape {settings.shape}, profile {settings.profile}, seed {settings.seed}, "
        f"{settings.duration_s:g} s of arrivals per point; {len(cells)} cells (workload x QPS x link: "
        f"{len(settings.workloads)} x {len(settings.qps)} x {len(settings.links)}). Turn 2 figures. "
        f"`ppd2` / `ppd3`: the per-cell pick of a two-way (pd, local) / three-way (pd, local, bidir) table "
        f"built from these same runs, S with w_ttft={settings.w_ttft:g}, w_tpot={settings.w_tpot:g}, modes "
        f"below {100 * settings.min_success:.0f}% success not allowed (in-sample: the table's own answers).",
        "",
        "### Per-metric winners (the paper's Table 3, three ways)",
        "",
        "Cells won per mode (median margin over the best other mode).",
        "",
    ]
    for metric, title in (("ttft_ms", "Mean Turn 2 TTFT"), ("tpot_ms", "Mean Turn 2 TPOT")):
        rows: list[list[str]] = []
        for label, key in _class_keys():
            rows += _winner_rows(winners(cells, metric, key), label)
        lines += [f"**{title}**", "", *md_table(["cell class", *MODES], rows)]
    lines += ["### Turn 2 TTFT across QPS (the paper's Table 1, with bidir and three-way PPD)", ""]
    rows = []
    for link in settings.links:
        for band, _, _ in BANDS:
            group = [c for c in cells if c.link == link and c.band == band]
            if not group:
                continue
            base = _arm_mean(group, "pd", "ttft_ms", settings)
            row = [link, band, ms(base)]
            for arm in (*ARMS[1:], *ROUTED):
                value = _arm_mean(group, arm, "ttft_ms", settings)
                row.append(f"{ms(value)} ({_change(value, base)})")
            tpot = [_arm_mean(group, arm, "tpot_ms", settings) for arm in ("pd", *ROUTED)]
            row.append(" / ".join(ms(v) for v in tpot))
            rows.append(row)
    header = [
        "link", "QPS band", "pd TTFT ms", *(f"{a} (vs pd)" for a in (*ARMS[1:], *ROUTED)),
        "TPOT pd / ppd2 routed / ppd3 routed",
    ]  # fmt: skip
    lines += md_table(header, rows)
    lines += ["### Where three-way routing beats the best two-way table", ""]
    gains = []
    for cell in cells:
        two, three = pick(cell, _TWO_WAY, settings), pick(cell, MODES, settings)
        if three != two:
            s2, s3 = score(cell, two, settings) or 0.0, score(cell, three, settings) or 0.0
            gains.append((s3 - s2, cell, two, three))
    if not gains:
        lines += [
            f"On this cost model the three-way table never picks bidir over the best of pd and local in "
            f"any of the {len(cells)} cells: its answers are the two-way table's.",
            "",
        ]
    else:
        gains.sort(key=lambda g: -g[0])
        lines += [
            f"The three-way table picks bidir in {len(gains)} of {len(cells)} cells "
            f"(mean S gain {statistics.fmean(g[0] for g in gains):.2f} over the two-way pick). Largest:",
            "",
        ]
        rows = [
            [cell.workload, f"{cell.qps:g}", cell.link, two, three, f"{gain:.2f}"]
            for gain, cell, two, three in gains[:15]
        ]
        lines += md_table(["workload", "QPS", "link", "two-way pick", "three-way pick", "S gain"], rows)
    return lines


# ---------------------------------------------------------------------------------------- the runs


def _conversations(workload: str, qps: float, settings: BidirSettings) -> list[Any]:
    from simulator.core.workload import turn_list_conversations

    w = parse_workload(workload)
    seed = zlib.crc32(f"{settings.seed}/{workload}/{qps:g}".encode())
    turns = [[(w.first.n_in, w.first.n_out), (w.second.n_in, w.second.n_out)]]
    return turn_list_conversations(turns, qps, settings.duration_s, workload=workload, seed=seed)


def run_point(
    workload: str, qps: float, link: str, mode: str, settings: BidirSettings, *, router: Any = None
) -> list[Record]:
    """One static mode, or (``router`` given) ``ppd`` routed three ways when ``mode`` is ppd3."""
    from simulator.core.cluster import ClusterConfig, simulate
    from simulator.core.profile import load_profile
    from simulator.core.topology import Topology

    config = ClusterConfig(
        topology=Topology.parse(settings.shape),
        mode="ppd" if router is not None else mode,
        link=link,
        timeout_s=settings.timeout_s,
        target_qps=qps,
        run_id=f"bidir-{link}-{mode.replace(' ', '-')}-{workload}-{qps:g}",
        model=settings.model,
        ppd_bidir=ROUTED.get(mode, False),
    )
    conversations = _conversations(workload, qps, settings)
    result = simulate(load_profile(settings.profile), config, conversations, router)
    return [Record.from_dict(r) for r in result.records]


def run_bidir(
    settings: BidirSettings, out: Path, *, progress: Callable[[str], None]
) -> tuple[list[Cell], Path]:
    """Every point of the grid, its records under ``out/records``, the section (``bidir.md``) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    cells: list[Cell] = []
    total = len(settings.links) * len(settings.workloads) * len(settings.qps)
    for link in settings.links:
        runs: dict[tuple[str, float], dict[str, list[Record]]] = {}
        for workload in settings.workloads:
            for qps in settings.qps:
                by_mode = runs.setdefault((workload, qps), {})
                for mode in MODES:
                    by_mode[mode] = _keep(
                        out, (link, mode, workload, qps), run_point(workload, qps, link, mode, settings)
                    )
                progress(f"bidir: {link} {workload} {qps:g} QPS, static runs")
        table = _table(
            out, link, [r for by_mode in runs.values() for rs in by_mode.values() for r in rs], settings
        )
        try:
            for (workload, qps), by_mode in runs.items():
                for arm in ROUTED:
                    router = _router(table, settings)
                    records = run_point(workload, qps, link, arm, settings, router=router)
                    by_mode[arm] = _keep(out, (link, arm, workload, qps), records)
                cells.append(cell_of(workload, qps, link, by_mode))
                progress(f"bidir: {len(cells)}/{total} cells ({link} {workload} {qps:g} QPS)")
        finally:
            table.close()
    figures_json = [{**asdict(c), "modes": {m: asdict(f) for m, f in c.modes.items()}} for c in cells]
    (out / "bidir.json").write_text(
        json.dumps({"settings": asdict(settings), "cells": figures_json}, indent=1)
    )
    path = out / SECTION_NAME
    path.write_text("\n".join(render(cells, settings)) + "\n", "utf-8")
    return cells, path


def _keep(out: Path, point: tuple[str, str, str, float], records: list[Record]) -> list[Record]:
    """Write one point's records (``point``: link, mode, workload, QPS) under ``out/records``."""
    link, mode, workload, qps = point
    folder = out / "records" / link / mode.replace(" ", "-")
    folder.mkdir(parents=True, exist_ok=True)
    write_records(folder / f"{workload}_{qps:g}.jsonl", records)
    return records


def _table(out: Path, link: str, records: Sequence[Record], settings: BidirSettings) -> Any:
    """Rule 2b: the table of one link's static runs, written to ``out/tables/<link>.ppdt`` and opened."""
    from decision_service.table import Table, write_table
    from table_builder.build import BuildOptions, build_from_records, default_header

    options = BuildOptions(
        header=default_header(settings.shape, settings.model),
        min_samples=1,
        labels={"engine": "sim", "link": link, "seed": str(settings.seed)},
    )
    result = build_from_records(records, options)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    return Table.open(write_table(out / "tables" / f"{link}.ppdt", result.spec))


def _router(table: Any, settings: BidirSettings) -> Any:
    from decision_service.table import Weights
    from simulator.core.routing import TableRouter

    return TableRouter(table, Weights(settings.w_ttft, settings.w_tpot))


# ---------------------------------------------------------------------------------------- the command


def _command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    del environ
    d = BidirSettings()
    workloads = (
        tuple(x.strip() for x in args.workloads.split(",") if x.strip()) if args.workloads else d.workloads
    )
    for name in workloads:
        parse_workload(name)
    settings = BidirSettings(
        shape=args.shape,
        workloads=workloads,
        qps=args.qps,
        links=tuple(x.strip() for x in args.links.split(",") if x.strip()),
        duration_s=args.duration,
        seed=args.seed,
        w_ttft=args.w_ttft,
        w_tpot=args.w_tpot,
    )
    _, path = run_bidir(settings, args.out, progress=progress_printer(args.no_progress))
    print_section("bidir", path)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``bidir`` subcommand of ``ppd-bench``."""
    d = BidirSettings()
    parser = add_experiment_parser(
        sub,
        "bidir",
        help="local vs PD vs vLLM's bidirectional path per cell, three-way vs two-way PPD (simulator)",
        description="Runs static pd, local and bidir for each workload x QPS x link point on the "
        "virtual-time cluster (same arrivals for the three) and writes bidir.md (per-metric winners by "
        "context, Turn-2 tokens, QPS and link; Turn 2 TTFT across QPS bands with two-way and three-way PPD; "
        "the cells where three-way beats two-way), bidir.json and the records into --out.",
        shape=d.shape,
        seed=d.seed,
    )
    parser.add_argument("--workloads", default=None, help=f"comma list (default {','.join(d.workloads)})")
    parser.add_argument(
        "--qps",
        type=positive_list,
        default=d.qps,
        help=f"QPS levels (default {','.join(f'{q:g}' for q in d.qps)})",
    )
    parser.add_argument(
        "--links", default=",".join(d.links), help=f"link presets (default {','.join(d.links)})"
    )
    parser.add_argument(
        "--duration",
        type=positive,
        default=d.duration_s,
        help=f"seconds per point (default {d.duration_s:g})",
    )
    parser.add_argument("--w-ttft", type=positive, default=d.w_ttft, help="w_ttft of S (default 1)")
    parser.add_argument("--w-tpot", type=positive, default=d.w_tpot, help="w_tpot of S (default 1)")
    parser.set_defaults(handler=_command)
