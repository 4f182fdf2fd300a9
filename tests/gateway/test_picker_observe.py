"""The picker's observed turns (gateway/picker.py rule 6, core.py rule 7) on scripted ext_proc message
sequences, as Envoy sends them once the response body is switched to STREAMED, over the fakes of
tests/gateway/fakes.py. Through the real Envoy: tests/deploy/test_envoy_picker_evidence.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.deps import Deps
from gateway.picker import Picker
from gateway.request_log import RequestLog
from gateway.sessions import explicit_key
from ppd.records import CLIENT_DISCONNECTED
from tests.gateway.fakes import ManualClock, forwarder_on_fakes
from tests.gateway.test_picker import MODEL, WORKERS, _body, _headers
from tests.support.metrics import sample

STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
FIRST = [{"role": "user", "content": "tell me about the sea"}]
SESSION = {"X-Session-ID": "s-observed"}


def _event(content: str) -> bytes:
    return (
        b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": content}}]}).encode() + b"\n\n"
    )


ANSWER = [_event("sea "), _event("is "), _event("wide"), b"data: [DONE]\n\n"]


Setup = Callable[..., tuple[Picker, Deps, ManualClock, Path]]


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    """A picker over fakes with `[log] picker_observe_share = share`, its request log closed after."""
    logs: list[RequestLog] = []

    def make(share: float, **extra: Any) -> tuple[Picker, Deps, ManualClock, Path]:
        picker, deps, clock, path = _setup(tmp_path, share, **extra)
        assert deps.request_log is not None
        logs.append(deps.request_log)
        return picker, deps, clock, path

    yield make
    for log in logs:
        log.close()


def _setup(tmp_path: Path, share: float, **extra: Any) -> tuple[Picker, Deps, ManualClock, Path]:
    path = tmp_path / "requests.jsonl"
    clock = ManualClock()
    config = {
        "mode": "local",
        "served_model": MODEL,
        "workers": WORKERS,
        "log": {"picker_observe_share": share, "run_id": "picker"},
        **extra,
    }
    _, deps = forwarder_on_fakes(config, request_log=RequestLog(str(path)), clock=clock)
    return Picker(deps, draw=lambda: 0.5), deps, clock, path


def _response_headers(status: str = "200") -> pb.ProcessingRequest:
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=status.encode())])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers))


def _chunk(data: bytes, *, end: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


async def _run(
    picker: Picker, clock: ManualClock, messages: list[pb.ProcessingRequest]
) -> list[pb.ProcessingResponse]:
    """Envoy's side: each message sent once the previous one is answered, 0.1 s apart."""

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for message in messages:
            clock.advance(0.1)
            yield message

    return [answer async for answer in picker.Process(requests(), cast(Any, None))]


def _lines(deps: Deps, path: Path) -> list[dict[str, Any]]:
    assert deps.request_log is not None
    deps.request_log.flush()
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _stream_turn(*, last_apart: bool = False) -> list[pb.ProcessingRequest]:
    body = _chat_stream()
    chunks = [_chunk(c) for c in ANSWER]
    if last_apart:
        chunks.append(_chunk(b"", end=True))
    else:
        chunks[-1] = _chunk(ANSWER[-1], end=True)
    return [_headers(extra=SESSION), body, _response_headers(), *chunks]


def _chat_stream() -> pb.ProcessingRequest:
    return _body({"model": MODEL, "messages": FIRST, "max_tokens": 8, "stream": True})


def _inflight(deps: Deps) -> float | None:
    return sample(deps.metrics.registry, "ppd_gateway_requests_in_flight")


