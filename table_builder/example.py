"""Regenerate the shipped example: ``tables/example/records.jsonl`` and the table built from it.

    python -m table_builder.example [--root .]

The records come from the closed-form analytic model (``analytic.py``), seeded, on a small grid
(1P3D, the 18 synthetic workloads, 1 / 8 / 20 QPS, static pd and local), so the file stays small and the
decision service has a table to serve out of the box. The table is built with exactly what
``ppd-table build --records tables/example/records.jsonl --shape 1P3D --model llama-3.1-8b
--min-samples 5 --label engine=analytic --label example=true`` would do; a test rebuilds it and compares
bytes.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from decision_service.table import write_table
from ppd.catalog import WORKLOADS
from table_builder.analytic import AnalyticEngine
from table_builder.build import BuildOptions, build_from_records, default_header, table_file_name
from table_builder.records import Record, read_records, write_records
from table_builder.sweep import SweepPlan

__all__ = ["EXAMPLE_OPTIONS", "RECORDS", "TABLE", "example_records", "main"]

SHAPE: Final = "1P3D"
MODEL: Final = "llama-3.1-8b"
RECORDS: Final = Path("tables/example/records.jsonl")
TABLE: Final = Path("tables/example") / table_file_name(SHAPE, MODEL)
EXAMPLE_OPTIONS: Final = BuildOptions(
    header=default_header(SHAPE, MODEL), min_samples=5, labels={"engine": "analytic", "example": "true"}
)
_PLAN: Final = SweepPlan((SHAPE,), MODEL, ("pd", "local"), WORKLOADS, (1.0, 8.0, 20.0))
_ENGINE: Final = AnalyticEngine(conversations=5, seed=2026)


def example_records() -> list[Record]:
    records: list[Record] = []
    for point in _PLAN.points():
        records.extend(_ENGINE.run(point))
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m table_builder.example",
        description="Regenerate tables/example/records.jsonl and the example table built from it.",
    )
    parser.add_argument("--root", type=Path, default=Path(), help="repository root (default: .)")
    args = parser.parse_args(argv)
    records_path = args.root / RECORDS
    write_records(records_path, example_records())
    result = build_from_records(read_records([records_path]), EXAMPLE_OPTIONS)
    path = write_table(args.root / TABLE, result.spec)
    print(result.summary.format())
    print(f"wrote {records_path} and {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
