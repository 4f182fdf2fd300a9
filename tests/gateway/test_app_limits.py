"""What a client cannot push past, each refused with a 400 before any worker is called: identifiers,
invalid Unicode, the served model's length, what the P/D path cannot serve, the message count."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from tests.gateway.conftest import MODEL, Reply, Stack, StackFactory
from tests.support.polling import eventually

CHAT = "/v1/chat/completions"


def _no_completions_reached(stack: Stack) -> bool:
    return all(not w.completions() for w in stack.workers.values())


def _user(text: str = "x") -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def _model_length_learnt(stack: Stack) -> int:
    async def known() -> bool:
        return stack.deps.pool.max_model_len(MODEL) is not None

    await eventually(known)
    length = stack.deps.pool.max_model_len(MODEL)
    assert length is not None
    return length


def _refused(reply: Reply, param: str | None) -> None:
    assert reply.status == 400, reply.body
    assert reply.body["error"]["code"] == 400
    assert reply.body["error"]["param"] == param


# ---------------------------------------------------------------- identifiers


_TOO_LONG_OR_ODD = ["x" * 33, "two words"]


@pytest.mark.parametrize("where", ["session_id", "conversation_id", "request_id"])
@pytest.mark.parametrize("value", [*_TOO_LONG_OR_ODD, "caf\u00e9", "tab\there", "line\r\nbreak", ""])
async def test_client_identifiers_in_the_body_are_bounded(
    make_stack: StackFactory, where: str, value: str
) -> None:
    stack = await make_stack(limits={"max_id_length": 32})
    reply = await stack.post(CHAT, {"model": MODEL, "messages": _user(), "max_tokens": 4, where: value})
    _refused(reply, where)
    assert _no_completions_reached(stack)
    assert len(stack.deps.sessions) == 0


@pytest.mark.parametrize("where", ["X-Session-ID", "X-PPD-Workload"])
@pytest.mark.parametrize("value", _TOO_LONG_OR_ODD)
async def test_client_identifiers_in_headers_are_bounded(
    make_stack: StackFactory, where: str, value: str
) -> None:
    stack = await make_stack(limits={"max_id_length": 32})
    reply = await stack.chat(_user(), headers={where: value})
    _refused(reply, where)
    assert _no_completions_reached(stack)
    assert len(stack.deps.sessions) == 0


async def test_an_identifier_at_the_limit_is_served_and_echoed(make_stack: StackFactory) -> None:
    stack = await make_stack(limits={"max_id_length": 32})
    session = "s-" + "x" * 30
    reply = await stack.chat(_user(), headers={"X-Session-ID": session, "X-PPD-Workload": "w" * 32})
    assert reply.status == 200
    assert reply.headers["X-PPD-Session-Id"] == session


async def test_a_huge_session_id_is_refused_and_nothing_is_kept(make_stack: StackFactory) -> None:
    stack = await make_stack()
    reply = await stack.chat(_user(), session_id="x" * 1_000_000)
    _refused(reply, "session_id")
    assert "256 characters" in reply.body["error"]["message"]
    assert len(stack.deps.sessions) == 0
    assert _no_completions_reached(stack)


# ---------------------------------------------------------------- Unicode


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "session_id": "\\ud800"}',
        b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
    ],
)
async def test_lone_surrogates_in_a_chat_body_are_a_400(
    make_stack: StackFactory, raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await make_stack()
    reply = await stack.post(CHAT, None, raw=raw % MODEL.encode())
    _refused(reply, None)
    assert "not valid" in reply.body["error"]["message"]
    assert _no_completions_reached(stack)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_lone_surrogate_in_a_completions_prompt_is_a_400(make_stack: StackFactory) -> None:
    stack = await make_stack()
    raw = b'{"model": "%s", "prompt": "hello \\ud800 world", "max_tokens": 4}' % MODEL.encode()
    reply = await stack.post("/v1/completions", None, raw=raw)
    _refused(reply, None)
    assert _no_completions_reached(stack)


async def test_a_non_utf8_session_header_is_a_400(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await make_stack()
    body = json.dumps({"model": MODEL, "messages": _user(), "max_tokens": 4}).encode()
    host, port = stack.server.host, stack.server.port
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"X-Session-ID: caf\xe9\xff\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    response = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert json.loads(payload)["error"]["param"] == "X-Session-ID"
    assert _no_completions_reached(stack)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# ---------------------------------------------------------------- what the P/D path cannot serve


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": None, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 2}, "n"),
        ({"n": 0}, "n"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"min_tokens": 9}, "min_tokens"),
    ],
)
async def test_requests_d_would_refuse_reach_no_worker(
    make_stack: StackFactory, extra: dict[str, Any], param: str
) -> None:
    stack = await make_stack()
    body = {"model": MODEL, "messages": _user(), "max_tokens": 4, **extra}
    reply = await stack.post(CHAT, {k: v for k, v in body.items() if v is not None})
    _refused(reply, param)
    assert _no_completions_reached(stack)


async def test_a_batch_of_prompts_is_a_400(make_stack: StackFactory) -> None:
    stack = await make_stack()
    for prompt in (["a", "b"], [[1, 2], [3]]):
        reply = await stack.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
        _refused(reply, "prompt")
    assert _no_completions_reached(stack)
    single = await stack.post("/v1/completions", {"model": MODEL, "prompt": [[1, 2]], "max_tokens": 2})
    assert single.status == 200


# ---------------------------------------------------------------- the served model's length


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("words", "max_tokens", "param"),
    [
        (1, 10**9, "max_tokens"),  # the limit alone is past the model's length
        (1, 8192, "max_tokens"),
        (600, 7800, "max_tokens"),  # prompt + limit past it
        (9000, None, "messages"),  # the prompt alone fills it
    ],
)
async def test_requests_past_the_model_length_never_reach_p_or_d(
    make_stack: StackFactory, stream: bool, words: int, max_tokens: int | None, param: str
) -> None:
    stack = await make_stack(mode="pd")
    assert await _model_length_learnt(stack) == 8192  # the fake workers' /v1/models card
    body: dict[str, Any] = {"model": MODEL, "messages": _user("hello " * words), "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    reply = await stack.post(CHAT, body)
    _refused(reply, param)
    assert "maximum context length is 8192" in reply.body["error"]["message"]
    assert _no_completions_reached(stack)


async def test_a_token_id_prompt_past_the_model_length_is_a_400(make_stack: StackFactory) -> None:
    stack = await make_stack()
    await _model_length_learnt(stack)
    body = {"model": MODEL, "prompt": list(range(8000)), "max_tokens": 500}
    reply = await stack.post("/v1/completions", body)
    _refused(reply, "max_tokens")
    assert "at least 8000 input tokens" in reply.body["error"]["message"]
    assert _no_completions_reached(stack)


async def test_requests_that_fit_the_model_length_are_served(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="pd")
    await _model_length_learnt(stack)
    reply = await stack.chat(_user("hello " * 600), max_tokens=16)
    assert (reply.status, reply.path) == (200, "pd")
    # Whitespace the chat template trims and special-token markers count nothing (a lower bound).
    padded = await stack.chat(_user(" " * 40_000 + "<|eot_id|>" * 3000), max_tokens=16)
    assert padded.status == 200


# ---------------------------------------------------------------- message count


async def test_messages_per_request_are_capped(make_stack: StackFactory) -> None:
    stack = await make_stack(limits={"max_messages": 3})
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    reply = await stack.chat([*history, *history])
    _refused(reply, "messages")
    assert "at most 3" in reply.body["error"]["message"]
    assert _no_completions_reached(stack)
    assert (await stack.chat([*history, {"role": "user", "content": "c"}])).status == 200


async def test_the_default_message_cap_is_2048(make_stack: StackFactory) -> None:
    stack = await make_stack()
    reply = await stack.chat(_user() * 2049)
    _refused(reply, "messages")
    assert _no_completions_reached(stack)


# ---------------------------------------------------------------- JSON nesting depth


def _nested(depth: int) -> str:
    """A JSON array nested `depth` levels deep (valid JSON; orjson itself reads up to 1024)."""
    return "[" * depth + "]" * depth


def _deep_chat(where: str, depth: int) -> bytes:
    """A chat body whose history holds `depth`-deep JSON in a message's content or tool_calls."""
    nested = _nested(depth)
    if where == "content":
        history = f'{{"role": "user", "content": {nested}}}, {{"role": "assistant", "content": "a"}}'
    else:
        history = (
            '{"role": "user", "content": "q"}, '
            f'{{"role": "assistant", "content": "a", "tool_calls": {nested}}}'
        )
    messages = f'[{history}, {{"role": "user", "content": "x"}}]'
    return f'{{"model": "{MODEL}", "max_tokens": 4, "messages": {messages}}}'.encode()


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("where", ["content", "tool_calls"])
async def test_json_nested_past_the_limit_is_a_400_naming_it(
    make_stack: StackFactory, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await make_stack()
    reply = await stack.post(CHAT, None, raw=_deep_chat(where, 1000))
    _refused(reply, None)
    assert "nested deeper than 128 levels" in reply.body["error"]["message"]
    assert "limits.max_json_depth" in reply.body["error"]["message"]
    assert _no_completions_reached(stack)
    assert len(stack.deps.sessions) == 0
    _no_traceback(caplog)


async def test_nesting_is_bounded_on_every_json_body_the_gateway_reads(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Completions, /tokenize and /detokenize (no token needed) alike."""
    stack = await make_stack()
    deep = _nested(1000)
    bodies = {
        "/v1/completions": f'{{"model": "{MODEL}", "prompt": "x", "max_tokens": 4, "logit_bias": {deep}}}',
        "/tokenize": f'{{"model": "{MODEL}", "prompt": "x", "extra": {deep}}}',
        "/detokenize": f'{{"model": "{MODEL}", "tokens": {deep}}}',
    }
    for path, raw in bodies.items():
        reply = await stack.post(path, None, raw=raw.encode())
        _refused(reply, None)
        assert "nested deeper than 128 levels" in reply.body["error"]["message"], path
    assert all(not w.seen for w in stack.workers.values())
    _no_traceback(caplog)


async def test_nesting_at_the_limit_is_served_and_the_limit_is_a_setting(make_stack: StackFactory) -> None:
    stack = await make_stack(limits={"max_json_depth": 8})
    # The body object is level 1, messages 2, a message 3, its content 4: 4 more levels reach 8.
    at_limit = [{"role": "user", "content": [{"type": "text", "text": "x", "extra": [[[]]]}]}]
    assert (await stack.chat(at_limit)).status == 200
    over = [{"role": "user", "content": [{"type": "text", "text": "x", "extra": [[[[]]]]}]}]
    reply = await stack.chat(over)
    _refused(reply, None)
    assert "nested deeper than 8 levels" in reply.body["error"]["message"]


async def test_deep_json_is_logged_once_a_minute_at_most(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await make_stack()
    caplog.set_level(logging.INFO, logger="gateway")
    for _ in range(5):
        assert (await stack.post(CHAT, None, raw=_deep_chat("content", 900))).status == 400
    lines = [r for r in caplog.records if "nested deeper" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].levelno == logging.WARNING
    _no_traceback(caplog)
