"""The benchmark script at test size: it runs end to end and prints every figure (no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.decision import BenchConfig, main

pytestmark = pytest.mark.bench


def test_small_run_prints_and_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figures.json"
    assert main(["--small", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    phrases = [
        "in-process: route",
        "p99",
        "unary at saturation",
        "batch at saturation",
        "stream at saturation",
        "2 server process(es) on one port",
        "memory: RSS",
        "floor (empty grpc.aio handler",
        "Route latency while 4096-item RouteBatch calls run",
        "transports side by side",
        "floor grpcio sync, 4 thread(s), unary",
        "service grpc.aio RouteStream",
        "service grpc.aio unary, 2 processes (SO_REUSEPORT)",
        "service via the gateway's client, unary (stream = false)",
        "service via the gateway's client, RouteStreams (default)",
    ]
    for phrase in phrases:
        assert phrase in text
    figures = json.loads(out.read_text())
    assert set(figures["saturation"]) == {"unary", "batch", "stream"}
    assert figures["memory"]["reloads"] == BenchConfig.small().reloads
    assert all(value > 0 for value in figures["scaling"].values())
    assert figures["latency_us"]["p50"] <= figures["latency_us"]["p99"]
    assert figures["contention"]["batch_items"] == 4096
    assert figures["contention"]["batches_per_s"] > 0
    assert figures["contention"]["p50_us"] <= figures["contention"]["p99_us"]
    assert all(t["server_cpu_us_per_decision"] > 0 for t in figures["transports"].values())


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "--small" in capsys.readouterr().out
