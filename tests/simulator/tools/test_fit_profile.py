"""The profile fit: measurements made by a known cost model come back as that model's predictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator.core.cost import CostModel
from simulator.core.profile import ModelSpec, load_profile
from simulator.tools.fit_profile import MEASURED_LINK, Measurements, fit_profile, predictions

_TINY = ModelSpec(
    name="tiny",
    layers=2,
    hidden=256,
    ffn=512,
    q_heads=4,
    kv_heads=2,
    head_dim=64,
    vocab=128_256,
    dtype_bytes=2,
)


def _synthetic(floor: float = 0.004) -> Measurements:
    """Lines like a CPU worker's: a 20 ms step floor, 1.5 ms per decode, 40 us per prompt token."""
    prefill = [(n, floor + 0.02 + 4e-5 * n + 2e-9 * n * n) for n in (32, 256, 1024, 2048)]
    decode = [(b, c, 0.02 + 0.0015 * b + 2e-7 * b * c) for b in (1, 4, 16) for c in (32, 1024)]
    transfer = [(n, 0.003 + 2e-6 * n) for n in (128, 1024, 2048)]
    return Measurements(prefill=prefill, decode=decode, transfer=transfer, request_floor_s=floor)


def _fit(tmp_path: Path, measured: Measurements) -> Path:
    raw = fit_profile(
        measured, _TINY, name="fitted", description="test", hardware_name="cpu", kv_cache_bytes=128 << 20,
        max_num_batched_tokens=2048, max_num_seqs=256, block_size=32,
    )  # fmt: skip
    path = tmp_path / "fitted.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    return path


def test_the_fitted_profile_loads_and_reproduces_the_decode_and_transfer_lines(tmp_path: Path) -> None:
    measured = _synthetic()
    profile = load_profile(str(_fit(tmp_path, measured)))
    assert profile.name == "fitted"
    assert profile.scheduler.block_size == 32
    assert profile.kv_capacity_tokens == (128 << 20) // _TINY.kv_bytes_per_token
    got = {p.what: p for p in predictions(profile, measured)}
    for what, p in got.items():
        if what.startswith(("decode", "KV pull")):
            assert abs(p.error) < 0.05, (what, p)
    link = profile.link(MEASURED_LINK)
    assert link.latency_s == pytest.approx(0.003, rel=1e-6)
    assert link.bandwidth_bytes_per_s == pytest.approx(_TINY.kv_bytes_per_token / 2e-6, rel=1e-6)
    assert profile.overheads.local_s == 0.004
    assert profile.overheads.pd_s == 0.008


def test_prefill_grows_as_measured(tmp_path: Path) -> None:
    measured = _synthetic()
    profile = load_profile(str(_fit(tmp_path, measured)))
    cost = CostModel(profile)
    # The slope between the largest prefills follows the measured one within 10%.
    fitted = cost.prefill_chunks(2048, 0, None) - cost.prefill_chunks(1024, 0, None)
    real = dict(measured.prefill)[2048] - dict(measured.prefill)[1024]
    assert fitted == pytest.approx(real, rel=0.1)


def test_flat_lines_fall_back_and_say_so(tmp_path: Path) -> None:
    flat = Measurements(
        prefill=[(n, 0.02) for n in (32, 256, 1024)],
        decode=[(b, c, 0.02) for b in (1, 4) for c in (32, 1024)],
        transfer=[(n, 0.003) for n in (128, 1024)],
        request_floor_s=0.004,
    )
    raw = json.loads(_fit(tmp_path, flat).read_text("utf-8"))
    for note in ("KV reads costed as negligible", "GEMMs costed", "link bandwidth costed as negligible"):
        assert note in raw["description"]
    load_profile(str(tmp_path / "fitted.json"))  # still a valid profile


def test_too_few_points_are_refused() -> None:
    few = Measurements(
        prefill=[(32, 0.02)], decode=[(1, 32, 0.02)], transfer=[(128, 0.003)], request_floor_s=0.004
    )
    with pytest.raises(ValueError, match="need prefill at 3"):
        fit_profile(
            few, _TINY, name="x", description="x", hardware_name="x", kv_cache_bytes=1 << 20,
            max_num_batched_tokens=2048, max_num_seqs=256, block_size=32,
        )  # fmt: skip


def test_the_shipped_cpu_profile_is_a_fitted_one() -> None:
    profile = load_profile("tiny-llama-cpu")
    assert profile.model.layers == 2
    assert "measured by ppd-vllm fit-profile" in profile.description
    profile.link(MEASURED_LINK)
