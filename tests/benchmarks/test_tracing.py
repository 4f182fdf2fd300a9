"""The tracing-cost benchmark at a tiny size: every arm runs end to end and prints its figures (no
speed asserts)."""

from __future__ import annotations

import pytest

from tests.support.benchmarks import REPO, run_benchmark


@pytest.mark.bench
def test_tracing_cost_prints_every_arm_and_the_spans_it_exported() -> None:
    args = ["--rounds", "1", "--streams", "2", "--requests", "6", "--chunks", "2", "--ratio", "0", "1"]
    args += ["--in-process-requests", "50", "--in-process-repeats", "1"]
    figures = run_benchmark("benchmarks.tracing", [*args, "--baseline-src", str(REPO)])
    arms = [f for f in figures if f["figure"] == "arm"]
    assert [f["arm"] for f in arms] == ["today", "off", "on@0", "on@1"]
    assert all(f["requests"] == 6 for f in arms)
    assert all(f["cpu_us_per_request"] >= 0 for f in arms)  # /proc's 10 ms ticks: 0 at this size
    # At ratio 1 every request is traced: six spans a Turn 2+ request (root, parse, session lookup, ψ,
    # D's leg and its first token), seven a Turn 1 (its P leg).
    assert 6 <= arms[3]["spans_per_request"] <= 7
    assert arms[2]["spans_per_request"] == 0  # ratio 0: a tracer that keeps nothing
    assert "spans_per_request" not in arms[1]
    assert [f["ratio"] for f in figures if f["figure"] == "in_process"] == [0.0, 1.0]
    (summary,) = [f for f in figures if f["figure"] == "summary"]
    assert set(summary["cpu_vs_off"]) == {"today", "off", "on@0", "on@1"}
