"""In-process fakes of the gateway's seams (gateway/ports.py), for unit tests of the request path
without sockets: `FakeUpstream` (workers), `FakeDecisions` (the DecisionService), `FakeClient` (the
client's connection), `ManualClock`, and `forwarder_on_fakes` to put them together."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.deps import Deps
from gateway.errors import UpstreamBrokenError, UpstreamStatusError, UpstreamUnreachableError
from gateway.forwarding import Forwarder
from gateway.metrics import GatewayMetrics
from gateway.plan import UpstreamCall
from gateway.pool import WorkerPool
from gateway.ports import JsonReply, RouteQuery
from gateway.psi import QpsMeter, Tokenizers
from gateway.request_log import RequestLog
from gateway.routing import Decision
from gateway.sessions import InMemorySessionStore
from gateway.settings import Settings
from gateway.slo import SloControl

__all__ = [
    "FakeClient",
    "FakeDecisions",
    "FakeStream",
    "FakeUpstream",
    "ManualClock",
    "forwarder_on_fakes",
]

KV_PARAMS = {"remote_engine_id": "engine-P", "remote_block_ids": [1, 2], "do_remote_prefill": True}


class ManualClock:
    """Seconds that move only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def chat_answer(text: str, *, prompt_tokens: int = 10) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 2, "total_tokens": prompt_tokens + 2},
    }


def sse(*events: Mapping[str, Any], done: bool = True) -> list[bytes]:
    out = [f"data: {json.dumps(e)}\n\n".encode() for e in events]
    return [*out, b"data: [DONE]\n\n"] if done else out


def chunk(text: str) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}


