"""The streaming leg on asyncio Protocols + httptools (gateway/stream_upstream.py), against real HTTP
servers on 127.0.0.1 port 0 that misbehave on purpose: each failure arrives as the same error of ours
as from the aiohttp client (ports.Upstream's contract), connections are reused, and a stream closed
early (the client left) closes its connection so the worker sees it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.errors import (
    UpstreamBrokenError,
    UpstreamStatusError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from gateway.plan import UpstreamCall
from gateway.ports import JsonReply, UpstreamStream
from gateway.settings import TimeoutSettings
from gateway.stream_upstream import ProtocolStreamUpstream
from tests.support.polling import eventually

Writer = asyncio.StreamWriter
Script = Callable[[bytes, Writer, "RawServer"], Awaitable[None]]

_SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@dataclass
class RawServer:
    """An HTTP/1.1 server written by hand: reads each request (head and Content-Length body) and
    answers it with `script`, which may misbehave in any way a worker could. After the script it reads
    on (the next request), so `disconnected` is set as soon as the client closes the connection."""

    script: Script
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)  # for scripts that wait for the test
    server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    def url(self, path: str = "/v1/chat/completions") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: Writer) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                await self.script(head + body, writer, self)
                if writer.is_closing():
                    break
            # a closed connection shows as EOF (or a reset) on the next read
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.disconnected.set()
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], Awaitable[RawServer]]]:
    started: list[RawServer] = []

    async def start(script: Script) -> RawServer:
        raw = RawServer(script)
        raw.server = await asyncio.start_server(raw._serve, "127.0.0.1", 0)
        started.append(raw)
        return raw

    yield start
    for raw in started:
        assert raw.server is not None
        raw.server.close()
        await raw.server.wait_closed()


class _Base:
    """The wrapped client: records what reaches it."""

    def __init__(self) -> None:
        self.streams: list[str] = []
        self.closed = False

    async def call_json(self, call: UpstreamCall, *, prefill: bool) -> JsonReply:
        return JsonReply(200, b"{}", "application/json")

    async def open_stream(self, call: UpstreamCall) -> UpstreamStream:
        self.streams.append(call.url)
        raise UpstreamUnreachableError("base", worker=call.worker)

    async def get(self, url: str) -> JsonReply:
        return JsonReply(200, b"{}", "application/json")

    async def post(self, url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> JsonReply:
        return JsonReply(200, b"{}", "application/json")

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
async def client() -> AsyncIterator[ProtocolStreamUpstream]:
    up = ProtocolStreamUpstream(_Base(), TimeoutSettings(connect_s=2.0, idle_s=0.3))
    yield up
    await up.close()


def _call(url: str, headers: tuple[tuple[str, str], ...] = (("X-Request-Id", "r1"),)) -> UpstreamCall:
    return UpstreamCall("W0", url, {"stream": True, "x": 1}, headers, True)


async def _read_all(stream: UpstreamStream) -> list[bytes]:
    return [data async for data in stream.chunks()]


async def _collect(stream: UpstreamStream, into: list[bytes]) -> None:
    async for data in stream.chunks():
        into.append(data)


async def _sse(request: bytes, writer: Writer, raw: RawServer) -> None:
    writer.write(_SSE_HEAD + _chunk(b"data: {}\n\n"))
    await writer.drain()
    writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


async def test_a_chunked_stream_arrives_whole_and_its_connection_is_reused(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    raw = await serve(_sse)
    for _ in range(3):
        stream = await client.open_stream(_call(raw.url()))
        assert b"".join(await _read_all(stream)) == b"data: {}\n\ndata: [DONE]\n\n"
        stream.close()
    assert raw.connections == 1
    assert len(raw.requests) == 3
    head, body = raw.requests[0].split(b"\r\n\r\n", 1)
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nX-Request-Id: r1" in head
    assert f"\r\nHost: 127.0.0.1:{raw.port}".encode() in head
    assert body == b'{"stream":true,"x":1}'


async def test_a_content_length_body_and_a_body_ended_by_close(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    async def sized(request: bytes, writer: Writer, raw: RawServer) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\ndata: {}\n\n")
        await writer.drain()

    async def until_close(request: bytes, writer: Writer, raw: RawServer) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\ndata: {}\n\n")
        await writer.drain()
        writer.close()

    for script in (sized, until_close):
        raw = await serve(script)
        stream = await client.open_stream(_call(raw.url()))
        assert b"".join(await _read_all(stream)) == b"data: {}\n\n"
        stream.close()


async def test_an_error_status_raises_with_the_workers_body(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    body = b'{"error":{"message":"no","type":"BadRequestError","param":null,"code":400}}'

    def answering(status: int) -> Script:
        async def script(request: bytes, writer: Writer, raw: RawServer) -> None:
            head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            writer.write(head.encode() + b"\r\n\r\n" + body)
            await writer.drain()

        return script

    for status in (500, 400):
        raw = await serve(answering(status))
        with pytest.raises(UpstreamStatusError) as info:
            await client.open_stream(_call(raw.url()))
        assert (info.value.upstream_status, info.value.body, info.value.worker) == (status, body, "W0")
    assert info.value.to_openai_error()[0] == 400


async def test_a_worker_that_closes_mid_stream_breaks_the_stream(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    async def closes(request: bytes, writer: Writer, raw: RawServer) -> None:
        writer.write(_SSE_HEAD + _chunk(b"data: {}\n\n"))
        await writer.drain()
        writer.close()  # gone without the end of the chunked body

    raw = await serve(closes)
    stream = await client.open_stream(_call(raw.url()))
    received: list[bytes] = []
    with pytest.raises(UpstreamBrokenError) as info:
        await _collect(stream, received)
    stream.close()
    assert b"".join(received) == b"data: {}\n\n"
    assert info.value.message == f"worker W0 failed mid-stream: {info.value.cause}"


async def test_a_malformed_chunk_size_breaks_the_stream(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    async def malformed(request: bytes, writer: Writer, raw: RawServer) -> None:
        writer.write(_SSE_HEAD + _chunk(b"data: {}\n\n"))
        await writer.drain()
        writer.write(b"zz\r\ndata: {}\n\n\r\n")
        await writer.drain()
        # then silence: the server only reads on, so it sees when the client closes

    raw = await serve(malformed)
    stream = await client.open_stream(_call(raw.url()))
    with pytest.raises(UpstreamBrokenError) as info:
        await _read_all(stream)
    stream.close()
    assert "malformed response" in info.value.cause
    await asyncio.wait_for(raw.disconnected.wait(), 20)  # the connection was closed, not reused


async def test_a_malformed_status_line_is_unreachable(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    async def garbage(request: bytes, writer: Writer, raw: RawServer) -> None:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        # then silence: the server only reads on, so it sees when the client closes

    raw = await serve(garbage)
    with pytest.raises(UpstreamUnreachableError):
        await client.open_stream(_call(raw.url()))


async def test_a_worker_that_stalls_before_its_headers_times_out(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    async def stalls(request: bytes, writer: Writer, raw: RawServer) -> None:
        pass  # no answer: the server only reads on, so it sees when the client closes

    raw = await serve(stalls)
    with pytest.raises(UpstreamTimeoutError):
        await client.open_stream(_call(raw.url()))
    await asyncio.wait_for(raw.disconnected.wait(), 20)


async def test_a_worker_that_stalls_mid_stream_breaks_the_stream_after_the_idle_timeout(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    async def stalls(request: bytes, writer: Writer, raw: RawServer) -> None:
        writer.write(_SSE_HEAD + _chunk(b"data: {}\n\n"))
        await writer.drain()
        # then silence: the server only reads on, so it sees when the client closes

    raw = await serve(stalls)
    stream = await client.open_stream(_call(raw.url()))
    received: list[bytes] = []
    with pytest.raises(UpstreamBrokenError) as info:
        await _collect(stream, received)
    stream.close()
    assert received == [b"data: {}\n\n"]
    assert info.value.cause == "TimeoutError"
    await asyncio.wait_for(raw.disconnected.wait(), 20)


async def test_a_refused_connection_is_unreachable(client: ProtocolStreamUpstream) -> None:
    gone = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = gone.sockets[0].getsockname()[1]
    gone.close()
    await gone.wait_closed()
    with pytest.raises(UpstreamUnreachableError) as info:
        await client.open_stream(_call(f"http://127.0.0.1:{port}/v1/completions"))
    assert info.value.worker == "W0"


async def test_a_stream_closed_early_closes_its_connection(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    """The client left: the worker sees its connection close (and so stops generating)."""

    async def endless(request: bytes, writer: Writer, raw: RawServer) -> None:
        writer.write(_SSE_HEAD)
        while True:
            writer.write(_chunk(b"data: {}\n\n"))
            await writer.drain()
            await asyncio.sleep(0.01)

    raw = await serve(endless)
    stream = await client.open_stream(_call(raw.url()))
    assert await anext(stream.chunks())
    stream.close()
    await asyncio.wait_for(raw.disconnected.wait(), 20)
    stream.close()  # twice is fine


async def test_cancelled_while_waiting_for_headers_closes_the_connection(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    async def stalls(request: bytes, writer: Writer, raw: RawServer) -> None:
        pass  # no answer: the server only reads on, so it sees when the client closes

    raw = await serve(stalls)
    task = asyncio.create_task(client.open_stream(_call(raw.url())))

    async def sent() -> bool:
        return len(raw.requests) == 1

    await eventually(sent, what="the request reached the worker")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(raw.disconnected.wait(), 20)


async def test_an_idle_connection_the_worker_closed_is_retried_on_a_new_one(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    async def once_per_connection(request: bytes, writer: Writer, raw: RawServer) -> None:
        await _sse(request, writer, raw)
        if raw.connections == 1:
            writer.close()  # keep-alive said, then closed while idle (a worker's keep-alive timeout)

    raw = await serve(once_per_connection)
    stream = await client.open_stream(_call(raw.url()))
    await _read_all(stream)
    stream.close()
    await asyncio.wait_for(raw.disconnected.wait(), 20)
    stream = await client.open_stream(_call(raw.url()))
    assert b"".join(await _read_all(stream)) == b"data: {}\n\ndata: [DONE]\n\n"
    stream.close()
    assert raw.connections == 2


async def test_a_slow_reader_gets_every_byte_of_a_large_answer(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    """Past the high-water mark reading pauses until the reader catches up; nothing is lost."""
    event = b"data: " + b"x" * 4000 + b"\n\n"

    async def large(request: bytes, writer: Writer, raw: RawServer) -> None:
        writer.write(_SSE_HEAD)
        for _ in range(200):
            writer.write(_chunk(event))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    raw = await serve(large)
    stream = await client.open_stream(_call(raw.url()))

    async def written() -> bool:
        return len(raw.requests) == 1

    await eventually(written, what="the request reached the worker")
    assert b"".join(await _read_all(stream)) == event * 200
    stream.close()


async def test_other_schemes_and_calls_go_to_the_wrapped_client() -> None:
    base = _Base()
    up = ProtocolStreamUpstream(base, TimeoutSettings())
    with pytest.raises(UpstreamUnreachableError, match="base"):
        await up.open_stream(_call("https://worker.example/v1/completions"))
    assert base.streams == ["https://worker.example/v1/completions"]
    reply = await up.call_json(_call("http://127.0.0.1:1/x"), prefill=True)
    assert reply.status == 200
    assert (await up.get("http://127.0.0.1:1/health")).status == 200
    assert (await up.post("http://127.0.0.1:1/tokenize", {}, {})).status == 200
    await up.close()
    assert base.closed


async def test_a_header_holding_a_line_break_is_refused_before_sending(
    client: ProtocolStreamUpstream,
) -> None:
    with pytest.raises(ValueError, match="line break"):
        await client.open_stream(_call("http://127.0.0.1:1/x", (("X-Request-Id", "a\r\nX-Evil: 1"),)))


async def test_a_connection_that_receives_bytes_after_its_answer_is_never_reused(
    serve: Callable[[Script], Awaitable[RawServer]], client: ProtocolStreamUpstream
) -> None:
    async def chatty(request: bytes, writer: Writer, raw: RawServer) -> None:
        await _sse(request, writer, raw)
        if raw.connections == 1:
            await raw.go.wait()  # once the client has read the answer to its end
            writer.write(b"HTTP/1.1 200 OK\r\n")
            await writer.drain()

    raw = await serve(chatty)
    stream = await client.open_stream(_call(raw.url()))
    await _read_all(stream)
    stream.close()
    raw.go.set()
    await asyncio.wait_for(raw.disconnected.wait(), 20)  # the client closed it on the stray bytes
    stream = await client.open_stream(_call(raw.url()))
    assert b"".join(await _read_all(stream)) == b"data: {}\n\ndata: [DONE]\n\n"
    stream.close()
    assert raw.connections == 2
