"""The overload and bad-worker benchmark at a tiny size: runs end to end against real processes and
prints every figure (no speed asserts)."""

from __future__ import annotations

import pytest

from tests.support.benchmarks import run_benchmark


@pytest.mark.bench
def test_benchmark_prints_the_shed_and_both_ejection_figures() -> None:
    figures = run_benchmark("benchmarks.admission_shed", ["--shed", "5", "--requests", "60"])
    shed, off, on = figures
    assert shed["figure"] == "shed"
    assert shed["shed"] == 5  # the one slot is held: every request is turned away
    assert shed["retry_after_s"] == ["10"]
    assert [off["outliers"], on["outliers"]] == ["disabled", "default"]
    assert off["ejections"] == 0
    assert off["d1_requests_until_ejected"] is None
    assert on["ejections"] >= 1
    assert on["d1_requests_until_ejected"] is not None
    assert on["client_errors"] < off["client_errors"]
