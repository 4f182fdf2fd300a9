"""The picker in FULL_DUPLEX_STREAMED mode (gateway/picker_stream.py), on message sequences the real
Envoy sent with the GIE-style config (tests/testdata/extproc/gie_duplex.json, recorded by
tests/deploy/extproc_recorder.py), replayed to the picker served by a real grpc.aio server on
127.0.0.1 port 0 through a gRPC client, over the fakes of tests/gateway/fakes.py (a fake P leg).
Through the real Envoy: tests/deploy/test_envoy_picker_gie.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from gateway.errors import PayloadTooLargeError
from gateway.picker import DESTINATION_HEADER, PREFILLER_HEADER, Picker
from gateway.picker_stream import CHUNK_BYTES, BodyAssembly, modes, streamed_body
from tests.deploy.extproc_recorder import LIMIT, MODEL, load
from tests.gateway.fakes import KV_PARAMS, FakeUpstream, forwarder_on_fakes

WORKERS = [
    {"id": "P0", "role": "prefill", "url": "http://10.0.0.1:8001"},
    {"id": "D0", "role": "decode", "url": "http://10.0.0.2:8002"},
]
D0 = "10.0.0.2:8002"
RECORDED = load()
DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


@asynccontextmanager
async def _served(upstream: FakeUpstream) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    """The picker on a real grpc.aio server (port 0), and a client stub on it."""
    # No answer observed by chance (the default share draws 5%): the replays compare exact answers.
    config = {
        "mode": "local",
        "served_model": MODEL,
        "workers": WORKERS,
        "max_body_bytes": LIMIT,
        "log": {"picker_observe_share": 0.0},
    }
    _, deps = forwarder_on_fakes(config, upstream=upstream)
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Picker(deps), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.ExternalProcessorStub(channel)
    finally:
        await server.stop(0)


async def _replay(
    messages: list[pb.ProcessingRequest], upstream: FakeUpstream | None = None
) -> tuple[list[pb.ProcessingResponse], FakeUpstream]:
    upstream = upstream or FakeUpstream()

    def requests() -> Iterator[pb.ProcessingRequest]:
        yield from messages

    async with _served(upstream) as stub:
        answers = [answer async for answer in stub.Process(requests(), timeout=30)]
    return answers, upstream


def _kinds(answers: list[pb.ProcessingResponse]) -> list[str]:
    return [a.WhichOneof("response") or "" for a in answers]


def _sets(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key.lower(): h.header.raw_value.decode() for h in mutation.set_headers}


def _streamed(answers: list[pb.ProcessingResponse], kind: str) -> list[pb.StreamedBodyResponse]:
    return [getattr(a, kind).response.body_mutation.streamed_response for a in answers if a.HasField(kind)]


def _bodies(messages: list[pb.ProcessingRequest], kind: str) -> list[tuple[bytes, bool]]:
    return [(getattr(m, kind).body, getattr(m, kind).end_of_stream) for m in messages if m.HasField(kind)]


def test_the_recording_holds_what_it_claims() -> None:
    """Envoy named its modes, split the long body, and sent trailers: the sequences are worth replaying."""
    for name, messages in RECORDED.items():
        assert modes(messages[0]).request, name
        assert modes(messages[0]).response, name
    assert len(_bodies(RECORDED["multi_chunk_completion"], "request_body")) >= 2
    assert any(m.HasField("request_trailers") for m in RECORDED["trailers"])
    assert any(m.HasField("response_trailers") for m in RECORDED["trailers"])


async def test_a_body_in_chunks_is_gathered_then_routed_headers_first_and_the_answer_echoed() -> None:
    messages = RECORDED["multi_chunk_completion"]
    answers, upstream = await _replay(messages)
    chunks = len(_streamed(answers, "request_body"))
    responses = len(_bodies(messages, "response_body"))
    assert _kinds(answers) == [
        "request_headers",
        *["request_body"] * chunks,
        "response_headers",
        *["response_body"] * responses,
    ]
    common = answers[0].request_headers.response
    headers = _sets(common.header_mutation)
    assert headers[DESTINATION_HEADER] == D0
    assert answers[0].dynamic_metadata["envoy.lb"][DESTINATION_HEADER] == D0
    assert common.clear_route_cache
    assert "content-length" not in headers  # Envoy sends the new body chunked
    assert {"content-length", PREFILLER_HEADER} <= set(common.header_mutation.remove_headers)
    streamed = _streamed(answers, "request_body")
    assert [s.end_of_stream for s in streamed] == [False] * (chunks - 1) + [True]
    body = json.loads(b"".join(s.body for s in streamed))
    sent = json.loads(b"".join(b for b, _ in _bodies(messages, "request_body")))
    assert body["messages"] == sent["messages"]  # the whole gathered body went through the core
    assert body["kv_transfer_params"] == KV_PARAMS
    assert [c.worker for c in upstream.calls] == ["P0"]  # the P leg ran once
    provenance = _sets(answers[1 + chunks].response_headers.response.header_mutation)
    assert (provenance["x-ppd-path"], provenance["x-ppd-turn"]) == ("pd", "1")
    assert provenance["x-request-id"] == headers["x-request-id"]
    echoed = [(s.body, s.end_of_stream) for s in _streamed(answers, "response_body")]
    assert echoed == _bodies(messages, "response_body")  # every answer byte back, unchanged


async def test_a_body_over_max_body_bytes_is_the_standalones_413_before_any_routing() -> None:
    answers, upstream = await _replay(RECORDED["over_the_limit"])
    assert _kinds(answers) == ["immediate_response"]
    immediate = answers[0].immediate_response
    assert immediate.status.code == 413
    expected = PayloadTooLargeError(f"request body over the limit of {LIMIT} bytes").to_openai_error()[1]
    assert json.loads(immediate.body) == expected
    assert upstream.calls == []


async def test_a_request_without_a_body_is_routed_on_its_headers() -> None:
    messages = RECORDED["models"]
    answers, upstream = await _replay(messages)
    responses = _bodies(messages, "response_body")
    assert _kinds(answers) == ["request_headers", "response_headers", *["response_body"] * len(responses)]
    assert _sets(answers[0].request_headers.response.header_mutation)[DESTINATION_HEADER] == D0
    assert [(s.body, s.end_of_stream) for s in _streamed(answers, "response_body")] == responses
    assert upstream.calls == []


async def test_another_routes_body_is_passed_through_chunk_by_chunk() -> None:
    messages = RECORDED["other_post"]
    answers, upstream = await _replay(messages)
    assert _kinds(answers)[0] == "request_headers"  # routed at once, before its body
    assert _sets(answers[0].request_headers.response.header_mutation)[DESTINATION_HEADER] == D0
    assert [(s.body, s.end_of_stream) for s in _streamed(answers, "request_body")] == _bodies(
        messages, "request_body"
    )
    assert upstream.calls == []


async def test_request_trailers_end_the_body_and_every_trailer_is_answered_in_order() -> None:
    messages = RECORDED["trailers"]
    answers, _ = await _replay(messages)
    kinds = _kinds(answers)
    assert kinds[0] == "request_headers"
    assert kinds[kinds.index("request_trailers") - 1] == "request_body"
    assert kinds[-1] == "response_trailers"
    assert kinds.index("request_trailers") < kinds.index("response_headers")
    streamed = _streamed(answers, "request_body")
    assert not streamed[-1].end_of_stream  # the trailers end the request, not the body
    assert json.loads(b"".join(s.body for s in streamed))["kv_transfer_params"] == KV_PARAMS


def _duplex_headers() -> pb.ProcessingRequest:
    pairs = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=DUPLEX, response_body_mode=DUPLEX),
    )


def _chunk(data: bytes, *, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


async def test_a_malformed_gathered_body_is_an_immediate_400() -> None:
    answers, upstream = await _replay(
        [_duplex_headers(), _chunk(b'{"model": ', end=False), _chunk(b"", end=True)]
    )
    assert _kinds(answers) == ["immediate_response"]
    assert answers[0].immediate_response.status.code == 400
    assert upstream.calls == []


async def test_a_body_longer_than_one_chunk_comes_back_in_several() -> None:
    content = "y" * (CHUNK_BYTES + 1000)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4})
    raw = body.encode()
    assert CHUNK_BYTES < len(raw) < LIMIT
    half = len(raw) // 2
    answers, _ = await _replay(
        [_duplex_headers(), _chunk(raw[:half], end=False), _chunk(raw[half:], end=True)]
    )
    streamed = _streamed(answers, "request_body")
    assert len(streamed) == 2
    assert all(len(s.body) <= CHUNK_BYTES for s in streamed)
    assert json.loads(b"".join(s.body for s in streamed))["messages"][0]["content"] == content


def test_streamed_body_splits_at_the_chunk_size_and_ends_only_on_the_last() -> None:
    data = bytes(range(256)) * 1000  # 256,000 bytes
    pieces = list(streamed_body(data, end=True, chunk_bytes=100_000))
    bodies = [p.request_body.response.body_mutation.streamed_response for p in pieces]
    assert [len(b.body) for b in bodies] == [100_000, 100_000, 56_000]
    assert [b.end_of_stream for b in bodies] == [False, False, True]
    assert b"".join(b.body for b in bodies) == data
    (empty,) = streamed_body(b"", end=False, kind="response_body")
    assert empty.HasField("response_body")
    assert not empty.response_body.response.body_mutation.streamed_response.end_of_stream


def test_the_assembly_refuses_one_byte_over_the_limit() -> None:
    assembly = BodyAssembly(10)
    assert not assembly.add(pb.HttpBody(body=b"12345"))
    assert assembly.add(pb.HttpBody(body=b"67890", end_of_stream=True))
    assert assembly.body == b"1234567890"
    with pytest.raises(PayloadTooLargeError):
        BodyAssembly(10).add(pb.HttpBody(body=b"12345678901"))


def test_without_a_protocol_config_nothing_is_duplex() -> None:
    mode = modes(pb.ProcessingRequest(request_headers=pb.HttpHeaders()))
    assert not mode.request
    assert not mode.response


async def test_a_duplex_request_with_the_response_body_off_is_answered_without_echoes() -> None:
    """Request body FULL_DUPLEX_STREAMED, response body NONE (the answer streamed by Envoy alone):
    each direction follows its own mode."""
    headers = _duplex_headers()
    headers.protocol_config.response_body_mode = processing_mode_pb2.ProcessingMode.NONE
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    response_headers = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    answers, _ = await _replay([headers, _chunk(body.encode(), end=True), response_headers])
    assert _kinds(answers) == ["request_headers", "request_body", "response_headers"]
    assert _sets(answers[2].response_headers.response.header_mutation)["x-ppd-turn"] == "1"
