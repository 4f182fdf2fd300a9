"""The Envoy endpoint picker: `envoy.service.ext_proc.v3.ExternalProcessor.Process` (one gRPC stream
per HTTP request) over the gateway's request core (core.py). Envoy carries D's leg and streams the
answer; Python touches only the request, once, but for the few answers it observes (rules 6 and 9).
docs/envoy-extproc.md has the protocol facts.

Rule 1 (processing modes): our config (deploy/envoy/picker/envoy.yaml) sends request headers, the
request body BUFFERED and response headers (response body NONE, STREAMED for an observed answer by
rule 6; trailers SKIP); the GIE-style config
(envoy-gie.yaml, what GIE's gateways send) has request and response bodies FULL_DUPLEX_STREAMED and
trailers SEND. The mode comes from the stream's first message (picker_stream rule 1); in full duplex
the body is gathered, answered and echoed by picker_stream.py's rules 2-4. Each message gets its
answer, in order. A request body in pieces outside full duplex (STREAMED) is refused with a 500
ImmediateResponse.
Rule 2 (a completion, `POST /v1/chat/completions` or `/v1/completions` with a body): when the whole
body is there (BUFFERED: its one message, the headers answered empty; full duplex: gathered up to
`max_body_bytes`, the headers answered afterwards) the core runs (parse and limits, session, ψ,
decision, exploration, plan, the P leg with its retries and fallback, metrics, the session
remembered) and the answer sets the destination header `x-gateway-destination-endpoint: ip:port`
(D's, or the replica's; a worker configured by name is resolved first, destinations.py, and one
that does not resolve is a 502 before the turn is remembered) and the same value as `envoy.lb`
dynamic metadata, clears the route cache, replaces the body with D's (a client-sent
`kv_transfer_params` dropped; for pd and bidir P's params) (BUFFERED: in the body's answer, with its
Content-Length; full duplex: the mutation in the headers' answer with Content-Length removed, the
body as streamed chunks), sets the legs' `X-Request-Id` (and the worker key when one is set; a
client's Authorization is kept only with `forward_authorization`), and removes a client's
`x-prefiller-host-port`.
Rule 3: a GatewayError (what the standalone gateway renders as an OpenAI-style error, 413 for a body
over `max_body_bytes` included) is an ImmediateResponse with the same status and body; anything else
is a 500 with the same body as the standalone's. The stream then ends.
Rule 4: the response headers get the turn's provenance headers (turn_report.PROVENANCE_HEADERS); in
full duplex each response body chunk is echoed unchanged and trailers are answered empty.
Rule 5: any other request (no body, another path or method) goes to a live worker as the standalone's
pass-through routes do (decode, replica, prefill in that order), on its headers' answer (its body,
in full duplex, echoed); none live: ImmediateResponse 503; its name not resolving: 502.
Rule 5b (picker_failover.py): the destination names a fallback worker after the chosen one; if
Envoy's retry reached it, the response headers' answer rebinds the session to it and names it.
Rule 6: the turn is remembered when it is routed (core.py rule 6). Most answers never cross Python:
the response body mode stays NONE. A turn is *observed* when it is drawn (share
`[log] picker_observe_share`, drawn when its body arrives) or explored (every one: the table refresh
learns from them), or its D may answer with bidirectional params (rule 9): the core holds it (core.py
rule 7), and the answer to the response headers of a 200 carries `mode_override` with
`response_body_mode: STREAMED` (`_OBSERVE`; Envoy honours it in answers to headers messages with the
filter's `allow_mode_override`). Envoy then sends each chunk of the
answer and waits for its (empty) answer before passing the very same bytes on. observed_turn.py
learns from each (bytes, time) through answer_observer.py: TTFT, the last token, the answer's text,
usage and chunk count. At `[DONE]` (before that chunk goes on) the turn is remembered again with the
real answer (its token count, its answer key), and at the body's end the turn ends: the TTFT and
TPOT metrics and the same request-log line the standalone gateway writes (turn_report.py). A non-200
answer, a cut stream or a stream that ends early (the client gone: CLIENT_DISCONNECTED) is a line
with its error.
Rule 7 (llm-d's decode sidecar, `[routing] llmd_sidecar`): the picker runs no P leg (core.py rule
8). A pd (or bidir, then pd) turn's answer sets `x-prefiller-host-port: ip:port` of the chosen P
beside D's destination, and D's body carries no P params; a local or replica turn sets none. A
client's `x-prefiller-host-port` is removed either way.
Rule 8 (GIE's subset hint, picker_subset.py): a hint on the request headers message narrows the
candidates: D or R of a completion (the core's view, core.py rule 4), any worker of a pass-through;
none live inside is an ImmediateResponse 503.
In full duplex the response body comes to the picker anyway (echoed, rule 4): an observed answer is
read from the echoed chunks, without an override. With only the request side in full duplex Envoy
ignores `mode_override`: the answer cannot be observed, and the turn ends at its response headers
without a line.
Rule 9 (vLLM's bidirectional mode, `[routing] bidir`): a D leg that carries params (pd, bidir: plan.py
`decode_returns_params`; never in rule 7's mode) is answered by such a D with its own
`kv_transfer_params`, so that turn is always observed (rule 6), each chunk answered with the bytes the
standalone would send instead, without them (observed_turn rule 2b; a replacing `BodyMutation`, or
the `streamed_response` in full duplex: picker_stream rule 5), the response's Content-Length removed,
and the turn remembered with D's params at `[DONE]` (or the body's end), so the next turn can go bidir.
Rule 10 (tracing, gateway/request_trace.py): with a tracer, a completion is one trace under its
`ppd.picker.request` span, from its request headers to the end of its ext_proc stream (core.py rule 10
adds the steps and the P legs). D's request carries the `ppd.decode` span's traceparent among the
headers Envoy forwards, so vLLM's span joins the trace; the picker sees D's leg only up to D's response
headers (where `ppd.decode` ends, with the status) unless it observes the answer (rule 6): D's first
token and end are in vLLM's span, not the picker's.
It stays one module (about 545 lines): `Process` and the answers it builds share one stream's state
(modes, headers, the routed and held turn) in the order Envoy requires; what stands alone lives apart
(picker_stream, picker_subset, picker_failover, observed_turn, answer_observer, destinations).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from gateway.core import ActiveTurn, RequestCore
from gateway.deps import Deps
from gateway.destinations import Destinations, host_port, joined
from gateway.errors import GatewayError, NoWorkerError, UpstreamUnreachableError, error_body
from gateway.observed_turn import ObservedTurn
from gateway.picker_failover import Failover, answered
from gateway.picker_stream import BodyAssembly, Modes, echo, modes, replaced_chunk, streamed_body
from gateway.picker_subset import SUBSET_SCOPE, Subset, subset_hint
from gateway.plan import decode_returns_params
from gateway.ports import ClientRequest
from gateway.request_trace import LegSpan, RequestTrace
from gateway.turn_report import exploration
from gateway.types import Endpoint, Role

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
_UNBUFFERED: Final = (
    "the endpoint picker needs Envoy's ext_proc request_body_mode BUFFERED or FULL_DUPLEX_STREAMED"
)
_Mode = processing_mode_pb2.ProcessingMode
_ANY_ROLE: Final[tuple[Role, ...]] = ("decode", "replica", "prefill")  # rule 8: a pass-through's
_DESTINATION: Final[tuple[Role, ...]] = ("decode", "replica")  # rule 8: a completion's
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
    # Rule 7: P's `ip:port` for D's llm-d sidecar (None: no P leg left to it).
    prefiller: str | None = None
    # Rule 9: D may answer with its bidirectional params: the answer's bytes are rewritten.
    strip: bool = False
    failover: Failover | None = None  # rule 5b
    span: LegSpan | None = None  # rule 10: D's leg, ended at its response headers


def destination(url: str) -> str:
    """`host:port` of a worker URL as written (an IPv6 host in []); the picker names the resolved
    `ip:port` instead (destinations.py)."""
    return joined(*host_port(url))


def _header_map(headers: pb.HttpHeaders) -> Headers:
    return Headers(
        {h.key: h.raw_value.decode("utf-8", "replace") or h.value for h in headers.headers.headers}
    )


def _leg_answered(span: LegSpan | None, headers: pb.HttpHeaders) -> LegSpan | None:
    """Rule 10: D's leg span ends at its response headers, with their `:status`; None (ended)."""
    if span is not None:
        raw = _header_map(headers).get(":status", "")
        span.end(status=int(raw) if raw.isdigit() else 0)
    return None


