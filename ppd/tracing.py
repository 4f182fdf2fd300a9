"""OpenTelemetry tracing settings and W3C trace context, shared by the gateway and the DecisionService.

Rule 1: tracing is off unless `enabled`; then no tracer exists and the request paths create no span
object at all (each checks for a `Tracer` of None). Settings are read once at start-up into the frozen
`TracingSettings`; `tracing_export.build_tracing` turns them into the process's tracer provider.
Rule 2: trace context crosses processes as the W3C `traceparent` (and `tracestate`) header: on HTTP to
the workers (vLLM extracts it and parents its `llm_request` span on it), and as gRPC metadata of the
DecisionService's Route call. `traceparent_of` writes it, `context_from` reads it (OpenTelemetry's
W3C propagator, never a hand-written parser).
Only OpenTelemetry's API is imported here (no SDK, no exporter, no grpc): the gateway's request core,
which must not import grpc, uses these helpers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "TRACEPARENT",
    "TracingSettings",
    "context_from",
    "parse_headers",
    "traceparent_of",
]

#: The W3C trace context header (lower case: HTTP/2 and gRPC metadata keys are).
TRACEPARENT: Final = "traceparent"
# Stateless: the W3C propagator keeps nothing between calls.
_W3C: Final = TraceContextTextMapPropagator()


@dataclass(frozen=True, slots=True, repr=False)
class TracingSettings:
    # Export OpenTelemetry traces (off: no tracer, no span objects, nothing exported).
    enabled: bool = False
    # Share of the traces this process starts that are kept (parent-based: a request that arrives with
    # a sampled traceparent is kept whatever the ratio, an unsampled one is not).
    sampling_ratio: float = 1.0
    # OTLP/gRPC receiver (an OpenTelemetry Collector, Jaeger, Tempo): http://host:4317 (plain) or
    # https://host:4317 (TLS).
    endpoint: str = "http://127.0.0.1:4317"
    # OTLP transport; only "grpc" (what vLLM's --otlp-traces-endpoint speaks by default).
    protocol: Literal["grpc"] = "grpc"
    # The spans' service.name; empty: the program's own ("ppd-gateway", "ppd-picker", "ppd-decision").
    service_name: str = ""
    # Extra gRPC metadata on each export (e.g. an API key of a hosted backend); values never printed.
    headers: Mapping[str, str] = field(default_factory=dict)
    # Seconds one export may take before it is dropped (spans are exported in the background).
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not (isinstance(self.sampling_ratio, int | float) and 0.0 <= self.sampling_ratio <= 1.0):
            raise ValueError(f"tracing.sampling_ratio must be between 0 and 1, got {self.sampling_ratio}")
        if self.protocol != "grpc":
            raise ValueError(f"tracing.protocol must be 'grpc' (OTLP over gRPC), got {self.protocol!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"tracing.timeout_s must be a positive number of seconds, got {self.timeout_s}")
        if self.enabled and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"tracing.endpoint must be http://host:port or https://host:port, got {self.endpoint!r}"
            )
        if not isinstance(self.headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.headers.items()
        ):
            raise ValueError("tracing.headers must map names to string values")

    def __repr__(self) -> str:
        shown = dict.fromkeys(self.headers, "<redacted>")
        return (
            f"TracingSettings(enabled={self.enabled}, sampling_ratio={self.sampling_ratio}, "
            f"endpoint={self.endpoint!r}, protocol={self.protocol!r}, service_name={self.service_name!r}, "
            f"headers={shown}, timeout_s={self.timeout_s})"
        )


def parse_headers(raw: str) -> dict[str, str]:
    """`key=value,key2=value2` (OpenTelemetry's OTEL_EXPORTER_OTLP_HEADERS form) as a mapping; a pair
    without `=` is a ValueError naming it."""
    out: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in raw.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"OTLP header {pair!r} is not key=value")
        out[key.strip().lower()] = value.strip()
    return out


def traceparent_of(span: trace.Span) -> str:
    """The W3C `traceparent` value naming `span` as the parent of what the callee does."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def context_from(carrier: Mapping[str, str]) -> Context | None:
    """The trace context a caller sent (`traceparent`, `tracestate`; keys in lower case), or None when
    it sent none or an invalid one (the span then starts a trace of its own)."""
    if TRACEPARENT not in carrier:
        return None
    context = _W3C.extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None
