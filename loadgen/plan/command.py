"""``ppd-bench plan``: how many of N GPUs should prefill and how many decode, and in which mode.

Rule 1: every input is checked before anything runs; a bad one (fewer than 2 GPUs, an unknown workload
        or mode, a bad QPS list, an unreadable or empty request log, a baseline that is not run) is a
        usage error: exit 2, and the message names the flag and what to give instead.
Rule 2: the runs (``runner``), then the recommendation (``recommend``), then the report (``render``);
        the wall time of the whole is printed at the end (it is no part of the report, which depends
        only on the settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from loadgen.arguments import at_least, names, positive, positive_list, share
from loadgen.plan.recommend import Config, Objective, recommend
from loadgen.plan.render import write_report
from loadgen.plan.runner import Component, PlanSettings, component, log_component, make_plan, run_plan
from loadgen.report.reproduce import PAPER_QPS
from loadgen.sharegpt import SHAREGPT_WORKLOAD
from ppd.catalog import select_workloads
from ppd.modes import ModeError, parse_mode
from table_builder.records import RecordsError, read_records

__all__ = ["add_parser"]

_MODES: Final = ("pd", "local", "ppd")


def _gpus(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of GPUs (2 or more), got {text}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"needs at least 2 GPUs (one prefill and one decode worker), got {value}"
        )
    return value


def _qps(text: str) -> tuple[float, ...]:
    if text.strip() == "all":
        return PAPER_QPS
    try:
        return tuple(sorted(set(positive_list(text))))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; give e.g. 1,4,8 or 'all' (the paper's 10 levels)") from None


def _mix(text: str) -> tuple[tuple[str, float], ...]:
    """``NAME[=SHARE],...``: catalog workloads, the groups ``all`` / ``huge``, and ``sharegpt``."""
    out: dict[str, float] = {}
    for item in names(text):
        name, sep, raw = item.partition("=")
        weight = positive(raw) if sep else 1.0
        if name == SHAREGPT_WORKLOAD:
            out[name] = weight
            continue
        try:
            chosen = select_workloads(name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc}, or '{SHAREGPT_WORKLOAD}', 'all', 'huge'") from None
        for w in chosen:
            out[w.name] = weight
    if not out:
        raise argparse.ArgumentTypeError("names no workload")
    return tuple(out.items())


def _modes(text: str) -> tuple[str, ...]:
    modes = names(text)
    for m in modes:
        try:
            mode = parse_mode(m)
        except ModeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if mode.kind not in {"pd", "local", "ppd", "fraction"}:
            raise argparse.ArgumentTypeError(
                f"mode {m} is not a P/D mode: give pd, local, ppd or fraction:<x> "
                "(--replica adds the all-replica shape)"
            )
    if not modes:
        raise argparse.ArgumentTypeError("names no mode")
    return modes


def _request_log(text: str) -> Component:
    try:
        records = read_records([text])
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {exc.strerror or exc}") from None
    except RecordsError as exc:
        raise argparse.ArgumentTypeError(f"{text} is not a request log of ours: {exc}") from None
    try:
        return log_component(records, 1.0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc}") from None


def _profile(text: str) -> str:
    from simulator.core.profile import ProfileError, load_profile

    try:
        load_profile(text)
    except ProfileError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc} (give a shipped profile name or a profile JSON file)"
        ) from None
    return text


def _baseline(text: str) -> Config:
    shape, sep, mode = text.partition(":")
    if not sep or not shape or not mode:
        raise argparse.ArgumentTypeError(f"expected SHAPE:MODE such as 2P2D:pd, got {text!r}")
    return Config(shape, mode)


def _usage(message: str) -> int:
    print(f"ppd-bench plan: error: {message}", file=sys.stderr)
    return 2


def _command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    del environ
    if args.workloads is not None:
        mix = args.workloads
    else:  # the request log alone when one is given, else ShareGPT
        mix = () if args.request_log is not None else ((SHAREGPT_WORKLOAD, 1.0),)
    components = [
        component(name, weight, seed=args.seed, conversations=args.sharegpt_conversations)
        for name, weight in mix
    ]
    if args.request_log is not None:
        components.append(dataclasses.replace(args.request_log, share=args.request_log_share))
    objective = Objective(
        w_ttft=args.w_ttft,
        w_tpot=args.w_tpot,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        min_success=args.min_success,
    )
    settings = PlanSettings(
        gpus=args.gpus,
        components=tuple(components),
        qps=args.qps,
        objective=objective,
        modes=args.modes,
        replica=args.replica,
        duration_s=args.duration,
        seed=args.seed,
        jobs=args.jobs or os.cpu_count() or 1,
        tables=args.tables,
        profile=args.profile,
        model=args.model,
    )
    plan = make_plan(settings)
    baseline = args.baseline or Config(f"{args.gpus // 2}P{args.gpus - args.gpus // 2}D", "pd")
    if baseline not in plan.configs:
        run = ", ".join(f"{c.shape}:{c.mode}" for c in plan.configs)
        return _usage(f"--baseline {baseline.shape}:{baseline.mode} is not one of the configs run ({run})")
    started = time.perf_counter()
    runs = run_plan(settings, plan, progress=not args.no_progress)
    shares = {c.name: c.share for c in settings.components}
    combined = runs.combined(shares)
    rec = recommend(combined, baseline, objective)
    path = write_report(rec, combined, runs, settings, args.out)
    wall = time.perf_counter() - started
    print(f"recommended: {rec.overall.label} ({rec.objective.describe()})")
    for w in rec.levels:
        print(f"  QPS {w.qps:g}: {w.winner.label}")
    print(f"report: {path}")
    print(f"wall time: {wall:.1f} s for {runs.runs} runs on {settings.jobs} processes")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``plan`` subcommand of ``ppd-bench``."""
    parser = sub.add_parser(
        "plan",
        help="which P:D split of N GPUs and which mode (pd, local, ppd) to run, on the simulator",
        description="Runs every P:D split of --gpus (at least one of each) in each mode on the "
        "virtual-time cluster simulation, for each workload of the mix at each QPS level, and "
        "recommends a shape and mode by the operator's weights (the paper's score S against a baseline) "
        "or SLO targets (attainment). Writes report.md, plan.png, plan_score.png and plan.json into "
        "--out, with the comparison with the paper's Tables 1 and 2. ppd needs a table for the shape "
        "(--tables); a shape without one gets pd and local only.",
    )
    parser.add_argument("--gpus", type=_gpus, required=True, help="GPUs to split between P and D (2 or more)")
    parser.add_argument(
        "--workloads",
        type=_mix,
        default=None,
        help="the mix: comma list of NAME[=SHARE], NAME a synthetic workload (e.g. large_mid_paste), "
        f"'all' (the paper's 18), 'huge' (the nine huge-context ones) or '{SHAREGPT_WORKLOAD}'; shares "
        f"default to 1 and are normalised (default {SHAREGPT_WORKLOAD}, or only --request-log when given)",
    )
    parser.add_argument(
        "--request-log",
        type=_request_log,
        default=None,
        help="a request log of ours (JSONL benchmark records, as the gateway's request_log writes): its "
        "conversations' turn sizes join the mix as the workload 'request-log'",
    )
    parser.add_argument(
        "--request-log-share",
        type=positive,
        default=1.0,
        help="the request log's share of the mix (default 1)",
    )
    parser.add_argument(
        "--qps",
        type=_qps,
        default=PAPER_QPS,
        help="QPS levels, comma list or 'all' (the paper's 10; default)",
    )
    parser.add_argument(
        "--modes", type=_modes, default=_MODES, help="modes to run (default pd,local,ppd; also fraction:<x>)"
    )
    parser.add_argument(
        "--replica", action="store_true", help="also run the all-replica shape (NR, mode replica)"
    )
    parser.add_argument("--w-ttft", type=positive, default=1.0, help="w_ttft of the score S (default 1)")
    parser.add_argument("--w-tpot", type=positive, default=1.0, help="w_tpot of the score S (default 1)")
    parser.add_argument(
        "--slo-ttft-ms",
        type=positive,
        default=None,
        help="TTFT target, ms: rank by SLO attainment instead of S",
    )
    parser.add_argument(
        "--slo-tpot-ms",
        type=positive,
        default=None,
        help="TPOT target, ms: rank by SLO attainment instead of S",
    )
    parser.add_argument(
        "--min-success",
        type=share,
        default=0.95,
        help="success rate a config needs to win a QPS level under weights (default 0.95)",
    )
    parser.add_argument(
        "--baseline",
        type=_baseline,
        default=None,
        help="SHAPE:MODE the score S is relative to (default the even split's pd, e.g. 2P2D:pd)",
    )
    parser.add_argument(
        "--profile",
        type=_profile,
        default="llama-3.1-8b-h100",
        help="simulator profile (default llama-3.1-8b-h100)",
    )
    parser.add_argument(
        "--model", default="llama-3.1-8b", help="model label of the tables (default llama-3.1-8b)"
    )
    parser.add_argument(
        "--tables",
        type=Path,
        default=Path("tables"),
        help="folder of the tables ppd routes with (default tables)",
    )
    parser.add_argument(
        "--duration",
        type=positive,
        default=10.0,
        help="seconds of arrivals per run (default 10, the paper's)",
    )
    parser.add_argument(
        "--seed", type=at_least(0), default=0, help="seed of the arrivals and conversations (default 0)"
    )
    parser.add_argument(
        "--jobs",
        type=at_least(0),
        default=0,
        help="worker processes (default 0: one per CPU of this machine)",
    )
    parser.add_argument(
        "--sharegpt-conversations",
        type=at_least(1),
        default=1000,
        help="seeded ShareGPT conversations in the 'sharegpt' workload (default 1000)",
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for report.md, the PNGs and plan.json"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=_command)
