"""``ppd-table``: build, check, show, sweep and refresh decision tables (also ``python -m table_builder``).

Exit codes: 0 success; 1 bad inputs or a table that fails validation (the reason is printed);
2 bad command-line usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from decision_service.table import SUFFIX, Table, TableError, write_table
from table_builder.artifact import ArtifactError, read_artifact
from table_builder.build import BuildResult, build_from_artifact, build_from_records, table_file_name
from table_builder.flags import add_build_options, options_from_args, positive_int, weights_arg
from table_builder.records import Record, RecordsError, read_records, scan_records

__all__ = ["main"]

logger = logging.getLogger("table_builder")


def _is_folder(raw: str) -> bool:
    return raw.endswith(("/", os.sep)) or Path(raw).is_dir()


def resolve_out(raw: str, shape: str, model: str) -> Path:
    """The table path for ``--out``/``--publish``: a file, or a folder (an existing one, or any path
    ending in '/') that gets ``<shape>__<model>.ppdt``. Missing parent folders are created."""
    path = Path(raw) / table_file_name(shape, model) if _is_folder(raw) else Path(raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def publish(result: BuildResult, out: Path, *, as_json: bool) -> int:
    """Write the table atomically, print the summary; 1 when nothing could be built."""
    try:
        path = write_table(out, result.spec)
    except TableError as exc:
        logger.error("no table written: %s", exc)
        print(result.summary.format(), file=sys.stderr)
        return 1
    table = Table.open(path)
    try:
        if as_json:
            print(
                json.dumps(
                    {
                        "table": str(path),
                        "key": table.key,
                        "version": table.version,
                        **result.summary.counts(),
                    }
                )
            )
        else:
            print(result.summary.format())
            print(f"wrote {path} (key {table.key}, version {table.version})")
    finally:
        table.close()
    return 0


def _record_paths(targets: Sequence[Path]) -> list[Path]:
    """Files as given; a folder stands for every ``*.jsonl`` under it (sorted), e.g. a sweep's records/."""
    paths: list[Path] = []
    for target in targets:
        if target.is_dir():
            found = sorted(target.rglob("*.jsonl"))
            if not found:
                raise FileNotFoundError(f"{target}: no *.jsonl record files in this folder")
            paths.extend(found)
        else:
            paths.append(target)
    return paths


def _cmd_build(args: argparse.Namespace) -> int:
    options = options_from_args(args, shape=args.shape)
    out = resolve_out(args.out, options.header.shape, options.header.model)
    try:
        if args.records:
            records = read_records(_record_paths(args.records))
            result = build_from_records(records, options)
        else:
            scan = read_artifact(args.artifact)
            for path, why in scan.ignored:
                logger.info("ignored %s: %s", path, why)
            result = build_from_artifact(scan.points, options)
    except (RecordsError, ArtifactError) as exc:
        logger.error("%s", exc)
        return 1
    except OSError as exc:
        logger.error("cannot read inputs: %s", exc)
        return 1
    return publish(result, out, as_json=args.json)


def _table_paths(targets: Sequence[Path]) -> list[Path]:
    paths: list[Path] = []
    for target in targets:
        if target.is_dir():
            paths.extend(sorted(target.glob(f"*{SUFFIX}")))
        else:
            paths.append(target)
    return paths


def _cmd_check(args: argparse.Namespace) -> int:
    paths = _table_paths(args.files)
    if not paths:
        print(f"FAIL {' '.join(map(str, args.files))}: no {SUFFIX} files found")
        return 1
    failed = 0
    for path in paths:
        try:
            table = Table.open(path)
        except TableError as exc:
            failed += 1
            print(f"FAIL {path}: {exc.reason}: {exc.message}")
            continue
        except OSError as exc:
            failed += 1
            print(f"FAIL {path}: unreadable: {exc.strerror or exc}")
            continue
        try:
            nc, nw, nq = table.header.axes.shape
            measured = sum(table.measured(c, w, q) for c in range(nc) for w in range(nw) for q in range(nq))
            cells = f"{measured}/{nc * nw * nq} cells measured"
            print(f"ok   {path}: key {table.key}, version {table.version}, {cells}")
        finally:
            table.close()
    return 1 if failed else 0


