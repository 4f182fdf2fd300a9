"""The Envoy endpoint picker (gateway/picker.py) on scripted ext_proc message sequences, as Envoy sends
them in our processing mode (request headers, the buffered body, response headers), over the
fakes of tests/gateway/fakes.py: no Envoy, no sockets. Through the real Envoy:
tests/deploy/test_envoy_picker.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.deps import Deps
from gateway.picker import DESTINATION_HEADER, PREFILLER_HEADER, Picker, destination
from tests.gateway.fakes import KV_PARAMS, FakeUpstream, forwarder_on_fakes
from tests.support.metrics import sample

MODEL = "example-org/unknown-model"
WORKERS = [
    {"id": "P0", "role": "prefill", "url": "http://10.0.0.1:8001"},
    {"id": "D0", "role": "decode", "url": "http://10.0.0.2:8002"},
]
FIRST = [{"role": "user", "content": "tell me about the sea"}]


def _picker(upstream: FakeUpstream | None = None, **extra: Any) -> tuple[Picker, Deps, FakeUpstream]:
    upstream = upstream or FakeUpstream()
    config = {"mode": "local", "served_model": MODEL, "workers": WORKERS, **extra}
    _, deps = forwarder_on_fakes(config, upstream=upstream)
    return Picker(deps, draw=lambda: 1.0), deps, upstream  # never drawn for observation: rule 6 apart


def _headers(
    path: str = "/v1/chat/completions",
    method: str = "POST",
    *,
    end: bool = False,
    extra: Mapping[str, str] | None = None,
) -> pb.ProcessingRequest:
    pairs = {":method": method, ":path": path, ":authority": "envoy", "content-type": "application/json"}
    pairs |= dict(extra or {})
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map, end_of_stream=end))


def _body(data: bytes | Mapping[str, Any]) -> pb.ProcessingRequest:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


def _chat(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, **fields}


RESPONSE_HEADERS = pb.ProcessingRequest(
    response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status")]))
)


async def _process(picker: Picker, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for message in messages:
            yield message

    return [answer async for answer in picker.Process(requests(), cast(Any, None))]


def _set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key.lower(): h.header.raw_value.decode() for h in mutation.set_headers}


def _routed(answers: list[pb.ProcessingResponse]) -> tuple[dict[str, str], dict[str, Any], pb.CommonResponse]:
    """The body answer's headers and body, and its CommonResponse."""
    common = answers[1].request_body.response
    return _set_headers(common.header_mutation), json.loads(common.body_mutation.body), common


async def test_turn_one_runs_the_p_leg_and_sends_d_its_params() -> None:
    picker, deps, upstream = _picker()
    client_params = {"remote_host": "10.9.9.9", "do_remote_prefill": True}
    answers = await _process(
        picker,
        _headers(extra={DESTINATION_HEADER: "10.9.9.9:1", PREFILLER_HEADER: "10.9.9.9:2"}),
        _body(_chat(FIRST, kv_transfer_params=client_params)),
        RESPONSE_HEADERS,
    )
    assert [a.WhichOneof("response") for a in answers] == [
        "request_headers",
        "request_body",
        "response_headers",
    ]
    assert not answers[0].request_headers.response.HasField("header_mutation")  # the body decides
    headers, body, common = _routed(answers)
    assert headers[DESTINATION_HEADER] == "10.0.0.2:8002"  # D0, not the client's
    assert answers[1].dynamic_metadata["envoy.lb"][DESTINATION_HEADER] == "10.0.0.2:8002"
    assert common.clear_route_cache
    assert body["kv_transfer_params"] == KV_PARAMS  # P's, the client's dropped
    assert headers["content-length"] == str(len(common.body_mutation.body))
    assert "stream_options" not in body
    assert PREFILLER_HEADER in common.header_mutation.remove_headers
    assert "authorization" in common.header_mutation.remove_headers  # no worker key, none forwarded
    assert [c.worker for c in upstream.calls] == ["P0"]  # the P leg only: Envoy carries D's
    assert headers["x-request-id"] == upstream.calls[0].headers[0][1]  # one id on both legs
    provenance = _set_headers(answers[2].response_headers.response.header_mutation)
    assert (provenance["x-ppd-path"], provenance["x-ppd-reason"], provenance["x-ppd-turn"]) == (
        "pd",
        "turn_one",
        "1",
    )
    assert (provenance["x-ppd-prefill-worker"], provenance["x-ppd-decode-worker"]) == ("P0", "D0")
    assert provenance["x-request-id"] == headers["x-request-id"]
    assert (
        sample(deps.metrics.registry, "ppd_gateway_decisions_total", {"path": "pd", "reason": "turn_one"})
        == 1
    )


