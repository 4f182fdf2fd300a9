"""The side-by-side streaming-client benchmark at a tiny size: it runs both clients end to end and
prints every figure (no speed asserts)."""

from __future__ import annotations

import pytest

from tests.support.benchmarks import run_benchmark


@pytest.mark.bench
def test_both_stream_clients_are_measured_in_one_run() -> None:
    args = ["--rounds", "1", "--streams", "2", "--requests", "8", "--chunks", "1", "5"]
    figures = run_benchmark("benchmarks.stream_client", args)
    rounds = {f["stream_client"]: f for f in figures if f["figure"] == "round"}
    assert set(rounds) == {"aiohttp", "httptools"}
    assert all(f["requests"] == 8 for f in rounds.values())
    assert all("cpu_s_per_1000_requests_5_chunks" in f for f in rounds.values())
    tail = ["median", "median", "ratio_httptools_over_aiohttp", "split_per_extra_chunk"]
    assert [f["figure"] for f in figures[-4:]] == tail
    assert set(figures[-1]) >= {"relay_feed_us", "aiohttp", "httptools"}