@pytest.mark.parametrize("last_apart", [False, True])
async def test_a_sampled_stream_is_observed_and_logged_as_the_standalone_logs_it(
    setup: Setup, last_apart: bool
) -> None:
    picker, deps, clock, path = setup(share=1.0)
    answers = await _run(picker, clock, _stream_turn(last_apart=last_apart))
    assert answers[2].mode_override.response_body_mode == STREAMED
    assert all(a.WhichOneof("response") == "response_body" for a in answers[3:])
    assert all(not a.response_body.HasField("response") for a in answers[3:])  # the bytes go on unchanged
    (line,) = _lines(deps, path)
    # Body at 1000.2 (the turn's start); content at 1000.4, .5, .6: TTFT 0.2 s, TPOT 0.1 s over 3 tokens.
    assert line["ttft_ms"] == pytest.approx(200.0)
    assert line["tpot_ms"] == pytest.approx(100.0)
    assert (line["n_out"], line["ok"], line["error"], line["path"], line["turn"]) == (3, True, None, "pd", 1)
    assert line["conversation_id"] == "s-observed"
    labels = {"path": "pd", "turn_class": "first"}
    assert sample(deps.metrics.registry, "ppd_gateway_time_to_first_token_seconds_count", labels) == 1
    assert sample(deps.metrics.registry, "ppd_gateway_time_per_output_token_seconds_count", labels) == 1
    assert _inflight(deps) == 0
    # The session holds the real answer's length, not ψ's guess (8 asked, 3 produced).
    session = await deps.sessions.get(explicit_key("s-observed"))
    assert session is not None
    assert session.output_lengths[-1] == 3


async def test_the_turn_is_remembered_before_the_done_chunk_goes_on(setup: Setup) -> None:
    """The client's next turn may arrive as soon as it sees [DONE]: the session is already updated."""
    picker, deps, clock, _ = setup(share=1.0)
    seen: list[int | None] = []

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        for message in _stream_turn(last_apart=True):
            clock.advance(0.1)
            yield message

    async for answer in picker.Process(requests(), cast(Any, None)):
        if answer.WhichOneof("response") == "response_body":
            session = await deps.sessions.get(explicit_key("s-observed"))
            seen.append(session.output_lengths[-1] if session else None)
    assert seen[3:] == [3, 3]  # answered [DONE] (and the end) with the answer remembered
    assert seen[:3] == [8, 8, 8]  # before: ψ's expected length (max_tokens)


async def test_share_zero_observes_nothing_and_writes_no_line(setup: Setup) -> None:
    picker, deps, clock, path = setup(share=0.0)
    answers = await _run(picker, clock, _stream_turn()[:3])
    assert not answers[2].HasField("mode_override")
    assert _lines(deps, path) == []
    assert _inflight(deps) == 0
    assert (
        sample(deps.metrics.registry, "ppd_gateway_decisions_total", {"path": "pd", "reason": "turn_one"})
        == 1
    )


async def test_a_draw_above_the_share_is_not_observed(setup: Setup) -> None:
    picker, deps, clock, path = setup(share=0.4)  # the draw is 0.5
    answers = await _run(picker, clock, _stream_turn()[:3])
    assert not answers[2].HasField("mode_override")
    assert _lines(deps, path) == []


async def test_a_non_200_answer_is_a_line_with_its_error_and_not_observed(setup: Setup) -> None:
    picker, deps, clock, path = setup(share=1.0)
    answers = await _run(picker, clock, [_headers(), _chat_stream(), _response_headers("503")])
    assert not answers[2].HasField("mode_override")
    (line,) = _lines(deps, path)
    assert (line["ok"], line["error"], line["ttft_ms"]) == (False, "worker D0 answered 503", None)
    assert _inflight(deps) == 0


async def test_a_stream_that_ends_mid_answer_is_a_disconnect(setup: Setup) -> None:
    """Envoy closes the ext_proc stream when the client leaves: the held turn ends there."""
    picker, deps, clock, path = setup(share=1.0)
    await _run(picker, clock, _stream_turn()[:5])  # two chunks of the answer, then nothing
    (line,) = _lines(deps, path)
    assert (line["ok"], line["error"]) == (False, CLIENT_DISCONNECTED)
    assert line["ttft_ms"] == pytest.approx(200.0)
    assert _inflight(deps) == 0


async def test_a_stream_cut_by_the_worker_is_a_line_with_its_error(setup: Setup) -> None:
    picker, deps, clock, path = setup(share=1.0)
    messages = [*_stream_turn()[:5], _chunk(b"", end=True)]
    await _run(picker, clock, messages)
    (line,) = _lines(deps, path)
    assert (line["ok"], line["error"]) == (False, "worker D0 ended the stream before [DONE]")