def _end_trace(trace: RequestTrace | None, span: LegSpan | None) -> None:
    """Rule 10: the ext_proc stream is over: the request's span ends (and D's, if no response
    headers came)."""
    if span is not None:
        span.end("the stream ended before D's response headers")
    if trace is not None:
        trace.end()


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_SET
    )


def _lb_metadata(dest: str) -> struct_pb2.Struct:
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION_HEADER: dest}})
    return meta


def _immediate(
    status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> pb.ProcessingResponse:
    sets = [
        _set("content-type", "application/json"),
        *(_set(k.lower(), v) for k, v in (headers or {}).items()),
    ]
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=sets),
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


class Picker:
    """Rules 1-9, one `Process` stream per request (registered with
    `external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server`). `draw` (tests: a fixed
    one) draws the share of observed turns; by default a private random.Random."""

    def __init__(self, deps: Deps, *, draw: Callable[[], float] | None = None) -> None:
        self._d = deps
        self._core = RequestCore(deps, relays_answer=False)
        self._share = deps.settings.log.picker_observe_share
        self._draw = draw or random.Random().random  # noqa: S311 (a sample's draw, not a secret)
        self._max_body = deps.settings.max_body_bytes
        self._destinations = Destinations(timeout_s=deps.settings.timeouts.connect_s)
        self._run_prefill = not deps.settings.routing.llmd_sidecar  # rule 7

    async def Process(  # noqa: N802 (the gRPC method's name)
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        headers = Headers({})
        endpoint: Endpoint | None = None
        provenance: Mapping[str, str] = {}
        mode: Modes | None = None
        gathering: BodyAssembly | None = None  # a duplex completion's body (picker_stream rule 2)
        watch: ObservedTurn | None = None  # rule 6: an observed turn, held until its answer is over
        subset: Subset | None = None  # rule 8
        failover: Failover | None = None  # rule 5b
        trace: RequestTrace | None = None  # rule 10
        span: LegSpan | None = None
        try:
            async for message in request_iterator:
                mode = mode or modes(message)
                kind = message.WhichOneof("request")
                answers: list[pb.ProcessingResponse] = []
                if kind == "request_headers":
                    headers, subset = _header_map(message.request_headers), subset_hint(message)
                    endpoint, answers = await self._on_headers(message.request_headers, headers, mode, subset)
                    trace = trace or self._start_trace(endpoint, headers)
                    if endpoint is not None and mode.request:  # answered with the body (picker_stream rule 2)
                        gathering = BodyAssembly(self._d.settings.max_body_bytes)
                elif kind == "request_body" or (kind == "request_trailers" and mode.request):
                    if mode.request:
                        answers, routed = await self._duplex_request(
                            message, gathering, endpoint, headers, subset, trace=trace
                        )
                    else:
                        answers, routed = await self._buffered_request(
                            message.request_body, endpoint, headers, subset, trace=trace
                        )
                    if routed is not None:
                        provenance, gathering, watch = routed.provenance, None, self._watch(routed)
                        failover, span = routed.failover, routed.span
                elif kind == "response_headers":
                    span = _leg_answered(span, message.response_headers)  # None from here on
                    provenance = await answered(failover, message, provenance)
                    answers = [self._response_headers(message.response_headers, provenance, mode, watch)]
                elif kind is not None:  # the response body (echoed in duplex; rule 6) and trailers
                    answers = [await self._after_headers(kind, message, mode, watch)]
                for answer in answers:
                    yield answer
                if answers and answers[0].HasField("immediate_response"):
                    return
        finally:
            ObservedTurn.close_if(watch)
            _end_trace(trace, span)

    def _start_trace(self, endpoint: Endpoint | None, headers: Headers) -> RequestTrace | None:
        """Rule 10: a completion's trace, when tracing is on."""
        tracer = self._d.tracer
        if tracer is None or endpoint is None:
            return None
        return RequestTrace(tracer, "ppd.picker.request", headers)

    def _watch(self, picked: Picked) -> ObservedTurn | None:
        if picked.observed is None:
            return None
        return ObservedTurn(
            self._core,
            picked.observed,
            stream=picked.stream,
            max_body_bytes=self._max_body,
            strip=picked.strip,
        )

    def _response_headers(
        self, message: pb.HttpHeaders, provenance: Mapping[str, str], mode: Modes, watch: ObservedTurn | None
    ) -> pb.ProcessingResponse:
        """Rule 4's provenance headers; rule 6: an observed answer's body switched to STREAMED (in
        full duplex it comes anyway; with only the request side duplex it cannot be observed)."""
        status = _header_map(message).get(":status", "")
        body_comes = mode.response or not mode.request
        observe = watch is not None and watch.headers(
            status, has_body=not message.end_of_stream, body_comes=body_comes
        )
        mutation = pb.HeaderMutation(
            set_headers=[_set(k, v) for k, v in provenance.items()],
            remove_headers=["content-length"] if observe and watch is not None and watch.strips else [],
        )
        common = pb.CommonResponse(header_mutation=mutation)
        return pb.ProcessingResponse(
            response_headers=pb.HeadersResponse(response=common),
            mode_override=_OBSERVE if observe and not mode.response else None,
        )

    async def _after_headers(
        self, kind: str, message: pb.ProcessingRequest, mode: Modes, watch: ObservedTurn | None
    ) -> pb.ProcessingResponse:
        """An observed answer's chunk, learnt from before it goes on (rule 6); the answer echoes it in
        full duplex (picker_stream rule 4), else is empty, as to the trailers; rule 9's carries the
        bytes the client gets instead."""
        out: bytes | None = None  # rule 9: the bytes the client gets instead
        if kind == "response_body" and watch is not None:
            body = message.response_body
            last = body.end_of_stream or body.end_of_stream_without_message
            out = await watch.body(body.body, last=last, at=self._d.timer())
        if kind == "response_body" and (mode.response or out is not None):
            return echo(message) if out is None else replaced_chunk(message, out, duplex=mode.response)
        return _empty_answer(kind)

    async def _on_headers(
        self, message: pb.HttpHeaders, headers: Headers, mode: Modes, subset: Subset | None
    ) -> tuple[Endpoint | None, list[pb.ProcessingResponse]]:
        """The request headers: a completion's endpoint (answered empty in BUFFERED mode, later in
        full duplex), or rule 5's pass-through."""
        path = headers.get(":path", "").split("?", 1)[0]
        endpoint = _ENDPOINTS.get(path) if headers.get(":method") == "POST" else None
        if endpoint is None or message.end_of_stream:
            return None, [await self._passthrough(subset)]
        return endpoint, [] if mode.request else [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    async def _buffered_request(
        self,
        body: pb.HttpBody,
        endpoint: Endpoint | None,
        headers: Headers,
        subset: Subset | None,
        *,
        trace: RequestTrace | None,
    ) -> tuple[list[pb.ProcessingResponse], Picked | None]:
        """The request body in BUFFERED mode (rules 1-3): its answer, and what was picked when routed."""
        if not body.end_of_stream:
            # A body in pieces outside full duplex (STREAMED): refused, never half-routed (rule 1).
            log.warning("request body in pieces: the picker needs BUFFERED or FULL_DUPLEX_STREAMED")
            return [_immediate(500, error_body(_UNBUFFERED, "InternalServerError", 500))], None
        if endpoint is None:
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())], None
        return await self._pick(endpoint, body.body, headers, subset, trace=trace)

    async def _duplex_request(
        self,
        message: pb.ProcessingRequest,
        gathering: BodyAssembly | None,
        endpoint: Endpoint | None,
        headers: Headers,
        subset: Subset | None,
        *,
        trace: RequestTrace | None,
    ) -> tuple[list[pb.ProcessingResponse], Picked | None]:
        """A request body chunk or the request trailers in full duplex (picker_stream rules 2-4): the
        answers to send now, and what was picked once the completion is routed."""
        kind = message.WhichOneof("request")
        if gathering is None or endpoint is None:  # a pass-through's body, or trailers after routing
            return [echo(message) if kind == "request_body" else _empty_answer(kind or "")], None
        try:
            if kind == "request_body":
                gathering.add(message.request_body)
            else:
                gathering.end_with_trailers()
        except GatewayError as exc:  # over max_body_bytes
            return [_immediate(*exc.to_openai_error())], None
        if not gathering.complete:
            return [], None
        answers, picked = await self._pick(
            endpoint, gathering.body, headers, subset, duplex=gathering, trace=trace
        )
        if kind == "request_trailers" and not answers[0].HasField("immediate_response"):
            answers.append(_empty_answer(kind))  # after the body (picker_stream rule 3)
        return answers, picked

    async def _passthrough(self, subset: Subset | None) -> pb.ProcessingResponse:
        """Rule 5: any live worker, as the standalone's pass-through routes (the headers' answer);
        inside the subset hint when there is one (rule 8)."""
        view = self._d.pool.view()
        if subset is not None:
            inside = await subset.inside(self._d.pool.specs(), self._destinations, roles=_ANY_ROLE)
            view = view.within(inside, roles=_ANY_ROLE, scope=SUBSET_SCOPE)
        try:
            worker = view.passthrough()
            dest = await self._destinations.of(worker.url, worker=worker.id)
        except (NoWorkerError, UpstreamUnreachableError) as exc:
            return _immediate(*exc.to_openai_error())
        mutation = pb.HeaderMutation(
            set_headers=[_set(DESTINATION_HEADER, dest)], remove_headers=[PREFILLER_HEADER]
        )
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=_routed(headers=mutation, body=None)),
            dynamic_metadata=_lb_metadata(dest),
        )

    async def _pick(
        self,
        endpoint: Endpoint,
        body: bytes,
        headers: Headers,
        subset: Subset | None,
        *,
        duplex: BodyAssembly | None = None,
        trace: RequestTrace | None = None,
    ) -> tuple[list[pb.ProcessingResponse], Picked | None]:
        """Rules 2 and 3: the core's answer, as the buffered body's response or, in full duplex, as
        the headers response and the streamed body (picker_stream rule 3); or one ImmediateResponse.
        With it what was picked (None: nothing)."""
        try:
            picked = await self.pick(ClientRequest(endpoint, body, headers), subset=subset, trace=trace)
        except GatewayError as exc:
            if trace is not None:
                trace.failed(exc)
            status, err = exc.to_openai_error()
            return [_immediate(status, err, exc.response_headers())], None
        except Exception as exc:
            if trace is not None:
                trace.failed(exc)
            log.exception("unhandled error picking an endpoint")
            return [_immediate(500, error_body("internal gateway error", "InternalServerError", 500))], None
        sets = [_set(DESTINATION_HEADER, picked.destination), *(_set(k, v) for k, v in picked.headers)]
        removes = [PREFILLER_HEADER]
        if picked.prefiller is not None:  # rule 7
            sets.append(_set(PREFILLER_HEADER, picked.prefiller))
            removes = []
        if duplex is None:
            sets.append(_set("content-length", str(len(picked.body))))
        else:  # Envoy sends a replaced duplex body chunked: a Content-Length would be stale
            removes.append("content-length")
        if not any(k.lower() == "authorization" for k, _ in picked.headers):
            removes.append("authorization")
        mutation = pb.HeaderMutation(set_headers=sets, remove_headers=removes)
        metadata = _lb_metadata(picked.destination)
        if duplex is None:
            routed = pb.BodyResponse(response=_routed(headers=mutation, body=picked.body))
            return [pb.ProcessingResponse(request_body=routed, dynamic_metadata=metadata)], picked
        first = pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=_routed(headers=mutation, body=None)),
            dynamic_metadata=metadata,
        )
        return [first, *streamed_body(picked.body, end=not duplex.trailers)], picked

    async def pick(
        self, request: ClientRequest, *, subset: Subset | None = None, trace: RequestTrace | None = None
    ) -> Picked:
        """The core for one completion request: routed, its P leg run (or left to D's sidecar, rule
        7), the turn remembered; an observed turn (rule 6) held, to be ended by whoever observes its
        answer. D or R chosen inside `subset` (rule 8); the steps traced under `trace` (rule 10)."""
        core = self._core
        inside = None
        if subset is not None:
            inside = await subset.inside(self._d.pool.specs(), self._destinations, roles=_DESTINATION)
        observed = self._share > 0 and self._draw() < self._share
        async with core.turn(
            request, observed=observed, subset=inside, subset_scope=SUBSET_SCOPE, trace=trace
        ) as t:
            leg = await core.route(t, run_prefill=self._run_prefill)
            # Before the turn is remembered: a D (or a sidecar's P) whose name does not resolve
            # serves no turn.
            dest = await self._destinations.of(leg.call.url, worker=leg.call.worker)
            p = leg.prefiller
            prefiller = None if p is None else await self._destinations.of(p.url, worker=p.worker)
            await core.remember(t.turn, t.outcome, None, None, completion_chunks=None)
            strip = self._d.settings.routing.bidir and decode_returns_params(leg.call)
            observed = t.observed or exploration(t.outcome)[0] or strip
            failover = await Failover.plan(core, t, leg, dest, self._destinations.of)
            picked = Picked(
                destination=failover.destination,
                body=json.dumps(leg.call.body, separators=(",", ":")).encode(),
                headers=leg.call.headers,
                provenance=failover.provenance,
                observed=t if observed else None,
                stream=leg.call.stream,
                prefiller=prefiller,
                strip=strip,
                failover=failover,
                span=leg.span,
            )
            if observed:
                core.hold(t)
            return picked
