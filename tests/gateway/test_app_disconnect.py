"""A client that goes away aborts the worker's request, in every mode, on every leg, streamed or not:
the gateway in front of simulated vLLM workers (in-process, real HTTP on 127.0.0.1), each worker's own
engine telling whether the request still runs there."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.app import DEPS, create_app
from gateway.settings import Settings
from simulator.core.profile import Profile, load_profile
from simulator.core.topology import Topology
from simulator.core.worker_settings import DEFAULT_MODEL, WorkerSettings
from simulator.server.worker import Worker
from simulator.server.worker_group import GroupSettings, WorkerGroup
from tests.support.metrics import sample

pytestmark = pytest.mark.integration

# Prefill of hours: a P leg surely still runs when the client leaves.
SLOW_PREFILL = {"hardware.flops_per_s": 1e8, "hardware.hbm_bytes_per_s": 1e8}


@dataclass
class _Stack:
    group: WorkerGroup
    server: TestServer

    @property
    def url(self) -> str:
        return str(self.server.make_url("/v1/chat/completions"))

    def inflight(self) -> float:
        return sample(self.server.app[DEPS].metrics.registry, "ppd_gateway_requests_in_flight") or 0.0


@asynccontextmanager
async def _stack(profile: Profile) -> AsyncIterator[_Stack]:
    group = WorkerGroup(
        GroupSettings(
            topology=Topology.parse("1P1D"),
            base_port=0,
            worker=WorkerSettings(worker_id="W", role="replica"),
            spin_s=0.0,
        ),
        profile,
    )
    await group.start()
    config: dict[str, Any] = {
        "mode": "pd",
        "allow_mode_header": True,  # each test names the mode it provokes (X-PPD-Mode)
        "workers": [w.describe() for w in group.workers],
        "pool": {"health_interval_s": 3600.0},
        "sessions": {"sweep_interval_s": 3600.0},
        "decision": {"fallback": "local"},  # ppd mode without a service: every Turn 2+ local
    }
    server = TestServer(create_app(Settings.from_mapping(config)), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        yield _Stack(group, server)
    finally:
        await server.close()
        await group.stop()


async def _until(check: Any, what: str) -> None:
    for _ in range(3000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never true: {what}")


async def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.read()


async def _leave_while_running(stack: _Stack, worker: Worker, body: dict[str, Any], mode: str) -> None:
    """Send `body`, go away once `worker` runs it, and see the worker drop it."""
    call = asyncio.create_task(_post(stack.url, body, {"X-PPD-Mode": mode, "X-Session-ID": "leaver"}))
    await _until(lambda: worker.driver.num_active == 1 or call.done(), "the worker runs the request")
    assert not call.done()
    call.cancel()  # the client closes its connection
    with pytest.raises(asyncio.CancelledError):
        await call
    await _until(lambda: worker.driver.num_active == 0, "the worker dropped the request")
    assert (worker.engine.load(), worker.engine.running_count()) == (0, 0)
    await _until(lambda: stack.inflight() == 0, "the gateway finished the request")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["pd", "local", "ppd"])
async def test_client_leaving_aborts_the_decode_leg(mode: str, stream: bool) -> None:
    async with _stack(load_profile()) as stack:
        d = stack.group.worker("D0")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
        first = await _post(stack.url, {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 4}, {
            "X-Session-ID": "leaver"
        })  # fmt: skip
        assert first
        messages += [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "go on"}]
        body = {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 20000, "ignore_eos": True}
        await _leave_while_running(stack, d, body | {"stream": stream}, mode)
        assert stack.group.worker("P0").engine.stats().num_pinned == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["pd", "local", "ppd"])
async def test_client_leaving_aborts_the_prefill_leg(mode: str, stream: bool) -> None:
    async with _stack(load_profile().with_overrides(SLOW_PREFILL)) as stack:
        p, d = stack.group.worker("P0"), stack.group.worker("D0")
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": stream}
        await _leave_while_running(stack, p, body, mode)  # Turn 1: through P in every mode
        assert p.engine.stats().num_pinned == 0
        assert (d.driver.num_active, d.engine.stats().prefix_cache_queries) == (0, 0)  # D never saw it