async def test_turn_two_finds_the_session_by_its_history_and_stays_on_d() -> None:
    """The picker never sees the answer; the next turn carries it and finds the session."""
    picker, _, upstream = _picker()
    first = await _process(picker, _headers(), _body(_chat(FIRST)), RESPONSE_HEADERS)
    session = _set_headers(first[2].response_headers.response.header_mutation)["x-ppd-session-id"]
    history = [
        *FIRST,
        {"role": "assistant", "content": "an answer Envoy streamed"},
        {"role": "user", "content": "more"},
    ]
    second = await _process(
        picker, _headers(), _body(_chat(history, stream=True, kv_transfer_params={"x": 1})), RESPONSE_HEADERS
    )
    headers, body, _ = _routed(second)
    assert headers[DESTINATION_HEADER] == "10.0.0.2:8002"
    assert "kv_transfer_params" not in body  # the client's dropped, no P leg
    assert body["stream"] is True
    assert "stream_options" not in body  # nobody would drop an injected usage chunk
    provenance = _set_headers(second[2].response_headers.response.header_mutation)
    assert (provenance["x-ppd-path"], provenance["x-ppd-turn"], provenance["x-ppd-session-id"]) == (
        "local",
        "2",
        session,
    )
    assert [c.worker for c in upstream.calls] == ["P0"]  # Turn 2 never reached P


async def test_a_malformed_body_is_an_immediate_openai_400_and_ends_the_stream() -> None:
    picker, _, upstream = _picker()
    answers = await _process(picker, _headers(), _body(b'{"model": '), RESPONSE_HEADERS)
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "immediate_response"]
    immediate = answers[1].immediate_response
    assert immediate.status.code == 400
    error = json.loads(immediate.body)["error"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
    assert _set_headers(immediate.headers)["content-type"] == "application/json"
    assert upstream.calls == []


async def test_every_p_failing_falls_back_to_local_prefill_on_d() -> None:
    upstream = FakeUpstream(failing={"P0"})
    picker, _, _ = _picker(upstream)
    answers = await _process(picker, _headers(), _body(_chat(FIRST)), RESPONSE_HEADERS)
    assert [c.worker for c in upstream.calls] == ["P0"]
    headers, body, _ = _routed(answers)
    assert headers[DESTINATION_HEADER] == "10.0.0.2:8002"
    assert "kv_transfer_params" not in body
    provenance = _set_headers(answers[2].response_headers.response.header_mutation)
    assert (provenance["x-ppd-path"], provenance["x-ppd-reason"]) == ("local", "prefill_failed")


async def test_prefill_failure_error_is_an_immediate_response() -> None:
    picker, _, _ = _picker(FakeUpstream(failing={"P0"}), policy={"prefill_failure": "error"})
    answers = await _process(picker, _headers(), _body(_chat(FIRST)))
    assert answers[1].immediate_response.status.code == 503
    assert "error" in json.loads(answers[1].immediate_response.body)


async def test_the_session_header_is_read_whatever_its_case() -> None:
    picker, _, _ = _picker()
    answers = await _process(
        picker, _headers(extra={"x-session-id": "conv-7"}), _body(_chat(FIRST)), RESPONSE_HEADERS
    )
    assert _set_headers(answers[2].response_headers.response.header_mutation)["x-ppd-session-id"] == "conv-7"


async def test_other_requests_pass_through_to_a_live_worker_on_their_headers() -> None:
    picker, _, upstream = _picker()
    answers = await _process(picker, _headers("/v1/models", "GET", end=True), RESPONSE_HEADERS)
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "response_headers"]
    common = answers[0].request_headers.response
    assert _set_headers(common.header_mutation)[DESTINATION_HEADER] == "10.0.0.2:8002"
    assert common.clear_route_cache
    assert upstream.calls == []


async def test_no_live_worker_is_an_immediate_503() -> None:
    picker, deps, _ = _picker()
    for worker in ("P0", "D0"):
        deps.pool.mark_failed(worker)
    answers = await _process(picker, _headers("/health", "GET", end=True))
    assert answers[0].immediate_response.status.code == 503


