"""The one place that talks HTTP to workers (the `Upstream` of ports.py over aiohttp): send an
UpstreamCall, map aiohttp's exceptions to ours (errors.py), also in the middle of a stream.

One shared `aiohttp.ClientSession` (it owns the connection pool) with explicit timeouts on every call;
nothing here waits forever.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson

from gateway.errors import (
    UpstreamBrokenError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from gateway.plan import UpstreamCall
from gateway.ports import JsonReply
from gateway.settings import TimeoutSettings

__all__ = ["HttpUpstream", "dumps", "map_exception"]


def dumps(body: Any) -> bytes:
    try:
        return orjson.dumps(body)
    except TypeError:  # integers beyond 64 bits, lone surrogates: the stdlib writes them exactly
        return json.dumps(body, separators=(",", ":")).encode("ascii")


class _Stream:
    """A streamed answer (ports.UpstreamStream): transport errors while reading become
    UpstreamBrokenError."""

    __slots__ = ("_chunks", "_resp", "_worker")

    def __init__(self, resp: aiohttp.ClientResponse, worker: str) -> None:
        self._resp = resp
        self._worker = worker
        self._chunks = resp.content.iter_any()

    def chunks(self) -> AsyncIterator[bytes]:
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise UpstreamBrokenError(type(exc).__name__, worker=self._worker) from exc

    def close(self) -> None:
        self._resp.close()


class HttpUpstream:
    def __init__(
        self, session: aiohttp.ClientSession, timeouts: TimeoutSettings, *, owns_session: bool = False
    ) -> None:
        self._session = session
        self._owns_session = owns_session
        self._t = timeouts
        self._prefill = aiohttp.ClientTimeout(total=timeouts.prefill_s, connect=timeouts.connect_s)
        self._response = aiohttp.ClientTimeout(total=timeouts.response_s, connect=timeouts.connect_s)
        self._stream = aiohttp.ClientTimeout(
            total=None, connect=timeouts.connect_s, sock_read=timeouts.idle_s
        )
        self._probe = aiohttp.ClientTimeout(total=timeouts.probe_s)

    @classmethod
    def create(cls, timeouts: TimeoutSettings) -> HttpUpstream:
        """An upstream with a client session of its own, closed by `close`."""
        return cls(cls.create_session(), timeouts, owns_session=True)

    async def close(self) -> None:
        if self._owns_session:
            await self._session.close()

    @staticmethod
    def create_session() -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30.0)
        return aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=600.0, connect=3.0),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def call_json(self, call: UpstreamCall, *, prefill: bool) -> JsonReply:
        """A non-streaming call read to the end (so its connection goes back to the pool).
        Raises UpstreamStatusError for any non-200 answer."""
        timeout = self._prefill if prefill else self._response
        headers = dict(call.headers)
        headers["Content-Type"] = "application/json"
        try:
            async with self._session.post(
                call.url, data=dumps(call.body), headers=headers, timeout=timeout
            ) as resp:
                body = await resp.read()
                reply = JsonReply(resp.status, body, resp.headers.get("Content-Type", "application/json"))
        except Exception as exc:
            raise map_exception(exc, call.worker) from exc
        if reply.status != 200:
            raise UpstreamStatusError(reply.status, reply.body, worker=call.worker)
        return reply

    async def open_stream(self, call: UpstreamCall) -> _Stream:
        """Send a streaming call and return once the headers are in; the caller must close the
        response. Raises UpstreamStatusError (body read) for any non-200 answer."""
        headers = dict(call.headers)
        headers["Content-Type"] = "application/json"
        try:
            resp = await self._session.post(
                call.url, data=dumps(call.body), headers=headers, timeout=self._stream
            )
        except Exception as exc:
            raise map_exception(exc, call.worker) from exc
        if resp.status != 200:
            try:
                body = await resp.read()
            except Exception:
                body = b""
            finally:
                resp.close()
            raise UpstreamStatusError(resp.status, body, worker=call.worker)
        return _Stream(resp, call.worker)

    async def get(self, url: str) -> JsonReply:
        try:
            async with self._session.get(url, timeout=self._probe) as resp:
                return JsonReply(resp.status, await resp.read(), resp.headers.get("Content-Type", ""))
        except Exception as exc:
            raise map_exception(exc, url) from exc

    async def post(self, url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> JsonReply:
        all_headers = dict(headers)
        all_headers["Content-Type"] = "application/json"
        try:
            async with self._session.post(
                url, data=dumps(body), headers=all_headers, timeout=self._probe
            ) as resp:
                return JsonReply(resp.status, await resp.read(), resp.headers.get("Content-Type", ""))
        except Exception as exc:
            raise map_exception(exc, url) from exc


def map_exception(exc: BaseException, worker: str) -> UpstreamError:
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamTimeoutError(f"worker {worker} timed out", worker=worker)
    if isinstance(exc, aiohttp.ClientError | OSError):
        return UpstreamUnreachableError(f"worker {worker} unreachable: {type(exc).__name__}", worker=worker)
    raise exc
