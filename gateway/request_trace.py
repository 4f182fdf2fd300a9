"""One request's OpenTelemetry spans in the gateway, for both front doors (core.py, forwarding.py,
picker.py), when tracing is on (ppd/tracing.py rule 1: off, none of this is built).

Rule 1: one trace per request. The front door's span (SERVER kind: `ppd.gateway.request` for the
standalone, `ppd.picker.request` for the Envoy picker) is the root, or the child of a `traceparent` the
client (or Envoy) sent; everything else is its child: `ppd.parse` (the body, the identifiers, the
model-length check), `ppd.session_lookup`, `ppd.psi`, `ppd.decision` (CLIENT: the DecisionService's
Route call carries its traceparent, so the service's span is its child), one `ppd.prefill` per P
attempt and `ppd.decode` (CLIENT both: the worker gets the leg's traceparent header, so vLLM's
`llm_request` span is its child).
Rule 2: `ppd.decode` is the D (or R) leg from its request to the answer's end as the front door sees
it; its child `ppd.decode.first_token` ends at the first answer token. The picker does not see D's
answer unless it observes it (picker.py rule 6): its `ppd.decode` ends at D's response headers.
Rule 2b: an unsampled request (the sampler said no: `recording` False) makes its root span only (a
non-recording one) and no other: its steps are not spans, and every worker leg sends the root's
traceparent, whose sampled flag is clear, so the workers (vLLM's parent-based sampler) record nothing
either, nor start traces of their own.
Rule 3: the root span carries the turn's attributes once it is reported (`record`): turn, path,
reason, table version, workers, explored, fallback, tokens (prompt, new, context, expected and
actual output), TTFT; an error sets its status to ERROR with the error's text.
Only OpenTelemetry's API is used (the tracer comes from ppd/tracing_export.py through Deps).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Final

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.turn import TurnInputs, TurnOutcome
from ppd.tracing import TRACEPARENT, context_from, traceparent_of

__all__ = ["LegSpan", "RequestTrace"]

_TRACESTATE: Final = "tracestate"


class LegSpan:
    """A call to a worker (rule 1): its CLIENT span and the traceparent the worker gets; of an unsampled
    request (rule 2b), no span: the root's (non-recording, ending it does nothing) and traceparent."""

    __slots__ = ("_first", "_start_ns", "_tracer", "span", "traceparent")

    def __init__(
        self,
        tracer: trace.Tracer,
        parent: trace.Span,
        name: str,
        worker: str,
        url: str,
        *,
        unsampled: str | None = None,
    ) -> None:
        self._tracer = tracer
        self._start_ns = time.time_ns()
        self._first = unsampled is not None  # rule 2b: no first-token span either
        if unsampled is not None:
            self.span, self.traceparent = parent, unsampled
            return
        self.span = tracer.start_span(
            name,
            context=trace.set_span_in_context(parent),
            kind=SpanKind.CLIENT,
            start_time=self._start_ns,
            attributes={"ppd.worker": worker, "server.address": url},
        )
        self.traceparent = traceparent_of(self.span)

    def headers(self, headers: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        """The leg's headers with its traceparent (a client's own was never forwarded)."""
        return (*headers, (TRACEPARENT, self.traceparent))

    def first_token(self) -> None:
        """Rule 2: the answer's first token arrived (once)."""
        if self._first:
            return
        self._first = True
        self._tracer.start_span(
            "ppd.decode.first_token",
            context=trace.set_span_in_context(self.span),
            start_time=self._start_ns,
        ).end()

    def end(self, error: str | None = None, *, status: int | None = None) -> None:
        if not self.span.is_recording():  # rule 2b
            return
        if status is not None:
            self.span.set_attribute("http.response.status_code", status)
        if error is not None:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()


class RequestTrace:
    """Rule 1's root span of one request and its children."""

    __slots__ = ("_context", "_tracer", "_unsampled", "recording", "root")

    def __init__(self, tracer: trace.Tracer, name: str, headers: Mapping[str, str]) -> None:
        self._tracer = tracer
        carrier = {key: headers[key] for key in (TRACEPARENT, _TRACESTATE) if key in headers}
        self.root = tracer.start_span(name, context=context_from(carrier), kind=SpanKind.SERVER)
        self.recording = self.root.is_recording()
        # Rule 2b: what an unsampled request's legs send.
        self._unsampled = None if self.recording else traceparent_of(self.root)
        self._context = trace.set_span_in_context(self.root)

    def step(
        self, name: str, *, kind: SpanKind = SpanKind.INTERNAL
    ) -> contextlib.AbstractContextManager[trace.Span]:
        """A child span around a step of the request path; an exception out of it is recorded. Of an
        unsampled request (rule 2b): none, the root's non-recording span stands in."""
        return self._step(name, kind) if self.recording else contextlib.nullcontext(self.root)

    @contextlib.contextmanager
    def _step(self, name: str, kind: SpanKind) -> Iterator[trace.Span]:
        span = self._tracer.start_span(name, context=self._context, kind=kind)
        try:
            yield span
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, _describe(exc)))
            raise
        finally:
            span.end()

    def leg(self, name: str, worker: str, url: str) -> LegSpan:
        """A call to a worker, child of the root (rule 1)."""
        return LegSpan(self._tracer, self.root, name, worker, url, unsampled=self._unsampled)

    def record(self, turn: TurnInputs, outcome: TurnOutcome) -> None:
        """Rule 3: the turn's attributes on the root span."""
        if not self.recording:
            return
        psi = turn.psi
        attributes: dict[str, str | int | float | bool] = {
            "ppd.request_id": turn.request_id,
            "ppd.turn": turn.turn,
            "ppd.path": outcome.path,
            "ppd.reason": outcome.reason,
            "ppd.worker.prefill": outcome.prefill_worker,
            "ppd.worker.decode": outcome.decode_worker,
            "ppd.tokens.new": psi.n_in.tokens,
            "ppd.tokens.context": psi.n_ctx,
            "ppd.tokens.prompt": psi.n_ctx + psi.n_in.tokens,
            "ppd.tokens.expected_output": psi.n_out,
        }
        decision = outcome.decision
        if decision is not None:
            attributes["ppd.table.version"] = decision.table_version
            attributes["ppd.explored"] = decision.explored
            attributes["ppd.fallback"] = decision.fallback
        if outcome.completion_tokens is not None:
            attributes["ppd.tokens.output"] = outcome.completion_tokens
        if outcome.ttft is not None:
            attributes["ppd.ttft_s"] = outcome.ttft
        if turn.session_reset:
            attributes["ppd.session_reset"] = turn.session_reset
        self.root.set_attributes(attributes)
        if outcome.error is not None:
            self.root.set_status(Status(StatusCode.ERROR, outcome.error))

    def failed(self, error: BaseException) -> None:
        """The request failed with `error` (its status), the span still open."""
        if self.recording:
            self.root.set_status(Status(StatusCode.ERROR, _describe(error)))

    def end(self, error: BaseException | None = None) -> None:
        """The front door is done with the request; an exception that ended it is its status."""
        if error is not None:
            self.failed(error)
        self.root.end()


def _describe(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    return message if isinstance(message, str) else type(exc).__name__
