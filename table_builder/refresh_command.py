"""``ppd-table refresh``: production request logs merged into a base table (``refresh.py``), the drift
report, the atomic publish."""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from decision_service.table import Table, TableError, write_table
from table_builder.flags import positive_int
from table_builder.publish import record_paths, resolve_out
from table_builder.records import Record, RecordsError, read_records, scan_records

__all__ = ["add_parser"]

logger = logging.getLogger("table_builder")


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
        return _read_logs(record_paths(args.logs), skip_bad=args.skip_bad_lines)
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
        base,
        records,
        min_samples=args.min_samples,
        confidence=args.confidence,
        qps_window_s=args.qps_window,
        replace_drifted=args.replace_drifted,
        interference=args.interference,
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


def add_parser(
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
        "--replace-drifted",
        action="store_true",
        help="a path whose logged figures moved beyond the bound takes the logged figures alone instead "
        "of merging them with the base's (rule 7; default: merge)",
    )
    refresh.add_argument(
        "--interference",
        action="store_true",
        help="a cell's local TPOT from the decode interference its LOCAL turns cause to every request "
        "on the worker, fitted on the logs (rule 8; default: the cell's own requests' per-path means)",
    )
    refresh.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip (and count) bad log lines instead of failing, e.g. a live log's line being written",
    )
    refresh.add_argument("--json", action="store_true", help="print the report as one JSON line")
    refresh.set_defaults(run=_cmd_refresh)
