"""``ppd-bench drift``: does the table follow the deployment when the hardware drifts? (issue 14, item 4)

One seeded workload, a mix of synthetic two-turn workloads arriving as one Poisson process at one QPS,
runs on the virtual-time cluster (``simulator.core.cluster``) with drift events, three times on the
same arrivals: the stale table, the closed loop and the oracle (``drift_arms``); then the figures and
the section (``drift_section``). This module runs them in order and is the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from decision_service.table import Table
from loadgen.arguments import at_least, names, open_unit, positive, share
from loadgen.report.drift_arms import (
    ARMS,
    DriftSettings,
    Refresh,
    build_oracle,
    run_arm,
    traffic_cells,
)
from loadgen.report.drift_section import DriftFigures, figures, figures_json, goals, write_section
from loadgen.report.reproduce import find_table
from loadgen.report.section import add_experiment_parser, print_section, progress_printer
from loadgen.report.traffic import mix_conversations
from ppd import catalog
from table_builder.records import Record, write_records

__all__ = ["add_parser", "run_drift"]

logger = logging.getLogger(__name__)


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
        run = run_arm(arm, settings, conversations, stale, oracle=oracle, refresh=refresh)
        write_records(out / "records" / f"{arm}.jsonl", [Record.from_dict(r) for r in run.records])
        runs.append(run)
    if "closed" in settings.arms:
        notes.append(
            f"closed loop: epsilon {settings.epsilon:g}, a refresh every {settings.refresh_every} finished "
            f"requests from the last {settings.window or 'all'} records, min samples {settings.min_samples}, "
            f"confidence {settings.confidence:g}"
            + (", drifted paths replaced by the logs" if settings.replace_drifted else "")
            + (", local TPOT from the fitted decode interference (rule 8)" if settings.interference else "")
        )
    fig = figures(runs, stale, oracle, cells, settings.drift_at)
    path = write_section(settings, runs, fig, out, notes=notes)
    (out / "drift.json").write_text(json.dumps(figures_json(fig), indent=2) + "\n", encoding="utf-8")
    return fig, path


# ---------------------------------------------------------------------------------------- the command


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
    chosen = names(text)
    try:
        for name in chosen:
            catalog.parse_workload(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not chosen:
        raise argparse.ArgumentTypeError("at least one workload")
    return chosen


def _arms(text: str) -> tuple[str, ...]:
    arms = names(text)
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(f"arms are {', '.join(ARMS)}; got {text!r}")
    return arms


def _command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:

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
        replace_drifted=args.replace_drifted,
        interference=args.interference,
    )
    if settings.drift_at >= settings.duration_s:
        logger.error(
            "the drift (%g s) comes after the end of the run (%g s)", settings.drift_at, settings.duration_s
        )
        return 2

    fig, path = run_drift(settings, args.out, progress=progress_printer(args.no_progress))
    print_section("drift", path, goals(fig))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``drift`` subcommand of ``ppd-bench``."""
    d = DriftSettings()
    parser = add_experiment_parser(
        sub,
        "drift",
        help="stale table vs closed loop vs oracle across a hardware drift, on the virtual-time simulator",
        description="Runs one seeded mix of synthetic two-turn workloads through the virtual-time cluster "
        "with drift events, three times on the same arrivals: the stale table (built before the drift), "
        "the closed loop (exploration + a table refreshed from the run's own records every K requests), "
        "and an oracle table built by the sweep on the post-drift cluster (only the cells the mix visits). "
        "Writes drift.md (a report section), drift.png, drift.json and each arm's records into --out.",
        shape=d.shape,
        seed=d.seed,
    )
    parser.add_argument("--model", default=d.model, help=f"model label of the tables (default {d.model})")
    parser.add_argument(
        "--workloads", type=_workloads, default=None,
        help=f"comma-separated synthetic workloads of the mix (default {','.join(d.workloads)})",
    )  # fmt: skip
    parser.add_argument(
        "--qps", type=positive, default=d.qps, help=f"conversations per second (default {d.qps:g})"
    )
    parser.add_argument(
        "--duration",
        type=positive,
        default=d.duration_s,
        help=f"seconds of arrivals (default {d.duration_s:g})",
    )
    parser.add_argument(
        "--drift", type=_events, default=None,
        help="drift events AT:KEY=FACTOR[,...] separated by ';', keys link (bandwidth factor), decode and "
        f"prefill (step-time factors) (default {';'.join(d.drift)})",
    )  # fmt: skip
    parser.add_argument(
        "--tables", type=Path, default=d.tables, help="where the stale table is found (default tables/)"
    )
    parser.add_argument(
        "--stale-table", type=Path, default=None, help="the stale table file (default: from --tables)"
    )
    parser.add_argument(
        "--oracle-duration", type=positive, default=None,
        help="seconds of arrivals per oracle sweep point (default: the stale table's, per its provenance)",
    )  # fmt: skip
    parser.add_argument(
        "--arms", type=_arms, default=d.arms, help="arms to run (default stale,closed,oracle)"
    )
    loop = parser.add_argument_group("closed loop")
    loop.add_argument(
        "--epsilon", type=share, default=d.epsilon, help=f"exploration share (default {d.epsilon:g})"
    )
    loop.add_argument(
        "--explore-seed", type=at_least(0), default=d.explore_seed, help="seed of the exploration draw"
    )
    loop.add_argument(
        "--refresh-every", type=at_least(1), default=d.refresh_every,
        help=f"finished requests between refreshes (default {d.refresh_every})",
    )  # fmt: skip
    loop.add_argument(
        "--window",
        type=at_least(0),
        default=d.window,
        help=f"records a refresh reads, the latest (default {d.window}; 0 = all)",
    )
    loop.add_argument(
        "--min-samples",
        type=at_least(1),
        default=d.min_samples,
        help=f"refresh: no flip below (default {d.min_samples})",
    )
    loop.add_argument(
        "--confidence",
        type=open_unit,
        default=d.confidence,
        help=f"refresh: drift bound (default {d.confidence:g})",
    )
    loop.add_argument(
        "--replace-drifted",
        action=argparse.BooleanOptionalAction,
        default=d.replace_drifted,
        help="refresh: a path whose logged figures drifted beyond the bound takes them alone, else they "
        "are merged with the base's pre-drift figures (rule 7; default on)",
    )
    loop.add_argument(
        "--interference",
        action=argparse.BooleanOptionalAction,
        default=d.interference,
        help="refresh: a cell's local TPOT from the decode interference its LOCAL turns cause to every "
        "request on the worker, fitted on the logs (rule 8; default on), else the cell's own per-path means",
    )
    parser.set_defaults(handler=_command)
