"""The request path up to D's leg, shared by both front doors: read the request, find its session,
measure ψ, decide, plan, run the P leg, and say where D's leg goes with which body; remember the turn
and report it. The standalone gateway (forwarding.py: it then calls D and relays the answer) and the
Envoy picker (picker.py: Envoy then carries D's leg) call this one core, so there is no second copy of
the routing logic.

Rule 1: every check that can fail on the client's input runs before any worker is called (the body's
fields and identifiers, the identifier headers, and the request against the served model's length).
Rule 2: an upstream failure before the answer has started is a GatewayError (each edge renders it as an
OpenAI-style error: an HTTP status with its body, or Envoy's ImmediateResponse).
Rule 3: the session's D being unreachable is not the client's problem: the edge that found it out
calls `reroute`, which marks it down and re-plans once, through P to a live D; the session is rebound.
Rule 4: one `PoolView` per request, taken when it arrives; ψ is measured once (psi.py); whether the
session's D is gone is decided by plan.py alone. A front door may narrow the D and R candidates to
a set of worker ids (`turn`'s `subset`: the picker's GIE subset hint; pool.py rule 7); P is never
narrowed (it is not the request's destination). The session's D outside the subset is gone for
this request (plan.py rule 5); no live candidate inside is a NoWorkerError (503) saying so.
Rule 5: `turn` is the turn's whole life: everything in its `async with` counts as in flight, and on the
way out, served or not, the turn is reported once (turn_report.py); a GatewayError or a cancellation
(the client left) inside it is recorded as the turn's error.
Rule 6: a front door that never sees the answer (`relays_answer=False`, the picker) gets D's body as
the client sent it (no `stream_options.include_usage` added: nobody would drop the extra chunk) and
remembers the turn when it is routed, under the messages it was sent only (session_lookup.py rule 1:
the next turn's history carries the answer and finds it by the longest stored prefix).
Rule 7: a turn's request-log line is written only when its front door saw the answer (`observed`;
the standalone always, the picker for its sampled and explored turns: a line without the answer's
timings is no evidence). A front door that observes the answer after `turn`'s block (the picker:
Envoy streams it later) holds the turn (`hold`), and ends it (`end`) when the answer is over; an
exception out of the block ends it there as always.
Rule 8: `route(t, run_prefill=False)` plans without running the P leg (llm-d's convention: D's
routing sidecar runs it): a pd or bidir plan is returned with the chosen P in `DecodeLeg.prefiller`
and D's body as planned (no P params); a bidir plan becomes pd (reason `bidir_sidecar`: the sidecar
sends a plain P leg), and P counts as picked (its load share) but is not called here.
Rule 9 (bad workers, retries): every call to a worker reports its outcome to the pool before its
first byte reaches the client (`worker_answered`, `worker_failed`: pool.py rule 8, outliers.py rule 1),
which may eject the worker; each ejection is counted and logged, each restoration logged, a worker
held back as the last of its role logged at most once a minute. A retry (the next P after a failed one,
the local prefill after every P failed, a re-plan after D or R was unreachable) happens only before
the answer started and only within the retry budget (retry_budget.py): counted by the failure that
caused it (`ppd_gateway_retries_total{reason}`); refused, it is counted
(`ppd_gateway_retry_budget_exhausted_total{reason}`, a WARNING line every 10 s at most) and the
request is answered with the error it had.
Rule 10 (admission, off by default): after the client's input is checked (rule 1) and before its
session is looked up, a request passes admission control (admission_gate.py over ppd/admission.py):
its tenant is `key:` + a hash of its bearer token, else `tenant:` + X-PPD-Tenant, else `anonymous`;
its class the X-PPD-Priority header (a bad value is a 400), else its tenant's default, never above
its tenant's ceiling. Shed, it is a TooManyRequestsError (429, Retry-After) and nothing else
happens; admitted, it holds its place until the turn ends (`_end`, held turns included).
Rule 11 (tracing, gateway/request_trace.py): with a `RequestTrace` from the front door, the steps get
their spans (parse, session lookup, ψ, the decision with its traceparent to the DecisionService, each
P attempt and D's leg with theirs to the worker) and the turn's attributes go on the front door's span
when it is reported. Without one (tracing off), no span object is made.
No transport here: workers are reached through the `Upstream`, the DecisionService through the
`DecisionClient` of ports.py (import-linter keeps the core free of aiohttp, grpc and Envoy's stubs).
It stays one module (about 910 lines): its steps share one turn's inputs, outcome and pool view in the
order the rules above need; the parts that stand alone already live apart (session_lookup, psi.measure,
plan, turn_report).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from opentelemetry.trace import SpanKind

from gateway.admission_gate import AdmissionGate, Ticket
from gateway.deps import Deps
from gateway.errors import (
    BadRequestError,
    GatewayError,
    PrefillFailedError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from gateway.limits import check_client_id, check_model_length
from gateway.openai_types import CompletionRequest, parse_completion_request
from gateway.openings import Marks
from gateway.outliers import Ejection, Held
from gateway.plan import (
    KV_FIELD,
    Plan,
    PlanRequest,
    UpstreamCall,
    bidir_retry,
    decode_after_prefill,
    decode_gone,
    local_fallback,
    plan,
    prefill_elsewhere,
    prompt_token_ids,
)
from gateway.pool import PoolView, WorkerView
from gateway.ports import ClientRequest, LiveSignals, RouteQuery
from gateway.psi import Psi, WorkerCount, estimate_tokens, measure, with_resident
from gateway.relay import Usage
from gateway.request_trace import LegSpan, RequestTrace
from gateway.residency import KvTracking, marks_from_text, marks_text, prefix_marks
from gateway.retry_budget import RetryBudget
from gateway.routing import Decision, static_decision
from gateway.session_lookup import SessionMatch, find_session, remember_turn
from gateway.sessions import KeyChain, Session, prompt_fingerprint
from gateway.turn import TurnInputs, TurnOutcome
from gateway.turn_report import TurnReport
from gateway.types import Role
from ppd.admission import Priority, parse_priority
from ppd.explore import ExplorationPolicy, secret_seed
from ppd.modes import Mode, ModeError, parse_mode
from ppd.rate_limited_log import RateLimitedLog
from ppd.records import CLIENT_DISCONNECTED
from ppd.tracing import traceparent_of

__all__ = ["ActiveTurn", "DecodeLeg", "RequestCore"]

log = logging.getLogger(__name__)

MODE_HEADER = "X-PPD-Mode"
OUTPUT_HINT_HEADER = "X-PPD-Expected-Output-Tokens"
SESSION_HEADER = "X-Session-ID"
WORKLOAD_HEADER = "X-PPD-Workload"
PRIORITY_HEADER = "X-PPD-Priority"
TENANT_HEADER = "X-PPD-Tenant"
ROLE_OF: Mapping[str, Role] = {"pd": "decode", "local": "decode", "replica": "replica", "bidir": "decode"}
_THROUGH_P: Final = ("pd", "bidir")
# Rule 4: the roles a request's destination can have (what a subset narrows).
_DESTINATION_ROLES: Final[tuple[Role, ...]] = ("decode", "replica")
# What a gateway whose workers run vLLM's bidirectional mode tells the DecisionService it can serve.
_BIDIR: Final = frozenset({"bidir"})
# What the core passes to plan() when the session's D is gone: plan() overrules any decision
# then (reason decode_gone), so the DecisionService is not asked.
_NOT_ASKED = Decision("pd", "not_asked")
# ppd mode, turn 2+: the decode worker's KV events say none of the context is resident any more, so
# the turn is a cold one (a full prefill either way): P/D, as turn 1, without asking (gateway/residency.py).
_KV_EVICTED = Decision("pd", "kv_evicted")
# Rule 11 without a trace: one reusable context manager that does nothing (no span object).
_NO_SPAN: Final = contextlib.nullcontext()


def _step(trace: RequestTrace | None, name: str) -> contextlib.AbstractContextManager[object]:
    return _NO_SPAN if trace is None else trace.step(name)


@dataclass(slots=True)
class ActiveTurn:
    """One turn inside `RequestCore.turn`: its inputs (final once the decision is made), its outcome
    as it is filled in, and the request's pool view (narrowed when a D turns out unreachable)."""

    request: ClientRequest
    turn: TurnInputs
    outcome: TurnOutcome
    view: PoolView
    # The front door sees this turn's answer: the turn's request-log line is written (rule 7).
    observed: bool = True
    # The turn's end (in-flight count, report) is the front door's, by `end` (rule 7).
    held: bool = False
    # The prompt's token ids as a worker's /tokenize gave them (asked at most once per turn).
    token_ids: list[int] | None = None
    # Rule 10: its admission, left when the turn ends (None: admission control is off).
    ticket: Ticket | None = None
    # Rule 11: the request's spans (None: tracing off or not asked for by the front door).
    trace: RequestTrace | None = None


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """Where D's (or R's) leg goes and with which body: the plan after its P leg ran."""

    plan: Plan
    call: UpstreamCall
    # Rule 8: the P leg left to D's sidecar (None: no P leg, or the core ran it).
    prefiller: UpstreamCall | None = None
    # Rule 11: D's leg span, whose traceparent `call` carries; the front door ends it.
    span: LegSpan | None = None


