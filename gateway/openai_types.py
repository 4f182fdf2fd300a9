"""The few OpenAI request fields the gateway reads, validated; everything else passes through untouched.

Rule: validation rejects what would make a worker fail or the gateway guess (400 with an OpenAI-style
error, before anything reaches a worker); it never rewrites the body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import BadRequestError
from gateway.types import Endpoint, JsonObject

__all__ = ["CompletionRequest", "parse_completion_request"]

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n")
_SESSION_FIELDS = ("session_id", "conversation_id")


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


def parse_completion_request(raw: bytes, endpoint: Endpoint) -> CompletionRequest:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("'model' must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be a boolean", param="stream")
    _check_numbers(body)
    session_id = _session_id(body)
    if endpoint == "chat":
        messages = _messages(body)
    else:
        messages = ()
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise BadRequestError("'prompt' must be a string or a non-empty array", param="prompt")
    return CompletionRequest(endpoint, body, model, stream, messages, session_id)


def _check_numbers(body: Mapping[str, Any]) -> None:
    for key in _INT_FIELDS:
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise BadRequestError(f"'{key}' must be a non-negative integer", param=key)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequestError("'stream_options' must be an object", param="stream_options")


def _session_id(body: Mapping[str, Any]) -> str | None:
    session_id: str | None = None
    for key in _SESSION_FIELDS:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise BadRequestError(f"'{key}' must be a non-empty string", param=key)
            session_id = session_id or value
    return session_id


def _messages(body: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise BadRequestError("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(raw_messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequestError(f"messages[{i}].content must be a string or an array", param="messages")
    return tuple(raw_messages)
