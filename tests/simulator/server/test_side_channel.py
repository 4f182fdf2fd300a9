"""The KV side channel between processes: claim and release over HTTP, and a dead remote is a failed claim."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from simulator.server.side_channel import KvRemote, SideChannelClient, SideChannelServer


class FakeSource:
    """A prefill worker's leases: `held` can be claimed once each."""

    node = "P0"

    def __init__(self, held: set[str]) -> None:
        self.held = held
        self.claimed: list[tuple[str, float]] = []
        self.released: list[tuple[str, float]] = []

    def claim_lease(self, remote_request_id: str, now: float) -> bool:
        self.claimed.append((remote_request_id, now))
        if remote_request_id not in self.held:
            return False
        self.held.discard(remote_request_id)
        return True

    def release_lease(self, remote_request_id: str, now: float) -> None:
        self.released.append((remote_request_id, now))


async def _read_json(request: web.Request) -> Any:
    return json.loads(await request.read())


@pytest.fixture
async def holder() -> AsyncIterator[tuple[FakeSource, KvRemote]]:
    source = FakeSource({"lease-1"})
    app = web.Application()
    SideChannelServer(source, now=lambda: 7.0, read_json=_read_json).add_routes(app.router)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        assert server.port is not None
        yield (
            source,
            KvRemote(engine_id="P0-x", remote_request_id="lease-1", host="127.0.0.1", port=server.port),
        )
    finally:
        await server.close()


async def test_claim_once_then_release(holder: tuple[FakeSource, KvRemote]) -> None:
    source, remote = holder
    client = SideChannelClient("D0")
    try:
        assert await client.call(remote, "claim") is True
        assert await client.call(remote, "claim") is False  # 410: already being read
        assert await client.call(remote, "release") is True
    finally:
        await client.close()
    assert source.claimed == [("lease-1", 7.0), ("lease-1", 7.0)]
    assert source.released == [("lease-1", 7.0)]


async def test_a_dead_remote_is_a_failed_claim_not_an_error() -> None:
    client = SideChannelClient("D0")
    remote = KvRemote(engine_id="gone", remote_request_id="x", host="127.0.0.1", port=9)  # discard port
    try:
        assert await client.call(remote, "claim") is False
    finally:
        await client.close()
        await client.close()  # closing twice is harmless
