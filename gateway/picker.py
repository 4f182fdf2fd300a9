"""The Envoy endpoint picker: `envoy.service.ext_proc.v3.ExternalProcessor.Process` (one gRPC stream
per HTTP request) over the gateway's request core (core.py). Envoy carries D's leg and streams the
answer; Python touches only the request, once, but for the few answers it observes (rule 6).
docs/envoy-extproc.md has the protocol facts.

Rule 1 (processing mode, deploy/envoy/picker/envoy.yaml): request headers SEND, request body BUFFERED,
response headers SEND, response body NONE (STREAMED for an observed answer: rule 6), trailers SKIP.
Each message gets its own answer, in order.
A request body in several messages (another body mode) is refused with a 500 ImmediateResponse.
Rule 2 (a completion, `POST /v1/chat/completions` or `/v1/completions` with a body): the headers are
answered empty; on the body the core runs (parse and limits, session, ψ, decision, exploration, plan,
the P leg with its retries and fallback, metrics, the session remembered) and the answer sets the
destination header `x-gateway-destination-endpoint: host:port` (D's, or the replica's) and the
same value as `envoy.lb` dynamic metadata, clears the route cache, replaces the body with D's
(a client-sent `kv_transfer_params` dropped; for pd and bidir P's params) with its Content-Length,
sets the legs' `X-Request-Id` (and the worker key when one is set; a client's Authorization is kept
only with `forward_authorization`), and removes a client's `x-prefiller-host-port`.
Rule 3: a GatewayError (what the standalone gateway renders as an OpenAI-style error) is an
ImmediateResponse with the same status and body; anything else is a 500 with the same body as the
standalone's. The stream then ends.
Rule 4: the response headers get the turn's provenance headers (turn_report.PROVENANCE_HEADERS).
Rule 5: any other request (no body, another path or method) goes to a live worker as the standalone's
pass-through routes do (decode, replica, prefill in that order); none live: ImmediateResponse 503.
Rule 6: the turn is remembered when it is routed (core.py rule 6). Most answers never cross Python:
the response body mode stays NONE. A turn is *observed* when it is drawn (share
`[log] picker_observe_share`, drawn when its body arrives) or explored (every one: the table refresh
learns from them): the core holds it (core.py rule 7), and the answer to the response headers of a 200
carries `mode_override` with `response_body_mode: STREAMED` (`_OBSERVE`; Envoy honours it in answers
to headers messages with the filter's `allow_mode_override`). Envoy then sends each chunk of the
answer and waits for its (empty) answer before passing the very same bytes on; answer_observer.py
learns from each (bytes, time): TTFT, the last token, the answer's text, usage and chunk count. At
`[DONE]` (before that chunk goes on) the turn is remembered again with the real answer (its token
count, its answer key), and at the body's end the turn ends: the TTFT and TPOT metrics and the same
request-log line the standalone gateway writes (turn_report.py). A non-200 answer, a cut stream or a
stream that ends early (the client gone: CLIENT_DISCONNECTED) is a line with its error.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from gateway.answer_observer import AnswerObserver
from gateway.core import ActiveTurn, RequestCore
from gateway.deps import Deps
from gateway.errors import GatewayError, NoWorkerError, error_body
from gateway.ports import ClientRequest
from gateway.turn_report import exploration, provenance_headers
from gateway.types import Endpoint
from ppd.records import CLIENT_DISCONNECTED

__all__ = [
    "DESTINATION_HEADER",
    "LB_NAMESPACE",
    "PREFILLER_HEADER",
    "SERVICE_NAME",
    "Headers",
    "Picked",
    "Picker",
    "destination",
]

log = logging.getLogger(__name__)

SERVICE_NAME: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION_HEADER: Final = "x-gateway-destination-endpoint"
PREFILLER_HEADER: Final = "x-prefiller-host-port"
LB_NAMESPACE: Final = "envoy.lb"
_ENDPOINTS: Final[Mapping[str, Endpoint]] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
_SET: Final = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_UNBUFFERED: Final = "the endpoint picker needs Envoy's ext_proc request_body_mode BUFFERED"
_Mode = processing_mode_pb2.ProcessingMode
# Rule 6: an observed turn's processing mode from its response headers on (Envoy takes the body modes
# as given, so both are named; the config's `allowed_override_modes` lists exactly this one).
_OBSERVE: Final = _Mode(
    request_header_mode=_Mode.SEND,
    request_body_mode=_Mode.BUFFERED,
    response_header_mode=_Mode.SEND,
    response_body_mode=_Mode.STREAMED,
    request_trailer_mode=_Mode.SKIP,
    response_trailer_mode=_Mode.SKIP,
)


class Headers(Mapping[str, str]):
    """Request headers as Envoy sent them (lower-case names), looked up case-insensitively."""

    __slots__ = ("_h",)

    def __init__(self, pairs: Mapping[str, str]) -> None:
        self._h = {k.lower(): v for k, v in pairs.items()}

    def __getitem__(self, key: str) -> str:
        return self._h[key.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._h)

    def __len__(self) -> int:
        return len(self._h)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._h


@dataclass(frozen=True, slots=True)
class Picked:
    """Where D's leg goes (`host:port`), with which body and extra headers; the provenance headers
    for the response."""

    destination: str
    body: bytes
    headers: tuple[tuple[str, str], ...]
    provenance: Mapping[str, str]
    # Rule 6: the held turn whose answer is observed (None: not observed), and whether D streams it.
    observed: ActiveTurn | None = None
    stream: bool = False


def destination(url: str) -> str:
    """`host:port` of a worker URL, as Envoy's ORIGINAL_DST cluster reads it (an IPv6 host in [])."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _header_map(headers: pb.HttpHeaders) -> Headers:
    return Headers(
        {h.key: h.raw_value.decode("utf-8", "replace") or h.value for h in headers.headers.headers}
    )


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_SET
    )


