"""The KV side channel between workers in different processes: the simulator's stand-in for NIXL's.

In one process a decode worker claims a prefill worker's lease with a call (`KvSource`). Across
processes it posts `{"remote_request_id": ...}` to the `remote_host:remote_port` the prefill worker
advertised in its `kv_transfer_params`: `POST /_nixl/claim` (200 `{"claimed": true}`, or 410 when the
blocks are gone) before the pull, `POST /_nixl/release` after it. Bidirectional mode uses the same
channel with the roles swapped (a prefill worker reading a decode worker's blocks).

Invariants:
- Rule 1: a failed call (connection refused, timeout, any status but 200) is a failed claim, never an
  exception: the caller turns it into a failed KV load.
- Rule 2: one client session per worker, opened at the first call and closed by `close()`; each call
  is bounded by `CALL_TIMEOUT_S`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import web

from simulator.core.api_error import ApiError
from simulator.server.fabric import KvSource

__all__ = ["CALL_TIMEOUT_S", "KvRemote", "SideChannelClient", "SideChannelServer"]

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0

Action = Literal["claim", "release"]


@dataclass(slots=True)
class KvRemote:
    """A request's source of KV until the pull starts (in this process or behind host:port)."""

    engine_id: str
    remote_request_id: str
    host: str | None
    port: int | None
    expires_at: float | None = None  # a decode worker's bidirectional pin (`remote_blocks_expiry_time`)


class SideChannelClient:
    """The reading side: claims and releases another process's blocks over HTTP."""

    def __init__(self, worker_id: str) -> None:
        self._worker_id = worker_id
        self._session: aiohttp.ClientSession | None = None

    async def call(self, remote: KvRemote, action: Action) -> bool:
        """True when the remote answered 200 (claimed, or released)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
        url = f"http://{remote.host}:{remote.port}/_nixl/{action}"
        try:
            async with self._session.post(url, json={"remote_request_id": remote.remote_request_id}) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("worker %s: side channel %s failed: %s", self._worker_id, url, exc)
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class SideChannelServer:
    """The holding side: `/_nixl/claim` and `/_nixl/release` over this worker's leases."""

    def __init__(
        self,
        source: KvSource,
        *,
        now: Callable[[], float],
        read_json: Callable[[web.Request], Awaitable[Any]],
    ) -> None:
        self._source = source
        self._now = now
        self._read_json = read_json

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/_nixl/claim", self.claim)
        router.add_post("/_nixl/release", self.release)

    async def _remote_request_id(self, request: web.Request) -> str:
        body = await self._read_json(request)
        rrid = body.get("remote_request_id") if isinstance(body, dict) else None
        if not isinstance(rrid, str):
            raise ApiError(400, "remote_request_id: Field required", param="remote_request_id")
        return rrid

    async def claim(self, request: web.Request) -> web.Response:
        rrid = await self._remote_request_id(request)
        claimed = self._source.claim_lease(rrid, self._now())
        return web.json_response({"claimed": claimed}, status=200 if claimed else 410)

    async def release(self, request: web.Request) -> web.Response:
        rrid = await self._remote_request_id(request)
        self._source.release_lease(rrid, self._now())
        return web.json_response({"released": True})
