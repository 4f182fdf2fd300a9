"""Active health checks and load scraping against fake workers on 127.0.0.1:0."""

from __future__ import annotations

import json

from gateway.metrics import GatewayMetrics
from gateway.pool import Load, WorkerPool, WorkerSpec
from gateway.probe import PoolMonitor, models_from_cards
from gateway.settings import PoolSettings, TimeoutSettings
from gateway.upstream import HttpUpstream
from tests.support.fake_openai import MODEL, FakeWorker
from tests.support.metrics import sample


async def test_checks_mark_down_after_two_failures_and_scrape_load() -> None:
    d0 = await FakeWorker("D0", "decode").start()
    d1 = await FakeWorker("D1", "decode").start()
    gone = await FakeWorker("D2", "decode").start()
    gone_url = gone.url
    await gone.close()
    d0.running = 3
    clock = [0.0]
    pool = WorkerPool(
        [WorkerSpec("D0", "decode", d0.url), WorkerSpec("D1", "decode", d1.url)],
        heartbeat_expiry_s=30,
        clock=lambda: clock[0],
    )
    pool.register(WorkerSpec("D2", "decode", gone_url))
    session = HttpUpstream.create_session()
    metrics = GatewayMetrics()
    monitor = PoolMonitor(pool, HttpUpstream(session, TimeoutSettings(probe_s=2.0)), PoolSettings(), metrics)
    try:
        d1.knobs.healthy = False
        await monitor.check_once()
        assert pool.is_live("D1")  # one failed check is not enough
        assert pool.is_live("D2")
        await monitor.check_once()
        assert not pool.is_live("D1")
        assert not pool.is_live("D2")
        assert pool.view().get("D0").load == Load(running=3.0, waiting=0.0, kv_usage=0.25)  # type: ignore[union-attr]
        assert sample(metrics.registry, "ppd_gateway_workers", role="decode", state="down") == 2
        d1.knobs.healthy = True
        clock[0] = 31.0  # D2 sent no heartbeat: removed
        await monitor.check_once()
        assert pool.is_live("D1")
        assert [s.id for s in pool.specs()] == ["D0", "D1"]
    finally:
        await session.close()
        await d0.close()
        await d1.close()


async def test_max_model_len_is_read_from_v1_models_and_again_after_a_worker_was_down() -> None:
    d0 = await FakeWorker("D0", "decode").start()
    d1 = await FakeWorker("D1", "decode", max_model_len=None).start()
    pool = WorkerPool(
        [WorkerSpec("D0", "decode", d0.url), WorkerSpec("D1", "decode", d1.url)],
        heartbeat_expiry_s=30,
        clock=lambda: 0.0,
    )
    session = HttpUpstream.create_session()
    settings = PoolSettings(unhealthy_after=1)
    monitor = PoolMonitor(
        pool, HttpUpstream(session, TimeoutSettings(probe_s=2.0)), settings, GatewayMetrics()
    )
    try:
        await monitor.check_once()
        assert pool.max_model_len(MODEL) == 8192  # D1's card declares none
        assert not pool.needs_models("D1")  # read once, not on every round
        d0.knobs.healthy = False
        await monitor.check_once()
        assert pool.max_model_len(MODEL) is None
        d0.max_model_len = 4096  # restarted with another length
        d0.knobs.healthy = True
        await monitor.check_once()
        assert pool.max_model_len(MODEL) == 4096
    finally:
        await session.close()
        await d0.close()
        await d1.close()


def test_models_from_cards() -> None:
    body = {
        "object": "list",
        "data": [
            {"id": "a", "max_model_len": 100},
            {"id": "b"},
            {"id": "c", "max_model_len": True},
            {"id": "d", "max_model_len": -1},
            "junk",
        ],
    }
    assert models_from_cards(json.dumps(body).encode()) == {"a": 100}
    assert models_from_cards(b"not json") == {}
    assert models_from_cards(b"[1]") == {}
    assert models_from_cards(b'{"data": 3}') == {}