async def test_a_whole_answer_is_observed_with_its_usage(setup: Setup) -> None:
    picker, deps, clock, path = setup(share=1.0)
    body = {
        "choices": [{"index": 0, "message": {"content": "the sea is wide"}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4},
    }
    raw = json.dumps(body).encode()
    messages = [
        _headers(),
        _body({"model": MODEL, "messages": FIRST, "max_tokens": 8}),
        _response_headers(),
        _chunk(raw[:7]),
        _chunk(raw[7:], end=True),
    ]
    answers = await _run(picker, clock, messages)
    assert answers[2].mode_override.response_body_mode == STREAMED
    (line,) = _lines(deps, path)
    assert (line["ok"], line["n_out"], line["ttft_ms"]) == (True, 4, None)


async def test_an_error_before_routing_writes_the_sampled_turns_line(setup: Setup) -> None:
    """A sampled turn the core refuses after reading it (every P failing, prefill_failure = error)
    gets its line, with the error, as the standalone's would."""
    picker, deps, clock, path = setup(share=1.0, policy={"prefill_failure": "error"})
    deps.upstream.failing.add("P0")  # type: ignore[attr-defined]
    answers = await _run(picker, clock, [_headers(), _chat_stream()])
    assert answers[1].immediate_response.status.code == 503
    (line,) = _lines(deps, path)
    assert line["ok"] is False
    assert "prefill" in line["error"]
    assert _inflight(deps) == 0


async def test_a_200_without_a_body_is_a_line_with_its_error(setup: Setup) -> None:
    picker, deps, clock, path = setup(share=1.0)
    empty = _response_headers()
    empty.response_headers.end_of_stream = True
    answers = await _run(picker, clock, [_headers(), _chat_stream(), empty])
    assert not answers[2].HasField("mode_override")
    (line,) = _lines(deps, path)
    assert (line["ok"], line["error"]) == (False, "worker D0 sent no body")
    assert _inflight(deps) == 0


async def test_a_stream_closed_after_done_is_a_served_turn(setup: Setup) -> None:
    """The client (or Envoy) gone after [DONE] but before the body's end: the answer was whole."""
    picker, deps, clock, path = setup(share=1.0)
    await _run(picker, clock, _stream_turn(last_apart=True)[:-1])
    (line,) = _lines(deps, path)
    assert (line["ok"], line["error"], line["n_out"]) == (True, None, 3)
    assert _inflight(deps) == 0


def _duplex_headers(*, response_duplex: bool) -> pb.ProcessingRequest:
    first = _headers(extra=SESSION)
    duplex = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    none = processing_mode_pb2.ProcessingMode.NONE
    first.protocol_config.request_body_mode = duplex
    first.protocol_config.response_body_mode = duplex if response_duplex else none
    return first


def _duplex_body() -> pb.ProcessingRequest:
    raw = json.dumps({"model": MODEL, "messages": FIRST, "max_tokens": 8, "stream": True}).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


async def test_in_full_duplex_an_observed_answer_is_read_from_its_echoed_chunks(setup: Setup) -> None:
    """GIE's mode: every answer chunk comes to the picker anyway; no override (Envoy ignores it)."""
    picker, deps, clock, path = setup(share=1.0)
    chunks = [_chunk(c) for c in ANSWER[:-1]] + [_chunk(ANSWER[-1], end=True)]
    messages = [_duplex_headers(response_duplex=True), _duplex_body(), _response_headers(), *chunks]
    answers = await _run(picker, clock, messages)
    headers_answer = next(a for a in answers if a.HasField("response_headers"))
    assert not headers_answer.HasField("mode_override")
    echoed = [
        a.response_body.response.body_mutation.streamed_response
        for a in answers
        if a.HasField("response_body")
    ]
    assert [(e.body, e.end_of_stream) for e in echoed] == [
        (c, i == len(ANSWER) - 1) for i, c in enumerate(ANSWER)
    ]
    (line,) = _lines(deps, path)
    assert (line["ok"], line["n_out"], line["ttft_ms"]) == (True, 3, pytest.approx(200.0))
    assert _inflight(deps) == 0


async def test_with_only_the_request_duplex_the_answer_is_not_observed_and_leaves_no_line(
    setup: Setup,
) -> None:
    """Envoy ignores mode_override when a configured body mode is FULL_DUPLEX_STREAMED: the answer
    never comes, so the drawn turn ends unobserved at its response headers (no line, no override)."""
    picker, deps, clock, path = setup(share=1.0)
    answers = await _run(
        picker, clock, [_duplex_headers(response_duplex=False), _duplex_body(), _response_headers()]
    )
    headers_answer = next(a for a in answers if a.HasField("response_headers"))
    assert not headers_answer.HasField("mode_override")
    assert _lines(deps, path) == []
    assert _inflight(deps) == 0
