"""The gateway's side of the Route RPC: one long-lived grpc.aio channel, a deadline on every call, and
a fallback decision whenever the DecisionService is slow, down or NOT_SERVING.

Rule 1: `route()` never raises and never waits longer than the deadline; a failure becomes the
configured fallback with `fallback=True` and a reason naming the cause (`fallback_timeout`,
`fallback_unavailable`, `fallback_not_serving`, `fallback_error`, `fallback_no_service`).
Rule 2: the standard gRPC health service is watched in the background; while it says NOT_SERVING no
RPC is attempted (no deadline is spent on a known-bad answer). A Watch stream lives on one replica
(behind Envoy, or one subchannel of a `round_robin` channel), so a NOT_SERVING or SERVICE_UNKNOWN on it
may speak for that replica only (it is draining): the client closes that Watch and opens a new one
after `decision.health_reopen_s`, doubling up to `decision.health_reopen_max_s` while the answer stays
not serving. The new Watch lands on a replica that still serves, and calls resume at its first SERVING.
Rule 3 (operators are told): the service going away (the health Watch fails, or
`_MISSES_BEFORE_DOWN` calls in a row over `_MISSING_FOR_S` time out or find no server) is logged once
as a WARNING, and its
return (any answer, or SERVING on the Watch) once, with how long it was gone and how many requests fell
back meanwhile; never a line per request.
Rule 4 (stream form, the default `decision.stream = true`): requests go over a pool of RouteStreams
(route_streams.py: one per backend address, spread, retired by age, reopened by the next request) and
answers are matched to them first-in-first-out; a late answer resolves a future nobody waits for any
more. A request whose stream ended before answering it is tried once more on a new stream within the
same deadline; while opening streams backs off (it failed repeatedly) requests make unary calls.
`decision.stream = false` makes one unary Route call per request.
Rule 5 (no table): the service answers UNAVAILABLE until its first table loads, with trailing
metadata `ppd-unavailable: no-table` (ppd/decision/v1/status.py); that answer is `fallback_not_serving`,
any other UNAVAILABLE `fallback_unavailable`. The message text is never read. The same holds for a
RouteStream the service ends with that status (read from the stream's trailing metadata, never
retried). The real service keeps its streams open and answers each item instead: an item's
`error.code` UNAVAILABLE, which it sets on a stream answer only for a missing table, is
`fallback_not_serving` too (not `fallback_error`).
Rule 6 (the third path): `RouteQuery.capabilities` containing "bidir" goes out as CAPABILITY_BIDIR, and
only then may the answer be DECISION_BIDIR, read back as path "bidir"; a query without it sends the
request it sent before capabilities existed.
Rule 7 (tracing): a query with a `traceparent` (a traced request, gateway/request_trace.py) is one
unary Route call carrying it as gRPC metadata, whatever `decision.stream` says: a RouteStream's metadata
is sent once for all the requests it carries, so a per-request trace context cannot ride on it. The
service's span of that call is then the child of the gateway's decision span. Untraced queries keep
to the streams.
Every time it measures (availability, RPC latency, stream retries) comes from the injected clock.
Talks gRPC only; never imports decision_service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from grpc_health.v1 import health_pb2

from gateway.metrics import GatewayMetrics
from gateway.ports import RouteQuery
from gateway.route_streams import RouteStreams, no_table, reopen_delays, stream_pool_size
from gateway.routing import Decision
from gateway.settings import DecisionSettings
from gateway.types import Clock, Path
from ppd.decision.v1 import decision_pb2, decision_pb2_grpc
from ppd.tracing import TRACEPARENT

__all__ = [
    "KEEPALIVE_TIMEOUT_MS",
    "KEEPALIVE_TIME_MS",
    "GrpcDecisionClient",
    "channel_options",
    "decision_from_response",
    "reopen_delays",
    "request_from_query",
]

log = logging.getLogger(__name__)
SERVICE_NAME = decision_pb2.DESCRIPTOR.services_by_name["DecisionService"].full_name
_REASONS = {v: k.removeprefix("REASON_").lower() for k, v in decision_pb2.Reason.items()}
_WATCH_RETRY_S = 1.0  # after the Watch itself failed (service down); calls are tried meanwhile
# Failed calls in a row (timeouts, no server), over at least this long, before the service counts as
# gone: a few slow answers on a busy host are not an outage; a frozen or killed service fails every call.
_MISSES_BEFORE_DOWN = 3
_MISSING_FOR_S = 1.0
_SERVING = health_pb2.HealthCheckResponse.SERVING
_SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
_STREAM_NO_TABLE: int = grpc.StatusCode.UNAVAILABLE.value[0]  # rule 5 in a RouteStream answer's error
_HealthWatch = grpc.aio.UnaryStreamMultiCallable[
    health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
]


# Keepalive: a ping every 10 s, calls in flight or not, so a dead connection is found within 15 s.
# It must agree with the server's policy, or the server answers GOAWAY too_many_pings: the decision
# service accepts a ping every --keepalive-min-ping-interval seconds (5 by default, half of ours, to
# leave room for timer jitter). Envoy's decision cluster pings its replicas at the same rate.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def channel_options(
    lb_policy: str,
    *,
    keepalive_time_ms: int = KEEPALIVE_TIME_MS,
    keepalive_timeout_ms: int = KEEPALIVE_TIMEOUT_MS,
) -> list[tuple[str, str | int]]:
    """The gRPC channel options of the gateway's connection to the DecisionService."""
    return [
        # round_robin spreads calls over every address a name resolves to (one per pod of a
        # headless Service); pick_first keeps to one and fails over.
        ("grpc.lb_policy_name", lb_policy),
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def request_from_query(q: RouteQuery) -> decision_pb2.RouteRequest:
    """The one place ψ's fields take the proto's names."""
    req = decision_pb2.RouteRequest(
        request_id=q.request_id,
        turn=q.turn,
        new_input_tokens=q.psi.n_in.tokens,
        expected_output_tokens=q.psi.n_out,
        context_tokens=q.psi.n_ctx,
        qps=q.qps,
        weights_profile=q.weights_profile,
        table_key=q.table_key,
    )
    if q.weights is not None:
        req.weights.w_ttft, req.weights.w_tpot = q.weights
    if "bidir" in q.capabilities:
        req.capabilities.append(decision_pb2.CAPABILITY_BIDIR)
    if q.live is not None:
        live = req.live
        if q.live.prefill_queue_depth is not None:
            live.prefill_queue_depth = q.live.prefill_queue_depth
        if q.live.decode_running_requests is not None:
            live.decode_running_requests = q.live.decode_running_requests
        if q.live.decode_kv_usage is not None:
            live.decode_kv_usage = q.live.decode_kv_usage
    return req


def decision_from_response(resp: decision_pb2.RouteResponse) -> Decision | None:
    """None when the answer carries an error or no decision."""
    if resp.HasField("error") and resp.error.code != 0:
        return None
    path: Path
    if resp.decision == decision_pb2.DECISION_LOCAL:
        path = "local"
    elif resp.decision == decision_pb2.DECISION_PD:
        path = "pd"
    elif resp.decision == decision_pb2.DECISION_BIDIR:
        path = "bidir"
    else:
        return None
    return Decision(
        path,
        _REASONS.get(resp.reason, "unspecified"),
        table_version=resp.table_version,
        score=resp.score,
        detail=resp.detail,
        alternative_allowed=resp.alternative_allowed,
    )


def _outcome(exc: grpc.aio.AioRpcError) -> str:
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if code == grpc.StatusCode.UNAVAILABLE:
        # The service answers UNAVAILABLE itself until its first table loads, and says so (rule 5).
        return "not_serving" if no_table(exc) else "unavailable"
    return "error"


class _Availability:
    """Whether the DecisionService answers, logged once per change of state (rule 3).

    "unknown" until the first answer (and again after a NOT_SERVING, which has its own log line),
    "up" while it answers, "down" from the moment it is seen gone until it answers again."""

    __slots__ = ("_clock", "_down_since", "_fallback", "_fallbacks", "_first_miss", "_misses", "_state")

    def __init__(self, fallback: str, clock: Clock) -> None:
        self._clock = clock
        self._fallback = fallback
        self._state = "unknown"
        self._down_since = 0.0
        self._fallbacks = 0
        self._misses = 0
        self._first_miss = 0.0

    def lost(self, cause: str) -> None:
        self._misses = 0
        if self._state == "down":
            return
        self._state = "down"
        self._down_since = self._clock()
        self._fallbacks = 0
        log.warning(
            "DecisionService unavailable (%s); ppd requests take the fallback decision %r until it answers",
            cause,
            self._fallback,
        )

    def missed(self, cause: str) -> None:
        now = self._clock()
        if not self._misses:
            self._first_miss = now
        self._misses += 1
        if self._misses >= _MISSES_BEFORE_DOWN and now - self._first_miss >= _MISSING_FOR_S:
            self.lost(f"{self._misses} calls in a row over {now - self._first_miss:.1f} s: {cause}")

    def answered(self, how: str) -> str:
        """Marks the service up; returns the state it was in before."""
        before, self._state, self._misses = self._state, "up", 0
        if before == "down":
            log.warning(
                "DecisionService available again (%s) after %.1f s; %d requests took the fallback meanwhile",
                how,
                self._clock() - self._down_since,
                self._fallbacks,
            )
        return before

    def forget(self) -> None:
        """Back to "unknown" (the Watch said NOT_SERVING, logged on its own)."""
        if self._state == "up":
            self._state = "unknown"

    def fell_back(self) -> None:
        if self._state == "down":
            self._fallbacks += 1


class GrpcDecisionClient:
    """The `DecisionClient` of ports.py over one grpc.aio channel."""

    def __init__(
        self, settings: DecisionSettings, metrics: GatewayMetrics, *, clock: Clock = time.monotonic
    ) -> None:
        self._s = settings
        self._clock = clock
        self._availability = _Availability(settings.fallback, clock)
        self._metrics = metrics
        self._deadline = settings.deadline_ms / 1000.0
        self._channel: grpc.aio.Channel | None = None
        self._stub: decision_pb2_grpc.DecisionServiceAsyncStub | None = None
        self._serving: bool | None = None  # None: unknown (no health answer yet)
        self._health_task: asyncio.Task[None] | None = None
        self._streams: RouteStreams | None = None

    @property
    def serving(self) -> bool | None:
        return self._serving

    async def start(self) -> None:
        if not self._s.address:
            return
        self._channel = grpc.aio.insecure_channel(
            self._s.address,
            options=channel_options(self._s.lb_policy),
        )
        self._stub = decision_pb2_grpc.DecisionServiceStub(self._channel)
        if self._s.stream:
            size = self._s.streams or await asyncio.to_thread(
                stream_pool_size, self._s.address, self._s.lb_policy
            )
            self._streams = RouteStreams(
                self._stub, size, max_age_s=self._s.stream_max_age_s, clock=self._clock
            )
        self._channel.get_state(try_to_connect=True)
        self._health_task = asyncio.create_task(self._watch_health(), name="decision-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._health_task
        if self._streams is not None:
            await self._streams.close()
        if self._channel is not None:
            await self._channel.close(grace=None)

    async def route(self, query: RouteQuery, fallback: Decision) -> Decision:
        if self._stub is None:
            return self._fall(fallback, "no_service")
        if self._serving is False:
            return self._fall(fallback, "not_serving")
        start = self._clock()
        resp, outcome = await self._call(self._stub, request_from_query(query), query.traceparent)
        self._metrics.route_rpc.labels(outcome).observe(self._clock() - start)
        if outcome in ("timeout", "unavailable"):
            self._availability.missed(outcome)
        else:
            self._availability.answered("a Route call answered")
        decision = decision_from_response(resp) if resp is not None else None
        if decision is None:
            return self._fall(fallback, "error" if outcome == "ok" else outcome)
        return decision

    async def _call(
        self,
        stub: decision_pb2_grpc.DecisionServiceAsyncStub,
        req: decision_pb2.RouteRequest,
        traceparent: str = "",
    ) -> tuple[decision_pb2.RouteResponse | None, str]:
        try:
            if traceparent:  # rule 7
                metadata = ((TRACEPARENT, traceparent),)
                return await stub.Route(req, timeout=self._deadline, metadata=metadata), "ok"
            if self._streams is not None:
                return await self._call_streams(self._streams, stub, req)
            return await stub.Route(req, timeout=self._deadline), "ok"
        except grpc.aio.AioRpcError as exc:
            return None, _outcome(exc)
        except TimeoutError:
            return None, "timeout"
        except (grpc.RpcError, ConnectionError, RuntimeError) as exc:
            log.warning("Route RPC failed: %s", exc)
            return None, "unavailable" if isinstance(exc, ConnectionError) else "error"

    def _fall(self, fallback: Decision, cause: str) -> Decision:
        self._metrics.fallbacks.labels(cause).inc()
        self._availability.fell_back()
        return Decision(fallback.path, f"fallback_{cause}", fallback=True)

    async def _call_streams(
        self,
        streams: RouteStreams,
        stub: decision_pb2_grpc.DecisionServiceAsyncStub,
        req: decision_pb2.RouteRequest,
    ) -> tuple[decision_pb2.RouteResponse | None, str]:
        """Rule 4: on a stream, once more on a new one if that stream ended unanswered, unary while
        streams back off; all within the one deadline (TimeoutError past it)."""
        outcome = "unavailable"
        async with asyncio.timeout(self._deadline):
            for _ in range(2):
                if streams.paused():
                    return await stub.Route(req, timeout=self._deadline), "ok"
                got = await streams.send(req)
                if isinstance(got, decision_pb2.RouteResponse):
                    if got.error.code == _STREAM_NO_TABLE:
                        return None, "not_serving"  # rule 5, an item's error
                    return got, "ok"
                outcome = got.outcome
                if not got.retry:
                    break
        return None, outcome

    async def _watch_health(self) -> None:
        assert self._channel is not None
        watch: _HealthWatch = self._channel.unary_stream(
            "/grpc.health.v1.Health/Watch",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        delays = reopen_delays(self._s.health_reopen_s, self._s.health_reopen_max_s)
        while True:
            try:
                saw_serving, not_serving = await self._follow_watch(watch)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self._serving = None
                    return
                self._availability.lost(f"health Watch failed: {exc.code().name}")
                saw_serving, not_serving = False, False
            if saw_serving:
                delays = reopen_delays(self._s.health_reopen_s, self._s.health_reopen_max_s)
            if not_serving:
                # This stream's replica may be draining while others serve. The state stays as
                # reported (calls keep falling back, rule 2) until the new Watch answers.
                await asyncio.sleep(next(delays))
            else:
                # Down, or the server ended the stream: let calls try (and fail fast) so recovery is
                # seen at once.
                self._serving = None
                await asyncio.sleep(_WATCH_RETRY_S)

    async def _follow_watch(self, watch: _HealthWatch) -> tuple[bool, bool]:
        """Follows one Watch stream while it says SERVING and closes it at the first other status.
        Returns (it said SERVING at least once, it ended on a not-serving status); an RPC error
        propagates."""
        saw_serving = False
        call = watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        try:
            async for resp in call:
                if resp.status == _SERVING:
                    if self._serving is not True and (
                        self._availability.answered("its health Watch says SERVING") == "unknown"
                    ):
                        log.info("DecisionService is SERVING")
                    self._serving = saw_serving = True
                    continue
                if self._serving is True:
                    log.warning(
                        "DecisionService health says %s on this Watch; falling back and re-opening "
                        "the Watch (another replica may serve)",
                        health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status),
                    )
                self._availability.forget()
                self._serving = None if resp.status == _SERVICE_UNKNOWN else False
                return saw_serving, True
            return saw_serving, False
        finally:
            call.cancel()
