"""A real OTLP/gRPC trace receiver for tests: a gRPC server on 127.0.0.1 port 0 implementing
OpenTelemetry's TraceService (the generated stubs opentelemetry-proto ships), which keeps the spans of
every ExportTraceServiceRequest it is sent, with the service.name of their resource. What a collector
(Jaeger, Tempo, the OpenTelemetry Collector) receives from our services and the workers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

from tests.support.polling import wait_until

__all__ = ["OtlpReceiver", "ReceivedSpan", "otlp_receiver"]

#: OTLP's Span.SpanKind values.
SERVER, CLIENT = 2, 3
STATUS_ERROR = 2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    status_code: int
    status_message: str
    start_ns: int
    end_ns: int


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[ReceivedSpan]], None]) -> None:
        self._sink = sink

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            status_code=span.status.code,
                            status_message=span.status.message,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        self._sink(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """The spans received so far, read safely from the test's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        add = trace_service_pb2_grpc.add_TraceServiceServicer_to_server
        add(_TraceService(self._add), self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def spans(self, *, service: str | None = None, name: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            found = list(self._spans)
        return [
            s for s in found if (service is None or s.service == service) and (name is None or s.name == name)
        ]

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], *, what: str, deadline_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """Poll until `predicate(all spans)` holds; the spans then."""
        wait_until(lambda: predicate(self.spans()), deadline_s=deadline_s, what=what)
        return self.spans()

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    receiver.start()
    try:
        yield receiver
    finally:
        receiver.stop()
