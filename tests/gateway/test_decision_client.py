"""The Route RPC client: answers, and the fallback whenever the service is slow, down or NOT_SERVING."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import shutil
import signal
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.decision_client import (
    _MISSES_BEFORE_DOWN,
    GrpcDecisionClient,
    decision_from_response,
    reopen_delays,
    request_from_query,
)
from gateway.metrics import GatewayMetrics
from gateway.ports import LiveSignals, RouteQuery
from gateway.psi import Psi, TokenCount
from gateway.route_streams import BACKOFF_MAX_S, stream_pool_size
from gateway.routing import Decision
from gateway.settings import DecisionSettings, Settings, SettingsError
from ppd.decision.v1 import decision_pb2, decision_pb2_grpc
from ppd.decision.v1.status import UNAVAILABLE_CAUSE_KEY, UNAVAILABLE_NO_TABLE
from tests.gateway.fake_decision import FakeDecision
from tests.gateway.fakes import ManualClock
from tests.gateway.processes import REPO, Process, start
from tests.support.metrics import sample, total

QUERY = RouteQuery(
    request_id="r1",
    turn=2,
    psi=Psi(TokenCount(40, "exact"), n_out=100, n_ctx=900),
    qps=3.0,
    live=LiveSignals(decode_kv_usage=0.4),
)
FALLBACK = Decision("pd", "fallback")
TABLE = REPO / "tests" / "testdata" / "tables" / "good.ppdt"


@pytest.fixture
async def service() -> AsyncIterator[FakeDecision]:
    svc = await FakeDecision().start()
    yield svc
    await svc.stop()


async def _client(address: str, **kw: object) -> GrpcDecisionClient:
    client = GrpcDecisionClient(DecisionSettings(address=address, **kw), GatewayMetrics())  # type: ignore[arg-type]
    await client.start()
    return client


async def _until(predicate: object, what: str) -> None:
    for _ in range(1000):
        if callable(predicate) and predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never became true: {what}")


def test_query_maps_onto_the_proto() -> None:
    req = request_from_query(QUERY)
    assert (req.turn, req.new_input_tokens, req.expected_output_tokens, req.context_tokens) == (
        2,
        40,
        100,
        900,
    )
    assert req.live.HasField("decode_kv_usage")
    assert not req.live.HasField("prefill_queue_depth")
    bad = decision_pb2.RouteResponse(error=decision_pb2.RouteError(code=3, message="bad"))
    assert decision_from_response(bad) is None
    assert decision_from_response(decision_pb2.RouteResponse()) is None
    allowed = decision_pb2.RouteResponse(decision=decision_pb2.DECISION_PD, alternative_allowed=True)
    assert decision_from_response(allowed) == Decision("pd", "unspecified", alternative_allowed=True)


def test_a_query_without_capabilities_sends_none() -> None:
    # The request a gateway sent before the capability existed: byte for byte the same.
    assert list(request_from_query(QUERY).capabilities) == []
    assert b"\x58" not in request_from_query(QUERY).SerializeToString()  # field 11, varint


def test_the_bidir_capability_is_sent() -> None:
    req = request_from_query(dataclasses.replace(QUERY, capabilities=frozenset({"bidir"})))
    assert list(req.capabilities) == [decision_pb2.CAPABILITY_BIDIR]


@pytest.mark.parametrize(
    ("decision", "path"),
    [
        (decision_pb2.DECISION_PD, "pd"),
        (decision_pb2.DECISION_LOCAL, "local"),
        (decision_pb2.DECISION_BIDIR, "bidir"),
    ],
)
def test_each_decision_maps_onto_a_path(decision: int, path: str) -> None:
    resp = decision_pb2.RouteResponse(decision=decision, reason=decision_pb2.REASON_TABLE, score=0.25)  # type: ignore[arg-type]
    got = decision_from_response(resp)
    assert got is not None
    assert (got.path, got.reason, got.score) == (path, "table", 0.25)


def test_an_unspecified_decision_is_no_decision() -> None:
    assert decision_from_response(decision_pb2.RouteResponse()) is None


def test_the_bidir_failed_reason_is_named() -> None:
    resp = decision_pb2.RouteResponse(
        decision=decision_pb2.DECISION_PD, reason=decision_pb2.REASON_BIDIR_FAILED_IN_CELL
    )
    got = decision_from_response(resp)
    assert got is not None
    assert got.reason == "bidir_failed_in_cell"


@pytest.mark.parametrize("stream", [False, True])
async def test_answer_from_the_service(service: FakeDecision, stream: bool) -> None:
    client = await _client(service.address, stream=stream, deadline_ms=2000.0)
    try:
        d = await client.route(QUERY, FALLBACK)
        assert d == Decision("local", "table", table_version="v-test", score=0.5)
        assert service.seen[-1].request_id == "r1"
        service.decision = decision_pb2.DECISION_PD
        service.reason = decision_pb2.REASON_NEAREST_CELL
        d2 = await client.route(QUERY, FALLBACK)
        assert (d2.path, d2.reason) == ("pd", "nearest_cell")
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_slow_service_falls_back_at_the_deadline(service: FakeDecision, stream: bool) -> None:
    client = await _client(service.address, stream=stream, deadline_ms=2000.0)
    try:
        await client.route(QUERY, FALLBACK)  # connected
        service.delay_s = 5.0
        client._deadline = 0.05  # a few ms in production; kept above CI scheduling noise here
        d = await client.route(QUERY, FALLBACK)
        assert (d.path, d.reason, d.fallback) == ("pd", "fallback_timeout", True)
    finally:
        await client.close()


async def test_down_service_falls_back() -> None:
    svc = await FakeDecision().start()
    address = svc.address
    await svc.stop()
    client = await _client(address, deadline_ms=500.0)
    try:
        d = await client.route(QUERY, Decision("local", "fallback"))
        assert d.path == "local"
        assert d.fallback
        # Refused at once in practice; a timeout (or an unrelated server that took the freed port) is
        # still a fallback, which is the behaviour under test.
        assert d.reason.startswith("fallback_")
    finally:
        await client.close()


async def test_not_serving_falls_back_without_calling(service: FakeDecision) -> None:
    client = await _client(service.address, deadline_ms=2000.0)
    try:
        await _until(lambda: client.serving is True, "serving")
        await service.set_serving(False)
        await _until(lambda: client.serving is False, "not serving")
        before = len(service.seen)
        d = await client.route(QUERY, FALLBACK)
        assert (d.reason, len(service.seen)) == ("fallback_not_serving", before)
        await service.set_serving(True)
        await _until(lambda: client.serving is True, "serving again")
        assert (await client.route(QUERY, FALLBACK)).reason == "table"
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_unavailable_before_the_first_table_is_not_serving(service: FakeDecision, stream: bool) -> None:
    # In stream form the fake ends the stream with the status and trailing metadata a unary call gets
    # (the real servicer answers the item instead: test_the_real_servicer_without_a_table_is_not_serving).
    service.abort_code = grpc.StatusCode.UNAVAILABLE
    service.abort_trailing = ((UNAVAILABLE_CAUSE_KEY, UNAVAILABLE_NO_TABLE),)
    client = await _client(service.address, deadline_ms=2000.0, stream=stream)
    try:
        assert (await client.route(QUERY, FALLBACK)).reason == "fallback_not_serving"
        service.abort_code = grpc.StatusCode.INTERNAL
        assert (await client.route(QUERY, FALLBACK)).reason == "fallback_error"
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_no_table_is_read_from_the_status_detail_not_the_message(
    service: FakeDecision, stream: bool
) -> None:
    # The fake's message says "no table loaded yet" either way: only the trailing metadata counts.
    service.abort_code = grpc.StatusCode.UNAVAILABLE
    client = await _client(service.address, deadline_ms=2000.0, stream=stream)
    try:
        assert (await client.route(QUERY, FALLBACK)).reason == "fallback_unavailable"
        service.abort_trailing = ((UNAVAILABLE_CAUSE_KEY, "something-else"),)
        assert (await client.route(QUERY, FALLBACK)).reason == "fallback_unavailable"
        service.abort_trailing = ((UNAVAILABLE_CAUSE_KEY, UNAVAILABLE_NO_TABLE),)
        assert (await client.route(QUERY, FALLBACK)).reason == "fallback_not_serving"
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_the_real_servicer_without_a_table_is_not_serving(tmp_path: Path, stream: bool) -> None:
    # Both sides of the no-table signal over a real gRPC server: the real servicer (no health
    # service here, so the client does call Route) sets it, the client reads it. In stream form the
    # answer carries it in `error` (no trailing metadata): still not_serving, never fallback_error.
    from decision_service.holder import TableHolder
    from decision_service.metrics import DecisionMetrics
    from decision_service.servicer import DecisionServicer, add_to_server

    metrics = DecisionMetrics()
    holder = TableHolder(tmp_path, default_key=None, listener=metrics)
    await holder.refresh()
    server = grpc.aio.server()
    add_to_server(DecisionServicer(holder, metrics), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gateway_metrics = GatewayMetrics()
    client = GrpcDecisionClient(
        DecisionSettings(address=f"127.0.0.1:{port}", deadline_ms=2000.0, stream=stream), gateway_metrics
    )
    await client.start()
    try:
        assert (await client.route(QUERY, FALLBACK)).reason == "fallback_not_serving"
        rpcs = sample(gateway_metrics.registry, "ppd_gateway_route_rpc_seconds_count", outcome="not_serving")
        assert rpcs == 1  # the RPC was made and answered with the signal
        fallbacks = sample(
            gateway_metrics.registry, "ppd_gateway_decision_fallbacks_total", cause="not_serving"
        )
        assert fallbacks == 1
    finally:
        await client.close()
        await server.stop(None)


async def test_no_service_configured() -> None:
    metrics = GatewayMetrics()
    client = GrpcDecisionClient(DecisionSettings(), metrics)
    await client.start()
    d = await client.route(QUERY, FALLBACK)
    assert (d.reason, d.fallback) == ("fallback_no_service", True)
    assert sample(metrics.registry, "ppd_gateway_decision_fallbacks_total", cause="no_service") == 1
    await client.close()


def _ready(client: GrpcDecisionClient) -> bool:
    channel = client._channel
    return channel is not None and channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY


@pytest.mark.parametrize("stream", [False, True])
async def test_a_broken_stream_is_reopened_by_the_next_request(stream: bool) -> None:
    # As prompt as unary: once the channel is connected again, the next request is answered. The
    # clock never moves, so no pause between re-opens can be what lets it through.
    svc = await FakeDecision().start()
    port = svc.port
    settings = DecisionSettings(address=svc.address, deadline_ms=2000.0, stream=stream)
    client = GrpcDecisionClient(settings, GatewayMetrics(), clock=ManualClock())
    await client.start()
    try:
        assert (await client.route(QUERY, FALLBACK)).reason == "table"
        await svc.stop()
        d = await client.route(QUERY, FALLBACK)
        assert d.fallback
        svc2 = await FakeDecision(port=port).start()
        try:
            await _until(lambda: _ready(client), "the channel connected again")
            assert (await client.route(QUERY, FALLBACK)).reason == "table"
            assert svc2.methods == ["RouteStream" if stream else "Route"]
        finally:
            await svc2.stop()
    finally:
        await client.close()


async def test_a_request_in_flight_when_its_stream_breaks_is_retried_once(service: FakeDecision) -> None:
    metrics = GatewayMetrics()
    settings = DecisionSettings(address=service.address, deadline_ms=2000.0, stream=True)
    client = GrpcDecisionClient(settings, metrics, clock=ManualClock())
    await client.start()
    try:
        assert (await client.route(QUERY, FALLBACK)).reason == "table"
        service.break_streams = 1  # the stream breaks under the request: it is answered on a new one
        assert (await client.route(QUERY, FALLBACK)).reason == "table"
        assert (service.broken, service.methods) == (1, ["RouteStream"] * 2)
        service.break_streams = 2  # the new stream breaks too: the fallback, after exactly one retry
        assert (await client.route(QUERY, FALLBACK)).reason == "fallback_unavailable"
        assert (service.broken, service.break_streams) == (3, 0)
        assert (await client.route(QUERY, FALLBACK)).reason == "table"  # and the next one is answered
        assert sample(metrics.registry, "ppd_gateway_decision_fallbacks_total", cause="unavailable") == 1
    finally:
        await client.close()


async def test_a_request_whose_client_leaves_never_ends_the_stream_others_wait_on(
    service: FakeDecision,
) -> None:
    # A client that leaves cancels its request at any point: while it waits for its answer, or while
    # its request is being written. Neither may end the stream (grpc.aio cancels a call whose write is
    # cancelled), nor reach the request next to it as a cancellation of its own (a request log line
    # saying "client disconnected") or a fallback.
    client = await _client(service.address, deadline_ms=2000.0, stream=True)
    try:
        assert (await client.route(QUERY, FALLBACK)).reason == "table"
        for steps in range(40):  # cancelled after 0, 1, ... turns of the loop, in its write or not
            staying = asyncio.create_task(client.route(QUERY, FALLBACK))
            leaving = asyncio.create_task(client.route(QUERY, FALLBACK))
            for _ in range(steps):
                await asyncio.sleep(0)
            leaving.cancel()
            assert (await staying).reason == "table", steps
            with contextlib.suppress(asyncio.CancelledError):
                await leaving
            assert (await client.route(QUERY, FALLBACK)).reason == "table", steps
    finally:
        await client.close()


async def test_streams_that_keep_failing_to_open_give_way_to_unary_calls() -> None:
    # With the service gone every stream fails before its first answer. After a few such opens in a row
    # the client backs off streams (a bounded, doubling pause on its clock) and makes unary calls
    # meanwhile, so the service's return is seen by the next request, as with `stream = false`.
    svc = await FakeDecision().start()
    port = svc.port
    await svc.stop()
    clock = ManualClock()
    settings = DecisionSettings(address=f"127.0.0.1:{port}", deadline_ms=2000.0, stream=True)
    client = GrpcDecisionClient(settings, GatewayMetrics(), clock=clock)
    await client.start()
    try:
        for _ in range(3):
            assert (await client.route(QUERY, FALLBACK)).fallback
        svc2 = await FakeDecision(port=port).start()
        try:
            await _until(lambda: _ready(client), "the channel connected")
            assert (await client.route(QUERY, FALLBACK)).reason == "table"
            assert svc2.methods == ["Route"]
            clock.advance(BACKOFF_MAX_S)
            assert (await client.route(QUERY, FALLBACK)).reason == "table"
            assert (await client.route(QUERY, FALLBACK)).reason == "table"
            assert svc2.methods == ["Route", "RouteStream", "RouteStream"]
        finally:
            await svc2.stop()
    finally:
        await client.close()


_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class DrainingReplicas(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # untyped base
    """The health service as a client sees it through Envoy in front of several replicas: each Watch
    lands on one replica. Watch 1 says SERVING until `drain` is set, then `drain_status`, and stays
    open (a draining replica keeps its streams until its grace period ends). Watch 2 lands on the
    draining replica again (Envoy has not noticed yet); Watch 3 and later land on a healthy one."""

    def __init__(self, drain_status: int) -> None:
        self.opened = 0
        self.drain = asyncio.Event()
        self.drain_status = drain_status

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        self.opened += 1
        number = self.opened
        if number == 1:
            yield health_pb2.HealthCheckResponse(status=_SERVING)
            await self.drain.wait()
        if number <= 2:
            yield health_pb2.HealthCheckResponse(status=self.drain_status)
        else:
            yield health_pb2.HealthCheckResponse(status=_SERVING)
        await asyncio.Event().wait()  # open until the client closes it


@pytest.mark.parametrize(("drain_status", "meanwhile"), [(_NOT_SERVING, False), (_SERVICE_UNKNOWN, None)])
async def test_watch_on_a_draining_replica_is_reopened_elsewhere(drain_status: int, meanwhile: bool) -> None:
    replicas = DrainingReplicas(drain_status)
    routes = FakeDecision()
    server = grpc.aio.server()
    decision_pb2_grpc.add_DecisionServiceServicer_to_server(routes, server)
    health_pb2_grpc.add_HealthServicer_to_server(replicas, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = await _client(f"127.0.0.1:{port}", deadline_ms=2000.0, health_reopen_s=0.05)
    try:
        await _until(lambda: client.serving is True, "serving")
        assert (await client.route(QUERY, FALLBACK)).reason == "table"
        replicas.drain.set()
        await _until(lambda: client.serving is meanwhile, "the draining replica's answer")
        if meanwhile is False:  # rule 2 holds while the latest answer is NOT_SERVING: no call spent
            before = len(routes.seen)
            assert (await client.route(QUERY, FALLBACK)).reason == "fallback_not_serving"
            assert len(routes.seen) == before
        # The old Watch still says not serving, forever; only a re-opened one can see SERVING.
        await _until(lambda: client.serving is True, "serving again through a re-opened Watch")
        assert replicas.opened >= 3
        assert (await client.route(QUERY, FALLBACK)).reason == "table"
    finally:
        await client.close()
        await server.stop(grace=None)


def test_watch_reopen_backoff_doubles_up_to_its_bound() -> None:
    assert list(itertools.islice(reopen_delays(0.2, 3.0), 6)) == [0.2, 0.4, 0.8, 1.6, 3.0, 3.0]
    assert list(itertools.islice(reopen_delays(5.0, 3.0), 2)) == [3.0, 3.0]


@pytest.mark.parametrize("policy", ["round_robin", "pick_first"])
async def test_lb_policy_reaches_the_channel(policy: str) -> None:
    # Unary calls, each placed by the policy; RouteStreams: test_streams_spread_over_every_backend_*.
    a, b = await FakeDecision().start(), await FakeDecision().start()
    client = await _client(
        f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}", deadline_ms=2000.0, lb_policy=policy, stream=False
    )
    try:
        if policy == "round_robin":  # every call to the next ready address: both get calls
            for _ in range(500):
                assert (await client.route(QUERY, FALLBACK)).reason == "table"
                if a.seen and b.seen:
                    break
                await asyncio.sleep(0.01)
            assert a.seen
            assert b.seen
        else:  # one address at a time: every call to the same one
            for _ in range(20):
                assert (await client.route(QUERY, FALLBACK)).reason == "table"
            assert sorted([len(a.seen), len(b.seen)]) == [0, 20]
    finally:
        await client.close()
        await a.stop()
        await b.stop()


def _decided(process: Process) -> float:
    """Decisions a real decision service process made, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{process.ready['metrics']}/metrics", timeout=10) as r:
        text = r.read().decode()
    return total(text, "ppd_decisions_total") or 0.0


