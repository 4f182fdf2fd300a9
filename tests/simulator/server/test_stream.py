"""The response writer of one generation request: the whole body, the SSE stream, and an engine error."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from simulator.core.api_error import ApiError
from simulator.core.protocol import GenerationRequest, ServingLimits, parse_completion
from simulator.core.responses import ResponseRenderer
from simulator.core.sampler import SampledOutput, SamplerSettings, sample_output
from simulator.core.tokenizer import Llama3Tokenizer
from simulator.core.worker_settings import DEFAULT_MODEL, WorkerSettings
from simulator.server.jobs import Emission, JobHandle
from simulator.server.metrics import WorkerMetrics
from simulator.server.stream import GenerationRun

LIMITS = ServingLimits(model=DEFAULT_MODEL, max_model_len=4096)


class FakeWorker:
    """The worker as a run sees it (`RunOwner`): records what the run reports."""

    def __init__(self, tokenizer: Llama3Tokenizer) -> None:
        self.settings = WorkerSettings(worker_id="W", role="replica")
        self.tokenizer = tokenizer
        self.metrics = WorkerMetrics(DEFAULT_MODEL)
        self.released: list[tuple[str, float]] = []
        self.finished: list[tuple[int, str]] = []

    def release_unpulled(self, request_id: str, now: float) -> None:
        self.released.append((request_id, now))

    def finish_metrics(self, req: GenerationRequest, handle: JobHandle, produced: int, reason: str) -> None:
        del req, handle
        self.finished.append((produced, reason))

    def kv_params_for(
        self, internal_id: str, handle: JobHandle, req: GenerationRequest
    ) -> dict[str, Any] | None:
        del internal_id, handle, req
        return None


def _run(
    worker: FakeWorker, body: dict[str, Any], emissions: list[Emission]
) -> tuple[GenerationRun, SampledOutput]:
    req = parse_completion(body, worker.tokenizer, LIMITS)
    output = sample_output(
        req.prompt_ids,
        seed=3,
        max_tokens=req.max_tokens,
        min_tokens=0,
        ignore_eos=True,
        settings=SamplerSettings(),
        tokenizer=worker.tokenizer,
    )
    handle = JobHandle(request_id="r-1", submitted_at=0.0)
    for emission in emissions:
        handle.queue.put_nowait(emission)
    run = GenerationRun(
        worker=worker,
        req=req,
        renderer=ResponseRenderer(req, response_id="cmpl-1", created=1),
        handle=handle,
        output=output,
        internal_id="r-1",
    )
    return run, output


async def test_full_body_carries_every_token_and_counts_once(tok: Llama3Tokenizer) -> None:
    worker = FakeWorker(tok)
    emissions = [Emission(tokens=3, at=1.0), Emission(tokens=2, at=2.0, finished=True)]
    run, output = _run(worker, {"prompt": "hello there", "max_tokens": 5}, emissions)
    response = await run.full()
    assert response.text is not None
    body = json.loads(response.text)
    assert body["choices"][0]["text"] == tok.decode(output.ids(0, 5))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert worker.finished == [(5, "length")]
    assert worker.released == [("r-1", 1.0)]  # at the first token


async def test_an_engine_error_is_a_500_and_counted_as_error(tok: Llama3Tokenizer) -> None:
    worker = FakeWorker(tok)
    run, _ = _run(worker, {"prompt": "hello", "max_tokens": 5}, [Emission(tokens=0, at=1.0, error="x")])
    with pytest.raises(ApiError) as excinfo:
        await run.full()
    assert excinfo.value.status == 500
    assert worker.finished == [(0, "error")]


@pytest.fixture
async def streaming(tok: Llama3Tokenizer) -> AsyncIterator[tuple[str, FakeWorker, SampledOutput]]:
    worker = FakeWorker(tok)
    emissions = [
        Emission(tokens=1, at=1.0),
        Emission(tokens=1, at=2.0),
        Emission(tokens=1, at=3.0, finished=True),
    ]
    body = {"prompt": "hello", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    run, output = _run(worker, body, emissions)

    async def handler(request: web.Request) -> web.StreamResponse:
        return await run.stream(request)

    app = web.Application()
    app.router.add_get("/", handler)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        yield str(server.make_url("/")), worker, output
    finally:
        await server.close()


async def test_stream_sends_each_step_then_usage_and_done(
    streaming: tuple[str, FakeWorker, SampledOutput], http: aiohttp.ClientSession
) -> None:
    url, worker, output = streaming
    async with http.get(url) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        text = await response.text()
    events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == tok_text(worker.tokenizer, output.ids(0, 3))
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert worker.finished == [(3, "length")]


def tok_text(tokenizer: Llama3Tokenizer, ids: list[int]) -> str:
    return "".join(map(tokenizer.token_text, ids))
