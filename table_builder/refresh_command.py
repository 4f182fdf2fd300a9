"""``ppd-table refresh``: production request logs merged into a base table (``refresh.py``), the drift
report, the atomic publish.

The logs are read as a stream (``_LogScan``), so memory stays bounded whatever they hold: one line at
a time, never more than ``MAX_LINE_BYTES`` of it (a longer line is bad, skipped unread); a bad line is
counted, and only the first few of them are kept to be named; a file reached twice (a folder and a
file in it, two spellings of one path) is read once. ``refresh_table`` keeps each distinct good record
and a 16-byte digest of it (``refresh.py`` rule 1), so a line repeated costs nothing either.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from decision_service.table import Table, TableError, write_table
from table_builder.flags import positive_int
from table_builder.publish import record_paths, resolve_out
from table_builder.records import BadRecord, Record, parse_line

__all__ = ["MAX_LINE_BYTES", "add_parser"]

logger = logging.getLogger("table_builder")

#: The longest log line read (a request-log line is well under 1 KiB); a longer one is a bad line.
MAX_LINE_BYTES: Final = 64 * 1024
#: Bad lines named per file, and in all (the rest are counted).
_NAMED_PER_FILE: Final = 3
_NAMED: Final = 20


@dataclass(slots=True)
class _LogScan:
    """The logs' records, one line at a time, with the bad lines counted (the first few kept)."""

    paths: Sequence[Path]
    bad: int = 0
    named: list[BadRecord] = field(default_factory=list)
    #: Bad lines per file beyond the ones named there.
    unnamed: dict[str, int] = field(default_factory=dict)

    def records(self) -> Iterator[Record]:
        for path in self.paths:
            yield from self._file(path)

    def _file(self, path: Path) -> Iterator[Record]:
        named_here = 0
        with path.open("rb") as fh:
            number = 0
            while raw := fh.readline(MAX_LINE_BYTES + 1):
                number += 1
                complete = raw.endswith(b"\n")
                reason = ""
                if len(raw) - (1 if complete else 0) > MAX_LINE_BYTES:
                    reason = f"line longer than {MAX_LINE_BYTES} bytes (not read)"
                    while raw and not raw.endswith(b"\n"):
                        raw = fh.readline(MAX_LINE_BYTES)
                else:
                    record, reason = parse_line(raw, complete)
                    if record is not None:
                        yield record
                        continue
                self.bad += 1
                if named_here < _NAMED_PER_FILE and len(self.named) < _NAMED:
                    named_here += 1
                    self.named.append(BadRecord(str(path), number, reason))
                else:
                    self.unnamed[str(path)] = self.unnamed.get(str(path), 0) + 1


def _distinct_paths(paths: Sequence[Path]) -> list[Path]:
    """Each file once, as first named (a folder and a file in it, or two spellings of one path)."""
    seen: dict[Path, Path] = {}
    for path in paths:
        key = path.resolve()
        if key in seen:
            logger.info("%s is %s again: read once", path, seen[key])
        else:
            seen[key] = path
    return list(seen.values())


def _open_base(path: Path) -> Table | None:
    try:
        return Table.open(path)
    except TableError as exc:
        logger.error("base table %s: %s", path, exc)
    except OSError as exc:
        logger.error("cannot read the base table: %s", exc)
    return None


def _report_bad_lines(scan: _LogScan, *, skip_bad: bool) -> bool:
    """Log the bad lines; False when they fail the run (without ``skip_bad``)."""
    if not scan.bad:
        return True
    if skip_bad:
        for problem in scan.named:
            logger.warning("skipped %s", problem)
        for path, n in scan.unnamed.items():
            logger.warning("skipped %d more bad line(s) in %s", n, path)
        return True
    shown = "\n".join(f"  {p}" for p in scan.named)
    more = f"\n  ... and {scan.bad - len(scan.named)} more" if scan.bad > len(scan.named) else ""
    logger.error(
        "%d bad record(s):\n%s%s\n(--skip-bad-lines reads a live log, skipping a line still being written)",
        scan.bad,
        shown,
        more,
    )
    return False


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
    try:
        scan = _LogScan(_distinct_paths(record_paths(args.logs)))
        result = refresh_table(
            base,
            scan.records(),
            min_samples=args.min_samples,
            confidence=args.confidence,
            qps_window_s=args.qps_window,
            replace_drifted=args.replace_drifted,
            interference=args.interference,
            timeout_ms=args.timeout_ms,
        )
    except OSError as exc:
        logger.error("cannot read the logs: %s", exc)
        return 1
    if not _report_bad_lines(scan, skip_bad=args.skip_bad_lines):
        return 1
    skipped = scan.bad
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


def _positive_ms(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of milliseconds, got {text}")
    return value


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    refresh = sub.add_parser(
        "refresh",
        parents=[common],
        help="merge production request logs into a base table, report drift, publish atomically",
        description="Merge the Turn-2+ evidence of request logs (ppd mode by the path each request took, "
        "and static pd/local/bidir benchmark runs; each request once, a client's disconnect no failure "
        "of the path) into the base table cell by cell, weighted by sample counts; print "
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
        "--timeout-ms",
        type=_positive_ms,
        default=None,
        metavar="MS",
        help="a logged TTFT or TPOT beyond it counts as a request that did not complete in time, not as "
        "a latency (default: the base table's benchmark timeout, provenance censored_ttft_ms, 30000)",
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
        help="skip (and count) bad log lines instead of failing, e.g. a live log's line being written; "
        f"a line over {MAX_LINE_BYTES} bytes is bad",
    )
    refresh.add_argument("--json", action="store_true", help="print the report as one JSON line")
    refresh.set_defaults(run=_cmd_refresh)