def _cmd_show(args: argparse.Namespace) -> int:
    from table_builder.grid import decision_grid, format_grid

    try:
        table = Table.open(args.file)
    except TableError as exc:
        print(f"FAIL {args.file}: {exc.reason}: {exc.message}")
        return 1
    except OSError as exc:
        print(f"FAIL {args.file}: unreadable: {exc.strerror or exc}")
        return 1
    try:
        profiles = table.header.profiles
        if args.profile is not None and args.profile not in profiles:
            known = ", ".join(sorted(profiles)) or "none"
            print(f"unknown profile {args.profile!r}; table {table.key} has: {known}")
            return 1
        grid = decision_grid(table, weights=args.weights, profile=args.profile)
        print(format_grid(grid, scores=args.scores))
        if args.provenance:
            print(json.dumps(table.header.provenance, indent=2, sort_keys=True))
        if args.png is not None:
            from table_builder.heatmap import PlotsMissingError, write_heatmap

            try:
                print(f"wrote {write_heatmap(grid, args.png)}")
            except PlotsMissingError as exc:
                logger.error("%s", exc)
                return 1
    finally:
        table.close()
    return 0


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _cmd_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from decision_service.axes import paper_axes
    from ppd.catalog import select_workloads
    from table_builder.analytic import parse_shape
    from table_builder.engines import EngineOptions, make_engine
    from table_builder.sweep import GridPoint, SweepError, SweepPlan, run_sweep

    try:
        shapes = tuple(_csv(args.shape))
        for shape in shapes:
            parse_shape(shape)
        modes = tuple(_csv(args.modes))
        if not modes or any(m not in ("pd", "local") for m in modes):
            raise ValueError(
                f"--modes takes pd and/or local (the table compares static runs), got {args.modes!r}"
            )
        workloads = select_workloads(args.workloads)
        levels = paper_axes().qps_levels if args.qps == "all" else tuple(float(q) for q in _csv(args.qps))
        if not workloads or not levels or any(not (math.isfinite(q) and q > 0) for q in levels):
            raise ValueError("--workloads and --qps must name at least one workload and positive QPS levels")
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    engine = make_engine(args.engine, EngineOptions(seed=args.seed, duration_s=args.duration))
    plan = SweepPlan(shapes, args.model, modes, workloads, levels)
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

    try:
        with bar:
            files = run_sweep(plan, engine, args.out, jobs=args.jobs, progress=progress, advance=advance)
    except SweepError as exc:
        logger.error("%s", exc)
        return 1
    if args.no_build:
        return 0
    labels = {"engine": engine.name, **{k: str(v) for k, v in sorted(engine.settings().items())}}
    publish_to = args.publish if args.publish is not None else f"{args.out}{os.sep}"
    code = 0
    for shape, paths in files.items():
        options = options_from_args(args, shape=shape, labels=labels)
        try:
            result = build_from_records(read_records(paths), options)
        except RecordsError as exc:
            logger.error("%s", exc)
            return 1
        code = max(code, publish(result, resolve_out(publish_to, shape, args.model), as_json=args.json))
    return code


def _read_logs(paths: Sequence[Path], *, skip_bad: bool) -> tuple[list[Record], int]:
    """Every record of the logs, and how many bad lines were skipped (``skip_bad``; else they raise)."""
    if not skip_bad:
        return read_records(paths), 0
    records: list[Record] = []
    skipped = 0
    for path in paths:
        good, bad = scan_records(path)
        records.extend(good)
        for problem in bad[:3]:
            logger.warning("skipped %s", problem)
        if len(bad) > 3:
            logger.warning("skipped %d more bad line(s) in %s", len(bad) - 3, path)
        skipped += len(bad)
    return records, skipped


def _open_base(path: Path) -> Table | None:
    try:
        return Table.open(path)
    except TableError as exc:
        logger.error("base table %s: %s", path, exc)
    except OSError as exc:
        logger.error("cannot read the base table: %s", exc)
    return None


def _load_logs(args: argparse.Namespace) -> tuple[list[Record], int] | None:
    try:
        return _read_logs(_record_paths(args.logs), skip_bad=args.skip_bad_lines)
    except RecordsError as exc:
        logger.error("%s\n(--skip-bad-lines reads a live log, skipping a line still being written)", exc)
    except OSError as exc:
        logger.error("cannot read the logs: %s", exc)
    return None


def _cmd_refresh(args: argparse.Namespace) -> int:
    from table_builder.refresh import refresh_table

    base = _open_base(args.base)
    if base is None:
        return 1
    out = resolve_out(args.out, base.header.shape, base.header.model)
    if out.resolve() == args.base.resolve():
        logger.error(
            "--out would replace --base (%s): keep the base apart, or the next refresh counts the logs twice",
            args.base,
        )
        return 2
    logs = _load_logs(args)
    if logs is None:
        return 1
    records, skipped = logs
    result = refresh_table(
        base, records, min_samples=args.min_samples, confidence=args.confidence, qps_window_s=args.qps_window
    )
    report = result.drift
    # The figures were encoded and validated while rule 4 was checked: the write cannot be refused.
    path = write_table(out, result.spec)
    version = Table.open(path).version
    if args.json:
        print(
            json.dumps({"table": str(path), "version": version, "skipped_lines": skipped, **report.to_json()})
        )
    else:
        print(report.format())
        if skipped:
            print(f"skipped {skipped} bad log line(s)")
        print(f"wrote {path} (key {report.key}, version {version}, from base version {report.base_version})")
    return 0