def _lb_metadata(dest: str) -> struct_pb2.Struct:
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION_HEADER: dest}})
    return meta


def _immediate(status: int, body: Mapping[str, Any]) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_set("content-type", "application/json")]),
            body=json.dumps(body).encode(),
            details="ppd-picker",
        )
    )


def _empty_answer(kind: str) -> pb.ProcessingResponse:
    if kind == "response_body":
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    if kind == "request_trailers":
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def _routed(*, headers: pb.HeaderMutation, body: bytes | None) -> pb.CommonResponse:
    return pb.CommonResponse(
        header_mutation=headers,
        body_mutation=pb.BodyMutation(body=body) if body is not None else None,
        clear_route_cache=True,
    )


class _Observation:
    """Rule 6 for one observed turn, from its response headers to the end of its answer."""

    __slots__ = ("_core", "_max", "_observer", "_stream", "_t")

    def __init__(self, core: RequestCore, picked: Picked, max_body_bytes: int) -> None:
        assert picked.observed is not None
        self._core = core
        self._t = picked.observed
        self._stream = picked.stream
        self._max = max_body_bytes
        self._observer: AnswerObserver | None = None

    def headers(self, message: pb.HttpHeaders) -> bool:
        """The response headers: True when the body is to be observed (a 200 with a body)."""
        t = self._t
        stream = self._stream
        status = _header_map(message).get(":status", "")
        worker = t.outcome.decode_worker
        if status == "200" and not message.end_of_stream:
            self._observer = AnswerObserver(
                t.outcome, stream=stream, start=t.turn.start, worker=worker, max_body_bytes=self._max
            )
            return True
        t.outcome.error = f"worker {worker} " + (f"answered {status}" if status != "200" else "sent no body")
        self._core.end(t)
        return False

    async def body(self, message: pb.HttpBody, at: float) -> None:
        """One chunk of the answer, received at `at`: learnt from; at its end the turn ends."""
        observer = self._observer
        if observer is None:
            return
        t = self._t
        outcome = t.outcome
        answer = observer.feed(message.body, at)
        last = message.end_of_stream or message.end_of_stream_without_message
        if last and answer is None:
            answer = observer.end()
        if answer is not None:  # before this chunk goes on: the client's next turn must find this one
            outcome.ok = True
            await self._core.remember(
                t.turn, outcome, answer.text, answer.usage, completion_chunks=answer.chunks
            )
            outcome.delivered = True  # the whole answer is Envoy's to pass on once this is answered
        if last:
            self._core.end(t)

    @staticmethod
    def close_if(watch: _Observation | None) -> None:
        if watch is not None:
            watch.close()

    def close(self) -> None:
        """The ext_proc stream is over: a turn still held lost its client (or Envoy its worker)."""
        t = self._t
        if t.held and not t.outcome.delivered:
            t.outcome.ok = False
            t.outcome.error = t.outcome.error or CLIENT_DISCONNECTED
        self._core.end(t)


