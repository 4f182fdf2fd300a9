"""The standalone gateway's request path: the core (core.py) reads, decides, plans and runs the P leg;
this module then calls D and hands its answer to the client, streamed or whole.

Rule 1: an upstream failure before the response has started becomes an HTTP status with an
OpenAI-style body (a GatewayError, rendered by app.py); after it started, an SSE error event and
`data: [DONE]` (never a silent 200 with a truncated body).
Rule 2: the session's D being unreachable is not the client's problem: it is marked down and the turn
re-planned once, through P to a live D (core.py rule 3), and the session is rebound.
Rule 3: when the client goes away, the upstream requests are closed at once (the worker sees the
abort): aiohttp's handler cancellation (`ppd-gateway serve` sets it) cancels the handler wherever it
waits, on the P leg or the D leg, streaming or not.
Rule 2b: the re-plan is a retry: made only within the retry budget (core.py rule 9), else the
client gets the unreachable worker's error (502). Each D (or R) call reports its outcome before the
first byte goes to the client: answered, or failed (a 5xx, a timeout, no connection), which may eject
the worker (core.py rule 9); a 4xx is the client's and counts as answered.
Rule 4: the turn is remembered with its answer, before the client can see `[DONE]` (and send its next
turn, which must find this one).
Rule 5 (tracing, gateway/request_trace.py): with a tracer, each request is one trace under its
`ppd.gateway.request` span (core.py rule 10 adds the steps and the P legs); D's leg span ends when the
answer is over (its `ppd.decode.first_token` child at the first token), with the error that ended it.
No transport here: the client is reached through the `ClientConnection` of ports.py, so this module is
unit-tested with fakes (tests/gateway/test_forwarding.py).
"""

from __future__ import annotations

import asyncio
import logging

