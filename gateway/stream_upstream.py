"""The streaming leg to workers without aiohttp: an asyncio Protocol (uvloop's transport) with
httptools' response parser, for `Upstream.open_stream` only (issue 16: the per-chunk cost of the
aiohttp client, its StreamReader and its per-read timeout, is most of a relayed chunk's CPU).

`ProtocolStreamUpstream` wraps the aiohttp `Upstream` (upstream.py): whole answers, probes and
tokenize calls still go there; `open_stream` to an `http://` worker comes here (any other scheme goes
to the wrapped one). It keeps the wrapped client's contract (ports.py): UpstreamStatusError (the body
read) for a non-200 answer, UpstreamTimeoutError when the connection or the headers take too long,
UpstreamUnreachableError when the worker cannot be reached or drops the connection before answering,
UpstreamBrokenError once the stream started (reset, close before the body's end, a malformed body,
silence longer than `idle_s` between two reads). The timeouts are the aiohttp stream's: `connect_s` for
the connection, `idle_s` for the headers and between two reads of the body.

Connections are kept alive per (host, port), at most `max_idle_per_host` idle ones, each dropped after
`keepalive_s` unused; a stream read to its end with a keep-alive answer gives its connection back, a
stream closed before its end (the client left) closes it, so the worker sees the disconnect. A reused
connection the worker had closed meanwhile (no byte of an answer on it) is retried once on a new one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from gateway.errors import (
    UpstreamBrokenError,
    UpstreamStatusError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from gateway.plan import UpstreamCall
from gateway.ports import JsonReply, Upstream, UpstreamStream
from gateway.settings import TimeoutSettings
from gateway.upstream import dumps

__all__ = ["ProtocolStreamUpstream"]

# Reading from a worker pauses while this much of its answer waits for a slow client (resumes at a
# quarter of it), as aiohttp's StreamReader does.
_HIGH_WATER = 256 * 1024
_LOW_WATER = _HIGH_WATER // 4


class _ConnectionFailedError(Exception):
    """How a connection failed; `before_answer` while no byte of the answer had arrived."""

    def __init__(self, cause: str, *, before_answer: bool, timeout: bool = False) -> None:
        super().__init__(cause)
        self.cause = cause
        self.before_answer = before_answer
        self.timeout = timeout


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to a worker, one exchange at a time. The parser's callbacks fill
    `_body`; the reader waits on `_waiter`, created only when it finds nothing to read."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_s: float) -> None:
        self._loop = loop
        self._idle_s = idle_s
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0
        self.status = 0
        self.keep_alive = False
        self._busy = False  # in an exchange (between send and the stream's close)
        self._got_bytes = False
        self._headers_done = False
        self._complete = False
        self._until_close = True  # no Content-Length and not chunked: the body ends with the connection
        self.failure: _ConnectionFailedError | None = None
        self.closed = False
        self.idle_since = 0.0

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if not self._busy or self._complete:  # bytes after the answer: out of step, never reuse it
            self.abort()
            return
        self._got_bytes = True
        self._last_read = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail("upgrade")
        except httptools.HttpParserError as exc:
            self._fail(f"malformed response ({type(exc).__name__})")
            return
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost says the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.stop_timer()
        if not self._complete and self.failure is None:
            if self._headers_done and self._until_close and exc is None:
                self._complete = True  # a body delimited by the end of the connection
            else:
                cause = type(exc).__name__ if exc is not None else "ServerDisconnectedError"
                self.failure = _ConnectionFailedError(cause, before_answer=not self._got_bytes)
        self._wake()

    # ------------------------------------------------------------------ httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self._until_close = False

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = bool(self._parser.should_keep_alive())
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        self._complete = True
        self.stop_timer()

    # ------------------------------------------------------------------ the exchange

    def _fail(self, cause: str) -> None:
        if self.failure is None and not self._complete:
            self.failure = _ConnectionFailedError(cause, before_answer=not self._got_bytes)
        self.abort()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_idle(self) -> None:
        """One timer per `idle_s` of silence, not one per read: it re-arms from the last read."""
        self._timer = None
        due = self._last_read + self._idle_s
        if self._paused:  # a slow client, not a silent worker
            self._last_read = self._loop.time()
            due = self._last_read + self._idle_s
        if self._loop.time() >= due:
            if self.failure is None and not self._complete:
                self.failure = _ConnectionFailedError(
                    "TimeoutError", before_answer=not self._headers_done, timeout=True
                )
            self.abort()
            self._wake()
        else:
            self._timer = self._loop.call_at(due, self._check_idle)

    def send(self, request: bytes) -> None:
        """Start one exchange on this (new or idle) connection."""
        assert self._transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._body.clear()
        self._buffered = 0
        self.status = 0
        self._busy = True
        self._got_bytes = False
        self._headers_done = False
        self._complete = False
        self._until_close = True
        self.failure = None
        self._last_read = self._loop.time()
        self._timer = self._loop.call_at(self._last_read + self._idle_s, self._check_idle)
        self._transport.write(request)

    async def headers(self) -> None:
        while not self._headers_done:
            if self.failure is not None:
                raise self.failure
            await self.waiter()

    def take(self) -> bytes | None:
        """The body bytes received since the last call (never empty); b"" at the body's end; None
        when the caller must `wait`. Raises _ConnectionFailedError."""
        body = self._body
        if body:
            data = body.popleft() if len(body) == 1 else b"".join(body)
            body.clear()
            self._buffered = 0
            if self._paused and self._transport is not None:
                self._paused = False
                self._transport.resume_reading()
            return data
        if self._complete:
            self.stop_timer()
            return b""
        if self.failure is not None:
            raise self.failure
        return None

    def waiter(self) -> asyncio.Future[None]:
        """Done at the next read, end or failure."""
        self._waiter = waiter = self._loop.create_future()
        return waiter

    def idle(self) -> None:
        """Back in the pool: any byte from the worker now closes it."""
        self._busy = False

    @property
    def reusable(self) -> bool:
        return self._complete and self.keep_alive and not self.closed and self.failure is None

    def abort(self) -> None:
        self.stop_timer()
        self.closed = True
        if self._transport is not None:
            self._transport.abort()


class _Stream:
    """A streamed answer (ports.UpstreamStream) on one connection."""

    __slots__ = ("_conn", "_done", "_key", "_owner", "_worker")

    def __init__(
        self, owner: ProtocolStreamUpstream, key: tuple[str, int], conn: _Connection, worker: str
    ) -> None:
        self._owner = owner
        self._key = key
        self._conn = conn
        self._worker = worker
        self._done = False

    def chunks(self) -> AsyncIterator[bytes]:
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        # One coroutine and (only when nothing is buffered) one future per chunk: the hot path.
        conn = self._conn
        while True:
            try:
                data = conn.take()
            except _ConnectionFailedError as exc:
                raise UpstreamBrokenError(exc.cause, worker=self._worker) from None
            if data:
                return data
            if data is not None:
                raise StopAsyncIteration
            await conn.waiter()

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        conn = self._conn
        if conn.reusable:
            self._owner._give_back(self._key, conn)
        else:
            conn.abort()


class ProtocolStreamUpstream:
    """`Upstream` whose `open_stream` runs on asyncio Protocols + httptools; the rest is `base`'s."""

    def __init__(
        self,
        base: Upstream,
        timeouts: TimeoutSettings,
        *,
        max_idle_per_host: int = 256,
        keepalive_s: float = 30.0,
    ) -> None:
        self._base = base
        self._t = timeouts
        self._max_idle = max_idle_per_host
        self._keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes, bytes] | None] = {}
        self._closed = False

    # ------------------------------------------------------------------ the wrapped client's calls

    async def call_json(self, call: UpstreamCall, *, prefill: bool) -> JsonReply:
        return await self._base.call_json(call, prefill=prefill)

    async def get(self, url: str) -> JsonReply:
        return await self._base.get(url)

    async def post(self, url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> JsonReply:
        return await self._base.post(url, body, headers)

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
        await self._base.close()

    # ------------------------------------------------------------------ streams

    def _target(self, url: str) -> tuple[tuple[str, int], bytes, bytes] | None:
        """(host, port), the request line's start and the Host header of an http:// URL; None for
        any other scheme. Cached per URL (a worker's URL is one of a few)."""
        try:
            return self._targets[url]
        except KeyError:
            pass
        parts = urlsplit(url)
        target: tuple[tuple[str, int], bytes, bytes] | None = None
        if parts.scheme == "http" and parts.hostname:
            port = parts.port or 80
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = parts.netloc.rsplit("@", 1)[-1]
            target = (
                (parts.hostname, port),
                f"POST {path} HTTP/1.1\r\n".encode("latin-1"),
                host.encode("latin-1"),
            )
        if len(self._targets) < 1024:
            self._targets[url] = target
        return target

    def _give_back(self, key: tuple[str, int], conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self._max_idle:
            conn.abort()
            return
        conn.stop_timer()
        conn.idle()
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    def _reuse(self, key: tuple[str, int], now: float) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive_s:
                return conn
            conn.abort()
        return None

    async def _connect(self, key: tuple[str, int], worker: str) -> _Connection:
        loop = asyncio.get_running_loop()
        idle_s = self._t.idle_s
        try:
            async with asyncio.timeout(self._t.connect_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop, idle_s), key[0], key[1])
        except TimeoutError:
            raise UpstreamTimeoutError(f"worker {worker} timed out", worker=worker) from None
        except OSError as exc:
            raise UpstreamUnreachableError(
                f"worker {worker} unreachable: {type(exc).__name__}", worker=worker
            ) from None
        return conn

    async def open_stream(self, call: UpstreamCall) -> UpstreamStream:
        target = self._target(call.url)
        if target is None:
            return await self._base.open_stream(call)
        key, request_line, host = target
        request = _request(request_line, host, call)
        loop = asyncio.get_running_loop()
        worker = call.worker
        conn = self._reuse(key, loop.time())
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(key, worker)
            try:
                conn.send(request)
                await conn.headers()
                break
            except _ConnectionFailedError as exc:
                conn.abort()
                if reused and exc.before_answer and not exc.timeout:
                    conn, reused = None, False  # the worker had closed this idle connection
                    continue
                if exc.timeout:
                    raise UpstreamTimeoutError(f"worker {worker} timed out", worker=worker) from None
                raise UpstreamUnreachableError(
                    f"worker {worker} unreachable: {exc.cause}", worker=worker
                ) from None
            except BaseException:
                conn.abort()  # cancelled while waiting: the worker sees the disconnect
                raise
        stream = _Stream(self, key, conn, worker)
        if conn.status == 200:
            return stream
        parts: list[bytes] = []
        try:
            async for data in stream:
                parts.append(data)
        except UpstreamBrokenError:
            pass
        finally:
            stream.close()
        raise UpstreamStatusError(conn.status, b"".join(parts), worker=worker)


def _request(request_line: bytes, host: bytes, call: UpstreamCall) -> bytes:
    body = dumps(call.body)
    head = [request_line, b"Host: ", host, b"\r\nContent-Type: application/json\r\nContent-Length: "]
    head.append(str(len(body)).encode("ascii"))
    head.append(b"\r\n")
    for name, value in call.headers:
        if name.lower() in ("content-type", "content-length", "host", "transfer-encoding", "connection"):
            continue
        line = f"{name}: {value}\r\n"
        if "\n" in line[:-2] or "\r" in line[:-2]:
            raise ValueError(f"header {name!r} holds a line break")
        head.append(line.encode("latin-1"))
    head.append(b"\r\n")
    head.append(body)
    return b"".join(head)
