"""The gateway profile at a tiny size: it runs end to end and prints every figure (no speed asserts)."""

from __future__ import annotations

import pytest

from tests.support.benchmarks import run_benchmark


@pytest.mark.bench
def test_profile_prints_the_cpu_split_per_request_and_per_chunk() -> None:
    args = ["--streams", "2", "--requests", "8", "--chunks", "1", "5", "--top", "3"]
    figures = {
        f["figure"] + str(f.get("chunks", "")): f for f in run_benchmark("benchmarks.gateway_profile", args)
    }
    assert set(figures) == {"cpu", "profile1", "profile5", "profile_per_extra_chunk"}
    assert figures["cpu"]["requests"] == 8
    assert figures["profile5"]["requests"] == 8
    assert any(k.startswith("gateway.") for k in figures["profile5"]["us_per_request"])
    assert len(figures["profile1"]["top_functions_us_per_request"]) == 3
