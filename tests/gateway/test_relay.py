"""What the relay passes on and what it learns from a stream, without sockets."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.errors import UpstreamStatusError, error_body
from gateway.relay import StreamRelay, answer_from_body, client_body, error_event, kv_params_from_body


def _sse(*objs: Any) -> bytes:
    return b"".join(
        b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs
    )


def _chunk(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}}


def test_passes_events_on_and_strips_only_the_usage_chunk_it_asked_for() -> None:
    stream = _sse(_chunk("Hel"), _chunk("lo"), USAGE, b"[DONE]")
    relay = StreamRelay(strip_usage=True)
    out = b""
    for i in range(0, len(stream), 7):  # arbitrary splits
        out += relay.feed(stream[i : i + 7])[0]
    assert out == _sse(_chunk("Hel"), _chunk("lo"), b"[DONE]")
    assert relay.answer == "Hello"
    assert relay.chunks == 2
    assert relay.done
    assert relay.usage is not None
    assert (relay.usage.prompt_tokens, relay.usage.completion_tokens) == (10, 2)

    kept = StreamRelay(strip_usage=False)
    assert kept.feed(stream)[0] == stream


def test_other_choices_and_completions_text() -> None:
    relay = StreamRelay(strip_usage=False)
    relay.feed(_sse({"choices": [{"index": 1, "delta": {"content": "no"}}, {"index": 0, "text": "yes"}]}))
    assert relay.answer == "yes"
    assert relay.truncated


def test_worker_error_event_is_recorded_and_passed() -> None:
    relay = StreamRelay(strip_usage=False)
    err = {"error": {"message": "boom", "code": 500}}
    out, content = relay.feed(_sse(err, b"[DONE]"))
    assert out == _sse(err, b"[DONE]")
    assert not content
    assert relay.error == "boom"


def test_error_event_shape() -> None:
    data = error_event("gone").split(b"\n\n")
    assert json.loads(data[0][6:]) == error_body("gone", "BadGatewayError", 502)
    assert data[1] == b"data: [DONE]"


def test_answer_from_body() -> None:
    body = {
        "choices": [{"index": 0, "message": {"content": "hi"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    text, usage = answer_from_body(body)
    assert text == "hi"
    assert usage is not None
    assert usage.completion_tokens == 1
    assert answer_from_body([]) == ("", None)


def test_upstream_status_keeps_client_errors_and_hides_server_errors() -> None:
    worker_body = json.dumps(error_body("too long", "BadRequestError", 400)).encode()
    assert UpstreamStatusError(400, worker_body, worker="D0").to_openai_error() == (
        400,
        error_body("too long", "BadRequestError", 400),
    )
    status, body = UpstreamStatusError(400, b"not json", worker="D0").to_openai_error()
    assert (status, body["error"]["code"]) == (400, 400)
    status, body = UpstreamStatusError(500, b"trace...", worker="D0").to_openai_error()
    assert (status, body["error"]["type"]) == (502, "BadGatewayError")


def test_events_orjson_refuses_are_still_read() -> None:
    relay = StreamRelay(strip_usage=False)
    relay.feed(b'data: {"choices": [{"index": 0, "delta": {"content": "\\ud800x"}}]}\n\n')
    assert relay.answer == "\ud800x"


def test_upstream_bodies_keep_big_integers_and_surrogates_exact() -> None:
    from gateway.upstream import dumps

    body = {"seed": 2**70, "text": "\ud800", "n": 1}
    assert json.loads(dumps(body)) == body
    assert json.loads(dumps({"a": "é"})) == {"a": "é"}


def test_ds_kv_params_on_the_final_chunk_or_body_are_recorded() -> None:
    params = {"do_remote_decode": True, "remote_block_ids": [[1]], "remote_engine_id": "d"}
    relay = StreamRelay(strip_usage=False)
    first = {"choices": [{"index": 0, "delta": {"content": "a"}}], "kv_transfer_params": None}
    final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "kv_transfer_params": params}
    out, _ = relay.feed(b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in (first, final)))
    assert relay.kv_params == params
    # Never passed on to the client: the final chunk goes on without them, the others unchanged.
    without = {k: v for k, v in final.items() if k != "kv_transfer_params"}
    compact = json.dumps(without, separators=(",", ":")).encode()
    assert out == f"data: {json.dumps(first)}\n\n".encode() + b"data: " + compact + b"\n\n"
    assert StreamRelay(strip_usage=False).kv_params is None
    assert kv_params_from_body({"kv_transfer_params": params}) == params
    assert kv_params_from_body({"kv_transfer_params": None}) is None
    assert kv_params_from_body([1]) is None
    answer = {"id": "c", "text": "\u00e9", "kv_transfer_params": params}
    assert json.loads(client_body(json.dumps(answer).encode(), answer)) == {"id": "c", "text": "\u00e9"}
    plain = json.dumps({"id": "c", "kv_transfer_params": None}).encode()
    assert client_body(plain, json.loads(plain)) is plain  # nothing to hide: the worker's very bytes


_text = st.text(st.characters(codec="utf-8"), max_size=6) | st.sampled_from(
    ['say "hi"', "a\\b", "\u00e9\u4e2d", "", '"index":0,', "\U0001f600"]
)
_holder = st.fixed_dictionaries(
    {}, optional={"content": st.none() | _text, "role": st.just("assistant"), "reasoning_content": _text}
)
_choice = st.fixed_dictionaries(
    {},
    optional={
        "index": st.sampled_from([0, 1]),
        "delta": _holder,
        "message": _holder,
        "text": _text,
        "logprobs": st.none() | st.just({"content": [{"token": "x", "logprob": -0.1}]}),
        "finish_reason": st.none() | st.just("stop"),
    },
)
_chunk_obj = st.fixed_dictionaries(
    {"id": st.just("chatcmpl-1"), "choices": st.lists(_choice, max_size=2)},
    optional={
        "usage": st.none() | st.just(USAGE["usage"]),
        "error": st.just({"message": "boom"}),
        "object": st.just("chat.completion.chunk"),
        "kv_transfer_params": st.none() | st.just({"do_remote_decode": True, "remote_block_ids": [[1]]}),
    },
)


def _learned(relay: StreamRelay) -> tuple[Any, ...]:
    usage = relay.usage
    return (
        relay.answer,
        relay.chunks,
        relay.done,
        relay.error,
        None if usage is None else (usage.prompt_tokens, usage.completion_tokens),
        relay.kv_params,
    )


def _c(*choices: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"id": "c", "choices": list(choices), **extra}


@settings(deadline=None, max_examples=300)
@given(
    st.lists(_chunk_obj, max_size=5),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
@example([_c({"index": 1, "delta": {"content": "no"}})], True, True, True)
@example([_c({"index": 1, "delta": {"content": "no"}}, {"index": 0, "text": "yes"})], True, True, True)
@example([_c({"index": 0, "delta": {"content": 'say "hi"'}})], True, True, True)
@example([_c({"index": 0, "delta": {"content": "a\\b"}})], True, True, True)
@example([_c({"index": 0, "delta": {"reasoning_content": "r"}})], True, True, True)
@example([_c({"index": 0, "delta": {"content": "x"}}, usage=None)], True, True, True)
@example([_c(usage=USAGE["usage"])], True, True, True)
@example([_c({"index": 0, "delta": {}, "text": "t"})], True, True, True)
@example([_c({"delta": {"content": "a"}}, {"delta": {"content": "b"}})], True, True, True)
@example([_c({}, {"index": 0, "delta": {"content": "0"}})], True, True, True)
@example([_c({"index": 0, "delta": {"content": None}}, id="chatcmpl-9")], True, True, True)
@example([_c({"index": 0, "delta": {}, "message": {"content": "0"}})], True, True, True)
def test_whole_events_learn_and_pass_on_exactly_what_any_split_does(
    objs: list[dict[str, Any]], compact: bool, done: bool, strip: bool
) -> None:
    # The relay's fast path (whole events of plain content chunks) against the parser (byte by
    # byte never ends on a whole event): the same bytes out, the same answer, usage, error, end.
    def dumps(o: Any) -> bytes:
        if compact:  # vLLM's form: no spaces, UTF-8 as it is
            return json.dumps(o, separators=(",", ":"), ensure_ascii=False).encode()
        return json.dumps(o).encode()

    events = [b"data: " + dumps(o) + b"\n\n" for o in objs] + ([b"data: [DONE]\n\n"] if done else [])
    by_event, whole, by_byte = (StreamRelay(strip_usage=strip) for _ in range(3))
    out_event = b"".join(by_event.feed(e)[0] for e in events)
    out_whole = whole.feed(b"".join(events))[0]
    stream = b"".join(events)
    out_byte = b"".join(by_byte.feed(stream[i : i + 1])[0] for i in range(len(stream)))
    assert out_event == out_whole == out_byte
    assert _learned(by_event) == _learned(whole) == _learned(by_byte)
    assert b'"kv_transfer_params":{' not in out_event.replace(b" ", b"")  # never reach the client


def test_vllm_content_chunks_are_passed_on_as_they_came() -> None:
    head = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    chunk = head + b'[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}\n\n'
    relay = StreamRelay(strip_usage=True)
    out, content = relay.feed(chunk)
    assert out is chunk  # the very bytes, not a copy
    assert content
    assert relay.answer == "Hi"
