"""The OpenTelemetry span of one traced Route call (the servicer makes one when it holds a tracer,
ppd/tracing.py; off, nothing here runs).

Rule 1: each unary Route call is a SERVER span `ppd.decision.Route`, the child of the `traceparent` in
the call's metadata (the gateway's `ppd.decision` span), or the root of a trace of its own without one
(kept at `--tracing-sampling-ratio`).
Rule 2: its attributes are the query (turn, tokens, QPS, table key) and the answer (decision path,
reason, table key and version, cell, score, whether the other path may be explored); a call that fails
has an error status with the message the caller gets and its gRPC status code.
Rule 3: RouteBatch and RouteStream items are not traced: their metadata is the whole call's, not one
request's (the gateway sends a traced request as a unary call: gateway/decision_client.py rule 7).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from ppd.decision.v1 import decision_pb2 as pb
from ppd.tracing import TRACEPARENT, context_from

__all__ = ["answered", "failed", "route_span"]

_TRACE_KEYS: Final = (TRACEPARENT, "tracestate")
_SERVICE: Final = pb.DESCRIPTOR.services_by_name["DecisionService"].full_name


def route_span(tracer: trace.Tracer, request: pb.RouteRequest, metadata: Iterable[Any]) -> trace.Span:
    """Rules 1 and 2: the started span of a Route call, with the query's attributes."""
    carrier = {key: value for key, value in metadata if key in _TRACE_KEYS and isinstance(value, str)}
    return tracer.start_span(
        "ppd.decision.Route",
        context=context_from(carrier),
        kind=SpanKind.SERVER,
        attributes={
            "rpc.system": "grpc",
            "rpc.service": _SERVICE,
            "rpc.method": "Route",
            "ppd.request_id": request.request_id,
            "ppd.turn": request.turn,
            "ppd.tokens.new": request.new_input_tokens,
            "ppd.tokens.context": request.context_tokens,
            "ppd.tokens.expected_output": request.expected_output_tokens,
            "ppd.qps": request.qps,
            "ppd.table.key": request.table_key,
        },
    )


def answered(span: trace.Span, response: pb.RouteResponse) -> None:
    """Rule 2: what the call answered."""
    attributes: dict[str, str | float | bool] = {
        "ppd.path": pb.Decision.Name(response.decision).removeprefix("DECISION_").lower(),
        "ppd.reason": pb.Reason.Name(response.reason).removeprefix("REASON_").lower(),
        "ppd.table.key": response.table_key,
        "ppd.table.version": response.table_version,
        "ppd.score": response.score,
        "ppd.alternative_allowed": response.alternative_allowed,
    }
    if response.HasField("cell"):
        cell = response.cell
        attributes["ppd.cell"] = f"{cell.context_class}/{cell.workload_class}/{cell.qps_level:g}"
        attributes["ppd.cell.context_class"] = cell.context_class
        attributes["ppd.cell.workload_class"] = cell.workload_class
        attributes["ppd.cell.qps_level"] = cell.qps_level
    span.set_attributes(attributes)


def failed(span: trace.Span, code: grpc.StatusCode, message: str) -> None:
    """Rule 2: a call that fails with `code` and `message`."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_status(Status(StatusCode.ERROR, message))
