"""Fixtures shared by the deploy tests: the descriptor set Envoy transcodes with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.processes import REPO


@pytest.fixture(scope="session")
def descriptor_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one command operators run: `python proto/generate.py --descriptor-set FILE`."""
    folder = tmp_path_factory.mktemp("descriptor")
    out = folder / "decision.pb"
    subprocess.run(
        [sys.executable, str(REPO / "proto" / "generate.py"), "--out", str(folder / "stubs"),
         "--descriptor-set", str(out)],
        check=True,
        timeout=120,
    )  # fmt: skip
    return out
