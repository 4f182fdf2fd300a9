"""A worker that has begun to stop answers a request still being parsed with 503 (vLLM's error body);
the decode leg it refused can still be served by another decode worker."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.simulator.client import start_alone
from tests.support.nixl import prefill_kv_params

pytestmark = pytest.mark.integration

PROMPT = " ".join(f"word{i}" for i in range(100))


async def complete(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(f"{url}/v1/completions", json=body) as response:
        return response.status, await response.json()


async def test_a_stopping_worker_refuses_a_half_parsed_request() -> None:
    prefill, decode, other = (
        await start_alone("P0", "prefill"),
        await start_alone("D0", "decode"),
        await start_alone("D1", "decode"),
    )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            p_leg = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": prefill_kv_params()}
            status, p_reply = await complete(session, prefill.workers[0].url, p_leg)
            assert status == 200
            d_leg = {"prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": p_reply["kv_transfer_params"]}
            decode.workers[0].begin_stop()
            status, body = await complete(session, decode.workers[0].url, d_leg)
            assert status == 503
            assert body["error"]["message"] == "The server is shutting down"
            await decode.stop()
            # A worker on its way out does not call P's side channel: the blocks stay for another D.
            status, body = await complete(session, other.workers[0].url, d_leg)
            assert status == 200
            assert body["usage"]["completion_tokens"] == 3
    finally:
        for group in (prefill, decode, other):
            await group.stop()
