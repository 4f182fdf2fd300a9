"""The picker's observation-cost benchmark at a tiny size: both stacks (observing and not) run end to
end through the real Envoy and every figure is printed (no speed asserts)."""

from __future__ import annotations

import pytest

from tests.support.benchmarks import run_benchmark


@pytest.mark.bench
def test_observed_and_unobserved_answers_are_measured_side_by_side() -> None:
    figures = run_benchmark("benchmarks.picker_observe", ["--requests", "4", "--chunks", "2", "6"])
    assert [f["figure"] for f in figures] == ["chunk_latency", "cpu", "lines"]
    latency, cpu, lines = figures
    assert latency["observed_chunks"] == latency["unobserved_chunks"] == 4 * 6
    assert {"added_per_chunk_p50_ms", "added_per_chunk_p99_ms"} <= set(latency)
    assert {"picker_us_per_observed_chunk", "envoy_us_per_observed_chunk"} <= set(cpu)
    # Every request to the observing picker left its line (2 warm-up + 4 + 4); the other wrote none.
    assert lines["observed_request_log_lines"] == lines["requests"] == 10
    assert lines["unobserved_request_log_lines"] == 0
