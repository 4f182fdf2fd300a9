"""Fault injection through /admin/faults and at start, and a client that walks away mid-stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from simulator.core.faults import Faults
from simulator.core.profile import load_profile
from simulator.server.worker_group import WorkerGroup
from tests.simulator.client import start_group

pytestmark = pytest.mark.integration

PROMPT = " ".join(f"token{i}" for i in range(60))


@pytest.fixture
async def group() -> AsyncIterator[WorkerGroup]:
    g = await start_group("1P1D")
    yield g
    await g.stop()


def fresh() -> aiohttp.ClientSession:
    """No pooled connections, so every request opens a new TCP connection."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=30)
    )


async def set_faults(url: str, faults: dict[str, Any]) -> dict[str, Any]:
    async with fresh() as http, http.post(f"{url}/admin/faults", json=faults) as r:
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body


async def complete(url: str, **extra: Any) -> tuple[int, Any]:
    async with (
        fresh() as http,
        http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2} | extra) as r,
    ):
        return r.status, await r.json(content_type=None)


async def wait_until_up(url: str) -> None:
    for _ in range(3000):
        try:
            async with fresh() as http, http.get(f"{url}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.01)
    raise AssertionError(f"{url} did not come back")


async def test_get_and_validate_faults(group: WorkerGroup) -> None:
    url = group.worker("D0").url
    async with fresh() as http, http.get(f"{url}/admin/faults") as r:
        assert await r.json() == Faults().as_json()
    for bad in ({"error_rate": 3}, {"down": 1}, {"what": True}):
        async with fresh() as http, http.post(f"{url}/admin/faults", json=bad) as r:
            assert r.status == 400
            assert "error" in await r.json()
    async with fresh() as http, http.post(f"{url}/admin/faults", data=b"{") as r:
        assert r.status == 400


async def test_error_rate(group: WorkerGroup) -> None:
    url = group.worker("D0").url
    assert (await set_faults(url, {"error_rate": 1.0}))["error_rate"] == 1.0
    status, body = await complete(url)
    assert status == 500
    assert body["error"]["type"] == "InternalServerError"
    await set_faults(url, {"error_rate": 0.5})
    statuses = [(await complete(url))[0] for _ in range(30)]
    assert set(statuses) == {200, 500}
    await set_faults(url, {"error_rate": None})
    assert (await complete(url))[0] == 200


async def test_error_seed_restarts_the_error_draws(group: WorkerGroup) -> None:
    url = group.worker("D0").url
    runs = []
    for _ in range(2):
        await set_faults(url, {"error_rate": 0.5, "error_seed": 11})
        runs.append([(await complete(url))[0] for _ in range(16)])
    assert runs[0] == runs[1]
    assert set(runs[0]) == {200, 500}
    async with fresh() as http, http.post(f"{url}/admin/faults", json={"error_seed": -1}) as r:
        assert r.status == 400
        assert "error_seed" in (await r.json())["error"]["message"]


async def test_added_latency(group: WorkerGroup) -> None:
    url = group.worker("D0").url
    await set_faults(url, {"added_latency_ms": 150})
    started = time.monotonic()
    status, _ = await complete(url)
    assert status == 200
    assert time.monotonic() - started >= 0.15  # a lower bound only: the delay was really applied


async def test_down_closes_the_port(group: WorkerGroup) -> None:
    url = group.worker("D0").url
    await set_faults(url, {"down": True})
    with pytest.raises(aiohttp.ClientConnectionError):
        await complete(url)
    with pytest.raises(aiohttp.ClientConnectorError):  # nothing listens any more
        await complete(url)


async def test_down_for_a_while_comes_back_fresh(group: WorkerGroup) -> None:
    d = group.worker("D0")
    url = d.url
    old_engine = d.engine_id
    await set_faults(url, {"down": True, "down_for_s": 0.3})
    await wait_until_up(url)  # (whether or not we saw it down: that is the test above)
    assert d.engine_id != old_engine  # a restarted worker has a new engine (empty prefix cache)
    assert (await complete(url))[0] == 200
    async with fresh() as http, http.get(f"{url}/admin/faults") as r:
        assert (await r.json())["down"] is False


async def test_down_cuts_open_streams(group: WorkerGroup) -> None:
    d = group.worker("D0")
    async with fresh() as http:
        body = {"prompt": "hi", "max_tokens": 5000, "stream": True}
        async with http.post(f"{d.url}/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")
            await set_faults(d.url, {"down": True})
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
    with pytest.raises(aiohttp.ClientConnectionError):
        await complete(d.url)
    assert d.is_down


async def test_down_after_requests(group: WorkerGroup) -> None:
    url = group.worker("D0").url
    await set_faults(url, {"down_after_requests": 2})
    assert (await complete(url))[0] == 200
    assert (await complete(url))[0] == 200
    with pytest.raises(aiohttp.ClientConnectionError):
        await complete(url)
    with pytest.raises(aiohttp.ClientConnectorError):
        await complete(url)


async def test_refuse_connections(group: WorkerGroup) -> None:
    url = group.worker("D0").url
    await set_faults(url, {"refuse_connections": True})
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await complete(url)
    await set_faults(url, {"refuse_connections": False})
    assert (await complete(url))[0] == 200


async def test_early_lease_expiry_fails_the_decode_leg(group: WorkerGroup) -> None:
    p, d = group.worker("P0"), group.worker("D0")
    await set_faults(p.url, {"lease_expiry_s": 0})
    p_body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    status, p_resp = await complete(p.url, **p_body)
    assert status == 200
    params = p_resp["kv_transfer_params"]
    status, body = await complete(d.url, prompt=PROMPT, max_tokens=4, kv_transfer_params=params)
    assert status == 500
    assert body["error"] == {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    # Streaming: the headers are out before the KV read fails, so vLLM sends an error event instead.
    _, p_resp = await complete(p.url, **p_body)
    stream = {
        "prompt": PROMPT,
        "max_tokens": 4,
        "stream": True,
        "kv_transfer_params": p_resp["kv_transfer_params"],
    }
    async with fresh() as http, http.post(f"{d.url}/v1/completions", json=stream) as r:
        assert r.status == 200
        text = await r.text()
    events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    assert json.loads(events[0])["error"]["code"] == 500
    assert events[-1] == "[DONE]"
    assert p.engine.stats().num_pinned == 0


async def test_faults_at_start_per_worker() -> None:
    g = await start_group("2R", worker_faults={"R1": Faults(error_rate=1.0)})
    try:
        assert (await complete(g.worker("R0").url))[0] == 200
        assert (await complete(g.worker("R1").url))[0] == 500
    finally:
        await g.stop()


async def test_client_leaving_mid_stream_aborts_the_request(group: WorkerGroup) -> None:
    d = group.worker("D0")
    async with fresh() as http:
        body = {"prompt": "hi", "max_tokens": 5000, "stream": True}
        async with http.post(f"{d.url}/v1/completions", json=body) as r:
            await r.content.readuntil(b"\n\n")
            assert d.engine.load() == 1
    for _ in range(3000):
        if d.engine.load() == 0:
            break
        await asyncio.sleep(0.01)
    assert d.engine.load() == 0
    assert (await complete(d.url))[0] == 200


@pytest.mark.parametrize("leg", ["decode", "prefill"])
async def test_client_leaving_a_non_streaming_request_aborts_it(leg: str) -> None:
    """vLLM aborts a non-streaming request whose client went away, the P leg of P/D included."""
    profile = None
    body: dict[str, Any] = {"prompt": "hi", "max_tokens": 5000, "ignore_eos": True}
    if leg == "prefill":  # a prefill of hours, surely still running when the client leaves
        profile = load_profile().with_overrides(
            {"hardware.flops_per_s": 1e8, "hardware.hbm_bytes_per_s": 1e8}
        )
        body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    g = await start_group("1P1D", profile=profile)
    try:
        w = g.worker("P0" if leg == "prefill" else "D0")
        call = asyncio.create_task(complete(w.url, **body))
        for _ in range(3000):
            if w.driver.num_active == 1:
                break
            await asyncio.sleep(0.01)
        assert w.driver.num_active == 1
        call.cancel()  # the client goes away: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(3000):
            if w.driver.num_active == 0:
                break
            await asyncio.sleep(0.01)
        assert (w.driver.num_active, w.engine.load(), w.engine.running_count()) == (0, 0, 0)
        assert w.engine.stats().num_pinned == 0  # an aborted P leg pins nothing for a D that never comes
    finally:
        await g.stop()


async def test_a_downed_prefill_worker_fails_the_decode_leg(group: WorkerGroup) -> None:
    p, d = group.worker("P0"), group.worker("D0")
    p_body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    _, p_resp = await complete(p.url, **p_body)
    await set_faults(p.url, {"down": True})
    status, body = await complete(
        d.url, prompt=PROMPT, max_tokens=4, kv_transfer_params=p_resp["kv_transfer_params"]
    )
    assert status == 500
    assert body["error"]["message"] == "Internal server error"


async def test_an_unexpected_error_is_a_500_and_the_worker_lives_on(
    group: WorkerGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    import simulator.server.worker

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(simulator.server.worker, "completion_steps", broken)
    url = group.worker("D0").url
    status, body = await complete(url)
    assert status == 500
    assert body["error"] == {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    monkeypatch.undo()
    assert (await complete(url))[0] == 200


async def test_a_dead_engine_fails_requests_and_health(
    group: WorkerGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = group.worker("D0")

    def broken(now: float, horizon: float = 0.0) -> None:
        raise RuntimeError("engine bug")

    monkeypatch.setattr(d.engine, "step", broken)
    status, body = await complete(d.url)
    assert status == 500
    assert body["error"]["code"] == 500
    async with fresh() as http, http.get(f"{d.url}/health") as r:
        assert r.status == 503
    status, _ = await complete(d.url)  # refused at once, no hang
    assert status == 500
    assert (await complete(group.worker("P0").url))[0] == 200  # the other workers live on
