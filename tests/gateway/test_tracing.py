"""Tracing in the standalone gateway's app on fake workers (in process), exported to a real OTLP/gRPC
receiver on 127.0.0.1 (tests/support/otlp_receiver.py): the traceparent each worker leg carries, a
client's trace joined, failures as error spans, a receiver that is down costing the requests nothing,
and the `[tracing]` settings. test_tracing_e2e.py runs both front doors on real processes."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.settings import Settings, SettingsError
from tests.gateway.conftest import StackFactory
from tests.support.otlp_receiver import STATUS_ERROR, OtlpReceiver, ReceivedSpan, otlp_receiver
from tests.support.polling import eventually

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # OpenTelemetry's own: export within 20 ms
    with otlp_receiver() as r:
        yield r


def _tracing(endpoint: str, ratio: float = 1.0) -> dict[str, Any]:
    return {"enabled": True, "sampling_ratio": ratio, "endpoint": endpoint, "timeout_s": 2.0}


async def _spans(receiver: OtlpReceiver, done: str) -> list[ReceivedSpan]:
    """The spans once the root span named `done` (which ends last) has arrived."""

    async def arrived() -> bool:
        return bool(receiver.spans(name=done))

    await eventually(arrived, what=f"span {done} at the receiver")
    return receiver.spans()


async def test_worker_legs_carry_the_traceparent_of_their_spans_in_the_clients_trace(
    make_stack: StackFactory, receiver: OtlpReceiver
) -> None:
    stack = await make_stack(mode="pd", tracing=_tracing(receiver.endpoint))
    client_parent = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
    reply = await stack.chat([{"role": "user", "content": "hi"}], headers={"traceparent": client_parent})
    assert reply.status == 200
    spans = await _spans(receiver, "ppd.gateway.request")
    root = next(s for s in spans if s.name == "ppd.gateway.request")
    assert (root.trace_id, root.parent_span_id) == (CLIENT_TRACE, CLIENT_PARENT)  # the client's trace
    assert root.service == "ppd-gateway"
    assert root.attributes["ppd.request_id"] == reply.headers["X-Request-ID"]
    legs = {s.name: s for s in spans if s.name in ("ppd.prefill", "ppd.decode")}
    legs_of = {
        reply.headers["X-PPD-Prefill-Worker"]: "ppd.prefill",
        reply.headers["X-PPD-Decode-Worker"]: "ppd.decode",
    }
    for worker, leg in legs_of.items():
        (seen,) = stack.workers[worker].completions()
        assert seen.headers["traceparent"] == f"00-{CLIENT_TRACE}-{legs[leg].span_id}-01"
        assert legs[leg].parent_span_id == root.span_id


async def test_off_by_default_sends_no_traceparent(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="pd")
    assert stack.deps.tracer is None
    client_parent = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
    reply = await stack.chat([{"role": "user", "content": "hi"}], headers={"traceparent": client_parent})
    assert reply.status == 200
    for worker in stack.workers.values():
        assert all("traceparent" not in seen.headers for seen in worker.completions())


async def test_a_refused_request_is_an_error_span(make_stack: StackFactory, receiver: OtlpReceiver) -> None:
    stack = await make_stack(mode="pd", tracing=_tracing(receiver.endpoint))
    reply = await stack.chat([{"role": "user", "content": "hi"}], max_tokens=0)
    assert reply.status == 400
    spans = await _spans(receiver, "ppd.gateway.request")
    root = next(s for s in spans if s.name == "ppd.gateway.request")
    parse = next(s for s in spans if s.name == "ppd.parse")
    assert parse.parent_span_id == root.span_id
    assert root.status_code == parse.status_code == STATUS_ERROR
    assert "max_tokens" in root.status_message
    assert not [s for s in spans if s.name in ("ppd.prefill", "ppd.decode")]


async def test_unsampled_requests_export_nothing_and_still_tell_the_workers(
    make_stack: StackFactory, receiver: OtlpReceiver
) -> None:
    stack = await make_stack(mode="pd", tracing=_tracing(receiver.endpoint, ratio=0.0))
    assert (await stack.chat([{"role": "user", "content": "hi"}])).status == 200
    await stack.server.close()  # the app's shutdown exports what is queued
    assert receiver.spans() == []
    seen = [s for w in stack.workers.values() for s in w.completions()]
    # The sampled flag (bit 0 of the last field) is clear: vLLM does not record them either.
    assert seen
    assert all(int(s.headers["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0 for s in seen)


async def test_a_receiver_that_is_down_costs_the_requests_nothing(make_stack: StackFactory) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    stack = await make_stack(mode="pd", tracing=_tracing(endpoint))
    for stream in (False, True):
        reply = await stack.chat([{"role": "user", "content": f"hi {stream}"}], stream=stream)
        assert reply.status == 200
        assert reply.text


@pytest.mark.parametrize(
    ("tracing", "message"),
    [
        ({"sampling_ratio": 1.5}, "tracing.sampling_ratio must be between 0 and 1"),
        ({"protocol": "http/protobuf"}, "tracing.protocol must be 'grpc'"),
        ({"enabled": True, "endpoint": "collector:4317"}, "tracing.endpoint must be http://host:port"),
        ({"timeout_s": 0}, "tracing.timeout_s must be a positive"),
        ({"headers": {"x-api-key": 7}}, "tracing.headers must map names to string values"),
        ({"sample": 0.1}, "unknown setting 'sample' in \\[tracing\\]"),
        ({"enabled": "yes"}, "setting 'enabled' in \\[tracing\\] must be bool"),
    ],
)
def test_bad_tracing_settings_name_the_key(tracing: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_mapping({"tracing": tracing})


def test_tracing_settings_read_and_header_values_hidden() -> None:
    settings = Settings.from_mapping(
        {"tracing": {"enabled": True, "sampling_ratio": 0, "headers": {"x-api-key": "s3cret"}}}
    )
    assert (settings.tracing.enabled, settings.tracing.sampling_ratio) == (True, 0.0)
    assert settings.tracing.headers == {"x-api-key": "s3cret"}
    assert "s3cret" not in repr(settings)
    assert not Settings().tracing.enabled
