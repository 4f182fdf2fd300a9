"""The gateway app from a settings mapping, served on 127.0.0.1:0 in the test's event loop with a
client session beside it (one place, for the tests that run the app on simulated workers)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from gateway.app import create_app
from gateway.settings import Settings

__all__ = ["served_gateway"]


@contextlib.asynccontextmanager
async def served_gateway(
    config: Mapping[str, Any],
) -> AsyncIterator[tuple[TestServer, aiohttp.ClientSession]]:
    """The started server and an open client session; both closed on exit."""
    server = TestServer(create_app(Settings.from_mapping(dict(config))), host="127.0.0.1", port=0)
    await server.start_server()
    http = aiohttp.ClientSession()
    try:
        yield server, http
    finally:
        await http.close()
        await server.close()
