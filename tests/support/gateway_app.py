"""The gateway app from a settings mapping, served on 127.0.0.1:0 in the test's event loop with a
client session beside it (one place, for the tests that run the app on simulated workers)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from gateway.app import create_app
from gateway.settings import Settings

__all__ = ["kv_events_settings", "served_gateway"]


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


def kv_events_settings(workers: Mapping[str, Any], *, block_size: int = 16) -> dict[str, Any]:
    """The gateway's `[kv_events]` for simulated workers by id (each one's `describe()` names its
    publisher and replay endpoints), with this process's PYTHONHASHSEED as the hash seed."""
    return {
        "endpoints": {i: w.describe()["kv_events"] for i, w in workers.items()},
        "replay_endpoints": {i: w.describe()["kv_events_replay"] for i, w in workers.items()},
        "hash_seed": os.environ.get("PYTHONHASHSEED", ""),
        "block_size": block_size,
    }
