"""The one fake OpenAI-compatible server of the tests: a tiny in-process stand-in for a vLLM worker
(P, D or R), served on 127.0.0.1:0. It records every request and can be told to fail in the ways the
gateway's failure policy and the load generator's records name (``Knobs``). The gateway's app tests
and the load generator's tests run against it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class Knobs:
    status: int | None = None  # answer this error status to completions
    hang: bool = False  # never answer completions
    break_after: int | None = None  # streaming: close the connection after this many chunks
    chunk_delay_s: float = 0.0
    no_done: bool = False  # streaming: end cleanly but without data: [DONE]
    error_event: bool = False  # streaming: send vLLM's error event mid-stream
    healthy: bool = True
    linger_after_done_s: float = 0.0  # streaming: keep the response open a while after [DONE]
    path_header: str | None = None  # streaming: answer with this X-PPD-Path, as the gateway does


@dataclass
class FakeWorker:
    id: str
    role: str
    knobs: Knobs = field(default_factory=Knobs)
    seen: list[Seen] = field(default_factory=list)
    aborted: int = 0
    aborted_event: asyncio.Event = field(default_factory=asyncio.Event)
    started_event: asyncio.Event = field(default_factory=asyncio.Event)
    running: int = 0
    # Declared in the /v1/models card (vLLM's ModelCard field); None leaves it out.
    max_model_len: int | None = 8192
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def completions(self) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith("/v1/")]

    def bodies(self) -> list[dict[str, Any]]:
        """The bodies of the completion requests, in arrival order."""
        return [s.body for s in self.completions()]

    async def start(self) -> FakeWorker:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        self.server = TestServer(app, host="127.0.0.1", port=0)
        await self.server.start_server()
        return self

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if self.knobs.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        text = (
            f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} {self.running}.0\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.25\n'
        )
        return web.Response(text=text)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        card: dict[str, Any] = {"id": MODEL, "object": "model", "owned_by": "vllm", "root": MODEL}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, dict(request.headers), body))
        text = json.dumps(body.get("messages") or body.get("prompt"))
        return web.json_response({"count": len(text.split()), "max_model_len": 8192, "tokens": []})

    async def _detokenize(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return web.json_response({"prompt": " ".join(str(t) for t in body.get("tokens", []))})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, dict(request.headers), body))
        self.started_event.set()
        chat = request.path.endswith("chat/completions")
        k = self.knobs
        if k.hang:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.aborted += 1
                self.aborted_event.set()
                raise
        if k.status is not None:
            err = {
                "error": {
                    "message": f"fake {k.status}",
                    "type": "BadRequestError",
                    "param": None,
                    "code": k.status,
                }
            }
            return web.json_response(err, status=k.status)
        n = body.get("max_completion_tokens") or body.get("max_tokens") or 8
        rid = request.headers.get("X-Request-Id", "x")
        prompt_tokens = _prompt_tokens(body)
        kv = None
        if self.role == "prefill" and isinstance(body.get("kv_transfer_params"), dict):
            kv = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": f"engine-{self.id}",
                "remote_request_id": f"{rid}-int",
                "remote_host": "localhost",
                "remote_port": 5600,
                "tp_size": 1,
            }
        words = [f"w{i} " for i in range(n)]
        if not body.get("stream"):
            text = "".join(words)
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out = {
                "id": ("chatcmpl-" if chat else "cmpl-") + rid,
                "object": "chat.completion" if chat else "text_completion",
                "model": body.get("model"),
                "choices": [choice],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                },
                "kv_transfer_params": kv,
            }
            return web.json_response(out)
        return await self._stream(request, body, words, chat=chat, rid=rid, prompt_tokens=prompt_tokens)

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        words: list[str],
        *,
        chat: bool,
        rid: str,
        prompt_tokens: int,
    ) -> web.StreamResponse:
        k = self.knobs
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if k.path_header is not None:
            resp.headers["X-PPD-Path"] = k.path_header
        await resp.prepare(request)
        self.running += 1
        try:
            for i, word in enumerate(words):
                if k.break_after is not None and i == k.break_after:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if k.error_event and i == 1:
                    err = {
                        "error": {"message": "fake engine error", "type": "InternalServerError", "code": 500}
                    }
                    await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                delta = {"content": word} if i else {"role": "assistant", "content": word}
                choice: dict[str, Any] = {"index": 0, "finish_reason": None}
                if chat:
                    choice["delta"] = delta
                else:
                    choice["text"] = word
                chunk = {"id": rid, "object": "chat.completion.chunk", "choices": [choice]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if k.chunk_delay_s:
                    await asyncio.sleep(k.chunk_delay_s)
            options = body.get("stream_options") or {}
            if options.get("include_usage"):
                n = len(words)
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                }
                await resp.write(
                    f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n".encode()
                )
            if not k.no_done:
                await resp.write(b"data: [DONE]\n\n")
            if k.linger_after_done_s:
                await asyncio.sleep(k.linger_after_done_s)
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted += 1
            self.aborted_event.set()
            raise
        finally:
            self.running -= 1
        return resp


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) + 5 for m in body["messages"])
    return len(str(body.get("prompt", "")).split())
