"""DecisionServicer: translation between the v1 proto and the pure core, nothing more.

Every handler answers; no exception escapes one:
- input the core rejects (`QueryError`)      -> INVALID_ARGUMENT with the core's message
- a `table_key` the server does not serve    -> NOT_FOUND naming the keys it does serve
- no table loaded (or the default missing)   -> UNAVAILABLE, with trailing metadata
                                                 `ppd-unavailable: no-table` (ppd/decision/v1/status.py)
- anything unexpected                        -> INTERNAL, logged once with its traceback
- a frame that is not a valid message        -> INVALID_ARGUMENT (see wire.py), one rate-limited line
Unary RPCs carry these as the call status; RouteBatch and RouteStream items carry them in
`RouteResponse.error` so one bad item never fails the others (a corrupt RouteStream frame included).
A RouteBatch of more than `max_batch_items` requests is refused whole (INVALID_ARGUMENT). A batch is
decided against one table snapshot, `BATCH_SLICE` items at a time, handing the event loop back between
slices so that a large batch never holds up the unary calls and streams sharing the loop.

Tracing (off unless a tracer is given): each unary Route call is one span (route_trace.py).

Route is the hot path: one snapshot read of the holder, one `Query`, one `route()`, one response
message, pre-bound metric children. Keep it that way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import grpc
from opentelemetry import trace

from decision_service.holder import TableHolder, TableSet
from decision_service.metrics import DecisionMetrics
from decision_service.route import Query, QueryError, Router, Verdict, check_query
from decision_service.route_trace import answered, failed, route_span
from decision_service.settings import DEFAULT_MAX_BATCH_ITEMS
from decision_service.table import Figure, Table, Weights
from decision_service.wire import Malformed, exactly_one, lenient
from ppd.decision.v1 import decision_pb2 as pb
from ppd.decision.v1 import decision_pb2_grpc as pb_grpc
from ppd.decision.v1.status import UNAVAILABLE_CAUSE_KEY, UNAVAILABLE_NO_TABLE
from ppd.rate_limited_log import RateLimitedLog

__all__ = ["BATCH_SLICE", "DecisionServicer", "add_to_server"]

logger = logging.getLogger(__name__)

_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
_NOT_FOUND = grpc.StatusCode.NOT_FOUND
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_INTERNAL = grpc.StatusCode.INTERNAL
_Context = grpc.aio.ServicerContext
_DECISION = (pb.DECISION_PD, pb.DECISION_LOCAL)  # indexed by Verdict.local
_SERVICE = pb.DESCRIPTOR.services_by_name["DecisionService"].full_name
_NO_TABLE: Final = ((UNAVAILABLE_CAUSE_KEY, UNAVAILABLE_NO_TABLE),)

# Batch items decided between two turns of the event loop (about 0.2 ms of handler time on a quiet
# core). A unary call needs several turns of the loop to be answered, each waiting for one slice.
BATCH_SLICE: Final = 32
#: One line at most this often for bad frames (docs/guides/operate.md, "Failure policy at the wire").
_BAD_FRAME_LOG_S: Final = 10.0


class _Failure:
    """Why an item got no decision: a status code, a message for the caller and, for a unary call,
    trailing metadata a client can act on (the no-table cause)."""

    __slots__ = ("code", "message", "trailing")

    def __init__(
        self, code: grpc.StatusCode, message: str, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.code = code
        self.message = message
        self.trailing = trailing


def _query(request: pb.RouteRequest) -> Query:
    weights = request.weights if request.HasField("weights") else None
    live = request.live if request.HasField("live") else None
    return Query(
        turn=request.turn,
        n_in=request.new_input_tokens,
        n_out=request.expected_output_tokens,
        n_ctx=request.context_tokens,
        qps=request.qps,
        weights=None if weights is None else Weights(weights.w_ttft, weights.w_tpot),
        profile=request.weights_profile or None,
        decode_kv_usage=None
        if live is None or not live.HasField("decode_kv_usage")
        else live.decode_kv_usage,
        prefill_queue_depth=None
        if live is None or not live.HasField("prefill_queue_depth")
        else live.prefill_queue_depth,
        decode_running=None
        if live is None or not live.HasField("decode_running_requests")
        else live.decode_running_requests,
        bidir=pb.CAPABILITY_BIDIR in request.capabilities,
    )


def _response(verdict: Verdict, table: Table, request_id: str) -> pb.RouteResponse:
    response = pb.RouteResponse(
        decision=pb.DECISION_BIDIR if verdict.bidir else _DECISION[verdict.local],
        reason=verdict.reason.value,  # type: ignore[arg-type]  # numbered exactly like the proto enum
        score=verdict.score,
        default_decision=pb.DECISION_BIDIR if verdict.default_bidir else _DECISION[verdict.default_local],
        table_version=table.version,
        table_key=table.key,
        request_id=request_id,
        detail=verdict.detail,
        alternative_allowed=verdict.alternative_allowed,
    )
    if verdict.context is not None:
        cell = response.cell
        cell.context_class = verdict.context
        cell.workload_class = verdict.workload or ""
        cell.qps_level = verdict.qps_level or 0.0
    return response


class DecisionServicer(pb_grpc.DecisionServiceServicer):
    """The DecisionService over a `TableHolder`; see the module docstring for the error policy."""

    def __init__(
        self,
        holder: TableHolder,
        metrics: DecisionMetrics,
        *,
        max_batch_items: int = DEFAULT_MAX_BATCH_ITEMS,
        clock: Callable[[], float] = time.perf_counter,
        bad_frame_log: RateLimitedLog | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self._holder = holder
        self._metrics = metrics
        self._clock = clock
        self._max_batch_items = max_batch_items
        self._bad_frames = bad_frame_log or RateLimitedLog(logger, interval_s=_BAD_FRAME_LOG_S)
        self._decision_counter = metrics.decision_counter
        self._latency = metrics.route_latency
        self._tracer = tracer

    # --- item level: one request -> a response or a failure ---------------------------------

    def _router(self, tables: TableSet, key: str) -> Router | _Failure:
        router = tables.routers.get(key) if key else tables.default
        return self._missing(tables, key) if router is None else router

    def _missing(self, tables: TableSet, key: str) -> _Failure:
        """Why no router answers `key` ("" = the default)."""
        if not tables.routers:
            return _Failure(_UNAVAILABLE, f"no table is loaded yet from {self._holder.directory}", _NO_TABLE)
        served = ", ".join(tables.keys())
        if key:
            return _Failure(_NOT_FOUND, f"unknown table_key {key!r}; this server serves: {served}")
        return _Failure(
            _UNAVAILABLE,
            f"the default table {tables.default_key!r} is not loaded; pass table_key, one of: {served}",
            _NO_TABLE,
        )

    def _decide(self, request: pb.RouteRequest, tables: TableSet) -> pb.RouteResponse | _Failure:
        key = request.table_key
        router = tables.default if not key else tables.routers.get(key)
        if router is None:
            return self._missing(tables, key)
        query = _query(request)
        table = router.table
        try:
            check_query(query, table)
        except QueryError as exc:
            return _Failure(_INVALID_ARGUMENT, str(exc))
        verdict = router.route(query)
        self._decision_counter[verdict.path, verdict.reason].inc()
        return _response(verdict, table, request.request_id)

    def _decide_counted(
        self, request: pb.RouteRequest, tables: TableSet, what: str
    ) -> pb.RouteResponse | _Failure:
        """`_decide`, with an unexpected exception logged and turned into INTERNAL, failures counted."""
        try:
            outcome = self._decide(request, tables)
        except Exception:
            logger.exception("%s %r failed unexpectedly", what, request.request_id)
            outcome = _Failure(_INTERNAL, "internal error while routing; see the decision service log")
        if isinstance(outcome, _Failure):
            self._metrics.count_error(outcome.code.name)
        return outcome

    def _decide_item(self, request: pb.RouteRequest, tables: TableSet) -> pb.RouteResponse:
        """For batch and stream: failures become a response with `error` set."""
        outcome = self._decide_counted(request, tables, "Route item")
        if isinstance(outcome, _Failure):
            return pb.RouteResponse(
                request_id=request.request_id,
                table_key=request.table_key,
                error=pb.RouteError(code=outcome.code.value[0], message=outcome.message),
            )
        return outcome

    def refused(self, method: str, peer: str, why: str) -> None:
        """A client error below the rule (a malformed frame, a unary call with 0 or 2+ messages)."""
        self._metrics.count_error(_INVALID_ARGUMENT.name)
        self._bad_frames.log("%s from %s: %s (INVALID_ARGUMENT)", method, peer, why)

    # --- RPCs -------------------------------------------------------------------------------

    async def Route(  # noqa: N802
        self, request: pb.RouteRequest, context: _Context[pb.RouteRequest, pb.RouteResponse]
    ) -> pb.RouteResponse:
        if self._tracer is not None:
            return await self._traced_route(request, context, self._tracer)
        start = self._clock()
        outcome = self._decide_counted(request, self._holder.current, "Route")
        if isinstance(outcome, _Failure):
            await context.abort(outcome.code, outcome.message, outcome.trailing)
        self._latency.observe(self._clock() - start)
        return outcome

    async def _traced_route(
        self,
        request: pb.RouteRequest,
        context: _Context[pb.RouteRequest, pb.RouteResponse],
        tracer: trace.Tracer,
    ) -> pb.RouteResponse:
        """Route inside its span (the module docstring's tracing)."""
        span = route_span(tracer, request, context.invocation_metadata() or ())
        try:
            start = self._clock()
            outcome = self._decide_counted(request, self._holder.current, "Route")
            if isinstance(outcome, _Failure):
                failed(span, outcome.code, outcome.message)
                await context.abort(outcome.code, outcome.message, outcome.trailing)
            self._latency.observe(self._clock() - start)
            answered(span, outcome)
            return outcome
        finally:
            span.end()

    async def RouteBatch(  # noqa: N802
        self,
        request: pb.RouteBatchRequest,
        context: _Context[pb.RouteBatchRequest, pb.RouteBatchResponse],
    ) -> pb.RouteBatchResponse:
        items = request.requests
        if len(items) > self._max_batch_items:
            why = (
                f"RouteBatch carries {len(items)} requests; this server takes at most "
                f"{self._max_batch_items} per batch (--max-batch-items): split it"
            )
            self.refused("RouteBatch", context.peer(), why)
            await context.abort(_INVALID_ARGUMENT, why)
        decide = self._decide_item
        tables = self._holder.current  # one snapshot for the whole batch, even across a reload
        answer = pb.RouteBatchResponse()
        responses = answer.responses
        for start in range(0, len(items), BATCH_SLICE):
            if start:
                await asyncio.sleep(0)  # let unary calls and streams in between slices
            responses.extend([decide(item, tables) for item in items[start : start + BATCH_SLICE]])
        return answer

    async def RouteStream(  # noqa: N802
        self,
        request_iterator: AsyncIterator[pb.RouteRequest | Malformed],
        context: _Context[pb.RouteRequest, pb.RouteResponse],
    ) -> AsyncIterator[pb.RouteResponse]:
        decide = self._decide_item
        holder = self._holder
        async for request in request_iterator:
            if isinstance(request, Malformed):
                # The frame was whole, only its content is bad: answer it in order, keep the stream.
                self.refused("RouteStream", context.peer(), request.describe())
                code, message = _INVALID_ARGUMENT.value[0], request.describe()
                yield pb.RouteResponse(error=pb.RouteError(code=code, message=message))
                continue
            yield decide(request, holder.current)

    async def DescribeTable(  # noqa: N802
        self,
        request: pb.DescribeTableRequest,
        context: _Context[pb.DescribeTableRequest, pb.DescribeTableResponse],
    ) -> pb.DescribeTableResponse:
        tables = self._holder.current
        try:
            router = self._router(tables, request.table_key)
            if isinstance(router, _Failure):
                failure = router
            else:
                return _describe(router, tables)
        except Exception:
            logger.exception("DescribeTable %r failed unexpectedly", request.table_key)
            failure = _Failure(_INTERNAL, "internal error while describing the table; see the log")
        await context.abort(failure.code, failure.message, failure.trailing)
        raise AssertionError("abort() returned")  # pragma: no cover


def add_to_server(servicer: DecisionServicer, server: grpc.aio.Server) -> None:
    """Register `servicer` like the generated `add_DecisionServiceServicer_to_server`, but with the
    strict framing of wire.py: unary methods take exactly one well-formed message, and a frame that
    does not parse is INVALID_ARGUMENT (an error item on RouteStream), never grpc's UNKNOWN."""

    def unary(name: str, handler: Any, request: Any, response: Any) -> grpc.RpcMethodHandler[Any, Any]:
        return grpc.stream_unary_rpc_method_handler(
            exactly_one(f"{_SERVICE}/{name}", handler, lambda peer, why: servicer.refused(name, peer, why)),
            request_deserializer=lenient(request),
            response_serializer=response.SerializeToString,
        )

    handlers = {
        "Route": unary("Route", servicer.Route, pb.RouteRequest, pb.RouteResponse),
        "RouteBatch": unary("RouteBatch", servicer.RouteBatch, pb.RouteBatchRequest, pb.RouteBatchResponse),
        "RouteStream": grpc.stream_stream_rpc_method_handler(
            servicer.RouteStream,
            request_deserializer=lenient(pb.RouteRequest),
            response_serializer=pb.RouteResponse.SerializeToString,
        ),
        "DescribeTable": unary(
            "DescribeTable", servicer.DescribeTable, pb.DescribeTableRequest, pb.DescribeTableResponse
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)


def _describe(router: Router, tables: TableSet) -> pb.DescribeTableResponse:
    table = router.table
    header = table.header
    axes = header.axes
    response = pb.DescribeTableResponse(
        table_key=table.key,
        table_version=table.version,
        format_version=table.format_version,
        context_edges=axes.context_edges,
        context_classes=axes.context_classes,
        workload_classes=[
            pb.WorkloadClass(name=w.name, bench_input_tokens=w.n_in, bench_output_tokens=w.n_out)
            for w in axes.workloads
        ],
        qps_levels=axes.qps_levels,
        default_weights=pb.Weights(
            w_ttft=header.default_weights.w_ttft, w_tpot=header.default_weights.w_tpot
        ),
        success_slo=header.min_success,
        default_decision=pb.DECISION_LOCAL if header.default_decision == "local" else pb.DECISION_PD,
        header_json=json.dumps(table.raw_header, sort_keys=True),
        table_keys=tables.keys(),
        default_table_key=tables.default_key or "",
    )
    for name, weights in sorted(header.profiles.items()):
        response.weights_profiles[name].w_ttft = weights.w_ttft
        response.weights_profiles[name].w_tpot = weights.w_tpot
    response.cells.extend(_cell_figures(router))
    return response


def _cell_figures(router: Router) -> list[pb.CellFigures]:
    """Every cell's measured figures with the router's precomputed default-weight verdict."""
    table = router.table
    axes = table.header.axes
    nc, nw, nq = axes.shape
    cells: list[pb.CellFigures] = []
    for c in range(nc):
        for w in range(nw):
            for q in range(nq):
                row = table.figures[c, w, q]
                own = router.cell(c, w, q)
                figures = pb.CellFigures(
                    cell=pb.Cell(
                        context_class=axes.context_classes[c],
                        workload_class=axes.workloads[w].name,
                        qps_level=axes.qps_levels[q],
                    ),
                    measured=table.measured(c, w, q),
                    pd_ttft_ms=float(row[Figure.PD_TTFT_MS]),
                    pd_tpot_ms=float(row[Figure.PD_TPOT_MS]),
                    local_ttft_ms=float(row[Figure.LOCAL_TTFT_MS]),
                    local_tpot_ms=float(row[Figure.LOCAL_TPOT_MS]),
                    pd_success=float(row[Figure.PD_SUCCESS]),
                    local_success=float(row[Figure.LOCAL_SUCCESS]),
                    pd_samples=int(row[Figure.PD_SAMPLES]),
                    local_samples=int(row[Figure.LOCAL_SAMPLES]),
                    delta_ttft=own.delta_ttft,
                    delta_tpot=own.delta_tpot,
                    default_decision=_DECISION[own.verdict.local],
                    default_reason=own.verdict.reason.value,  # type: ignore[arg-type]
                )
                if table.has_bidir(c, w, q):
                    # Only where the table has the mode: a version-1 table's answer stays as it was.
                    figures.bidir_ttft_ms = float(row[Figure.BIDIR_TTFT_MS])
                    figures.bidir_tpot_ms = float(row[Figure.BIDIR_TPOT_MS])
                    figures.bidir_success = float(row[Figure.BIDIR_SUCCESS])
                    figures.bidir_samples = int(row[Figure.BIDIR_SAMPLES])
                if own.bidir is not None:
                    figures.bidir_delta_ttft = own.bidir.delta_ttft
                    figures.bidir_delta_tpot = own.bidir.delta_tpot
                    v = own.bidir.verdict
                    figures.bidir_default_decision = pb.DECISION_BIDIR if v.bidir else _DECISION[v.local]
                    figures.bidir_default_reason = v.reason.value  # type: ignore[assignment]
                cells.append(figures)
    return cells
