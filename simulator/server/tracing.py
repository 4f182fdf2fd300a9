"""The `llm_request` span a simulated worker exports per generation request, as vLLM 0.32 does with
`--otlp-traces-endpoint` (vllm/v1/engine/output_processor.py: a SERVER span named `llm_request`,
started at the request's arrival, parented on the request's W3C `traceparent` header when it has one,
with the `gen_ai.*` latency and usage attributes below), so a trace through the gateway shows the
workers' spans as it would with real vLLM.

Rule 1: no endpoint, no tracer: a worker then builds no span object and reads no header for this.
Rule 2: the latencies come from the driver's clock (the engine's), the span's start and end times from
the wall clock, as vLLM's do.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from ppd.tracing import TracingSettings, context_from
from ppd.tracing_export import Tracing, build_tracing
from simulator.server.jobs import JobHandle

__all__ = ["RequestSpanData", "export_request_span", "worker_tracing"]


def worker_tracing(endpoint: str) -> Tracing | None:
    """The tracer provider of `--otlp-traces-endpoint` (None: off, rule 1); every span kept, as vLLM."""
    if not endpoint:
        return None
    settings = TracingSettings(enabled=True, endpoint=endpoint)
    return build_tracing(settings, service_name="vllm", scope="vllm.llm_engine")


class RequestSpanData:
    """What one request's span needs from its arrival: the wall time and the caller's trace headers."""

    __slots__ = ("arrival_ns", "carrier")

    def __init__(self, headers: Mapping[str, str]) -> None:
        self.arrival_ns = time.time_ns()
        self.carrier = {key: headers[key] for key in ("traceparent", "tracestate") if key in headers}


def export_request_span(
    tracer: trace.Tracer,
    data: RequestSpanData,
    *,
    request_id: str,
    handle: JobHandle,
    now: float,
    prompt_tokens: int,
    completion_tokens: int,
    max_tokens: int,
) -> None:
    """vLLM's `llm_request` span of a finished request (rule 2)."""
    first = handle.first_token_at if handle.first_token_at is not None else now
    scheduled = handle.scheduled_at if handle.scheduled_at is not None else first
    attributes: dict[str, str | int | float] = {
        "gen_ai.latency.time_to_first_token": max(0.0, first - handle.submitted_at),
        "gen_ai.latency.e2e": max(0.0, now - handle.submitted_at),
        "gen_ai.latency.time_in_queue": max(0.0, scheduled - handle.submitted_at),
        "gen_ai.usage.prompt_tokens": prompt_tokens,
        "gen_ai.usage.completion_tokens": completion_tokens,
        "gen_ai.latency.time_in_model_prefill": max(0.0, first - scheduled),
        "gen_ai.latency.time_in_model_decode": max(0.0, now - first),
        "gen_ai.latency.time_in_model_inference": max(0.0, now - scheduled),
        "gen_ai.request.id": request_id,
        "gen_ai.request.max_tokens": max_tokens,
    }
    tracer.start_span(
        "llm_request",
        context=context_from(data.carrier),
        kind=SpanKind.SERVER,
        start_time=data.arrival_ns,
        attributes=attributes,
    ).end()
