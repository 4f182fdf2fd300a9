"""The gateway's seams: what the request path needs from the outside world, as Protocols, and the
values that cross them. Pure: no transport here.

- `Upstream`: calls to workers (`upstream.HttpUpstream` over aiohttp). Every transport failure
  arrives as one of our `UpstreamError`s (errors.py), never as a library exception.
- `DecisionClient`: the Route RPC (`decision_client.GrpcDecisionClient`); `route()` never raises.
- `ClientConnection`: the client's side of one completion request (`app.py` over aiohttp).
`create_app` takes an `Upstream` and a `DecisionClient`, so the forwarder is tested with fakes of
these Protocols and no sockets (tests/gateway/fakes.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from gateway.plan import UpstreamCall
from gateway.psi import Psi
from gateway.routing import Decision
from gateway.types import Endpoint

__all__ = [
    "ClientConnection",
    "ClientRequest",
    "DecisionClient",
    "JsonReply",
    "LiveSignals",
    "RouteQuery",
    "Upstream",
    "UpstreamStream",
]


@dataclass(frozen=True, slots=True)
class JsonReply:
    """A worker's whole (non-streamed) answer."""

    status: int
    body: bytes
    content_type: str

    def json(self) -> Any:
        """The body as JSON (orjson: a P answer with its prompt's token ids parses 3x faster than with
        the stdlib); ValueError when it is not JSON (NaN and integers past 64 bits are not)."""
        return orjson.loads(self.body)


class UpstreamStream(Protocol):
    """A worker's streamed answer whose status was 200; close it when done."""

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises UpstreamBrokenError when the stream breaks."""
        ...

    def close(self) -> None: ...


class Upstream(Protocol):
    async def call_json(self, call: UpstreamCall, *, prefill: bool) -> JsonReply:
        """A non-streaming call read to the end; UpstreamStatusError for any non-200 answer,
        UpstreamTimeoutError, UpstreamUnreachableError."""
        ...

    async def open_stream(self, call: UpstreamCall) -> UpstreamStream:
        """A streaming call, returned once its headers are in; the same errors as call_json."""
        ...

    async def get(self, url: str) -> JsonReply:
        """A short GET (health, metrics, models) with the probe timeout."""
        ...

    async def post(self, url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> JsonReply:
        """A short POST (tokenize, detokenize) with the probe timeout; any status."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LiveSignals:
    prefill_queue_depth: int | None = None
    decode_running_requests: int | None = None
    decode_kv_usage: float | None = None


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What the DecisionService is asked for one request: ψ, the conversation rate and live signals."""

    request_id: str
    turn: int
    psi: Psi
    qps: float
    live: LiveSignals | None = None
    weights_profile: str = ""
    table_key: str = ""
    # Explicit (w_ttft, w_tpot), e.g. the SLO controller's; None: the profile's or the table's.
    weights: tuple[float, float] | None = None
    # Paths this gateway can serve besides pd and local ("bidir"); sent as RouteRequest.capabilities.
    # Without "bidir" the service never answers bidir.
    capabilities: frozenset[str] = frozenset()
    # The W3C traceparent of the gateway's decision span (gateway/request_trace.py); "" when the request
    # is not traced. A traced query goes as a unary Route call with it in the call's metadata.
    traceparent: str = ""


class DecisionClient(Protocol):
    @property
    def serving(self) -> bool | None:
        """The service's health as last seen; None when unknown."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def route(self, query: RouteQuery, fallback: Decision) -> Decision:
        """The service's decision, or `fallback` (with `fallback=True` and a `fallback_<cause>`
        reason) when it is slow, down or has no answer; never raises."""
        ...


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """One completion request as the client sent it: the raw body and the headers (looked up by
    their canonical names)."""

    endpoint: Endpoint
    body: bytes
    headers: Mapping[str, str]


class ClientConnection(Protocol):
    """Where the answer to one client request goes. A write to a client that left raises
    ConnectionResetError."""

    async def reply(self, body: bytes, headers: Mapping[str, str]) -> None:
        """The whole JSON answer, status 200."""
        ...

    async def open_stream(self, headers: Mapping[str, str]) -> None:
        """Status 200 and the headers of an event stream; `write` sends its bytes."""
        ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...