@pytest.mark.integration
async def test_streams_spread_over_every_backend_and_leave_one_that_goes_away(tmp_path: Path) -> None:
    """Two real decision service processes behind one round_robin target: the pool holds a stream per
    address (the default size), so both answer; when one is killed, requests go on being answered by
    the other (a request in flight then is retried on a new stream, which lands there)."""
    tables = tmp_path / "tables"
    tables.mkdir()
    shutil.copy(TABLE, tables / TABLE.name)
    args = ["decision_service", "serve", "--tables", str(tables), "--port", "0", "--metrics-port", "0"]
    a, b = await asyncio.gather(*(asyncio.to_thread(start, args, tmp_path, n) for n in ("da", "db")))
    target = f"ipv4:127.0.0.1:{a.ready['grpc']},127.0.0.1:{b.ready['grpc']}"
    clock = ManualClock()
    client = GrpcDecisionClient(
        DecisionSettings(address=target, deadline_ms=2000.0, stream=True), GatewayMetrics(), clock=clock
    )
    await client.start()
    try:
        await _until(lambda: client.serving is True, "serving")
        for _ in range(20):
            for _ in range(10):
                assert not (await client.route(QUERY, FALLBACK)).fallback
            counts = await asyncio.gather(asyncio.to_thread(_decided, a), asyncio.to_thread(_decided, b))
            if all(counts):
                break
            # A stream opened while only one backend was ready stays there until it is retired; its
            # successor lands on the next backend round_robin picks.
            clock.advance(DecisionSettings().stream_max_age_s)
        assert all(counts), counts
        a.proc.kill()
        a.proc.wait()
        answered = 0
        for _ in range(500):  # until 20 in a row are answered: streams on the dead backend reopened
            answered = 0 if (await client.route(QUERY, FALLBACK)).fallback else answered + 1
            if answered == 20:
                break
            await asyncio.sleep(0.01)
        assert answered == 20
        assert await asyncio.to_thread(_decided, b) >= counts[1] + 20
    finally:
        await client.close()
        a.stop()
        b.stop()


