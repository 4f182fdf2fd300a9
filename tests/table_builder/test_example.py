"""The shipped example: its records regenerate byte for byte, its table rebuilds byte for byte."""

from __future__ import annotations

from pathlib import Path

from decision_service.table import Table
from table_builder.build import build_from_records
from table_builder.cli import main
from table_builder.example import EXAMPLE_OPTIONS, RECORDS, TABLE
from table_builder.example import main as regenerate
from table_builder.records import read_records

REPO = Path(__file__).resolve().parents[2]


def test_checked_in_table_is_a_rebuild_of_the_checked_in_records() -> None:
    rebuilt = build_from_records(read_records([REPO / RECORDS]), EXAMPLE_OPTIONS).encode()
    assert rebuilt == (REPO / TABLE).read_bytes(), (
        "run `python -m table_builder.example` and commit the result"
    )


def test_the_cli_rebuilds_the_same_bytes(tmp_path: Path) -> None:
    out = tmp_path / "t.ppdt"
    args = ["build", "--records", str(REPO / RECORDS), "--shape", "1P3D", "--model", "llama-3.1-8b"]
    args += ["--min-samples", "5", "--label", "engine=analytic", "--label", "example=true", "--out", str(out)]
    assert main(args) == 0
    assert out.read_bytes() == (REPO / TABLE).read_bytes()


def test_the_generator_reproduces_the_checked_in_files(tmp_path: Path) -> None:
    assert regenerate(["--root", str(tmp_path)]) == 0
    assert (tmp_path / RECORDS).read_bytes() == (REPO / RECORDS).read_bytes()
    assert (tmp_path / TABLE).read_bytes() == (REPO / TABLE).read_bytes()


def test_check_passes_and_provenance_is_there() -> None:
    assert main(["check", str(REPO / TABLE)]) == 0
    table = Table.open(REPO / TABLE)
    try:
        assert table.key == "1P3D/llama-3.1-8b"
        p = table.header.provenance
        assert p["source"] == "records"
        assert p["labels"] == {"engine": "analytic", "example": "true"}
        assert p["built_at"].startswith("2026-01-01T")
        assert len(p["runs"]) == 108
    finally:
        table.close()
