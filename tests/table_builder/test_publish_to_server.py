"""A sweep publishes into the folder a running decision service watches, and the service serves it."""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from decision_service.table import Table
from devstack.ready import start_ready
from table_builder.cli import main
from tests.support.metrics import samples

pytestmark = pytest.mark.integration

DEADLINE_S = 60.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    tables = tmp_path / "tables"
    tables.mkdir()
    proc, ports = start_ready(
        [sys.executable, "-m", "decision_service", "serve", "--tables", str(tables), "--port", "0",
         "--metrics-port", "0", "--reload-interval", "0.2", "--log-level", "WARNING"],
        timeout_s=DEADLINE_S,
    )  # fmt: skip
    try:
        yield tables, int(ports["metrics"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def _wait_for_version(metrics_port: int, version: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        if any(("version", version) in labels for _, labels in samples(text, "ppd_table_info")):
            return
        assert time.monotonic() < deadline, f"the service never served version {version}:\n{text[-2000:]}"
        time.sleep(0.1)


def _version(path: Path) -> str:
    table = Table.open(path)
    try:
        return table.version
    finally:
        table.close()


def test_published_tables_are_picked_up_without_a_restart(server: tuple[Path, int], tmp_path: Path) -> None:
    tables, metrics_port = server
    sweep = [
        "sweep",
        "--engine",
        "analytic",
        "--shape",
        "1P3D",
        "--workloads",
        "small_mid_paste",
        "--qps",
        "2,8",
    ]
    sweep += ["--duration", "3", "--min-samples", "2", "--quiet", "--publish", str(tables)]
    assert main([*sweep, "--out", str(tmp_path / "a"), "--seed", "1"]) == 0
    published = tables / "1P3D__llama-3.1-8b.ppdt"
    _wait_for_version(metrics_port, _version(published))
    # A new sweep replaces the file atomically; the service swaps to the new version.
    assert main([*sweep, "--out", str(tmp_path / "b"), "--seed", "2"]) == 0
    _wait_for_version(metrics_port, _version(published))
    assert not [p.name for p in tables.iterdir() if p.name != published.name]