@dataclass
class FakeStream:
    """A streamed answer: `parts` in order, then `broken_by` (a transport error's name) if set."""

    parts: list[bytes]
    broken_by: str = ""
    worker: str = ""
    closed: bool = False
    # Set: after its parts the stream stays open until the test cancels the handler (the client
    # left while the worker had not yet ended its response).
    held: asyncio.Event | None = None

    def chunks(self) -> AsyncIterator[bytes]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part
        if self.held is not None:
            self.held.set()
            await asyncio.Event().wait()
        if self.broken_by:
            raise UpstreamBrokenError(self.broken_by, worker=self.worker)

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeUpstream:
    """Workers by id: P answers with KV_PARAMS, D and R with `answer`; `unreachable` workers refuse
    the connection, `failing` ones answer 500. Every call is kept in `calls`."""

    answer: str = "hello there"
    stream_parts: list[bytes] | None = None
    stream_broken_by: str = ""
    stream_held: asyncio.Event | None = None
    unreachable: set[str] = field(default_factory=set)
    failing: set[str] = field(default_factory=set)
    tokenize_count: int | None = None
    # D's `kv_transfer_params` on its answer (vLLM's bidirectional mode), and whether a P leg given
    # such params (do_remote_decode with remote blocks) fails with 500, as an expired read does.
    decode_kv_params: Mapping[str, Any] | None = None
    bidir_prefill_fails: bool = False
    calls: list[UpstreamCall] = field(default_factory=list)
    posts: list[tuple[str, Mapping[str, Any]]] = field(default_factory=list)
    closed: bool = False

    def _check(self, call: UpstreamCall) -> None:
        self.calls.append(call)
        if call.worker in self.unreachable:
            raise UpstreamUnreachableError(f"worker {call.worker} unreachable: fake", worker=call.worker)
        if call.worker in self.failing:
            raise UpstreamStatusError(500, b"{}", worker=call.worker)
        params = call.body.get("kv_transfer_params")
        params = params if isinstance(params, Mapping) else {}
        if self.bidir_prefill_fails and params.get("do_remote_decode") and params.get("remote_block_ids"):
            raise UpstreamStatusError(500, b"{}", worker=call.worker)

    async def call_json(self, call: UpstreamCall, *, prefill: bool) -> JsonReply:
        self._check(call)
        body = {"kv_transfer_params": KV_PARAMS} if prefill else chat_answer(self.answer)
        if not prefill and self.decode_kv_params is not None:
            body["kv_transfer_params"] = dict(self.decode_kv_params)
        return JsonReply(200, json.dumps(body).encode(), "application/json")

    async def open_stream(self, call: UpstreamCall) -> FakeStream:
        self._check(call)
        parts = self.stream_parts if self.stream_parts is not None else sse(chunk("hel"), chunk("lo"))
        return FakeStream(list(parts), self.stream_broken_by, call.worker, held=self.stream_held)

    async def get(self, url: str) -> JsonReply:
        return JsonReply(404, b"", "")

    async def post(self, url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> JsonReply:
        self.posts.append((url, body))
        if self.tokenize_count is None:
            return JsonReply(404, b"{}", "application/json")
        return JsonReply(200, json.dumps({"count": self.tokenize_count}).encode(), "application/json")

    async def close(self) -> None:
        self.closed = True


@dataclass
class FakeDecisions:
    """Answers `decision`; with `fallback_cause` set, the fallback as the real client gives it."""

    decision: Decision = field(default_factory=lambda: Decision("local", "table", table_version="v-test"))
    fallback_cause: str = ""
    serving: bool | None = True
    queries: list[RouteQuery] = field(default_factory=list)
    started: bool = False
    closed: bool = False

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def route(self, query: RouteQuery, fallback: Decision) -> Decision:
        self.queries.append(query)
        if self.fallback_cause:
            return Decision(fallback.path, f"fallback_{self.fallback_cause}", fallback=True)
        return self.decision


@dataclass
class FakeClient:
    """The client's connection: what was answered, and how."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    streamed: bool = False
    ended: bool = False
    gone_after_writes: int | None = None

    async def reply(self, body: bytes, headers: Mapping[str, str]) -> None:
        self.status, self.headers, self.body = 200, dict(headers), body

    async def open_stream(self, headers: Mapping[str, str]) -> None:
        self.status, self.headers, self.streamed = 200, dict(headers), True

    async def write(self, data: bytes) -> None:
        if self.gone_after_writes is not None:
            if self.gone_after_writes == 0:
                raise ConnectionResetError("client left")
            self.gone_after_writes -= 1
        self.body += data

    async def end(self) -> None:
        self.ended = True

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def events(self) -> list[str]:
        return [block.removeprefix("data: ") for block in self.body.decode().split("\n\n") if block]


def forwarder_on_fakes(
    config: Mapping[str, Any],
    *,
    upstream: FakeUpstream | None = None,
    decisions: FakeDecisions | None = None,
    clock: ManualClock | None = None,
    request_log: RequestLog | None = None,
    wall_clock: ManualClock | None = None,
) -> tuple[Forwarder, Deps]:
    """A Forwarder over `Settings.from_mapping(config)` with fake workers and DecisionService."""
    settings = Settings.from_mapping(config)
    clock = clock or ManualClock()
    ids = itertools.count(1)
    metrics = GatewayMetrics()
    deps = Deps(
        settings=settings,
        pool=WorkerPool(settings.workers, heartbeat_expiry_s=30.0, clock=clock, outliers=settings.outliers),
        sessions=InMemorySessionStore(ttl_s=3600.0, max_entries=1000, clock=clock),
        tokenizers=Tokenizers(),
        qps=QpsMeter(window_s=10.0, hysteresis=0.1, clock=clock),
        metrics=metrics,
        decisions=decisions or FakeDecisions(),
        upstream=upstream or FakeUpstream(),
        request_log=request_log,
        clock=clock,
        timer=clock,
        wall_clock=wall_clock or (lambda: 1_700_000_000.0),
        new_id=lambda: f"id{next(ids)}",
        slo=SloControl.from_config(settings.slo, metrics, clock),
    )
    return Forwarder(deps), deps
