"""The few OpenAI request fields the gateway reads, validated; everything else passes through untouched.

Rule: validation rejects what would make a worker fail or the gateway guess (400 with an OpenAI-style
error, before anything reaches a worker); it never rewrites the body.
Rule 2: what the P/D path cannot serve is refused too: `n` other than 1, a batch of prompts,
`stream_options` without `stream: true`, a token limit below 1 or under `min_tokens` (P never sees
those fields, so only D would refuse them, after P's prefill).
Rule 3: the body is parsed with orjson, which refuses invalid Unicode (a lone surrogate such as
"\\ud800", in any field) and NaN/Infinity, so the tokenizer and the session store never see them
(integers beyond 64 bits, which no OpenAI field takes, arrive as floats).
Rule 4: `parse_json_object` is the one reader of a client's JSON body (completions here, `/tokenize`,
`/detokenize` and the admin API in app.py): a JSON object, nested at most `limits.max_json_depth`
levels (limits.py rule 4), else a 400 before anything walks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import BadRequestError, JsonTooDeepError
from gateway.limits import LimitSettings, check_client_id, check_json_depth, json_depth_exceeds
from gateway.types import Endpoint, JsonObject

__all__ = ["CompletionRequest", "parse_completion_request", "parse_json_object"]

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "min_completion_tokens", "n")
_LIMIT_FIELDS = ("max_completion_tokens", "max_tokens")
_SESSION_FIELDS = ("session_id", "conversation_id")
_DEFAULT_LIMITS = LimitSettings()


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    endpoint: Endpoint
    body: JsonObject
    model: str
    stream: bool
    # Chat only; empty for /v1/completions.
    messages: tuple[Mapping[str, Any], ...]
    # Explicit session id from the body (header handled by the caller).
    session_id: str | None


def parse_json_object(raw: bytes, *, max_depth: int) -> JsonObject:
    """A client's JSON body (rule 4), or BadRequestError (JsonTooDeepError past `max_depth`)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if json_depth_exceeds(raw, max_depth):  # orjson stops at 1024 levels
            raise JsonTooDeepError(max_depth) from None
        raise BadRequestError(f"request body is not valid JSON (or not valid UTF-8): {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestError("request body must be a JSON object")
    check_json_depth(raw, max_depth)
    return body


def parse_completion_request(
    raw: bytes, endpoint: Endpoint, limits: LimitSettings = _DEFAULT_LIMITS
) -> CompletionRequest:
    body = parse_json_object(raw, max_depth=limits.max_json_depth)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("'model' must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be a boolean", param="stream")
    _check_numbers(body, stream)
    session_id = _session_id(body, limits.max_id_length)
    if body.get("request_id") is not None:
        check_client_id(body["request_id"], "request_id", max_length=limits.max_id_length)
    if endpoint == "chat":
        messages = _messages(body, limits.max_messages)
    else:
        messages = ()
        _check_prompt(body.get("prompt"))
    return CompletionRequest(endpoint, body, model, stream, messages, session_id)


def _check_numbers(body: Mapping[str, Any], stream: bool) -> None:
    for key in _INT_FIELDS:
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise BadRequestError(f"'{key}' must be a non-negative integer", param=key)
    limit: int | None = None
    for key in _LIMIT_FIELDS:
        value = body.get(key)
        if value is not None and value < 1:
            raise BadRequestError(f"'{key}' must be at least 1, got {value}", param=key)
        limit = value if limit is None else limit
    for key in ("min_tokens", "min_completion_tokens"):
        value = body.get(key)
        if value is not None and limit is not None and value > limit:
            raise BadRequestError(f"'{key}' must be at most the token limit {limit}, got {value}", param=key)
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequestError(
            f"'n' must be 1 (the P/D path serves one choice per request), got {n}", param="n"
        )
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequestError("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise BadRequestError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )


def _session_id(body: Mapping[str, Any], max_length: int) -> str | None:
    session_id: str | None = None
    for key in _SESSION_FIELDS:
        value = body.get(key)
        if value is not None:
            session_id = session_id or check_client_id(value, key, max_length=max_length)
    return session_id


def _check_prompt(prompt: Any) -> None:
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
        raise BadRequestError("'prompt' must be a string or a non-empty array", param="prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list):
        raise BadRequestError(
            f"'prompt' holds a batch of {len(prompt)} prompts; the P/D path serves one per request",
            param="prompt",
        )


def _messages(body: Mapping[str, Any], max_messages: int) -> tuple[Mapping[str, Any], ...]:
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise BadRequestError("'messages' must be a non-empty array", param="messages")
    if len(raw_messages) > max_messages:
        raise BadRequestError(
            f"'messages' holds {len(raw_messages)} messages; at most {max_messages} are accepted per request",
            param="messages",
        )
    for i, message in enumerate(raw_messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequestError(f"messages[{i}].content must be a string or an array", param="messages")
    return tuple(raw_messages)
