"""A small OpenAI-compatible streaming server for the load generator's tests (127.0.0.1, port 0).

Behaviour per request is chosen by ``FakeOpenAI.behaviour``: ``ok`` streams one content chunk per
token with usage at the end, ``http500`` answers an error status, ``hang`` never answers, ``sse_error``
sends an error event after the first token, ``cut`` closes the stream before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeOpenAI:
    behaviour: str = "ok"
    path_header: str | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    _release: asyncio.Event = field(default_factory=asyncio.Event)

    def release(self) -> None:
        """Let hanging handlers finish (call before shutting the server down)."""
        self._release.set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake/model", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.behaviour == "http500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.behaviour == "hang":
            await self._release.wait()
            return web.json_response({"error": {"message": "released"}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if self.path_header is not None:
            response.headers["X-PPD-Path"] = self.path_header
        await response.prepare(request)
        n_out = int(body["max_tokens"])
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        for i in range(n_out):
            chunk = {"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.behaviour == "sse_error":
                await response.write(b'data: {"error": {"message": "upstream died"}}\n\n')
                return response
        if self.behaviour == "cut":
            return response
        usage = {"prompt_tokens": prompt, "completion_tokens": n_out, "total_tokens": prompt + n_out}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


async def serve(fake: FakeOpenAI) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(fake.app(), shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    return runner, f"http://127.0.0.1:{port}"
