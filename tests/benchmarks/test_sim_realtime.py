"""The real-time benchmark at a small size: it runs end to end and prints its figures (no speed asserts)."""

from __future__ import annotations

import io

import pytest

from benchmarks.sim_realtime import print_result, run_bench

pytestmark = [pytest.mark.bench, pytest.mark.integration]


async def test_realtime_bench_small() -> None:
    result = await run_bench(streams=6, seconds=0.8, warmup_s=0.2, spin_us=0.0)
    assert result.steps > 0
    assert result.tokens > 0
    assert result.lateness_p50_ms <= result.lateness_p99_ms <= result.lateness_max_ms
    assert 0 <= result.delivered_p50_ms <= result.delivered_p99_ms
    assert result.cpu_us_per_token > 0
    out = io.StringIO()
    print_result(result, out, as_json=False)
    print(out.getvalue())
    assert "step lateness p50" in out.getvalue()
