"""``ppd-vllm fit-profile`` on the session's cluster (both engines): a small micro-benchmark, then a profile.

Figures are never asserted (the machine is shared); only that every point is measured and the fitted
profile is one the simulator loads and runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.core.profile import load_profile
from simulator.tools.fit_profile import MEASURED_LINK
from tests.conformance.workers import Cluster
from vllm_harness.microbench import BenchSettings, run_fit, tiny_model_spec

pytestmark = pytest.mark.integration

QUICK = BenchSettings(
    prefill_sizes=(16, 64, 256), decode_batches=(1, 2), decode_contexts=(16, 256), decode_tokens=6,
    transfer_sizes=(64, 256), repeats=1, seed=7,
)  # fmt: skip


def test_the_micro_benchmark_measures_every_point_and_fits_a_loadable_profile(
    cluster: Cluster, tmp_path: Path
) -> None:
    said: list[str] = []
    out = tmp_path / "fitted.json"
    model = tiny_model_spec() if cluster.engine == "vllm-cpu" else load_profile("llama-3.1-8b-h100").model
    lines = run_fit(
        dict(cluster.ready), out, QUICK, name="fitted", description="conformance", hardware_name="test",
        model=model, kv_cache_bytes=128 << 20, max_num_batched_tokens=2048, max_num_seqs=256, block_size=32,
        say=said.append,
    )  # fmt: skip
    assert len(lines) == 3 + 4 + 2  # prefill sizes + decode pairs + transfer sizes
    assert all("measured" in line and "fitted" in line for line in lines)
    assert said[0].startswith("request floor:")
    profile = load_profile(str(out))
    assert profile.name == "fitted"
    assert profile.link(MEASURED_LINK).bandwidth_bytes_per_s > 0
    assert profile.cpu.step_s > 0
