"""One completion request end to end: find the session, measure ψ, decide, plan, call P and D,
relay the answer, remember the turn.

Rule 1: every check that can fail on the client's input runs before any worker is called (the body's
fields and identifiers, the identifier headers, and the request against the served model's length).
Rule 2: an upstream failure before the response has started becomes an HTTP status with an
OpenAI-style body; after it started, an SSE error event and `data: [DONE]` (never a silent 200 with a
truncated body).
Rule 3: the session's D being unreachable is not the client's problem: the gateway marks it down and
re-plans once, through P to a live D, and the session is rebound.
Rule 4: when the client goes away, the upstream requests are closed at once (the worker sees the
abort): aiohttp's handler cancellation (`ppd-gateway serve` sets it) cancels the handler wherever it
waits, on the P leg or the D leg, streaming or not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from aiohttp import web

from gateway.decision_client import LiveSignals, RouteQuery
from gateway.deps import Deps
from gateway.errors import (
    BadRequestError,
    GatewayError,
    PayloadTooLargeError,
    PrefillFailedError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from gateway.limits import check_client_id, check_model_length
from gateway.openai_types import CompletionRequest, parse_completion_request
from gateway.plan import (
    KV_FIELD,
    Plan,
    PlanRequest,
    UpstreamCall,
    decode_after_prefill,
    local_fallback,
    plan,
)
from gateway.psi import TokenCount, estimate_tokens, expected_output, message_text
from gateway.relay import StreamRelay, Usage, answer_from_body, error_event
from gateway.request_log import RequestRecord
from gateway.routing import Decision, Mode, parse_mode, static_decision
from gateway.sessions import KeyChain, Session, explicit_key, history_extends, split_history
from gateway.types import Endpoint, Role

__all__ = ["PROVENANCE_HEADERS", "Forwarder"]

log = logging.getLogger(__name__)

MODE_HEADER = "X-PPD-Mode"
OUTPUT_HINT_HEADER = "X-PPD-Expected-Output-Tokens"
SESSION_HEADER = "X-Session-ID"
WORKLOAD_HEADER = "X-PPD-Workload"
PROVENANCE_HEADERS = (
    "X-PPD-Path",
    "X-PPD-Reason",
    "X-PPD-Turn",
    "X-PPD-Table-Version",
    "X-PPD-Session-Id",
    "X-PPD-Mode",
    "X-PPD-Decode-Worker",
    "X-PPD-Prefill-Worker",
    "X-PPD-Fallback",
    "X-PPD-Session-Reset",
    "X-Request-Id",
)
_ROLE_OF: Mapping[str, Role] = {"pd": "decode", "local": "decode", "replica": "replica"}


@dataclass(slots=True)
class _Turn:
    """Per-request facts, filled in as the request goes along."""

    request_id: str
    start: float
    start_wall: float
    req: CompletionRequest
    mode: Mode
    explicit_id: str | None
    session: Session | None
    session_id: str
    turn: int
    n_in: TokenCount
    n_out: int
    n_ctx: int
    workload: str = ""
    # The content-key chain over every message of this request (chat only): + the answer = next key.
    chain: KeyChain | None = None
    # Why a named session was not continued ("fork", "new_history"); "" when it was (or none was named).
    session_reset: str = ""
    decision: Decision | None = None
    path: str = ""
    reason: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    rebound: bool = False
    ttft: float | None = None
    last_token: float | None = None
    # The gateway's own share of the time to first token (see GatewayMetrics.overhead).
    prefill_wait: float = 0.0
    decode_sent: float | None = None
    overhead: float | None = None
    ok: bool = False
    error: str | None = None

    @property
    def turn_class(self) -> str:
        return "first" if self.turn <= 1 else "later"


class Forwarder:
    def __init__(self, deps: Deps) -> None:
        self._d = deps
        s = deps.settings
        self._s = s
        self._worker_headers: tuple[tuple[str, str], ...] = (
            (("Authorization", f"Bearer {s.worker_api_key}"),) if s.worker_api_key else ()
        )

    # ------------------------------------------------------------------ entry

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        d = self._d
        start = time.perf_counter()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLargeError(
                f"request body over the limit of {self._s.max_body_bytes} bytes"
            ) from None
        req = parse_completion_request(raw, endpoint, self._s.limits)
        self._check_id_headers(request)
        check_model_length(
            req.body,
            req.messages,
            max_model_len=d.pool.max_model_len(req.model),
            counter=d.tokenizers.encoding(req.model),
        )
        mode = self._mode(request)
        turn = self._begin(request, req, mode, start)
        d.metrics.inflight.inc()
        try:
            return await self._serve(request, turn)
        except GatewayError as exc:
            turn.error = exc.message
            raise
        except asyncio.CancelledError:
            turn.error = turn.error or "client disconnected"
            raise
        finally:
            d.metrics.inflight.dec()
            self._finish(turn)

    def _check_id_headers(self, request: web.Request) -> None:
        for name in (SESSION_HEADER, WORKLOAD_HEADER):
            value = request.headers.get(name)
            if value:  # an empty header is no header
                check_client_id(value, name, max_length=self._s.limits.max_id_length)

    def _mode(self, request: web.Request) -> Mode:
        override = request.headers.get(MODE_HEADER)
        if override is None or not self._s.allow_mode_header:
            return self._s.mode
        try:
            return parse_mode(override)
        except ValueError as exc:
            raise BadRequestError(str(exc), param=MODE_HEADER) from None

    def _begin(self, request: web.Request, req: CompletionRequest, mode: Mode, start: float) -> _Turn:
        d = self._d
        explicit = request.headers.get(SESSION_HEADER) or req.session_id
        history_end = split_history(req.messages)[0] if req.messages else 0
        session: Session | None = None
        chain: KeyChain | None = None
        reset = ""
        if explicit:
            session = d.sessions.get(explicit_key(explicit))
        if req.endpoint == "chat":
            chain = KeyChain(req.model)
            if session is None:
                chain.extend(req.messages[:history_end])
            elif explicit and history_extends(session, chain, req.messages, history_end) is False:
                # The id names a conversation this history does not continue (a reused id, an edit):
                # an earlier state of this exact history if one is known (a fork), else a new one.
                found = d.sessions.get(chain.key()) if history_end else None
                session = replace(found, id=explicit) if found is not None else None
                reset = "fork" if found is not None else "new_history"
                d.metrics.session_resets.labels(reset).inc()
            if not explicit and history_end:
                session = d.sessions.get(chain.key())
            chain.extend(req.messages[history_end:])
        turn_no = session.turns + 1 if session is not None else 1
        session_id = session.id if session is not None else (explicit or d.new_id())
        new_messages = req.messages[history_end:] if session is not None else req.messages
        n_in = self._count_exact(req, new_messages)
        hint = _int_header(request, OUTPUT_HINT_HEADER)
        n_out, _ = expected_output(
            req.body, hint=hint, session=session, default=self._s.policy.default_output_tokens
        )
        return _Turn(
            request_id=d.new_id(),
            start=start,
            start_wall=d.wall_clock(),
            req=req,
            mode=mode,
            explicit_id=explicit,
            session=session,
            session_id=session_id,
            turn=turn_no,
            n_in=n_in,
            n_out=n_out,
            n_ctx=session.context_tokens if session is not None else 0,
            workload=request.headers.get(WORKLOAD_HEADER, self._s.log.workload),
            chain=chain,
            session_reset=reset,
        )

    def _count_exact(self, req: CompletionRequest, messages: Sequence[Mapping[str, Any]]) -> TokenCount:
        tok = self._d.tokenizers
        if req.endpoint == "chat":
            count = tok.count_messages(req.model, messages)
            text = "".join(message_text(m) for m in messages)
        else:
            prompt = req.body.get("prompt")
            text = prompt if isinstance(prompt, str) else ""
            count = tok.count_text(req.model, text) if text else None
        return count if count is not None else estimate_tokens(text)

    # ------------------------------------------------------------------ decide and plan

    async def _decide(self, turn: _Turn) -> Decision:
        d = self._d
        d.qps.record()
        decision = static_decision(turn.mode, turn=turn.turn, session_id=turn.session_id)
        if decision is not None:
            return decision
        session = turn.session
        if session is not None and not d.pool.is_live(session.worker or ""):
            return Decision("pd", "decode_gone")
        if turn.n_in.source == "estimate" and self._s.policy.worker_tokenize:
            turn.n_in = await self._count_with_worker(turn)
        view = d.pool.view()
        live: LiveSignals | None = None
        if self._s.decision.send_live_signals:
            ranked_p = view.ranked("prefill")
            dec = view.get(session.worker if session else None)
            live = LiveSignals(
                prefill_queue_depth=int(ranked_p[0].load.waiting) if ranked_p else None,
                decode_running_requests=int(dec.load.running) if dec else None,
                decode_kv_usage=dec.load.kv_usage if dec else None,
            )
        query = RouteQuery(
            request_id=turn.request_id,
            turn=turn.turn,
            new_input_tokens=turn.n_in.tokens,
            expected_output_tokens=turn.n_out,
            context_tokens=turn.n_ctx,
            qps=d.qps.rate(),
            live=live,
            weights_profile=self._s.decision.weights_profile,
            table_key=self._s.decision.table_key,
        )
        fallback = Decision(self._s.decision.fallback, "fallback")
        return await d.decisions.route(query, fallback)

    async def _count_with_worker(self, turn: _Turn) -> TokenCount:
        """n_in from a worker's /tokenize when no exact tokenizer is bundled; estimate on failure."""
        d = self._d
        req = turn.req
        view = d.pool.view()
        worker = view.get(turn.session.worker if turn.session else None)
        if worker is None:
            return turn.n_in
        history_end = split_history(req.messages)[0]
        body: dict[str, Any] = {"model": req.model, "add_special_tokens": False}
        if req.endpoint == "chat":
            body["messages"] = list(req.messages[history_end:])
            body["add_generation_prompt"] = False
        else:
            body["prompt"] = req.body.get("prompt", "")
        try:
            reply = await d.upstream.post(worker.url + "/tokenize", body, dict(self._worker_headers))
            count = reply.json().get("count") if reply.status == 200 else None
        except (UpstreamError, ValueError, AttributeError):
            count = None
        if isinstance(count, int):
            return TokenCount(count, "worker")
        return turn.n_in

    def _plan_request(self, request: web.Request, turn: _Turn) -> PlanRequest:
        headers = self._worker_headers
        if self._s.forward_authorization and "Authorization" in request.headers:
            headers = (("Authorization", request.headers["Authorization"]),)
        return PlanRequest(
            endpoint=turn.req.endpoint,
            body=turn.req.body,
            request_id=turn.request_id,
            headers=headers,
            inject_usage=self._s.policy.inject_usage,
            prefill_attempts=self._s.policy.prefill_attempts,
        )

    # ------------------------------------------------------------------ execute

    async def _serve(self, request: web.Request, turn: _Turn) -> web.StreamResponse:
        d = self._d
        decision = await self._decide(turn)
        turn.decision = decision
        preq = self._plan_request(request, turn)
        p = plan(preq, turn.session, decision, d.pool.view())
        for attempt in range(2):
            kv: Mapping[str, Any] | None = None
            if p.path == "pd":
                p, kv = await self._prefill(turn, p)
            call = decode_after_prefill(p, kv) if p.path == "pd" else p.decode
            turn.path, turn.reason, turn.rebound = p.path, p.reason, p.rebound
            turn.decode_worker = call.worker
            d.pool.note_pick(call.worker)
            try:
                if call.stream:
                    return await self._stream(request, turn, p, call)
                return await self._unary(turn, call)
            except UpstreamUnreachableError as exc:
                self._upstream_error(call.worker, _ROLE_OF[p.path], "unreachable")
                d.pool.mark_failed(call.worker)
                if attempt:
                    raise
                log.warning("%s; re-planning request %s once", exc.message, turn.request_id)
                retry = Decision("replica", "replica_unreachable")
                if p.path != "replica":
                    retry = Decision("pd", "decode_unreachable")
                p = plan(preq, turn.session, retry, d.pool.view())
        raise AssertionError("unreachable")  # pragma: no cover

    async def _prefill(self, turn: _Turn, p: Plan) -> tuple[Plan, Mapping[str, Any] | None]:
        d = self._d
        for i, call in enumerate(p.prefill):
            if i:
                d.metrics.prefill_retries.inc()
            d.pool.acquire(call.worker)
            sent = time.perf_counter()
            try:
                reply = await d.upstream.call_json(call, prefill=True)
                body = reply.json()
            except UpstreamStatusError as exc:
                if 400 <= exc.upstream_status < 500:
                    raise
                self._upstream_error(call.worker, "prefill", "status")
                continue
            except UpstreamUnreachableError:
                self._upstream_error(call.worker, "prefill", "unreachable")
                d.pool.mark_failed(call.worker)
                continue
            except UpstreamTimeoutError:
                self._upstream_error(call.worker, "prefill", "timeout")
                continue
            except ValueError:
                self._upstream_error(call.worker, "prefill", "bad_body")
                continue
            finally:
                d.pool.release(call.worker)
                turn.prefill_wait += time.perf_counter() - sent
            turn.prefill_worker = call.worker
            d.pool.note_success(call.worker)
            d.pool.note_pick(call.worker)
            params = body.get(KV_FIELD) if isinstance(body, Mapping) else None
            return p, params if isinstance(params, Mapping) else None
        if self._s.policy.prefill_failure == "local":
            log.warning(
                "every prefill attempt failed for %s; prefilling on the decode worker", turn.request_id
            )
            return local_fallback(p, "prefill_failed"), None
        raise PrefillFailedError(f"every prefill worker failed ({len(p.prefill)} tried)")

    async def _unary(self, turn: _Turn, call: UpstreamCall) -> web.StreamResponse:
        d = self._d
        d.pool.acquire(call.worker)
        try:
            reply = await d.upstream.call_json(call, prefill=False)
        except UpstreamStatusError as exc:
            self._upstream_error(call.worker, _ROLE_OF[turn.path], "status")
            raise exc from None
        except UpstreamTimeoutError:
            self._upstream_error(call.worker, _ROLE_OF[turn.path], "timeout")
            raise
        finally:
            d.pool.release(call.worker)
        d.pool.note_success(call.worker)
        try:
            body = reply.json()
        except ValueError:
            self._upstream_error(call.worker, _ROLE_OF[turn.path], "bad_body")
            raise UpstreamError(f"worker {call.worker} sent a malformed answer", worker=call.worker) from None
        answer, usage = answer_from_body(body)
        self._remember(turn, answer, usage, completion_chunks=None)
        turn.ok = True
        return web.Response(
            body=reply.body, status=200, content_type="application/json", headers=self._provenance(turn)
        )

    async def _stream(
        self, request: web.Request, turn: _Turn, p: Plan, call: UpstreamCall
    ) -> web.StreamResponse:
        d = self._d
        d.pool.acquire(call.worker)
        try:
            try:
                turn.decode_sent = time.perf_counter()
                upstream = await d.upstream.open_stream(call)
                d.pool.note_success(call.worker)
            except UpstreamStatusError:
                self._upstream_error(call.worker, _ROLE_OF[turn.path], "status")
                raise
            except UpstreamTimeoutError:
                self._upstream_error(call.worker, _ROLE_OF[turn.path], "timeout")
                raise
            try:
                return await self._relay(request, turn, p, call, upstream)
            finally:
                upstream.close()
        finally:
            d.pool.release(call.worker)

    async def _relay(
        self,
        request: web.Request,
        turn: _Turn,
        p: Plan,
        call: UpstreamCall,
        upstream: aiohttp.ClientResponse,
    ) -> web.StreamResponse:
        headers = self._provenance(turn)
        headers["Content-Type"] = "text/event-stream"
        headers["Cache-Control"] = "no-cache"
        response = web.StreamResponse(status=200, headers=headers)
        relay = StreamRelay(strip_usage=p.strip_usage)
        try:
            await response.prepare(request)
            failure = await self._pump(turn, call, upstream, relay, response)
            if failure is not None:
                self._d.metrics.stream_errors.labels("upstream").inc()
                log.warning("request %s: %s", turn.request_id, failure)
                turn.error = failure
                await response.write(error_event(failure))
            elif relay.error is not None:
                self._d.metrics.stream_errors.labels("worker_error_event").inc()
                turn.error = relay.error
            else:
                self._complete(turn, relay)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            upstream.close()
            self._d.metrics.stream_errors.labels("client_disconnected").inc()
            turn.error = "client disconnected"
            turn.ok = False
            if isinstance(exc, asyncio.CancelledError):
                raise
        return response

    async def _pump(
        self,
        turn: _Turn,
        call: UpstreamCall,
        upstream: aiohttp.ClientResponse,
        relay: StreamRelay,
        response: web.StreamResponse,
    ) -> str | None:
        """Copy the worker's events to the client; returns what went wrong upstream, if anything.
        A failed write to the client raises ConnectionResetError."""
        role = _ROLE_OF[turn.path]
        chunks = upstream.content.iter_any()
        while True:
            try:
                data = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self._upstream_error(call.worker, role, "mid_stream")
                return f"worker {call.worker} failed mid-stream: {type(exc).__name__}"
            received = time.perf_counter()
            out, content = relay.feed(data)
            if content:
                if turn.ttft is None:
                    turn.ttft = received - turn.start
                turn.last_token = received
            if relay.done and relay.error is None:
                # Before the client can see [DONE] and send its next turn, which must find this one.
                self._complete(turn, relay)
            if out:
                await response.write(out)
                if turn.overhead is None and turn.decode_sent is not None:
                    # Everything since arrival, minus the time the workers had the request.
                    now = time.perf_counter()
                    turn.overhead = (now - turn.start) - turn.prefill_wait - (received - turn.decode_sent)
        tail = relay.end()
        if tail:
            await response.write(tail)
        if relay.truncated:
            self._upstream_error(call.worker, role, "truncated")
            return f"worker {call.worker} ended the stream before [DONE]"
        return None

    # ------------------------------------------------------------------ bookkeeping

    def _complete(self, turn: _Turn, relay: StreamRelay) -> None:
        if not turn.ok:
            turn.ok = True
            self._remember(turn, relay.answer, relay.usage, completion_chunks=relay.chunks)

    def _remember(
        self, turn: _Turn, answer: str, usage: Usage | None, *, completion_chunks: int | None
    ) -> None:
        d = self._d
        if usage is not None:
            prompt, completion = usage.prompt_tokens, usage.completion_tokens
        else:
            prompt = turn.n_ctx + turn.n_in.tokens
            completion = (
                completion_chunks if completion_chunks is not None else estimate_tokens(answer).tokens
            )
        turn.n_out = completion
        base = turn.session if turn.session is not None else Session(turn.session_id)
        chain = turn.chain
        after = base.after_turn(
            worker=turn.decode_worker,
            prompt_tokens=prompt,
            completion_tokens=completion,
            history_key=chain.key() if chain is not None else "",
            history_messages=len(turn.req.messages) if chain is not None else 0,
        )
        if turn.explicit_id:
            d.sessions.put(explicit_key(turn.explicit_id), after)
        if turn.chain is not None:
            key = turn.chain.fork().add({"role": "assistant", "content": answer}).key()
            d.sessions.put(key, after)
        if turn.rebound:
            d.metrics.rebinds.inc()

    def _provenance(self, turn: _Turn) -> dict[str, str]:
        decision = turn.decision
        headers = {
            "X-PPD-Path": turn.path,
            "X-PPD-Reason": turn.reason,
            "X-PPD-Turn": str(turn.turn),
            "X-PPD-Session-Id": turn.session_id,
            "X-PPD-Mode": str(turn.mode),
            "X-PPD-Decode-Worker": turn.decode_worker,
            "X-Request-Id": turn.request_id,
        }
        if decision is not None and decision.table_version:
            headers["X-PPD-Table-Version"] = decision.table_version
        if turn.prefill_worker:
            headers["X-PPD-Prefill-Worker"] = turn.prefill_worker
        if turn.session_reset:
            headers["X-PPD-Session-Reset"] = turn.session_reset
        if decision is not None and decision.fallback:
            headers["X-PPD-Fallback"] = "1"
        return headers

    def _upstream_error(self, worker: str, role: str, kind: str) -> None:
        self._d.metrics.upstream_errors.labels(worker, role, kind).inc()

    def _finish(self, turn: _Turn) -> None:
        d = self._d
        end = time.perf_counter()
        m = d.metrics
        if turn.path:
            m.decisions.labels(turn.path, turn.reason).inc()
        d.metrics.token_counts.labels(turn.n_in.source).inc()
        tpot: float | None = None
        if turn.overhead is not None:
            m.overhead.labels(turn.path or "pd").observe(turn.overhead)
        if turn.ok and turn.ttft is not None:
            m.ttft.labels(turn.path, turn.turn_class).observe(turn.ttft)
            if turn.last_token is not None and turn.n_out > 1:
                tpot = (turn.last_token - (turn.start + turn.ttft)) / (turn.n_out - 1)
                m.tpot.labels(turn.path, turn.turn_class).observe(tpot)
        if d.request_log is not None:
            s = self._s.log
            d.request_log.write(
                RequestRecord(
                    run_id=s.run_id,
                    shape=s.shape,
                    model=s.model or turn.req.model,
                    mode=str(turn.mode),
                    target_qps=s.target_qps,
                    workload=turn.workload,
                    conversation_id=turn.session_id,
                    turn=turn.turn,
                    n_in=turn.n_in.tokens,
                    n_out=turn.n_out,
                    n_ctx=turn.n_ctx,
                    path=turn.path or "pd",
                    ttft_ms=turn.ttft * 1000.0 if turn.ttft is not None else None,
                    tpot_ms=tpot * 1000.0 if tpot is not None else None,
                    e2e_ms=(end - turn.start) * 1000.0,
                    ok=turn.ok,
                    error=turn.error,
                    start_time=turn.start_wall,
                )
            )


def _int_header(request: web.Request, name: str) -> int | None:
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BadRequestError(f"header {name} must be an integer", param=name) from None
    if value < 0:
        raise BadRequestError(f"header {name} must be non-negative", param=name)
    return value
