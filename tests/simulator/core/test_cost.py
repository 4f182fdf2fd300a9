"""The step cost model reproduces the reference table (docs/emulator-model.md 2.4) and is monotone."""

from __future__ import annotations

import pytest

from simulator.core.cost import CostModel
from simulator.core.profile import load_profile


@pytest.mark.parametrize(
    ("what", "n_new", "n_cached", "target_ms"),
    [
        ("full 1,024", 1024, 0, 34.5),
        ("full 2,200", 2200, 0, 72.0),
        ("full 10,000 in chunks", 10_000, 0, 362.0),
        ("append 1,024 on 2,048", 1024, 2048, 37.0),
        ("append 1,024 on 32K", 1024, 32_768, 70.0),
        ("append 1,024 on 64K", 1024, 65_536, 106.0),
    ],
)
def test_prefill_matches_reference_table(what: str, n_new: int, n_cached: int, target_ms: float) -> None:
    cost = CostModel(load_profile())
    steps = -(-n_new // 8192)
    gpu_ms = (cost.prefill_chunks(n_new, n_cached, budget=8192) - steps * cost.cpu(0)) * 1e3
    assert gpu_ms == pytest.approx(target_ms, rel=0.08), what


@pytest.mark.parametrize(("batch", "target_ms"), [(1, 7.9), (32, 9.6), (200, 20.8)])
def test_decode_step_matches_reference_table(batch: int, target_ms: float) -> None:
    cost = CostModel(load_profile())
    assert cost.decode_only(batch, batch * 1024) * 1e3 == pytest.approx(target_ms, rel=0.05)


def test_step_cost_is_monotone() -> None:
    cost = CostModel(load_profile())
    prev = 0.0
    for n in (1, 16, 128, 512, 2048, 8192):
        t = cost.step(num_decodes=0, chunks=[(n, 0)], num_sampled=1, kv_read_tokens=0)
        assert t > prev
        prev = t
    assert cost.step(num_decodes=0, chunks=(), num_sampled=0, kv_read_tokens=0) == 0.0
