"""The HTTP client to workers (gateway/upstream.py): every transport failure arrives as one of our
errors, in the middle of a stream too, so nothing past this module sees an aiohttp exception."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.errors import UpstreamBrokenError, UpstreamStatusError, UpstreamUnreachableError
from gateway.plan import UpstreamCall
from gateway.settings import TimeoutSettings
from gateway.upstream import HttpUpstream


async def _ok(request: web.Request) -> web.StreamResponse:
    return web.json_response({"echo": await request.json()})


async def _fail(request: web.Request) -> web.StreamResponse:
    return web.json_response({"error": {"message": "no"}}, status=500)


async def _breaks(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    await response.write(b"data: {}\n\n")
    assert request.transport is not None
    request.transport.close()  # gone without the end of the chunked body
    return response


@pytest.fixture
async def server() -> AsyncIterator[TestServer]:
    app = web.Application()
    app.router.add_post("/ok", _ok)
    app.router.add_post("/fail", _fail)
    app.router.add_post("/breaks", _breaks)
    served = TestServer(app, host="127.0.0.1", port=0)
    await served.start_server()
    yield served
    await served.close()


@pytest.fixture
async def upstream() -> AsyncIterator[HttpUpstream]:
    client = HttpUpstream.create(TimeoutSettings(connect_s=2.0, probe_s=2.0))
    yield client
    await client.close()


def _call(server: TestServer, path: str, *, stream: bool = False) -> UpstreamCall:
    return UpstreamCall("W0", str(server.make_url(path)), {"x": 1}, (("X-Request-Id", "r1"),), stream)


async def test_a_whole_answer_and_an_error_status(server: TestServer, upstream: HttpUpstream) -> None:
    reply = await upstream.call_json(_call(server, "/ok"), prefill=False)
    assert (reply.status, reply.json()) == (200, {"echo": {"x": 1}})
    with pytest.raises(UpstreamStatusError) as info:
        await upstream.call_json(_call(server, "/fail"), prefill=True)
    assert (info.value.upstream_status, info.value.worker) == (500, "W0")


async def test_a_stream_that_breaks_raises_upstream_broken(
    server: TestServer, upstream: HttpUpstream
) -> None:
    stream = await upstream.open_stream(_call(server, "/breaks", stream=True))
    received: list[bytes] = []

    async def read_all() -> None:
        async for data in stream.chunks():
            received.append(data)

    try:
        with pytest.raises(UpstreamBrokenError) as info:
            await read_all()
    finally:
        stream.close()
    assert b"".join(received) == b"data: {}\n\n"
    assert info.value.message == f"worker W0 failed mid-stream: {info.value.cause}"


async def test_a_worker_that_is_not_there_is_unreachable(upstream: HttpUpstream) -> None:
    gone = TestServer(web.Application(), host="127.0.0.1", port=0)
    await gone.start_server()
    url = str(gone.make_url("/v1/completions"))
    await gone.close()
    with pytest.raises(UpstreamUnreachableError):
        await upstream.call_json(UpstreamCall("W1", url, {}, (), False), prefill=False)
    with pytest.raises(UpstreamUnreachableError):
        await upstream.open_stream(UpstreamCall("W1", url, {}, (), True))