class Picker:
    """Rules 1-6, one `Process` stream per request (registered with
    `external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server`). `draw` (tests: a fixed
    one) draws the share of observed turns; by default a private random.Random."""

    def __init__(self, deps: Deps, *, draw: Callable[[], float] | None = None) -> None:
        self._d = deps
        self._core = RequestCore(deps, relays_answer=False)
        self._share = deps.settings.log.picker_observe_share
        self._draw = draw or random.Random().random  # noqa: S311 (a sample's draw, not a secret)
        self._max_body = deps.settings.max_body_bytes

    async def Process(  # noqa: N802 (the gRPC method's name)
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        headers = Headers({})
        endpoint: Endpoint | None = None
        provenance: Mapping[str, str] = {}
        watch: _Observation | None = None  # rule 6: an observed turn, held until its answer is over
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    headers = _header_map(message.request_headers)
                    path = headers.get(":path", "").split("?", 1)[0]
                    endpoint = _ENDPOINTS.get(path) if headers.get(":method") == "POST" else None
                    if endpoint is None or message.request_headers.end_of_stream:
                        answer = self._passthrough()
                        yield answer
                        if answer.HasField("immediate_response"):
                            return
                        endpoint = None
                    else:
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                elif kind == "request_body":
                    if not message.request_body.end_of_stream:
                        # A body in pieces: Envoy is not in BUFFERED mode (rule 1); streamed bodies are
                        # not supported yet (issue 25 item 5): refused, never half-routed.
                        log.warning("request body in pieces: the picker needs request_body_mode BUFFERED")
                        yield _immediate(500, error_body(_UNBUFFERED, "InternalServerError", 500))
                        return
                    body = message.request_body.body
                    if endpoint is None:
                        yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                        continue
                    answer, provenance, watch = await self._pick(endpoint, body, headers)
                    yield answer
                    if answer.HasField("immediate_response"):
                        return
                elif kind == "response_headers":
                    observe = watch is not None and watch.headers(message.response_headers)
                    mutation = pb.HeaderMutation(set_headers=[_set(k, v) for k, v in provenance.items()])
                    yield pb.ProcessingResponse(
                        response_headers=pb.HeadersResponse(
                            response=pb.CommonResponse(header_mutation=mutation)
                        ),
                        mode_override=_OBSERVE if observe else None,
                    )
                elif kind is not None:  # the answer's body (rule 6) and trailers: answered empty
                    yield await self._after_headers(kind, message, watch)
        finally:
            _Observation.close_if(watch)

    async def _after_headers(
        self, kind: str, message: pb.ProcessingRequest, watch: _Observation | None
    ) -> pb.ProcessingResponse:
        """An observed answer's chunk, learnt from before it goes on (rule 6); the answer is empty,
        as to anything else after the response headers (not sent in our mode)."""
        if kind == "response_body" and watch is not None:
            await watch.body(message.response_body, self._d.timer())
        return _empty_answer(kind)

    def _passthrough(self) -> pb.ProcessingResponse:
        """Rule 5: any live worker, as the standalone's pass-through routes (the headers' answer)."""
        try:
            dest = destination(self._d.pool.view().passthrough().url)
        except NoWorkerError as exc:
            return _immediate(*exc.to_openai_error())
        mutation = pb.HeaderMutation(
            set_headers=[_set(DESTINATION_HEADER, dest)], remove_headers=[PREFILLER_HEADER]
        )
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=_routed(headers=mutation, body=None)),
            dynamic_metadata=_lb_metadata(dest),
        )

    async def _pick(
        self, endpoint: Endpoint, body: bytes, headers: Headers
    ) -> tuple[pb.ProcessingResponse, Mapping[str, str], _Observation | None]:
        """Rules 2 and 3: the core's answer as the request body's response; rule 6: an observed
        turn's watch."""
        try:
            picked = await self.pick(ClientRequest(endpoint, body, headers))
        except GatewayError as exc:
            status, err = exc.to_openai_error()
            return _immediate(status, err), {}, None
        except Exception:
            log.exception("unhandled error picking an endpoint")
            error = error_body("internal gateway error", "InternalServerError", 500)
            return _immediate(500, error), {}, None
        sets = [
            _set(DESTINATION_HEADER, picked.destination),
            _set("content-length", str(len(picked.body))),
            *(_set(k, v) for k, v in picked.headers),
        ]
        removes = [PREFILLER_HEADER]
        if not any(k.lower() == "authorization" for k, _ in picked.headers):
            removes.append("authorization")
        mutation = pb.HeaderMutation(set_headers=sets, remove_headers=removes)
        return (
            pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=_routed(headers=mutation, body=picked.body)),
                dynamic_metadata=_lb_metadata(picked.destination),
            ),
            picked.provenance,
            None if picked.observed is None else _Observation(self._core, picked, self._max_body),
        )

    async def pick(self, request: ClientRequest) -> Picked:
        """The core for one completion request: routed, its P leg run, the turn remembered; an
        observed turn (rule 6) held, to be ended by whoever observes its answer."""
        core = self._core
        async with core.turn(request, observed=self._share > 0 and self._draw() < self._share) as t:
            leg = await core.route(t)
            await core.remember(t.turn, t.outcome, None, None, completion_chunks=None)
            observed = t.observed or exploration(t.outcome)[0]
            picked = Picked(
                destination=destination(leg.call.url),
                body=json.dumps(leg.call.body, separators=(",", ":")).encode(),
                headers=leg.call.headers,
                provenance=provenance_headers(t.turn, t.outcome),
                observed=t if observed else None,
                stream=leg.call.stream,
            )
            if observed:
                core.hold(t)
            return picked
