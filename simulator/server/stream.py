"""The response writer of one generation request: vLLM's SSE stream, or the whole body at the end.

A `GenerationRun` takes the request's step emissions from its `JobHandle` queue, turns them into token
ids (the sampled output), text and vLLM chunks (`simulator.core.responses`), and writes them to the
client; it counts the tokens into the worker's metrics and asks the worker for the request's
`kv_transfer_params` when it finishes.

Invariants:
- Rule 1: the driver never sees a client problem: the direct-write sink and the render-ahead hook
  catch everything and fall back to the handler's own write.
- Rule 2: the hot path writes mid-stream chunks straight to the transport, in HTTP/1.1 chunked
  framing as aiohttp's writer would, only when the response is chunked and uncompressed and nothing
  but plain deltas is sent (no echo, usage on every chunk or token ids); the order of bytes holds
  because aiohttp does not buffer a prepared chunked response.
- Rule 3: an engine error ends a full response with HTTP 500 and a stream with an SSE error event
  (headers are already out); either way the request is counted as finished with reason "error".
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, cast

from aiohttp import web

from simulator.core.api_error import ApiError
from simulator.core.protocol import GenerationRequest
from simulator.core.responses import SSE_DONE, ResponseRenderer, Usage, sse_event
from simulator.core.sampler import SampledOutput
from simulator.core.tokenizer import Llama3Tokenizer
from simulator.core.worker_settings import WorkerSettings
from simulator.server.jobs import Emission, JobHandle
from simulator.server.metrics import WorkerMetrics

__all__ = ["INTERNAL_ERROR", "GenerationRun", "RunOwner"]

logger = logging.getLogger(__name__)

INTERNAL_ERROR = "Internal server error"


class RunOwner(Protocol):
    """What a run needs of the worker that serves it."""

    @property
    def settings(self) -> WorkerSettings: ...

    @property
    def tokenizer(self) -> Llama3Tokenizer: ...

    @property
    def metrics(self) -> WorkerMetrics: ...

    def release_unpulled(self, request_id: str, now: float) -> None:
        """The first token is out: a decode leg that pulled nothing frees the prefill's blocks."""
        ...

    def finish_metrics(
        self, req: GenerationRequest, handle: JobHandle, produced: int, reason: str
    ) -> None: ...

    def kv_params_for(
        self, internal_id: str, handle: JobHandle, req: GenerationRequest
    ) -> dict[str, Any] | None: ...


class _Writable(Protocol):
    """What the direct-write path needs of a transport (asyncio's or uvloop's)."""

    def write(self, data: bytes) -> None: ...

    def is_closing(self) -> bool: ...


