"""The span of a traced Route call (route_trace.py), exported to a real OTLP/gRPC receiver on 127.0.0.1
(tests/support/otlp_receiver.py) by the tracer provider the service builds from its settings: the child
of the caller's traceparent, the query and the answer as attributes, a failed call an error span, and
streams untraced."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from ppd.decision.v1 import decision_pb2 as pb
from ppd.tracing import TracingSettings
from ppd.tracing_export import build_tracing
from tests.decision_service.harness import Running, start_server, turn2
from tests.support.otlp_receiver import SERVER, STATUS_ERROR, OtlpReceiver, ReceivedSpan, otlp_receiver
from tests.support.polling import eventually

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # OpenTelemetry's own: export within 20 ms
    with otlp_receiver() as r:
        yield r


@pytest.fixture
async def traced(loaded_dir: Path, receiver: OtlpReceiver) -> AsyncIterator[Running]:
    tracing = build_tracing(
        TracingSettings(enabled=True, endpoint=receiver.endpoint), service_name="ppd-decision", scope="test"
    )
    assert tracing is not None
    served = await start_server(loaded_dir, tracer=tracing.tracer)
    yield served
    await served.channel.close()
    await served.server.stop(None)
    tracing.close()


async def _one_span(receiver: OtlpReceiver) -> ReceivedSpan:
    async def arrived() -> bool:
        return bool(receiver.spans(name="ppd.decision.Route"))

    await eventually(arrived, what="the Route span at the receiver")
    (span,) = receiver.spans(name="ppd.decision.Route")
    return span


async def test_a_route_call_is_the_child_of_the_callers_traceparent(
    traced: Running, receiver: OtlpReceiver
) -> None:
    metadata = (("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"),)
    answer = await traced.stub.Route(turn2(), metadata=metadata)
    span = await _one_span(receiver)
    assert (span.trace_id, span.parent_span_id, span.kind) == (CALLER_TRACE, CALLER_SPAN, SERVER)
    assert span.service == "ppd-decision"
    attrs = span.attributes
    assert (attrs["ppd.turn"], attrs["ppd.tokens.new"], attrs["ppd.tokens.context"]) == (2, 256, 1500)
    assert attrs["ppd.table.version"] == answer.table_version
    assert attrs["ppd.path"] == pb.Decision.Name(answer.decision).removeprefix("DECISION_").lower()
    cell = answer.cell
    assert attrs["ppd.cell"] == f"{cell.context_class}/{cell.workload_class}/{cell.qps_level:g}"


async def test_a_failed_call_is_an_error_span(traced: Running, receiver: OtlpReceiver) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await traced.stub.Route(turn2(table_key="9P9D/none"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    span = await _one_span(receiver)
    assert span.parent_span_id == ""  # no traceparent: a trace of its own
    assert span.status_code == STATUS_ERROR
    assert "unknown table_key" in span.status_message
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


async def test_stream_items_are_not_traced(traced: Running, receiver: OtlpReceiver) -> None:
    async def requests() -> AsyncIterator[pb.RouteRequest]:
        yield turn2()

    answers = [a async for a in traced.stub.RouteStream(requests())]
    assert len(answers) == 1
    await traced.stub.Route(turn2(request_id="after"))  # one traced call: the spans before it are in
    span = await _one_span(receiver)
    assert span.attributes["ppd.request_id"] == "after"