def _open_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _add_refresh(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    refresh = sub.add_parser(
        "refresh",
        parents=[common],
        help="merge production request logs into a base table, report drift, publish atomically",
        description="Merge the Turn-2+ evidence of request logs (ppd mode by the path each request took, "
        "and static pd/local runs) into the base table cell by cell, weighted by sample counts; print "
        "the drift report (figures beyond the confidence bound, flipped answers, cells held back) and "
        "publish the new table atomically, where a running decision service picks it up. Same logs in "
        "any order, same bytes. Keep the base apart from the published table.",
    )
    refresh.add_argument(
        "--logs",
        type=Path,
        nargs="+",
        required=True,
        metavar="PATH",
        help="request logs / record JSONL files, or folders (every *.jsonl under them)",
    )
    refresh.add_argument(
        "--base", type=Path, required=True, metavar="TABLE", help="the table to refresh (the offline build)"
    )
    refresh.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="folder (existing, or ending in /) for <shape>__<model>.ppdt, or a table file; not --base",
    )
    refresh.add_argument(
        "--min-samples",
        type=positive_int,
        default=20,
        metavar="N",
        help="logged requests a cell needs before its answer may flip (default 20)",
    )
    refresh.add_argument(
        "--confidence",
        type=_open_fraction,
        default=0.99,
        metavar="C",
        help="two-sided confidence of the drift bound (default 0.99: beyond 2.58 standard errors)",
    )
    refresh.add_argument(
        "--qps-window",
        type=_positive_seconds,
        default=10.0,
        metavar="S",
        help="seconds over which a log line without target_qps has its load level counted (default 10)",
    )
    refresh.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip (and count) bad log lines instead of failing, e.g. a live log's line being written",
    )
    refresh.add_argument("--json", action="store_true", help="print the report as one JSON line")
    refresh.set_defaults(run=_cmd_refresh)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppd-table",
        description="Build, check, show, sweep and refresh PPD decision tables (one file per deployment "
        "shape and model).",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="log what is read and ignored")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    build = sub.add_parser(
        "build",
        parents=[common],
        help="benchmark records or paper-artifact folders -> a table file (atomic publish)",
        description="Compare static pd runs with static local runs per cell and publish a table atomically. "
        "Same inputs, same bytes.",
    )
    source = build.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--records", type=Path, nargs="+", metavar="FILE", help="benchmark record JSONL files"
    )
    source.add_argument(
        "--artifact",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="paper artifact folders holding 1P_3D/, 1P_3pD/, ...",
    )
    build.add_argument(
        "--out",
        required=True,
        help="table file, or a folder (existing, or ending in /) for <shape>__<model>.ppdt",
    )
    build.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    build.add_argument("--shape", required=True, help="deployment shape, e.g. 1P3D")
    build.add_argument("--model", required=True, help="model label, e.g. llama-3.1-8b")
    add_build_options(build)
    build.set_defaults(run=_cmd_build)

    check = sub.add_parser(
        "check",
        parents=[common],
        help="validate table files with the decision service's own reader",
        description="Open each table (or every *.ppdt in a folder) exactly as the server does; "
        "exit 1 if any fails, printing the reason.",
    )
    check.add_argument("files", type=Path, nargs="+", metavar="FILE", help="table files or folders")
    check.set_defaults(run=_cmd_check)

    show = sub.add_parser(
        "show",
        parents=[common],
        help="print the decision grid per context class (and --png for a heatmap)",
        description="Ask the decision service's router every cell of a table and print the answers.",
    )
    show.add_argument("file", type=Path, metavar="FILE", help="a table file")
    who = show.add_mutually_exclusive_group()
    who.add_argument("--weights", type=weights_arg, help="W_TTFT,W_TPOT instead of the table's default")
    who.add_argument("--profile", help="one of the table's named weights profiles")
    show.add_argument("--scores", action="store_true", help="print the score S next to each decision")
    show.add_argument("--provenance", action="store_true", help="print the table's provenance as JSON")
    show.add_argument("--png", type=Path, metavar="OUT", help="also write a heatmap PNG (needs matplotlib)")
    show.set_defaults(run=_cmd_show)

    from table_builder.engines import ENGINES

    sweep = sub.add_parser(
        "sweep",
        parents=[common],
        help="run a grid of static pd/local runs on an engine, keep the records, build and publish tables",
        description="Run shape x mode x workload x QPS points (resumable: finished points are skipped), "
        "then build one table per shape and publish it atomically.",
    )
    sweep.add_argument("--engine", choices=ENGINES, default=ENGINES[-1], help="what produces the records")
    sweep.add_argument("--shape", required=True, help="deployment shape(s), comma-separated: 1P3D,2P2D,3P1D")
    sweep.add_argument("--model", default="llama-3.1-8b", help="model label (default llama-3.1-8b)")
    sweep.add_argument("--modes", default="pd,local", help="static modes to run (default pd,local)")
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
    add_build_options(sweep)
    sweep.set_defaults(run=_cmd_sweep)
    _add_refresh(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        logger.error("interrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (`ppd-table show ... | head`): stop quietly, as other Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as exc:  # the edge: one line, the traceback only with --verbose
        logger.error("%s failed: %s: %s", args.command, type(exc).__name__, exc, exc_info=args.verbose)
        return 1
    return code
