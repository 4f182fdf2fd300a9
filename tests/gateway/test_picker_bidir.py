"""The picker on vLLM's bidirectional path (gateway/picker.py rule 7, observed_turn rule 2b,
answer_observer rule 4), on scripted ext_proc message sequences over the fakes of tests/gateway/fakes.py:
a turn whose D may answer with its own `kv_transfer_params` is observed, the client gets byte for byte
what the standalone gateway (forwarding.py, on the same fakes) sends, however Envoy splits the answer
into chunks, and the params are kept with the session. Through the real Envoy:
tests/deploy/test_envoy_picker_bidir.py."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.deps import Deps
from gateway.picker import Picker
from gateway.ports import ClientRequest
from gateway.request_log import RequestLog
from gateway.sessions import explicit_key
from tests.gateway.fakes import FakeClient, FakeUpstream, ManualClock, chat_answer, forwarder_on_fakes
from tests.gateway.test_picker import MODEL, WORKERS, _body, _headers

STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
SESSION = {"X-Session-ID": "s-bidir"}
FIRST = [{"role": "user", "content": "tell me about the sea"}]
D_PARAMS = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [4, 5, 6],
    "remote_engine_id": "engine-D",
    "remote_host": "10.0.0.2",
    "remote_port": 5600,
}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _delta(content: str, **extra: Any) -> dict[str, Any]:
    return {"id": "c1", "choices": [{"index": 0, "delta": {"content": content}}], **extra}


#: D's streamed answer as a bidirectional D sends it: params null on every chunk but the final one.
STREAM = b"".join(
    [
        _event(_delta("sea ", kv_transfer_params=None)),
        _event(_delta("is ", kv_transfer_params=None)),
        _event(
            {
                "id": "c1",
                "choices": [{"index": 0, "delta": {"content": "wide"}, "finish_reason": "length"}],
                "kv_transfer_params": D_PARAMS,
            }
        ),
        b"data: [DONE]\n\n",
    ]
)
WHOLE = json.dumps(chat_answer("the sea is wide") | {"kv_transfer_params": D_PARAMS}).encode()


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "mode": "bidir",
        "served_model": MODEL,
        "workers": WORKERS,
        "routing": {"bidir": True},
        "log": {"picker_observe_share": 0.0, "run_id": "picker"},
        **extra,
    }


@pytest.fixture
def logs(tmp_path: Path) -> Iterator[list[RequestLog]]:
    opened: list[RequestLog] = []
    yield opened
    for log in opened:
        log.close()


def _picker(logs: list[RequestLog], tmp_path: Path, **extra: Any) -> tuple[Picker, Deps, ManualClock]:
    clock = ManualClock()
    request_log = RequestLog(str(tmp_path / "requests.jsonl"))
    logs.append(request_log)
    _, deps = forwarder_on_fakes(_config(**extra), request_log=request_log, clock=clock)
    return Picker(deps, draw=lambda: 0.5), deps, clock


async def _standalone(*, stream: bool) -> bytes:
    """What the standalone gateway sends the client for the same answer of D."""
    upstream = FakeUpstream(stream_parts=[STREAM], decode_kv_params=D_PARAMS, answer="the sea is wide")
    forwarder, _ = forwarder_on_fakes(_config(), upstream=upstream)
    client = FakeClient()
    body = json.dumps({"model": MODEL, "messages": FIRST, "max_tokens": 8, "stream": stream}).encode()
    await forwarder.handle(ClientRequest("chat", body, SESSION), client)
    return client.body


def _response_headers(*, content_length: int | None = None) -> pb.ProcessingRequest:
    pairs = [(":status", "200")] + ([("content-length", str(content_length))] if content_length else [])
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers))


def _request(*, stream: bool, duplex: bool = False) -> list[pb.ProcessingRequest]:
    body = {"model": MODEL, "messages": FIRST, "max_tokens": 8, "stream": stream}
    first = _headers(extra=SESSION)
    if duplex:
        first.protocol_config.request_body_mode = DUPLEX
        first.protocol_config.response_body_mode = DUPLEX
    return [first, _body(body)]


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


async def _run(
    picker: Picker, clock: ManualClock, messages: list[pb.ProcessingRequest]
) -> list[pb.ProcessingResponse]:
    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for message in messages:
            clock.advance(0.1)
            yield message

    return [answer async for answer in picker.Process(requests(), cast(Any, None))]


def _client_gets(chunks: list[bytes], answers: list[pb.ProcessingResponse]) -> bytes:
    """The bytes Envoy passes on for the answer's chunks, by each chunk's answer."""
    out = b""
    for data, answer in zip(chunks, answers, strict=True):
        mutation = answer.response_body.response.body_mutation
        kind = mutation.WhichOneof("mutation")
        if kind == "body":
            out += mutation.body
        elif kind == "streamed_response":
            out += mutation.streamed_response.body
        elif kind is None:
            out += data  # no mutation: the very same bytes
    return out


async def _turn(
    picker: Picker, clock: ManualClock, chunks: list[bytes], *, stream: bool, duplex: bool = False
) -> tuple[list[pb.ProcessingResponse], bytes]:
    """One turn; the answers from the response headers on, and what the client got."""
    messages = [
        *_request(stream=stream, duplex=duplex),
        _response_headers(content_length=None if stream else len(WHOLE)),
        *(
            pb.ProcessingRequest(response_body=pb.HttpBody(body=c, end_of_stream=i == len(chunks) - 1))
            for i, c in enumerate(chunks)
        ),
    ]
    answers = await _run(picker, clock, messages)
    after = answers[-len(chunks) - 1 :]
    return after, _client_gets(chunks, after[1:])


async def _stored_params(deps: Deps) -> Any:
    session = await deps.sessions.get(explicit_key("s-bidir"))
    assert session is not None
    return json.loads(session.decode_kv_params) if session.decode_kv_params else None


CUTS = [[], *([i] for i in range(1, len(STREAM), 5)), [10, 80, 150, len(STREAM) - 3]]


@pytest.mark.parametrize("cuts", CUTS, ids=[",".join(map(str, c)) or "whole" for c in CUTS])
async def test_a_streamed_answer_reaches_the_client_as_the_standalone_sends_it_on_any_chunk_boundaries(
    logs: list[RequestLog], tmp_path: Path, cuts: list[int]
) -> None:
    picker, deps, clock = _picker(logs, tmp_path)
    after, got = await _turn(picker, clock, _split(STREAM, cuts), stream=True)
    assert after[0].mode_override.response_body_mode == STREAMED  # observed though never drawn
    assert "content-length" in after[0].response_headers.response.header_mutation.remove_headers
    assert got == await _standalone(stream=True)
    assert b"remote_block_ids" not in got
    assert await _stored_params(deps) == D_PARAMS


async def test_a_streamed_answer_byte_by_byte(logs: list[RequestLog], tmp_path: Path) -> None:
    picker, deps, clock = _picker(logs, tmp_path)
    _, got = await _turn(picker, clock, _split(STREAM, list(range(1, len(STREAM)))), stream=True)
    assert got == await _standalone(stream=True)
    assert await _stored_params(deps) == D_PARAMS


@pytest.mark.parametrize("cuts", [[], [7], [7, 100, len(WHOLE) - 1]], ids=["one", "two", "four"])
async def test_a_whole_answer_is_held_and_goes_on_as_the_standalone_sends_it(
    logs: list[RequestLog], tmp_path: Path, cuts: list[int]
) -> None:
    picker, deps, clock = _picker(logs, tmp_path)
    after, got = await _turn(picker, clock, _split(WHOLE, cuts), stream=False)
    assert after[0].mode_override.response_body_mode == STREAMED
    assert "content-length" in after[0].response_headers.response.header_mutation.remove_headers
    # Every chunk but the last is held back; the last carries the whole rewritten answer.
    assert all(a.response_body.response.body_mutation.clear_body for a in after[1:-1])
    assert got == await _standalone(stream=False)
    assert "kv_transfer_params" not in json.loads(got)
    assert await _stored_params(deps) == D_PARAMS


async def test_in_full_duplex_the_echoed_chunks_carry_the_standalones_bytes(
    logs: list[RequestLog], tmp_path: Path
) -> None:
    picker, deps, clock = _picker(logs, tmp_path)
    chunks = _split(STREAM, [150, 170])
    after, got = await _turn(picker, clock, chunks, stream=True, duplex=True)
    assert not after[0].HasField("mode_override")  # Envoy ignores it in this mode: the body comes anyway
    streamed = [a.response_body.response.body_mutation.streamed_response for a in after[1:]]
    assert [s.end_of_stream for s in streamed] == [False, False, True]
    assert got == await _standalone(stream=True)
    assert await _stored_params(deps) == D_PARAMS


async def test_a_whole_answer_past_max_body_bytes_goes_on_unchanged_with_an_error(
    logs: list[RequestLog], tmp_path: Path
) -> None:
    """Too long to be rewritten: the held bytes and the rest go on as they came (D's params with them),
    none are kept, and the turn's line says why."""
    picker, deps, clock = _picker(logs, tmp_path, max_body_bytes=len(WHOLE) - 10)
    chunks = _split(WHOLE, [40, 120])
    _, got = await _turn(picker, clock, chunks, stream=False)
    assert got == WHOLE
    assert await _stored_params(deps) is None
    assert deps.request_log is not None
    deps.request_log.flush()
    (line,) = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert line["ok"] is False
    assert f"over {len(WHOLE) - 10} bytes" in line["error"]


async def test_a_local_turn_is_not_observed_for_bidir(logs: list[RequestLog], tmp_path: Path) -> None:
    """A D leg without params gets none back from a bidirectional D: nothing to keep, no observation."""
    picker, _, clock = _picker(logs, tmp_path, mode="local")
    turn_one, _ = await _turn(picker, clock, _split(STREAM, []), stream=True)
    assert turn_one[0].mode_override.response_body_mode == STREAMED  # Turn 1 went through P (pd)
    history = [*FIRST, {"role": "assistant", "content": "sea is wide"}, {"role": "user", "content": "and?"}]
    second = {"model": MODEL, "messages": history}
    answers = await _run(picker, clock, [_headers(extra=SESSION), _body(second), _response_headers()])
    provenance = {
        h.header.key: h.header.raw_value
        for h in answers[-1].response_headers.response.header_mutation.set_headers
    }
    assert provenance["X-PPD-Path"] == b"local"
    assert not answers[-1].HasField("mode_override")


async def test_without_routing_bidir_no_turn_is_observed_for_it(
    logs: list[RequestLog], tmp_path: Path
) -> None:
    picker, _, clock = _picker(logs, tmp_path, mode="pd", routing={"bidir": False})
    answers = await _run(picker, clock, [*_request(stream=True), _response_headers()])
    assert not answers[-1].HasField("mode_override")