class GenerationRun:
    """One generation request from submission to the last byte (streaming or not)."""

    def __init__(
        self,
        *,
        worker: RunOwner,
        req: GenerationRequest,
        renderer: ResponseRenderer,
        handle: JobHandle,
        output: SampledOutput,
        internal_id: str,
    ) -> None:
        self.w = worker
        self.req = req
        self.renderer = renderer
        self.handle = handle
        self.output = output
        self.finish_reason: str = output.finish_reason
        self.internal_id = internal_id
        self.produced = 0
        self.last_at: float | None = None
        self._transport: _Writable | None = None
        self._ready: tuple[int, list[int], bytes] | None = None  # (produced, ids, frame) from _prepare

    def _usage(self) -> Usage:
        cached: int | None = None
        if self.w.settings.enable_prompt_tokens_details:
            kv = self.req.kv_transfer
            if kv is not None and kv.do_remote_prefill and not kv.do_remote_decode:
                cached = kv.remote_prefill_cached_tokens
            else:
                cached = self.handle.cached_tokens
        return Usage(
            prompt_tokens=len(self.req.prompt_ids), completion_tokens=self.produced, cached_tokens=cached
        )

    def _take(self, emission: Emission) -> list[int]:
        ids = self.output.ids(self.produced, self.produced + emission.tokens)
        self._commit(ids, emission)
        return ids

    def _commit(self, ids: list[int], emission: Emission) -> None:
        self.produced += len(ids)
        if self.produced == len(ids) and ids:
            self.w.release_unpulled(self.internal_id, emission.at)
        if ids and self.last_at is not None:
            self.w.metrics.on_token_gap(emission.at - self.last_at)
        if ids:
            self.last_at = emission.at

    def _frame(self, ids: list[int]) -> bytes:
        """One mid-stream SSE event in HTTP/1.1 chunked framing."""
        data = self.renderer.delta_event("".join(map(self.w.tokenizer.token_text, ids)))
        return b"%x\r\n%b\r\n" % (len(data), data)

    def _prepare(self) -> None:
        """Render the next token's chunk ahead of its deadline (pure: nothing is counted or sent)."""
        try:
            ids = self.output.ids(self.produced, self.produced + 1)
            self._ready = (self.produced, ids, self._frame(ids))
        except Exception:  # never let a client problem reach the driver; the sink renders it again
            logger.exception("stream %s: rendering ahead failed", self.renderer.response_id)
            self._ready = None

    def _sink(self, emission: Emission) -> bool:
        """Write one mid-stream chunk straight to the socket, in HTTP/1.1 chunked framing as aiohttp's
        writer would (the response is prepared and chunked; aiohttp does not buffer, so order holds).
        Saves a queue hop and a task switch per token on the hot path."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return False  # the handler finds out on its next write and aborts the request
        try:
            ready, self._ready = self._ready, None
            if ready is not None and ready[0] == self.produced and len(ready[1]) == emission.tokens:
                ids, frame = ready[1], ready[2]
                self._commit(ids, emission)
            else:
                ids = self._take(emission)
                frame = self._frame(ids)
            transport.write(frame)
        except Exception:  # never let a client problem reach the driver
            logger.exception("stream %s: direct write failed", self.renderer.response_id)
            self._transport = None
            return False
        return True

    def _final_reason(self) -> str:
        kv = self.req.kv_transfer
        if self.handle.kv_pinned and kv is not None and kv.do_remote_decode:
            return "length"  # the P leg of P/D always stops at its one token
        return self.finish_reason

    async def full(self) -> web.Response:
        ids: list[int] = []
        while True:
            emission = await self.handle.queue.get()
            if emission.error is not None:
                self.w.finish_metrics(self.req, self.handle, self.produced, "error")
                raise ApiError(500, INTERNAL_ERROR)
            ids.extend(self._take(emission))
            if emission.finished:
                break
        reason = self._final_reason()
        self.w.finish_metrics(self.req, self.handle, self.produced, reason)
        kv_params = self.w.kv_params_for(self.internal_id, self.handle, self.req)
        prompt_text = self.w.tokenizer.decode(self.req.prompt_ids) if self.req.echo else None
        body = self.renderer.full(
            text=self.w.tokenizer.decode(ids),
            token_ids=ids,
            finish_reason=reason,
            usage=self._usage(),
            kv_transfer_params=kv_params,
            prompt_text=prompt_text,
        )
        return web.json_response(body)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"},
        )
        await response.prepare(request)
        req = self.req
        continuous = req.include_usage and req.continuous_usage_stats
        fast = not continuous and not req.return_token_ids
        echo = self.w.tokenizer.decode(req.prompt_ids) if req.echo else None  # sent with the first tokens
        try:
            if req.kind == "chat":
                await response.write(
                    sse_event(self.renderer.role_chunk(self._usage() if continuous else None))
                )
            # Our framing must match aiohttp's. `response.chunked` only reports an explicit
            # enable_chunked_encoding(); aiohttp chunks HTTP/1.1 streams implicitly and then says so in
            # the Transfer-Encoding header it sent at prepare().
            chunked = response.headers.get("Transfer-Encoding", "").lower() == "chunked"
            direct = chunked and not response.compression
            if fast and echo is None and direct and hasattr(request.transport, "write"):
                self._transport = cast(_Writable, request.transport)  # uvloop's is no WriteTransport
                self.handle.sink = self._sink
                self.handle.prepare = self._prepare
            while True:
                emission = await self.handle.queue.get()
                if emission.error is not None:
                    self.w.finish_metrics(req, self.handle, self.produced, "error")
                    await response.write(sse_event(ApiError(500, INTERNAL_ERROR).body()))
                    break
                ids = self._take(emission)
                if fast and not emission.finished and echo is None:
                    text = "".join(map(self.w.tokenizer.token_text, ids))
                    await response.write(self.renderer.delta_event(text))
                    continue
                reason = self._final_reason() if emission.finished else None
                kv_params = None
                if emission.finished:
                    self.w.finish_metrics(req, self.handle, self.produced, reason or "length")
                    kv_params = self.w.kv_params_for(self.internal_id, self.handle, req)
                text = self.w.tokenizer.decode(ids)
                if echo is not None:
                    text, echo = echo + text, None
                chunk = self.renderer.delta_chunk(
                    text=text,
                    token_ids=ids,
                    finish_reason=reason,
                    usage=self._usage() if continuous else None,
                    kv_transfer_params=kv_params,
                )
                await response.write(sse_event(chunk))
                if emission.finished:
                    break
            if req.include_usage:
                await response.write(sse_event(self.renderer.usage_chunk(self._usage())))
            await response.write(SSE_DONE)
            await response.write_eof()
        except ConnectionResetError:
            logger.debug("client went away during stream %s", self.renderer.response_id)
        return response
