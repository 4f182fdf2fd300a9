"""The shared-store benchmark at a tiny size: runs end to end, prints every figure (no speed asserts)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.benchmarks import run_benchmark
from tests.support.ci import require_tool


@pytest.mark.bench
def test_benchmark_prints_every_figure_for_both_stores_side_by_side() -> None:
    require_tool("redis-server", "the benchmark runs a redis-server of its own (make redis)")
    args = [
        "--streams",
        "1",
        "4",
        "--requests-per-stream",
        "2",
        "--chunks",
        "5",
        "--chunk-interval-ms",
        "1",
        "--ops",
        "50",
    ]
    figures = run_benchmark("benchmarks.session_store", args)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for figure in figures:
        by_name.setdefault(figure["figure"], []).append(figure)
    assert [(f["store"], f["streams"]) for f in by_name["request"]] == [
        ("memory", 1), ("redis", 1), ("memory", 4), ("redis", 4),
    ]  # fmt: skip
    assert all(f["requests"] == f["streams"] * 2 for f in by_name["request"])
    assert all(f["own_p50_ms"] is not None for f in by_name["request"])
    assert [f["streams"] for f in by_name["added"]] == [1, 4]
    assert {"own_p50_ms", "own_p99_ms", "ttft_p99_ms", "request_p99_ms"} <= set(by_name["added"][0])
    (ops,) = by_name["ops"]
    assert ops["operations"] == 50
    assert ops["get_p50_us"] > 0
