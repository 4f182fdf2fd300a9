"""The OpenTelemetry tracer provider of one process, built once at start-up from `TracingSettings`
(ppd/tracing.py) and passed down as a `Tracer`: a parent-based ratio sampler, a batch span processor
(spans leave in the background, never on the request path) and the OTLP/gRPC exporter.

OpenTelemetry's global tracer provider is never set: `build_tracing` returns the provider with its
tracer, the caller passes the tracer to what it builds and calls `close()` at shutdown (which exports
what is still queued). The batch processor reads its queue and delay settings from OpenTelemetry's own
`OTEL_BSP_*` environment variables (e.g. OTEL_BSP_SCHEDULE_DELAY, milliseconds, 5000 by default).
Imports the SDK and the gRPC exporter: the gateway's request core never imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from ppd.tracing import TracingSettings

__all__ = ["Tracing", "build_tracing"]


@dataclass(frozen=True, slots=True)
class Tracing:
    """A process's tracer provider and the tracer its request paths use."""

    provider: TracerProvider
    tracer: trace.Tracer

    def close(self) -> None:
        """Export the spans still queued (within the exporter's timeout) and stop exporting."""
        self.provider.shutdown()


def build_tracing(settings: TracingSettings, *, service_name: str, scope: str) -> Tracing | None:
    """The provider for `settings` (None when tracing is off). `service_name` is used unless the
    settings name one; `scope` names the instrumentation (the package: "gateway", "decision_service")."""
    if not settings.enabled:
        return None
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: settings.service_name or service_name}),
        sampler=ParentBased(TraceIdRatioBased(settings.sampling_ratio)),
    )
    exporter = OTLPSpanExporter(
        endpoint=settings.endpoint,
        headers=tuple(settings.headers.items()) or None,
        timeout=settings.timeout_s,
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, provider.get_tracer(scope))
