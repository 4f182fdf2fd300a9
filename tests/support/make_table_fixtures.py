"""Regenerate tests/testdata/tables/ (python -m tests.support.make_table_fixtures)."""

from __future__ import annotations

from pathlib import Path

from tests.support.tables import write_fixtures

FOLDER = Path(__file__).resolve().parent.parent / "testdata" / "tables"

if __name__ == "__main__":
    for reason, path in sorted(write_fixtures(FOLDER).items()):
        print(f"{reason:16s} {path}")
