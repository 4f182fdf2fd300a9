"""A sweep, or a refresh from request logs, publishes into the folder a running decision service
watches, and the service serves it without a restart."""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from decision_service.table import Table, TableSpec, write_table
from devstack.ready import start_ready
from ppd.decision.v1 import decision_pb2, decision_pb2_grpc
from table_builder.cli import main
from table_builder.records import write_records
from tests.support.metrics import samples
from tests.support.records import base_table, logged

pytestmark = pytest.mark.integration

DEADLINE_S = 60.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Path, int, int]]:
    tables = tmp_path / "tables"
    tables.mkdir()
    proc, ports = start_ready(
        [sys.executable, "-m", "decision_service", "serve", "--tables", str(tables), "--port", "0",
         "--metrics-port", "0", "--reload-interval", "0.2", "--log-level", "WARNING"],
        timeout_s=DEADLINE_S,
    )  # fmt: skip
    try:
        yield tables, int(ports["metrics"]), int(ports["grpc"])
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


def test_published_tables_are_picked_up_without_a_restart(
    server: tuple[Path, int, int], tmp_path: Path
) -> None:
    tables, metrics_port, _ = server
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


def _route(grpc_port: int) -> int:
    """The served answer for a Turn-2 request in (small, mid_paste, 2 QPS)."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = decision_pb2_grpc.DecisionServiceStub(channel)
        request = decision_pb2.RouteRequest(
            turn=2, new_input_tokens=256, expected_output_tokens=64, context_tokens=256, qps=2.0
        )
        answer: int = stub.Route(request, timeout=10).decision
        return answer


def test_a_refreshed_table_is_picked_up_and_answers_from_the_logs(
    server: tuple[Path, int, int], tmp_path: Path
) -> None:
    """The closed loop's last step: the offline table is served, request logs show its answer went
    stale, `ppd-table refresh` publishes into the served folder, the running service answers anew."""
    tables, metrics_port, grpc_port = server
    offline = base_table()
    spec = TableSpec(offline.header, offline.figures)
    (tmp_path / "base").mkdir()
    base = write_table(tmp_path / "base" / "1P3D__llama-3.1-8b.ppdt", spec)
    served = write_table(tables / base.name, spec)
    _wait_for_version(metrics_port, offline.version)
    assert _route(grpc_port) == decision_pb2.DECISION_LOCAL
    # The gateway's log: local append-prefills in that cell now take 400 ms.
    write_records(tmp_path / "logs" / "gateway-0" / "requests.jsonl", logged("local", 20, ttft=400.0))
    refresh = ["refresh", "--logs", str(tmp_path / "logs"), "--base", str(base), "--out", str(tables)]
    assert main(refresh) == 0
    refreshed = _version(served)
    assert refreshed != offline.version
    _wait_for_version(metrics_port, refreshed)
    assert _route(grpc_port) == decision_pb2.DECISION_PD
    assert sorted(p.name for p in tables.iterdir()) == [base.name]