def test_destination_is_host_and_port_with_ipv6_in_brackets() -> None:
    assert destination("http://10.0.0.2:8002/v1/chat/completions") == "10.0.0.2:8002"
    assert destination("http://[::1]:8002") == "[::1]:8002"
    assert destination("http://10.0.0.2") == "10.0.0.2:80"


async def test_a_body_in_pieces_is_refused_not_half_routed() -> None:
    """Envoy configured with STREAMED bodies (neither BUFFERED nor full duplex: no protocol_config
    naming FULL_DUPLEX_STREAMED): the picker says so instead of routing a request it has not read."""
    picker, _, upstream = _picker()
    piece = pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"model": ', end_of_stream=False))
    answers = await _process(picker, _headers(), piece, _body(b'"x"}'))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "immediate_response"]
    assert answers[1].immediate_response.status.code == 500
    assert "BUFFERED" in json.loads(answers[1].immediate_response.body)["error"]["message"]
    assert upstream.calls == []


async def test_a_worker_configured_by_name_is_named_to_envoy_by_its_address() -> None:
    """Envoy's ORIGINAL_DST cluster resolves no names (destinations.py): a D configured as
    `localhost` (a StatefulSet pod's DNS name on Kubernetes) is sent as its IP address."""
    workers = [WORKERS[0], {"id": "D0", "role": "decode", "url": "http://localhost:8002"}]
    picker, _, _ = _picker(workers=workers)
    answers = await _process(picker, _headers(), _body(_chat(FIRST)), RESPONSE_HEADERS)
    headers, _, _ = _routed(answers)
    assert headers[DESTINATION_HEADER] == "127.0.0.1:8002"
    assert answers[1].dynamic_metadata["envoy.lb"][DESTINATION_HEADER] == "127.0.0.1:8002"
    passthrough = await _process(picker, _headers("/v1/models", "GET", end=True))
    assert _set_headers(passthrough[0].request_headers.response.header_mutation)[DESTINATION_HEADER] == (
        "127.0.0.1:8002"
    )


async def test_a_worker_name_that_does_not_resolve_is_an_immediate_502_naming_it() -> None:
    workers = [WORKERS[0], {"id": "D0", "role": "decode", "url": "http://vllm-decode-0.nowhere.invalid:8002"}]
    picker, deps, _ = _picker(workers=workers)
    answers = await _process(picker, _headers(), _body(_chat(FIRST)))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "immediate_response"]
    assert len(cast(Any, deps.sessions)) == 0  # no turn remembered on a D Envoy cannot reach
    assert answers[1].immediate_response.status.code == 502
    assert "worker D0's host" in json.loads(answers[1].immediate_response.body)["error"]["message"]
    passthrough = await _process(picker, _headers("/v1/models", "GET", end=True))
    assert passthrough[0].immediate_response.status.code == 502


async def test_a_request_shed_by_admission_control_is_an_immediate_429_with_retry_after() -> None:
    upstream = FakeUpstream()
    config = {
        "mode": "local",
        "served_model": MODEL,
        "workers": WORKERS,
        "log": {"picker_observe_share": 1.0},
        "admission": {"enabled": True, "max_inflight": 1, "max_queue": 0},
    }
    _, deps = forwarder_on_fakes(config, upstream=upstream)
    picker = Picker(deps, draw=lambda: 0.0)  # every answer observed: the first turn stays in flight
    answer_over = asyncio.Event()

    async def first() -> AsyncIterator[pb.ProcessingRequest]:
        yield _headers()
        yield _body(_chat(FIRST))
        await answer_over.wait()
        yield RESPONSE_HEADERS

    held = picker.Process(first(), cast(Any, None))
    routed = [await anext(held), await anext(held)]
    assert routed[1].WhichOneof("response") == "request_body"
    answers = await _process(picker, _headers(), _body(_chat([{"role": "user", "content": "another"}])))
    immediate = answers[1].immediate_response
    assert immediate.status.code == 429
    assert _set_headers(immediate.headers)["retry-after"] == "10"
    error = json.loads(immediate.body)["error"]
    assert (error["type"], error["code"]) == ("RateLimitError", 429)
    assert "queue_full" in error["message"]
    answer_over.set()
    assert [a async for a in held]  # the first turn's answer: observed, then it ends
    assert sample(deps.metrics.registry, "ppd_gateway_admission_in_flight") == 0
