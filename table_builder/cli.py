"""``ppd-table``: build, check and show decision tables, sweep, refresh them from request logs, import
vLLM benchmark outputs (also ``python -m table_builder``).

Exit codes: 0 success; 1 bad inputs or a table that fails validation (the reason is printed);
2 bad command-line usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from decision_service.table import SUFFIX, Table, TableError
from table_builder import import_command, refresh_command, sweep_command
from table_builder.artifact import ArtifactError, read_artifact
from table_builder.build import build_from_artifact, build_from_records
from table_builder.flags import add_build_options, options_from_args, weights_arg
from table_builder.publish import publish, record_paths, resolve_out
from table_builder.records import RecordsError, read_records

__all__ = ["build_parser", "main"]

logger = logging.getLogger("table_builder")


def _cmd_build(args: argparse.Namespace) -> int:
    options = options_from_args(args, shape=args.shape)
    out = resolve_out(args.out, options.header.shape, options.header.model)
    try:
        if args.records:
            records = read_records(record_paths(args.records))
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
            every = [(c, w, q) for c in range(nc) for w in range(nw) for q in range(nq)]
            measured = sum(table.measured(*cell) for cell in every)
            cells = f"{measured}/{nc * nw * nq} cells measured"
            if table.format_version >= 2:
                # The reader checked the BIDIR figures; say how many cells have them, and how many of
                # those the router cannot use (no PD/LOCAL pair to compare with).
                bidir = [cell for cell in every if table.has_bidir(*cell)]
                unused = sum(not table.measured(*cell) for cell in bidir)
                cells += f", {len(bidir)} with bidir figures (format {table.format_version})"
                if unused:
                    cells += f", {unused} of them unused (no pd/local pair)"
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
        grid = decision_grid(table, weights=args.weights, profile=args.profile, bidir=not args.no_bidir)
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
        description="Compare static pd runs with static local runs per cell (and, where records of mode "
        "bidir exist, the bidirectional KV mode as a third) and publish a table atomically. "
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
    show.add_argument(
        "--no-bidir",
        action="store_true",
        help="ask as a caller without CAPABILITY_BIDIR (a table with bidir figures is otherwise asked as "
        "one that can serve the bidirectional path, and shows it as B)",
    )
    show.add_argument("--provenance", action="store_true", help="print the table's provenance as JSON")
    show.add_argument("--png", type=Path, metavar="OUT", help="also write a heatmap PNG (needs matplotlib)")
    show.set_defaults(run=_cmd_show)

    sweep_command.add_parser(sub, common)

    import_command.add_parser(sub, common)
    refresh_command.add_parser(sub, common)
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