def test_the_stream_pool_is_sized_one_stream_per_address() -> None:
    assert stream_pool_size("ipv4:127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "round_robin") == 3
    assert stream_pool_size("ipv6:[::1]:1,[::1]:2", "round_robin") == 2
    assert stream_pool_size("127.0.0.1:50051", "round_robin") == 1
    assert stream_pool_size("dns:///127.0.0.1:50051", "round_robin") == 1
    assert stream_pool_size("unix:/tmp/decision.sock", "round_robin") == 1
    # pick_first sends every call to one address: one stream is all it can use.
    assert stream_pool_size("ipv4:127.0.0.1:1,127.0.0.1:2", "pick_first") == 1
    assert Settings.from_mapping({}).decision.stream is True  # RouteStreams by default; false: unary
    assert Settings.from_mapping({}).decision.streams == 0
    assert Settings.from_mapping({"decision": {"streams": 3}}).decision.streams == 3
    with pytest.raises(SettingsError, match="streams"):
        Settings.from_mapping({"decision": {"streams": -1}})
    with pytest.raises(SettingsError, match="stream_max_age_s"):
        Settings.from_mapping({"decision": {"stream_max_age_s": 0}})


def test_lb_policy_and_reopen_settings_are_checked() -> None:
    s = Settings.from_mapping({"decision": {"lb_policy": "pick_first", "health_reopen_s": 0.5}})
    assert (s.decision.lb_policy, s.decision.health_reopen_s) == ("pick_first", 0.5)
    assert Settings.from_mapping({}).decision.lb_policy == "round_robin"
    with pytest.raises(SettingsError, match="lb_policy"):
        Settings.from_mapping({"decision": {"lb_policy": "ring_hash"}})
    with pytest.raises(SettingsError, match="health_reopen"):
        Settings.from_mapping({"decision": {"health_reopen_s": 5.0, "health_reopen_max_s": 1.0}})


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "gateway.decision_client" and text in r.getMessage()]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_few_slow_answers_are_not_logged_as_an_outage(
    service: FakeDecision, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    # In stream form each timed-out request leaves its stream stale, so the answer after the blip does
    # not queue behind the slow ones (the fake answers a stream's requests one after another).
    caplog.set_level(logging.INFO, logger="gateway.decision_client")
    client = await _client(service.address, deadline_ms=2000.0, stream=stream)
    try:
        assert not (await client.route(QUERY, FALLBACK)).fallback
        service.delay_s = 5.0
        client._deadline = 0.05
        for _ in range(_MISSES_BEFORE_DOWN):  # a blip: well under a second of timeouts
            assert (await client.route(QUERY, FALLBACK)).reason == "fallback_timeout"
        service.delay_s = 0.0
        client._deadline = 2.0
        assert not (await client.route(QUERY, FALLBACK)).fallback
    finally:
        await client.close()
    assert not _lines(caplog, "DecisionService unavailable")
    assert not _lines(caplog, "available again")


async def test_an_outage_is_timed_on_the_injected_clock(
    service: FakeDecision, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.decision_client")
    clock = ManualClock()
    settings = DecisionSettings(address=service.address, deadline_ms=50.0)
    client = GrpcDecisionClient(settings, GatewayMetrics(), clock=clock)
    await client.start()
    try:
        service.delay_s = 5.0
        for _ in range(2 * _MISSES_BEFORE_DOWN):  # many misses, but no time passed on the clock
            assert (await client.route(QUERY, FALLBACK)).reason == "fallback_timeout"
        assert not _lines(caplog, "DecisionService unavailable")
        clock.advance(1.0)
        assert (await client.route(QUERY, FALLBACK)).reason == "fallback_timeout"
        assert len(_lines(caplog, "DecisionService unavailable")) == 1
    finally:
        await client.close()


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["killed", "frozen"])
async def test_losing_the_service_and_its_return_are_logged_once_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, stream: bool
) -> None:
    """A real `decision_service` process, killed (then started again on its port) or frozen (SIGSTOP, then
    SIGCONT): one WARNING when it goes, one when it is back, however many requests fall back between."""
    caplog.set_level(logging.INFO, logger="gateway.decision_client")
    tables = tmp_path / "tables"
    tables.mkdir()
    shutil.copy(TABLE, tables / TABLE.name)

    def serve(port: int, name: str) -> Process:
        args = ["decision_service", "serve", "--tables", str(tables), "--port", str(port)]
        return start([*args, "--metrics-port", "0"], tmp_path, name)

    first = await asyncio.to_thread(serve, 0, "decision")
    port = int(first.ready["grpc"])
    again: Process | None = None
    # A frozen service costs each call its whole deadline; kept well above CI scheduling noise.
    client = await _client(
        f"127.0.0.1:{port}", deadline_ms=2000.0 if how == "killed" else 300.0, stream=stream
    )
    try:
        await _until(lambda: client.serving is True, "serving")
        assert not (await client.route(QUERY, FALLBACK)).fallback
        if how == "killed":
            first.proc.kill()  # SIGKILL: no goodbye on the connection's side
            first.proc.wait()
        else:
            first.proc.send_signal(signal.SIGSTOP)
        for _ in range(2 * _MISSES_BEFORE_DOWN):
            assert (await client.route(QUERY, FALLBACK)).fallback
        await _until(lambda: _lines(caplog, "DecisionService unavailable"), "the loss is logged")
        if how == "killed":
            again = await asyncio.to_thread(serve, port, "decision-again")
        else:
            first.proc.send_signal(signal.SIGCONT)
        client._deadline = 2.0
        for _ in range(200):  # traffic goes on: the first answer (or the Watch's SERVING) ends the outage
            if not (await client.route(QUERY, FALLBACK)).fallback:
                break
            await asyncio.sleep(0.05)
        assert _lines(caplog, "DecisionService available again")
        for _ in range(3):
            decision = await client.route(QUERY, FALLBACK)
            assert not decision.fallback, decision
    finally:
        await client.close()
        if first.proc.poll() is None:
            first.proc.send_signal(signal.SIGCONT)
        first.stop()
        if again is not None:
            again.stop()
    gone, back = _lines(caplog, "DecisionService unavailable"), _lines(caplog, "available again")
    assert [r.levelno for r in gone] == [logging.WARNING]
    assert [r.levelno for r in back] == [logging.WARNING]
    assert "requests took the fallback meanwhile" in back[0].getMessage()
    assert not _lines(caplog, "RouteStream broke")
