"""The shipped default tables (tables/*.ppdt): present, valid, named by key, with provenance.

They are produced by one command (README, "Table files and the table builder"); a full rebuild takes
minutes, so CI checks what can be checked cheaply: the server's reader accepts them and they say how
they were made.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from decision_service.table import Table
from table_builder.build import BUILDER_VERSION, table_file_name
from table_builder.cli import main

TABLES = Path(__file__).resolve().parents[2] / "tables"
DEFAULT_SHAPES = ("1P3D", "2P2D", "3P1D")
MODEL = "llama-3.1-8b"


@pytest.mark.parametrize("shape", DEFAULT_SHAPES)
def test_default_table_is_shipped_valid_and_documented(shape: str) -> None:
    path = TABLES / table_file_name(shape, MODEL)
    table = Table.open(path)
    try:
        assert table.key == f"{shape}/{MODEL}"
        p = table.header["provenance"]
        assert p["builder"] == BUILDER_VERSION
        assert p["source"] == "records"
        assert p["labels"]["engine"] == "sim"
        assert p["labels"]["profile"] == "llama-3.1-8b-h100"
        assert p["labels"]["hardware"] == "H100"
        assert len(p["inputs_sha256"]) == 64
        # The full paper grid: 18 workloads x 10 QPS levels x 2 modes.
        assert len(p["runs"]) == 360
        assert p["cells"]["filled"] + p["cells"]["low_sample"] >= 100
    finally:
        table.close()


def test_check_accepts_the_whole_folder() -> None:
    assert main(["check", str(TABLES)]) == 0