from gateway.core import ROLE_OF, ActiveTurn, DecodeLeg, RequestCore
from gateway.deps import Deps
from gateway.errors import (
    UpstreamBrokenError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from gateway.plan import Plan, UpstreamCall
from gateway.ports import ClientConnection, ClientRequest, UpstreamStream
from gateway.relay import StreamRelay, answer_from_body, client_body, error_event, kv_params_from_body
from gateway.request_trace import LegSpan, RequestTrace
from gateway.turn import TurnInputs, TurnOutcome
from gateway.turn_report import provenance_headers
from ppd.records import CLIENT_DISCONNECTED

__all__ = ["Forwarder"]

log = logging.getLogger(__name__)


class Forwarder:
    def __init__(self, deps: Deps) -> None:
        self._d = deps
        self._core = RequestCore(deps)

    async def handle(self, request: ClientRequest, client: ClientConnection) -> None:
        """Serve one completion request; the answer goes to `client`. Raises GatewayError before
        the answer has started (app.py renders it)."""
        tracer = self._d.tracer
        if tracer is None:
            await self._handle(request, client, None)
            return
        trace = RequestTrace(tracer, "ppd.gateway.request", request.headers)  # rule 5
        try:
            await self._handle(request, client, trace)
        except BaseException as exc:
            trace.end(exc)
            raise
        trace.end()

    async def _handle(
        self, request: ClientRequest, client: ClientConnection, trace: RequestTrace | None
    ) -> None:
        core = self._core
        async with core.turn(request, trace=trace) as t:
            leg = await core.route(t)
            for attempt in range(2):
                try:
                    await self._decode(client, t, leg)
                    return
                except UpstreamUnreachableError as exc:
                    core.decode_unreachable(t, leg)
                    if attempt or not core.may_reroute(leg):
                        raise
                    leg = await core.reroute(t, leg, exc)

    async def _decode(self, client: ClientConnection, t: ActiveTurn, leg: DecodeLeg) -> None:
        span = leg.span
        try:
            if leg.call.stream:
                await self._stream(client, t.turn, t.outcome, leg.plan, leg.call, span=span)
            else:
                await self._unary(client, t.turn, t.outcome, leg.call)
        except BaseException as exc:
            if span is not None:
                span.end(getattr(exc, "message", type(exc).__name__))
            raise
        if span is not None:
            span.end(t.outcome.error)

    async def _unary(
        self, client: ClientConnection, turn: TurnInputs, outcome: TurnOutcome, call: UpstreamCall
    ) -> None:
        d = self._d
        role = ROLE_OF[outcome.path]
        d.pool.acquire(call.worker)
        try:
            reply = await d.upstream.call_json(call, prefill=False)
        except UpstreamStatusError as exc:
            self._core.count_upstream_error(call.worker, role, "status")
            self._core.answer_status(call.worker, role, exc.upstream_status)
            raise exc from None
        except UpstreamTimeoutError:
            self._core.count_upstream_error(call.worker, role, "timeout")
            self._core.worker_failed(call.worker, role)
            raise
        finally:
            d.pool.release(call.worker)
        self._core.worker_answered(call.worker)
        try:
            body = reply.json()
        except ValueError:
            self._core.count_upstream_error(call.worker, role, "bad_body")
            raise UpstreamError(f"worker {call.worker} sent a malformed answer", worker=call.worker) from None
        answer, usage = answer_from_body(body)
        await self._core.remember(
            turn, outcome, answer, usage, completion_chunks=None, kv_params=kv_params_from_body(body)
        )
        outcome.ok = True
        await client.reply(client_body(reply.body, body), provenance_headers(turn, outcome))
        outcome.delivered = True

    async def _stream(
        self,
        client: ClientConnection,
        turn: TurnInputs,
        outcome: TurnOutcome,
        p: Plan,
        call: UpstreamCall,
        *,
        span: LegSpan | None = None,
    ) -> None:
        d = self._d
        role = ROLE_OF[outcome.path]
        d.pool.acquire(call.worker)
        try:
            try:
                outcome.decode_sent = d.timer()
                upstream = await d.upstream.open_stream(call)
                self._core.worker_answered(call.worker)
            except UpstreamStatusError as exc:
                self._core.count_upstream_error(call.worker, role, "status")
                self._core.answer_status(call.worker, role, exc.upstream_status)
                raise
            except UpstreamTimeoutError:
                self._core.count_upstream_error(call.worker, role, "timeout")
                self._core.worker_failed(call.worker, role)
                raise
            try:
                await self._relay(client, turn, outcome, p=p, call=call, upstream=upstream, span=span)
            finally:
                upstream.close()
        finally:
            d.pool.release(call.worker)

    async def _relay(
        self,
        client: ClientConnection,
        turn: TurnInputs,
        outcome: TurnOutcome,
        *,
        p: Plan,
        call: UpstreamCall,
        upstream: UpstreamStream,
        span: LegSpan | None,
    ) -> None:
        metrics = self._d.metrics
        headers = provenance_headers(turn, outcome)
        headers["Content-Type"] = "text/event-stream"
        headers["Cache-Control"] = "no-cache"
        relay = StreamRelay(strip_usage=p.strip_usage)
        try:
            await client.open_stream(headers)
            failure = await self._pump(
                client, turn, outcome, call=call, upstream=upstream, relay=relay, span=span
            )
            if failure is not None:
                metrics.stream_errors.labels("upstream").inc()
                log.warning("request %s: %s", turn.request_id, failure)
                outcome.error = failure
                await client.write(error_event(failure))
            elif relay.error is not None:
                metrics.stream_errors.labels("worker_error_event").inc()
                outcome.error = relay.error
            else:
                await self._complete(turn, outcome, relay)
            await client.end()
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            upstream.close()
            if not outcome.delivered:
                metrics.stream_errors.labels("client_disconnected").inc()
                outcome.error = CLIENT_DISCONNECTED
                outcome.ok = False
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _pump(
        self,
        client: ClientConnection,
        turn: TurnInputs,
        outcome: TurnOutcome,
        *,
        call: UpstreamCall,
        upstream: UpstreamStream,
        relay: StreamRelay,
        span: LegSpan | None,
    ) -> str | None:
        """Copy the worker's events to the client; returns what went wrong upstream, if anything.
        A failed write to the client raises ConnectionResetError."""
        timer = self._d.timer
        role = ROLE_OF[outcome.path]
        chunks = upstream.chunks()
        while True:
            try:
                data = await anext(chunks)
            except StopAsyncIteration:
                break
            except UpstreamBrokenError as exc:
                self._core.count_upstream_error(call.worker, role, "mid_stream")
                return exc.message
            received = timer()
            out, content = relay.feed(data)
            if content:
                outcome.content_at(received, turn.start)
                if span is not None:
                    span.first_token()
            if relay.done and relay.error is None:
                # Before the client can see [DONE] and send its next turn, which must find this one.
                await self._complete(turn, outcome, relay)
            if out:
                await client.write(out)
                outcome.delivered = outcome.ok and relay.done
                if outcome.overhead is None and outcome.decode_sent is not None:
                    # Everything since arrival, minus the time the workers had the request.
                    waited = outcome.prefill_wait + (received - outcome.decode_sent)
                    outcome.overhead = (timer() - turn.start) - waited
        tail = relay.end()
        if tail:
            await client.write(tail)
        if relay.truncated:
            self._core.count_upstream_error(call.worker, role, "truncated")
            return f"worker {call.worker} ended the stream before [DONE]"
        return None

    # ------------------------------------------------------------------ bookkeeping

    async def _complete(self, turn: TurnInputs, outcome: TurnOutcome, relay: StreamRelay) -> None:
        if not outcome.ok:
            outcome.ok = True
            await self._core.remember(
                turn,
                outcome,
                relay.answer,
                relay.usage,
                completion_chunks=relay.chunks,
                kv_params=relay.kv_params,
            )
