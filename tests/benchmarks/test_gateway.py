"""The gateway benchmark at a tiny size: it runs end to end and prints every figure (no speed asserts)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.benchmarks import run_benchmark


@pytest.mark.bench
def test_benchmark_prints_every_figure() -> None:
    args = [
        "run", "--streams", "4", "8", "--requests-per-stream", "2", "--chunks", "10",
        "--chunk-interval-ms", "1", "--proxied", "50", "--sessions", "2000", "--session-bound", "500",
    ]  # fmt: skip
    figures = run_benchmark("benchmarks.gateway", args)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for f in figures:
        by_name.setdefault(f["figure"], []).append(f)
    assert [f["streams"] for f in by_name["ttft"]] == [4, 8]
    assert all(f["requests"] == f["streams"] * 2 for f in by_name["ttft"])
    assert by_name["ttft"][0]["gateway_own_p50_ms"] is not None
    assert by_name["relay"][0]["chunks_relayed"] == (4 + 8) * 3 * 10
    assert by_name["memory_proxied"][0]["proxied_requests"] == 50
    sessions = by_name["memory_sessions"][0]
    assert sessions["entries_at_peak"] == 500
    assert sessions["evicted_by_bound"] == 1500
    assert sessions["entries_after_expiry"] == 0
