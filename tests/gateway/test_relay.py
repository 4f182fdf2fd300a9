"""What the relay passes on and what it learns from a stream, without sockets."""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import UpstreamStatusError, error_body
from gateway.relay import StreamRelay, answer_from_body, error_event, kv_params_from_body


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
    assert b"kv_transfer_params" in out  # passed on unchanged
    assert StreamRelay(strip_usage=False).kv_params is None
    assert kv_params_from_body({"kv_transfer_params": params}) == params
    assert kv_params_from_body({"kv_transfer_params": None}) is None
    assert kv_params_from_body([1]) is None
