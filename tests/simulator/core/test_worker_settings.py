"""Start-up settings of one simulated worker: the KV connector knobs are validated."""

from __future__ import annotations

import pytest

from simulator.core.worker_settings import WorkerSettings


def test_worker_settings_validate_the_kv_connector_knobs() -> None:
    ok = WorkerSettings(worker_id="D0", role="decode", bidirectional_kv_xfer=True)
    assert (ok.decoder_kv_blocks_ttl_s, ok.kv_recompute_threshold) == (480.0, 64)
    with pytest.raises(ValueError, match="decoder_kv_blocks_ttl_s"):
        WorkerSettings(worker_id="D0", role="decode", decoder_kv_blocks_ttl_s=0.0)
    with pytest.raises(ValueError, match="kv_recompute_threshold"):
        WorkerSettings(worker_id="P0", role="prefill", kv_recompute_threshold=-1)
