"""The Route RPC client: answers, and the fallback whenever the service is slow, down or NOT_SERVING."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from gateway.decision_client import (
    DecisionClient,
    LiveSignals,
    RouteQuery,
    decision_from_response,
    request_from_query,
)
from gateway.metrics import GatewayMetrics
from gateway.routing import Decision
from gateway.settings import DecisionSettings
from ppd.decision.v1 import decision_pb2
from tests.gateway.fake_decision import FakeDecision

QUERY = RouteQuery("r1", 2, 40, 100, 900, 3.0, LiveSignals(decode_kv_usage=0.4))
FALLBACK = Decision("pd", "fallback")


@pytest.fixture
async def service() -> AsyncIterator[FakeDecision]:
    svc = await FakeDecision().start()
    yield svc
    await svc.stop()


async def _client(address: str, **kw: object) -> DecisionClient:
    client = DecisionClient(DecisionSettings(address=address, **kw), GatewayMetrics())  # type: ignore[arg-type]
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
        assert d.reason in ("fallback_unavailable", "fallback_timeout")
        assert d.fallback
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


async def test_unavailable_before_the_first_table_is_not_serving(service: FakeDecision) -> None:
    service.abort_code = grpc.StatusCode.UNAVAILABLE
    client = await _client(service.address, deadline_ms=2000.0)
    try:
        assert (await client.route(QUERY, FALLBACK)).reason == "fallback_not_serving"
        service.abort_code = grpc.StatusCode.INTERNAL
        assert (await client.route(QUERY, FALLBACK)).reason == "fallback_error"
    finally:
        await client.close()


async def test_no_service_configured() -> None:
    metrics = GatewayMetrics()
    client = DecisionClient(DecisionSettings(), metrics)
    await client.start()
    d = await client.route(QUERY, FALLBACK)
    assert (d.reason, d.fallback) == ("fallback_no_service", True)
    assert metrics.fallbacks.labels("no_service")._value.get() == 1
    await client.close()


async def test_stream_break_fails_over_to_fallback_and_recovers() -> None:
    svc = await FakeDecision().start()
    port = svc.port
    client = await _client(svc.address, stream=True, deadline_ms=2000.0)
    try:
        assert (await client.route(QUERY, FALLBACK)).reason == "table"
        await svc.stop()
        d = await client.route(QUERY, FALLBACK)
        assert d.fallback
        svc2 = await FakeDecision(port=port).start()
        try:
            client._stream_failed_at = 0.0  # skip the 1 s reconnect pause instead of sleeping
            for _ in range(100):
                d = await client.route(QUERY, FALLBACK)
                if not d.fallback:
                    break
                client._stream_failed_at = 0.0
                await asyncio.sleep(0.05)
            assert d.reason == "table"
        finally:
            await svc2.stop()
    finally:
        await client.close()
