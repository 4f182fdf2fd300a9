"""What the gateway learns from an answer while passing it on, without I/O.

`StreamRelay.feed(bytes)` returns the bytes to send to the client (whole SSE events only) and
records the answer text, `usage`, the worker's `kv_transfer_params` (a decode worker's, on its final
chunk, in vLLM's bidirectional mode: docs/vllm-protocol.md 3.4), errors and the end marker. Rule: the
client gets every event the worker sent, in order, except the usage-only chunk the gateway itself
asked for (`strip_usage`).
`answer_from_body` and `kv_params_from_body` do the same for a non-streaming answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

from gateway.sse import DONE, SSEEvent, SSEParser, encode_data, encode_event

__all__ = ["StreamRelay", "Usage", "answer_from_body", "error_event", "kv_params_from_body"]

_KV_FIELD = "kv_transfer_params"

_DONE_BYTES = b"data: [DONE]\n\n"


class Usage:
    __slots__ = ("completion_tokens", "prompt_tokens")

    def __init__(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens

    @classmethod
    def parse(cls, raw: Any) -> Usage | None:
        if not isinstance(raw, Mapping):
            return None
        prompt, completion = raw.get("prompt_tokens"), raw.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            return cls(prompt, completion)
        return None


def _choice_text(choice: Any) -> str:
    if not isinstance(choice, Mapping):
        return ""
    for holder in (choice.get("delta"), choice.get("message")):
        if isinstance(holder, Mapping):
            content = holder.get("content")
            return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _first_choice(choices: Any) -> Any:
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, Mapping) and choice.get("index", 0) == 0:
                return choice
    return None


def answer_from_body(body: Any) -> tuple[str, Usage | None]:
    """The text of choice 0 and the usage of a non-streaming answer."""
    if not isinstance(body, Mapping):
        return "", None
    return _choice_text(_first_choice(body.get("choices"))), Usage.parse(body.get("usage"))


def kv_params_from_body(body: Any) -> dict[str, Any] | None:
    """The answer's top-level `kv_transfer_params` when it is an object (vLLM sends null otherwise)."""
    params = body.get(_KV_FIELD) if isinstance(body, Mapping) else None
    return dict(params) if isinstance(params, Mapping) else None


def _loads(data: str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        try:  # what orjson refuses but the stdlib (and so the client) reads, e.g. lone surrogates
            return json.loads(data)
        except ValueError:
            return None


def error_event(message: str, *, error_type: str = "BadGatewayError", code: int = 502) -> bytes:
    payload = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return encode_data(json.dumps(payload, separators=(",", ":"))) + _DONE_BYTES


class StreamRelay:
    __slots__ = ("_parser", "_parts", "_strip_usage", "chunks", "done", "error", "kv_params", "usage")

    def __init__(self, *, strip_usage: bool) -> None:
        self._parser = SSEParser()
        self._strip_usage = strip_usage
        self._parts: list[str] = []
        self.chunks = 0  # content-carrying chunks of choice 0 (about one token each)
        self.done = False
        self.error: str | None = None
        self.usage: Usage | None = None
        self.kv_params: dict[str, Any] | None = None

    @property
    def answer(self) -> str:
        return "".join(self._parts)

    @property
    def truncated(self) -> bool:
        return not self.done

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        """(bytes for the client, whether new answer content arrived)."""
        events, raw = self._parser.feed_raw(data)
        return self._events(events, raw)

    def end(self) -> bytes:
        """The worker closed the stream; whatever whole event was still held."""
        events, raw = self._parser.end_raw()
        return self._events(events, raw)[0]

    def _events(self, events: list[SSEEvent], raw: bytes) -> tuple[bytes, bool]:
        """Observe each event; pass the worker's bytes on unchanged unless an event is dropped."""
        content = False
        dropped = False
        kept: list[SSEEvent] = []
        for event in events:
            if event.data == DONE:
                self.done = True
                kept.append(event)
                continue
            obj = _loads(event.data)
            if obj is None:
                kept.append(event)
                continue
            if isinstance(obj, dict):
                if "error" in obj:
                    err = obj["error"]
                    msg = err.get("message") if isinstance(err, Mapping) else err
                    self.error = str(msg)
                params = kv_params_from_body(obj)
                if params is not None:
                    self.kv_params = params
                usage = obj.get("usage")
                if usage is not None:
                    parsed = Usage.parse(usage)
                    if parsed is not None:
                        self.usage = parsed
                        if self._strip_usage and obj.get("choices") == []:
                            dropped = True
                            continue
                text = _choice_text(_first_choice(obj.get("choices")))
                if text:
                    self._parts.append(text)
                    self.chunks += 1
                    content = True
            kept.append(event)
        if not dropped:
            return raw, content
        return b"".join(encode_event(e) for e in kept), content
