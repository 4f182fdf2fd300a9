"""The picker's fallback worker and rebinding (gateway/picker_failover.py) on scripted ext_proc message
sequences over the fakes of tests/gateway/fakes.py: no Envoy, no sockets. Through the real Envoy (a D's
port closed, Envoy's retry on the fallback): tests/deploy/test_envoy_picker_failover.py."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from gateway.deps import Deps
from gateway.picker import DESTINATION_HEADER, Picker
from gateway.picker_failover import SERVED_KEY, served_endpoint
from tests.gateway.fakes import forwarder_on_fakes
from tests.support.metrics import sample

MODEL = "example-org/unknown-model"
D0, D1 = "10.0.0.2:8002", "10.0.0.3:8003"
WORKERS = [
    {"id": "P0", "role": "prefill", "url": "http://10.0.0.1:8001"},
    {"id": "D0", "role": "decode", "url": f"http://{D0}"},
    {"id": "D1", "role": "decode", "url": f"http://{D1}"},
]
FIRST = [{"role": "user", "content": "tell me about the sea"}]
SECOND = [*FIRST, {"role": "assistant", "content": "waves"}, {"role": "user", "content": "more"}]
THIRD = [*SECOND, {"role": "assistant", "content": "tides"}, {"role": "user", "content": "and?"}]


def _picker(workers: list[dict[str, str]] | None = None) -> tuple[Picker, Deps]:
    config = {"mode": "local", "served_model": MODEL, "workers": workers or WORKERS}
    _, deps = forwarder_on_fakes(config)
    return Picker(deps), deps


def _request(messages: list[dict[str, str]]) -> tuple[pb.ProcessingRequest, pb.ProcessingRequest]:
    pairs = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 8}).encode()
    return (
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    )


def _response(status: str, served: str | None) -> pb.ProcessingRequest:
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=status.encode())])
    message = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers))
    if served is not None:
        meta = struct_pb2.Struct()
        meta.update({SERVED_KEY: served})
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(meta)
    return message


async def _turn(
    picker: Picker, messages: list[dict[str, str]], *, status: str = "200", served: str | None = None
) -> tuple[str, dict[str, str]]:
    """One request's stream: the destination the picker named and the provenance headers it set."""

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for message in (*_request(messages), _response(status, served)):
            yield message

    answers = [a async for a in picker.Process(requests(), cast(Any, None))]
    routed = answers[1].request_body.response.header_mutation
    destination = {h.header.key: h.header.raw_value.decode() for h in routed.set_headers}[DESTINATION_HEADER]
    metadata = answers[1].dynamic_metadata["envoy.lb"][DESTINATION_HEADER]
    assert metadata == destination  # the two channels agree
    mutation = answers[2].response_headers.response.header_mutation
    return destination, {h.header.key.lower(): h.header.raw_value.decode() for h in mutation.set_headers}


def _rebinds(deps: Deps) -> float:
    return sample(deps.metrics.registry, "ppd_gateway_session_rebinds_total", {}) or 0.0


async def test_the_destination_names_the_chosen_d_then_the_other_live_d() -> None:
    picker, _ = _picker()
    destination, provenance = await _turn(picker, FIRST)
    assert provenance["x-ppd-decode-worker"] == "D0"
    assert destination == f"{D0},{D1}"


async def test_a_lone_d_is_named_alone() -> None:
    picker, _ = _picker(WORKERS[:2])
    destination, _ = await _turn(picker, FIRST)
    assert destination == D0


async def test_the_chosen_d_answering_changes_nothing() -> None:
    picker, deps = _picker()
    await _turn(picker, FIRST, served=D0)
    destination, second = await _turn(picker, SECOND, served=D0)
    assert (second["x-ppd-decode-worker"], second["x-ppd-path"]) == ("D0", "local")
    assert destination == f"{D0},{D1}"
    assert deps.pool.is_live("D0")
    assert _rebinds(deps) == 0


async def test_the_fallback_answering_rebinds_the_session_and_marks_the_chosen_d_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Envoy's retry reached D1: the session follows it, D0 is reported down, the headers say D1."""
    picker, deps = _picker()
    _, first = await _turn(picker, FIRST, served=D0)
    with caplog.at_level(logging.WARNING, logger="gateway.picker_failover"):
        _, second = await _turn(picker, SECOND, served=D1)
    session = first["x-ppd-session-id"]
    line = f"D0 failed before its first byte, Envoy's retry reached D1; D0 marked down, session {session}"
    assert line + " rebound to D1" in caplog.text
    assert (second["x-ppd-decode-worker"], second["x-ppd-path"], second["x-ppd-reason"]) == (
        "D1",
        "local",
        "decode_unreachable",
    )
    assert second["x-ppd-session-id"] == first["x-ppd-session-id"]
    assert not deps.pool.is_live("D0")
    assert _rebinds(deps) == 1
    errors = {"worker": "D0", "role": "decode", "kind": "unreachable"}
    assert sample(deps.metrics.registry, "ppd_gateway_upstream_errors_total", errors) == 1
    destination, third = await _turn(picker, THIRD, served=D1)
    assert (third["x-ppd-decode-worker"], third["x-ppd-path"], third["x-ppd-turn"]) == ("D1", "local", "3")
    assert destination == D1  # D0 is down: no fallback left


async def test_a_failed_fallback_marks_the_chosen_d_down_but_rebinds_nothing() -> None:
    """Both attempts failed (Envoy's own 503 names the fallback as the last attempt)."""
    picker, deps = _picker()
    await _turn(picker, FIRST, served=D0)
    _, second = await _turn(picker, SECOND, status="503", served=D1)
    assert second["x-ppd-decode-worker"] == "D0"
    assert second["x-ppd-reason"] == "mode_local"  # as routed
    assert not deps.pool.is_live("D0")
    assert _rebinds(deps) == 0


async def test_no_served_metadata_or_an_unknown_address_leaves_the_turn_as_routed() -> None:
    picker, deps = _picker()
    await _turn(picker, FIRST)
    _, second = await _turn(picker, SECOND, served="10.9.9.9:1")
    assert second["x-ppd-decode-worker"] == "D0"
    assert deps.pool.is_live("D0")
    assert _rebinds(deps) == 0


def test_served_endpoint_reads_only_a_string() -> None:
    message = _response("200", None)
    assert served_endpoint(message) is None
    message.metadata_context.filter_metadata["envoy.lb"].update({SERVED_KEY: 3})
    assert served_endpoint(message) is None
    assert served_endpoint(_response("200", D1)) == D1