class RequestCore:
    def __init__(self, deps: Deps, *, relays_answer: bool = True) -> None:
        self._d = deps
        s = deps.settings
        self._s = s
        self._relays_answer = relays_answer
        self._report = TurnReport(
            deps.metrics, deps.request_log, s.log, slo=deps.slo, table_key=s.decision.table_key
        )
        self._explorer = ExplorationPolicy(s.explore, default_seed=secret_seed())
        if s.explore.seed is None and s.explore.epsilon > 0:
            log.info(
                "explore.seed is not set: this process drew a random secret one "
                "(set explore.seed for draws that repeat across runs)"
            )
        self._budget = RetryBudget(s.retry_budget)
        self._placement = s.routing.placement_settings()
        self._held_log = RateLimitedLog(log, clock=deps.clock)
        self._budget_log = RateLimitedLog(log, interval_s=10.0, clock=deps.clock)
        self._gate: AdmissionGate | None = None
        if s.admission.enabled:
            pool = deps.pool
            self._gate = AdmissionGate(
                s.admission,
                deps.metrics,
                clock=deps.clock,
                workers=lambda: pool.count("decode", live=True) + pool.count("replica", live=True),
            )
        self._worker_headers: tuple[tuple[str, str], ...] = (
            (("Authorization", f"Bearer {s.worker_api_key}"),) if s.worker_api_key else ()
        )

    # ------------------------------------------------------------------ entry

    @contextlib.asynccontextmanager
    async def turn(
        self,
        request: ClientRequest,
        *,
        observed: bool | None = None,
        subset: frozenset[str] | None = None,
        subset_scope: str = "the gateway's endpoint subset",
        trace: RequestTrace | None = None,
    ) -> AsyncIterator[ActiveTurn]:
        """Read, check and decide one request (rules 1, 4, 5); the turn is served inside. Raises
        GatewayError before anything is counted when the request itself is wrong. `observed`
        (default: whether this front door relays answers) says whether the turn's line is written;
        `subset` (rule 4) the ids D or R may be chosen from, named `subset_scope` in errors; `trace`
        (rule 11) the front door's spans of this request."""
        d = self._d
        start, start_wall = d.timer(), d.wall_clock()
        with _step(trace, "ppd.parse"):
            req, mode = self._read(request)
        ticket = await self._admit(request.headers)
        try:
            view = self._view(subset, subset_scope)
            with _step(trace, "ppd.session_lookup"):
                match = await self._find_session(request, req)
            static = static_decision(mode, turn=match.turn, session_id=match.session_id)
            ask = static is None and not decode_gone(match.session, view)
            measure_psi = functools.partial(
                measure,
                d.tokenizers,
                model=req.model,
                body=req.body,
                new_messages=req.messages[match.new_messages_from :] if req.endpoint == "chat" else None,
                session=match.session,
                hint=_int_header(request.headers, OUTPUT_HINT_HEADER),
                default_output=self._s.policy.default_output_tokens,
            )
            # ψ without asking a worker never waits; a worker's count (below) may, so it is asked inside
            # the try: a client that leaves meanwhile still gets its request-log line.
            with _step(trace, "ppd.psi"):
                psi = await measure_psi()
            worker_count = (
                self._worker_count(req, match, view) if ask and psi.n_in.source == "estimate" else None
            )
            turn = TurnInputs(
                request_id=d.new_id(),
                start=start,
                start_wall=start_wall,
                req=req,
                mode=mode,
                explicit_id=match.explicit_id,
                session=match.session,
                session_id=match.session_id,
                turn=match.turn,
                psi=psi,
                workload=self._s.log.workload_label(request.headers.get(WORKLOAD_HEADER)),
                chain=match.chain,
                session_reset=match.reset,
            )
            active = ActiveTurn(
                request,
                turn,
                TurnOutcome(),
                view,
                observed=self._relays_answer if observed is None else observed,
                trace=trace,
            )
        except BaseException:
            self._leave(ticket)
            raise
        active.ticket = ticket
        outcome = active.outcome
        self._begin()
        served = False
        try:
            evicted = False
            if worker_count is not None or (ask and d.kv is not None):
                with _step(trace, "ppd.psi.worker"):  # a worker's /tokenize: may wait
                    evicted = await self._worker_psi(active, measure_psi, worker_count, match, ask=ask)
            if match.turn == 1:  # tables index QPS by conversations started per second (the paper's)
                d.qps.record()
            outcome.decision = await self._decide(active, static, ask=ask, evicted=evicted)
            yield active
            served = True  # rule 7: only a block that ended without an exception leaves the turn held
        except GatewayError as exc:
            outcome.error = exc.message
            raise
        except asyncio.CancelledError:
            if not outcome.delivered:
                outcome.error = outcome.error or CLIENT_DISCONNECTED
            raise
        finally:
            if not (active.held and served):
                self._end(active)

    def _read(self, request: ClientRequest) -> tuple[CompletionRequest, Mode]:
        """Rule 1: the request's body and identifiers checked, against the model's length too; its mode."""
        d = self._d
        req = parse_completion_request(request.body, request.endpoint, self._s.limits)
        self._check_id_headers(request.headers)
        check_model_length(
            req.body,
            req.messages,
            max_model_len=d.pool.max_model_len(req.model),
            counter=d.tokenizers.encoding(req.model),
        )
        return req, self._mode(request.headers)

    async def _decide(self, t: ActiveTurn, static: Decision | None, *, ask: bool, evicted: bool) -> Decision:
        """The turn's decision: static, a cold turn's PD, the DecisionService's (explored), or none
        asked (the session's D is gone: plan.py decides)."""
        if static is not None:
            return static
        if ask and evicted:
            return _KV_EVICTED
        if ask:
            return self._explore(t.turn, await self._ask(t.turn, t.view, t.trace))
        return _NOT_ASKED

    async def _worker_psi(
        self,
        active: ActiveTurn,
        measure_psi: Callable[..., Awaitable[Psi]],
        worker_count: WorkerCount | None,
        match: SessionMatch,
        *,
        ask: bool,
    ) -> bool:
        """ψ refined by what a worker says (its /tokenize count; the context still resident by its
        KV events), inside the turn's try; whether none of the context is resident (evicted)."""
        kv = self._d.kv
        evicted = False
        if worker_count is not None:
            active.turn = dataclasses.replace(active.turn, psi=await measure_psi(worker_count=worker_count))
        if ask and kv is not None:  # asks the decode worker's /tokenize
            req = active.turn.req
            resident_psi, evicted, active.token_ids = await self._resident(
                kv, req, match, active.view, active.turn.psi
            )
            active.turn = dataclasses.replace(active.turn, psi=resident_psi)
        return evicted

    def _begin(self) -> None:
        """A turn is served from here on: in flight, and one request the retry budget counts."""
        self._d.metrics.inflight.inc()
        self._budget.note_request(self._d.clock())

    async def _admit(self, headers: Mapping[str, str]) -> Ticket | None:
        """Rule 10: the request through admission control (when on), in its tenant's class."""
        if self._gate is None:
            return None
        tenant = self._tenant(headers)
        asked: Priority | None = None
        raw = headers.get(PRIORITY_HEADER)
        if raw:
            try:
                asked = parse_priority(raw.strip().lower())
            except ValueError as exc:
                raise BadRequestError(f"header {PRIORITY_HEADER}: {exc}", param=PRIORITY_HEADER) from None
        priority = self._s.admission.tenant(tenant).priority_for(asked)
        return await self._gate.enter(priority, tenant)

    def _leave(self, ticket: Ticket | None) -> None:
        if ticket is not None and self._gate is not None:
            self._gate.leave(ticket)

    def _tenant(self, headers: Mapping[str, str]) -> str:
        """Rule 10: `key:` and the first 16 hex digits of the SHA-256 of the client's bearer token,
        else `tenant:` and the X-PPD-Tenant header, else `anonymous`. The key itself is never kept."""
        scheme, _, token = headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()[:16]
        named = headers.get(TENANT_HEADER)
        if named:
            check_client_id(named, TENANT_HEADER, max_length=self._s.limits.max_id_length)
            return f"tenant:{named}"
        return "anonymous"

    def _view(self, subset: frozenset[str] | None, scope: str) -> PoolView:
        """Rule 4: this request's pool view, its D and R narrowed to `subset` when given."""
        view = self._d.pool.view()
        return view if subset is None else view.within(subset, roles=_DESTINATION_ROLES, scope=scope)

    def hold(self, t: ActiveTurn) -> None:
        """Rule 7: the turn outlives `turn`'s block (in flight, unreported) and is observed; the
        front door calls `end` once its answer is over. Call it last in the block."""
        t.held = t.observed = True

    def end(self, t: ActiveTurn) -> None:
        """Rule 7: a held turn ends: no longer in flight, reported with its line. Once: a turn not
        held (never, or already ended) is left alone."""
        if t.held:
            self._end(t)

    def _end(self, t: ActiveTurn) -> None:
        t.held = False
        self._leave(t.ticket)
        self._d.metrics.inflight.dec()
        self._report.finish(t.turn, t.outcome, end=self._d.timer(), line=t.observed)
        if t.trace is not None:
            t.trace.record(t.turn, t.outcome)

    async def route(self, t: ActiveTurn, *, run_prefill: bool = True) -> DecodeLeg:
        """The decided turn planned and, for pd and bidir, its P leg run (with its retries and the
        `prefill_failure` fallback): where D's leg goes and with which body. `run_prefill` False
        (rule 8): the P leg is chosen, not run."""
        assert t.outcome.decision is not None
        p = plan(
            await self._placed_request(t, t.outcome.decision), t.turn.session, t.outcome.decision, t.view
        )
        return await self._through_p(t, p, run_prefill=run_prefill)

    def decode_unreachable(self, t: ActiveTurn, leg: DecodeLeg) -> None:
        """D's leg could not reach its worker: counted, and the worker marked down."""
        role = ROLE_OF[leg.plan.path]
        self.count_upstream_error(leg.call.worker, role, "unreachable")
        self.worker_failed(leg.call.worker, role)
        self._d.pool.mark_failed(leg.call.worker)

    def may_reroute(self, leg: DecodeLeg) -> bool:
        """Rule 9: whether the retry budget lets `reroute` re-plan the turn (counted either way)."""
        return self.may_retry("replica_unreachable" if leg.plan.path == "replica" else "decode_unreachable")

    async def reroute(self, t: ActiveTurn, leg: DecodeLeg, why: UpstreamUnreachableError) -> DecodeLeg:
        """Rule 3: the turn re-planned without the unreachable worker, through P to a live D (or to
        another replica)."""
        log.warning("%s; re-planning request %s once", why.message, t.turn.request_id)
        retry = Decision("replica", "replica_unreachable")
        if leg.plan.path != "replica":
            retry = Decision("pd", "decode_unreachable")
        t.view = t.view.without(leg.call.worker)
        preq = await self._placed_request(t, retry)
        return await self._through_p(t, plan(preq, t.turn.session, retry, t.view))

    async def _placed_request(self, t: ActiveTurn, decision: Decision) -> PlanRequest:
        """The plan's inputs with the prompt's resident blocks on each synced candidate (plan.py rule 8):
        by the prompt's token ids when the turn has them (the D residency check asked), else by the
        session's marks of its last P prompt (residency.py rule 5), else by asking a worker's /tokenize
        (Turn 1, or a session no P leg marked)."""
        preq = self._plan_request(t.request.headers, t.turn)
        kv = self._d.kv
        if kv is None or self._d.placement() == "least_loaded" or decision.path == "replica":
            return preq
        roles: list[Role] = (
            ["prefill"] if decision.path != "local" or decode_gone(t.turn.session, t.view) else []
        )
        session = t.turn.session
        if session is None or session.worker is None or decode_gone(session, t.view):
            roles.append("decode")
        tracked = [w for w in t.view.workers if w.role in roles and kv.residency.synced(w.id)]
        if not any(len(t.view.ranked(role)) > 1 for role in roles) or not tracked:
            return preq  # no choice to make, or nothing known: the least loaded, as before
        marks: Marks = ()
        if t.token_ids is None and session is not None:  # residency.py rule 5: no /tokenize
            marks = marks_from_text(session.prompt_marks)
        elif t.token_ids is None and kv.openings is not None and t.turn.req.endpoint == "chat":
            opening = kv.openings.get(_opening_key(t.turn.req))
            if not opening:  # openings.py rule 2: nothing known to place by; no /tokenize
                return preq
            marks = opening
        if marks:
            by_marks = {w.id: kv.residency.resident_by_marks(w.id, marks) for w in tracked}
            return dataclasses.replace(
                preq, resident_blocks={w: b for w, b in by_marks.items() if b is not None}
            )
        if t.token_ids is None:
            t.token_ids = await self._token_ids(tracked[0], t.turn.req)
        if t.token_ids is None:
            return preq
        hashes = kv.hasher.chain(t.token_ids)
        resident: dict[str, int] = {}
        for w in tracked:
            blocks = kv.residency.resident_blocks(w.id, hashes)
            if blocks is not None:
                resident[w.id] = blocks
        return dataclasses.replace(preq, resident_blocks=resident)

    async def _through_p(self, t: ActiveTurn, p: Plan, *, run_prefill: bool = True) -> DecodeLeg:
        self._count_placements(t, p)
        kv: Mapping[str, Any] | None = None
        prefiller: UpstreamCall | None = None
        if p.path in _THROUGH_P and not run_prefill:  # rule 8: D's sidecar runs it
            p = prefill_elsewhere(p)
            prefiller = p.prefill[0]
            t.outcome.prefill_worker = prefiller.worker
            self._d.pool.note_pick(prefiller.worker)
        elif p.path in _THROUGH_P:
            p, kv = await self._prefill(t.turn, t.outcome, p, t.trace)
        call = decode_after_prefill(p, kv) if p.path in _THROUGH_P else p.decode
        outcome = t.outcome
        outcome.path, outcome.reason, outcome.rebound = p.path, p.reason, p.rebound
        outcome.decode_worker = call.worker
        self._d.pool.note_pick(call.worker)
        span = None
        if t.trace is not None:  # rule 11: D's leg carries its span's traceparent
            span = t.trace.leg("ppd.decode", call.worker, call.url)
            span.span.set_attribute("ppd.path", p.path)
            call = dataclasses.replace(call, headers=span.headers(call.headers))
        return DecodeLeg(p, call, prefiller, span)

    def _count_placements(self, t: ActiveTurn, p: Plan) -> None:
        """ppd_gateway_placements_total for the P of a leg through P and a D placed (not the bound one)."""
        placements = self._d.metrics.placements
        if p.path in _THROUGH_P:
            placements.labels("prefill", "prefix" if p.prefill_by_prefix else "least_loaded").inc()
        session = t.turn.session
        if p.path != "replica" and (p.rebound or session is None or session.worker is None):
            placements.labels("decode", "prefix" if p.decode_by_prefix else "least_loaded").inc()

    async def _find_session(self, request: ClientRequest, req: CompletionRequest) -> SessionMatch:
        """The session this request continues (session_lookup.py), with its lookup counted."""
        d = self._d
        match = await find_session(
            d.sessions,
            explicit=request.headers.get(SESSION_HEADER) or req.session_id,
            endpoint=req.endpoint,
            model=req.model,
            messages=req.messages,
            new_id=d.new_id,
            prompt=req.body.get("prompt") if req.endpoint == "completions" else None,
            max_candidates=self._s.sessions.prefix_candidates,
        )
        if match.lookup:
            d.metrics.session_lookups.labels(match.lookup).inc()
        if match.reset:
            d.metrics.session_resets.labels(match.reset).inc()
        return match

    def _check_id_headers(self, headers: Mapping[str, str]) -> None:
        for name in (SESSION_HEADER, WORKLOAD_HEADER):
            value = headers.get(name)
            if value:  # an empty header is no header
                check_client_id(value, name, max_length=self._s.limits.max_id_length)

    def _mode(self, headers: Mapping[str, str]) -> Mode:
        """The configured mode, or the client's X-PPD-Mode where the operator allows it
        (`allow_mode_header`; off by default: the header is then not read at all). A mode the header
        names that this gateway cannot serve is the client's error (400), not a missing worker (503)."""
        override = headers.get(MODE_HEADER)
        if override is None:
            return self._s.mode
        if not self._s.allow_mode_header:
            log.debug("%s ignored (allow_mode_header is off); mode %s", MODE_HEADER, self._s.mode)
            return self._s.mode
        try:
            mode = parse_mode(override, loose=True)
        except ModeError as exc:
            raise BadRequestError(str(exc), param=MODE_HEADER) from None
        role: Role = "replica" if mode.kind == "replica" else "decode"
        if not self._d.pool.count(role, live=False):
            raise BadRequestError(
                f"{MODE_HEADER} {mode}: this gateway's pool has no {role} workers",
                param=MODE_HEADER,
            )
        if mode.kind == "bidir" and not self._s.routing.bidir:
            raise BadRequestError(
                f"{MODE_HEADER} bidir: this gateway's workers do not run vLLM's bidirectional KV mode "
                "(routing.bidir is off)",
                param=MODE_HEADER,
            )
        return mode

    # ------------------------------------------------------------------ ψ

    def _worker_count(
        self, req: CompletionRequest, match: SessionMatch, view: PoolView
    ) -> WorkerCount | None:
        """n_in from the session's worker's /tokenize (psi.py rule 1), when one is live and the
        policy allows it."""
        worker = view.get(match.session.worker if match.session is not None else None)
        if worker is None or not self._s.policy.worker_tokenize:
            return None
        body: dict[str, Any] = {"model": req.model, "add_special_tokens": False}
        if req.endpoint == "chat":
            body["messages"] = list(req.messages[match.new_messages_from :])
            body["add_generation_prompt"] = False
        else:
            body["prompt"] = req.body.get("prompt", "")
        return lambda: self._tokenize(worker, body)

    async def _tokenize(self, worker: WorkerView, body: Mapping[str, Any]) -> int | None:
        self._d.metrics.worker_tokenize.labels("count").inc()
        try:
            reply = await self._d.upstream.post(worker.url + "/tokenize", body, dict(self._worker_headers))
            count = reply.json().get("count") if reply.status == 200 else None
        except (UpstreamError, ValueError, AttributeError):
            count = None
        return count if isinstance(count, int) else None

    async def _resident(
        self, kv: KvTracking, req: CompletionRequest, match: SessionMatch, view: PoolView, psi: Psi
    ) -> tuple[Psi, bool, list[int] | None]:
        """ψ on the context the session's decode worker still holds, by its KV events (psi.with_resident),
        and whether none of it is (evicted: routed as a cold turn), and the prompt's token ids when they
        were asked for. ψ unchanged while the worker's event stream is not synced, the context is under
        one block, or its token ids cannot be had."""
        worker_id = match.session.worker if match.session is not None else None
        worker = view.get(worker_id)
        if worker is None or not kv.residency.synced(worker.id) or psi.n_ctx < kv.hasher.block_size:
            return psi, False, None
        tokens = await self._token_ids(worker, req)
        resident = kv.resident_tokens(worker.id, tokens) if tokens is not None else None
        if resident is None:
            return psi, False, tokens
        return with_resident(psi, resident), resident == 0, tokens

    async def _token_ids(self, worker: WorkerView, req: CompletionRequest) -> list[int] | None:
        """The prompt's token ids as the worker computes them (its /tokenize, chat template applied)."""
        body: dict[str, Any] = {"model": req.model}
        if req.endpoint == "chat":
            body["messages"] = list(req.messages)
            for key in (
                "add_generation_prompt",
                "continue_final_message",
                "chat_template",
                "chat_template_kwargs",
            ):
                if key in req.body:
                    body[key] = req.body[key]
        else:
            prompt = req.body.get("prompt")
            if isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt
            ):
                return list(prompt)
            body["prompt"] = prompt if isinstance(prompt, str) else ""
        self._d.metrics.worker_tokenize.labels("token_ids").inc()
        try:
            reply = await self._d.upstream.post(worker.url + "/tokenize", body, dict(self._worker_headers))
            tokens = reply.json().get("tokens") if reply.status == 200 else None
        except (UpstreamError, ValueError, AttributeError):
            tokens = None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens

    # ------------------------------------------------------------------ decide and plan

    async def _ask(self, turn: TurnInputs, view: PoolView, trace: RequestTrace | None) -> Decision:
        d = self._d
        s = self._s.decision
        live: LiveSignals | None = None
        if s.send_live_signals:
            ranked_p = view.ranked("prefill")
            dec = view.get(turn.session.worker if turn.session else None)
            live = LiveSignals(
                prefill_queue_depth=int(ranked_p[0].load.waiting) if ranked_p else None,
                decode_running_requests=int(dec.load.running) if dec else None,
                decode_kv_usage=dec.load.kv_usage if dec else None,
            )
        query = RouteQuery(
            request_id=turn.request_id,
            turn=turn.turn,
            psi=turn.psi,
            qps=d.qps.rate(),
            live=live,
            weights_profile=s.weights_profile,
            table_key=s.table_key,
            weights=d.slo.weights(s.table_key) if d.slo is not None else None,
            capabilities=_BIDIR if self._s.routing.bidir else frozenset(),
        )
        fallback = Decision(s.fallback, "fallback")
        if trace is None or not trace.recording:  # an unsampled request's decision: no span, no metadata
            return await d.decisions.route(query, fallback)
        with trace.step("ppd.decision", kind=SpanKind.CLIENT) as span:  # rule 11
            query = dataclasses.replace(query, traceparent=traceparent_of(span))
            decision = await d.decisions.route(query, fallback)
            span.set_attributes(
                {
                    "ppd.table.key": s.table_key,
                    "ppd.table.version": decision.table_version,
                    "ppd.path": decision.path,
                    "ppd.reason": decision.reason,
                    "ppd.fallback": decision.fallback,
                }
            )
            return decision

    def _explore(self, turn: TurnInputs, decision: Decision) -> Decision:
        """ppd mode, turn 2+: the path the exploration policy takes (ppd/explore.py). Its draw is keyed
        by session and turn, its cap by the session's decode worker; a fallback decision never
        explores (the service did not allow it), nor one a live signal moved (reason live_signal)."""
        e = self._explorer.decide(
            request_key=f"{turn.session_id}#{turn.turn}",
            chosen_local=decision.path == "local",
            alternative_allowed=decision.alternative_allowed,
            worker=(turn.session.worker if turn.session is not None else None) or "",
            now=self._d.clock(),
            guard_active=decision.reason == "live_signal",
        )
        if e.explored:
            path: Literal["pd", "local"] = "local" if e.local else "pd"
            return dataclasses.replace(
                decision, path=path, reason="explore", explored=True, propensity=e.propensity
            )
        if e.propensity != decision.propensity:
            return dataclasses.replace(decision, propensity=e.propensity)
        return decision

    def _plan_request(self, headers: Mapping[str, str], turn: TurnInputs) -> PlanRequest:
        forwarded = self._worker_headers
        if self._s.forward_authorization and "Authorization" in headers:
            forwarded = (("Authorization", headers["Authorization"]),)
        return PlanRequest(
            endpoint=turn.req.endpoint,
            body=turn.req.body,
            request_id=turn.request_id,
            headers=forwarded,
            inject_usage=self._s.policy.inject_usage and self._relays_answer,
            prefill_attempts=self._s.policy.prefill_attempts,
            placement=self._placement,
            now=self._d.wall_clock(),
            prompt_token_ids=self._d.placement() == "prefix",
        )

    # ------------------------------------------------------------------ the P leg

    async def _prefill(
        self, turn: TurnInputs, outcome: TurnOutcome, p: Plan, trace: RequestTrace | None = None
    ) -> tuple[Plan, Mapping[str, Any] | None]:
        d = self._d
        failure: tuple[str, GatewayError] | None = None  # the last P's: the retry's reason and error
        for i, call in enumerate(p.prefill):
            if failure is not None:
                if not self.may_retry(failure[0]):
                    raise failure[1]
                d.metrics.prefill_retries.inc()
            d.pool.acquire(call.worker)
            sent = d.timer()
            leg = None if trace is None else trace.leg("ppd.prefill", call.worker, call.url)
            try:
                body = await self._prefill_call(call, leg)
            except UpstreamStatusError as exc:
                if 400 <= exc.upstream_status < 500:
                    self.worker_answered(call.worker)
                    raise
                failure = self._prefill_failed(call.worker, "status", exc)
                continue
            except UpstreamUnreachableError as exc:
                failure = self._prefill_failed(call.worker, "unreachable", exc)
                d.pool.mark_failed(call.worker)
                continue
            except UpstreamTimeoutError as exc:
                failure = self._prefill_failed(call.worker, "timeout", exc)
                continue
            except ValueError:
                self.count_upstream_error(call.worker, "prefill", "bad_body")
                bad = UpstreamError(f"worker {call.worker} sent a malformed answer", worker=call.worker)
                failure = ("prefill_bad_body", bad)
                continue
            finally:
                d.pool.release(call.worker)
                outcome.prefill_wait += d.timer() - sent
            outcome.prefill_worker = call.worker
            if i:  # a bidirectional first leg failed; the retries are plain P legs (plan.py rule 6)
                p = bidir_retry(p)
            self.worker_answered(call.worker)
            d.pool.note_pick(call.worker)
            params = body.get(KV_FIELD) if isinstance(body, Mapping) else None
            outcome.prefill_answer = body
            return p, params if isinstance(params, Mapping) else None
        if self._s.policy.prefill_failure == "local":
            if failure is not None and not self.may_retry("prefill_failed"):
                raise failure[1]
            log.warning(
                "every prefill attempt failed for %s; prefilling on the decode worker", turn.request_id
            )
            return local_fallback(p, "prefill_failed"), None
        raise PrefillFailedError(f"every prefill worker failed ({len(p.prefill)} tried)")

    async def _prefill_call(self, call: UpstreamCall, leg: LegSpan | None) -> Any:
        """One P leg's answer body (parsed); with its span (rule 11), ended with the outcome."""
        if leg is None:
            return (await self._d.upstream.call_json(call, prefill=True)).json()
        try:
            reply = await self._d.upstream.call_json(
                dataclasses.replace(call, headers=leg.headers(call.headers)), prefill=True
            )
            body = reply.json()
        except GatewayError as exc:
            leg.end(exc.message)
            raise
        except BaseException as exc:  # a malformed body (ValueError), or the client left
            leg.end(type(exc).__name__)
            raise
        leg.end(status=reply.status)
        return body

    def _prefill_failed(self, worker: str, kind: str, exc: GatewayError) -> tuple[str, GatewayError]:
        """A P leg failed before its answer (rule 9): counted, reported; the retry's reason and error."""
        self.count_upstream_error(worker, "prefill", kind)
        self.worker_failed(worker, "prefill")
        return f"prefill_{kind}", exc

    # ------------------------------------------------------------------ bad workers (rule 9)

    def may_retry(self, reason: str) -> bool:
        """Whether the retry budget lets one more retry go now; counted by `reason` either way."""
        if self._budget.try_retry(self._d.clock()):
            self._d.metrics.retries.labels(reason).inc()
            return True
        self._d.metrics.retry_budget_exhausted.labels(reason).inc()
        self._budget_log.log(
            "retry budget exhausted ([retry_budget]): no retry after %s; the request gets the error it had",
            reason,
        )
        return False

    def worker_answered(self, worker: str) -> None:
        """A call to `worker` was answered (a 4xx included); logs a restored worker."""
        restored = self._d.pool.note_success(worker)
        if restored is not None:
            log.warning(
                "worker %s restored: its probe request succeeded after %.1f s out of rotation",
                worker,
                restored.ejected_s,
            )

    def worker_failed(self, worker: str, role: str) -> None:
        """A call to `worker` failed before its first byte (connection, timeout, 5xx)."""
        event = self._d.pool.note_failure(worker)
        if isinstance(event, Ejection):
            self._d.metrics.worker_ejections.labels(worker, role, event.reason).inc()
            log.warning(
                "worker %s (%s) ejected (%s) for %.1f s; then one probe request decides",
                worker, role, event.reason, event.backoff_s,
            )  # fmt: skip
        elif isinstance(event, Held):
            self._held_log.log(
                "worker %s (%s) meets an ejection rule (%s) but is the last live %s worker: "
                "it stays in rotation and requests keep going to it",
                worker, role, event.reason, role,
            )  # fmt: skip

    def answer_status(self, worker: str, role: str, status: int) -> None:
        """A worker's answer status seen by a front door that does not call it (the picker)."""
        if status >= 500:
            self.worker_failed(worker, role)
        elif status > 0:
            self.worker_answered(worker)

    # ------------------------------------------------------------------ bookkeeping

    async def remember(
        self,
        turn: TurnInputs,
        outcome: TurnOutcome,
        answer: str | None,
        usage: Usage | None,
        *,
        completion_chunks: int | None,
        kv_params: Mapping[str, Any] | None = None,
    ) -> None:
        """The session after this turn (session_lookup.remember_turn: under its explicit id, the
        content key of what it was sent and, when the answer is known, that + this answer); with D's
        returned params (bidirectional mode) and their expiry. `answer` None: a front door that never
        sees it (rule 6) remembers the turn with its expected output length (ψ's n_out) instead."""
        d = self._d
        if usage is not None:
            prompt, completion = usage.prompt_tokens, usage.completion_tokens
        else:
            prompt = turn.psi.n_ctx + turn.psi.n_in.tokens
            if completion_chunks is not None:
                completion = completion_chunks
            elif answer is not None:
                completion = estimate_tokens(answer).tokens
            else:
                completion = turn.psi.n_out
        if answer is not None:
            outcome.completion_tokens = completion
        base = turn.session if turn.session is not None else Session(turn.session_id)
        chain = turn.chain
        answer_key = ""
        if chain is not None:
            history_key, history_length = chain.key(), len(turn.req.messages)
            if answer is not None:
                answer_key = chain.fork().add({"role": "assistant", "content": answer}).key()
        else:  # completions: the next prompt must start with this one and its answer
            history_key, history_length = prompt_fingerprint(
                turn.req.model, turn.req.body.get("prompt"), answer or ""
            )
        after = base.after_turn(
            worker=outcome.decode_worker,
            prompt_tokens=prompt,
            completion_tokens=completion,
            history_key=history_key,
            history_messages=history_length,
            answer_key=answer_key,
            decode_kv_params=json.dumps(kv_params, separators=(",", ":")) if kv_params else "",
            decode_kv_expires_at=d.wall_clock() + self._s.routing.bidir_params_ttl_s if kv_params else 0.0,
            prompt_marks=self._learn_marks(turn, prompt_token_ids(outcome.prefill_answer)),
        )
        await remember_turn(d.sessions, after, explicit_id=turn.explicit_id)
        if outcome.rebound:
            d.metrics.rebinds.inc()

    def _learn_marks(self, turn: TurnInputs, token_ids: list[int] | None) -> str:
        """The marks of the prompt P prefilled (residency.py rule 5), as the session keeps them ("" when
        P said no token ids); a Turn 1 also teaches them to the openings (openings.py)."""
        kv = self._d.kv
        if kv is None or not token_ids:
            return ""
        marks = prefix_marks(kv.hasher.chain(token_ids))
        if kv.openings is not None and turn.session is None and turn.req.endpoint == "chat":
            kv.openings.learn(_opening_key(turn.req), marks)
        return marks_text(marks)

    def count_upstream_error(self, worker: str, role: str, kind: str) -> None:
        self._d.metrics.upstream_errors.labels(worker, role, kind).inc()


#: The largest integer header the gateway takes: what the DecisionService's int64 fields can carry.
_MAX_HEADER_INT: Final = 2**63 - 1


def _int_header(headers: Mapping[str, str], name: str) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BadRequestError(f"header {name} must be an integer", param=name) from None
    if not 0 <= value <= _MAX_HEADER_INT:
        raise BadRequestError(f"header {name} must be an integer in [0, {_MAX_HEADER_INT}]", param=name)
    return value


def _opening_key(req: CompletionRequest) -> str:
    """The content key of a chat request's first message (openings.py): the model and that message."""
    return KeyChain(req.model).add(req.messages[0]).key()
