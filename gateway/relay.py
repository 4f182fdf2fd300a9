"""What the gateway learns from an answer while passing it on, without I/O.

`StreamRelay.feed(bytes)` returns the bytes to send to the client (whole SSE events only) and
records the answer text, `usage`, the worker's `kv_transfer_params` (a decode worker's, on its final
chunk, in vLLM's bidirectional mode: docs/vllm-protocol.md 3.4), errors and the end marker. Rule: the
client gets every event the worker sent, in order, except the usage-only chunk the gateway itself
asked for (`strip_usage`), and without a worker's `kv_transfer_params` (its host, port, engine id
and block ids are for the gateway alone: the event that carries them is re-encoded without them).
`answer_from_body` and `kv_params_from_body` do the same for a non-streaming answer, and
`client_body` is that answer as the client gets it.
The hot path (one call per relayed chunk): a chunk of whole one-line `data: ` events, as vLLM sends
them, is read straight off its bytes (orjson on each payload; no line parser, no event objects) and
the very bytes object that came in is what goes out; anything else takes the sans-I/O parser (sse.py).
Both paths learn and pass on exactly the same (tests/gateway/test_relay.py, a property test).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Final

import orjson

from gateway.sse import DONE, SSEEvent, SSEParser, encode_data, encode_event

__all__ = ["StreamRelay", "Usage", "answer_from_body", "client_body", "error_event", "kv_params_from_body"]

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


def _is_mapping(x: Any) -> bool:
    return type(x) is dict or isinstance(x, Mapping)  # the dict test first: ABC checks cost ~1 µs


def _choice_text(choice: Any) -> str:
    if not _is_mapping(choice):
        return ""
    for holder in (choice.get("delta"), choice.get("message")):
        if _is_mapping(holder):
            content = holder.get("content")
            return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _first_choice(choices: Any) -> Any:
    if isinstance(choices, list):
        for choice in choices:
            if _is_mapping(choice) and choice.get("index", 0) == 0:
                return choice
    return None


def answer_from_body(body: Any) -> tuple[str, Usage | None]:
    """The text of choice 0 and the usage of a non-streaming answer."""
    if not isinstance(body, Mapping):
        return "", None
    return _choice_text(_first_choice(body.get("choices"))), Usage.parse(body.get("usage"))


_KV_FIELD: Final = "kv_transfer_params"


def kv_params_from_body(body: Any) -> dict[str, Any] | None:
    """The answer's top-level `kv_transfer_params` when it is an object (vLLM sends null otherwise)."""
    params = body.get(_KV_FIELD) if isinstance(body, Mapping) else None
    return dict(params) if isinstance(params, Mapping) else None


def _dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj)
    except TypeError:  # integers beyond 64 bits, lone surrogates: the stdlib writes them exactly
        return json.dumps(obj, separators=(",", ":")).encode("ascii")


def client_body(raw: bytes, body: Any) -> bytes:
    """A non-streaming answer as the client gets it: the worker's bytes (`raw`, parsed as `body`),
    re-encoded without `kv_transfer_params` when it carries some (the relay's rule)."""
    if not isinstance(body, dict) or body.get(_KV_FIELD) is None:
        return raw
    return _dumps({k: v for k, v in body.items() if k != _KV_FIELD})


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


_DATA = b"data: "
_DONE_DATA = DONE.encode()
_DONE_MARK: Final = object()  # the [DONE] event among parsed ones
# What becomes of one observed event: passed on as it came, dropped, or re-encoded (the parsed
# object, changed by _observe).
_PASS: Final = 0
_DROP: Final = 1
_REWRITE: Final = 2


class StreamRelay:
    __slots__ = ("_parser", "_parts", "_strip_usage", "chunks", "done", "error", "kv_params", "usage")

    def __init__(self, *, strip_usage: bool) -> None:
        self._parser = SSEParser()
        self._strip_usage = strip_usage
        self._parts: list[str] = []
        self.chunks = 0  # content-carrying chunks of choice 0 (about one token each)
        self.done = False
        self.error: str | None = None
        self.kv_params: dict[str, Any] | None = None
        self.usage: Usage | None = None

    @property
    def answer(self) -> str:
        return "".join(self._parts)

    @property
    def truncated(self) -> bool:
        return not self.done

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        """(bytes for the client, whether new answer content arrived)."""
        if self._parser.idle and data[-2:] == b"\n\n" and b"\r" not in data:
            fast = self._plain(data)
            if fast is not None:
                return fast
        events, raw = self._parser.feed_raw(data)
        return self._events(events, raw)

    def end(self) -> bytes:
        """The worker closed the stream; whatever whole event was still held."""
        events, raw = self._parser.end_raw()
        return self._events(events, raw)[0]

    def _plain(self, data: bytes) -> tuple[bytes, bool] | None:
        """The fast path for what a worker sends nearly always: whole events of one `data: ` line
        each, read straight off the bytes (no line parser, no event objects, no decoding before the
        JSON parser) and passed on as they came (`feed`'s answer); None, with nothing
        recorded, when the chunk is anything else or not JSON the fast parser takes (the line parser
        then reads it, as before)."""
        if data.find(b"\n") == len(data) - 2:  # one event, one line: the usual chunk
            if data[:6] != _DATA:
                return None
            payloads = [data[6:-2]]
        else:
            payloads = [b[6:] for b in data[:-2].split(b"\n\n") if b[:6] == _DATA and b"\n" not in b]
            if len(payloads) != data.count(b"\n\n"):
                return None
        objs: list[Any] = []
        for payload in payloads:
            if payload == _DONE_DATA:
                objs.append(_DONE_MARK)
                continue
            try:
                objs.append(orjson.loads(payload))
            except orjson.JSONDecodeError:
                return None
        return self._pass_on(data, payloads, objs)

    def _pass_on(self, data: bytes, payloads: list[bytes], objs: list[Any]) -> tuple[bytes, bool]:
        """`_plain` once every event parsed: observe each; the chunk as it came unless one is dropped
        or re-encoded."""
        content = False
        kept: list[bytes] | None = None
        for i, obj in enumerate(objs):
            if obj is _DONE_MARK:
                self.done = True
                action = _PASS
            else:
                action, got = self._observe(obj)
                content = content or got
            if action == _PASS:
                if kept is not None:
                    kept.append(b"data: " + payloads[i] + b"\n\n")
                continue
            if kept is None:
                kept = [b"data: " + p + b"\n\n" for p in payloads[:i]]
            if action == _REWRITE:
                kept.append(b"data: " + _dumps(obj) + b"\n\n")
        return (data, content) if kept is None else (b"".join(kept), content)

    def _observe(self, obj: Any) -> tuple[int, bool]:
        """Learn from one parsed event: (_PASS, _DROP or _REWRITE it, it carried answer content).
        _REWRITE: `obj` was changed (its `kv_transfer_params` removed) and goes on re-encoded."""
        if not isinstance(obj, dict):
            return _PASS, False
        action = _PASS
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message") if isinstance(err, Mapping) else err
            self.error = str(msg)
        if obj.get(_KV_FIELD) is not None:  # null on every chunk but D's final one in bidir mode
            self.kv_params = kv_params_from_body(obj) or self.kv_params
            del obj[_KV_FIELD]
            action = _REWRITE
        usage = obj.get("usage")
        if usage is not None:
            parsed = Usage.parse(usage)
            if parsed is not None:
                self.usage = parsed
                if self._strip_usage and obj.get("choices") == []:
                    return _DROP, False
        text = _choice_text(_first_choice(obj.get("choices")))
        if text:
            self._parts.append(text)
            self.chunks += 1
            return action, True
        return action, False

    def _events(self, events: list[SSEEvent], raw: bytes) -> tuple[bytes, bool]:
        """Observe each event; pass the worker's bytes on unchanged unless an event is dropped."""
        content = False
        changed = False
        kept: list[SSEEvent] = []
        for event in events:
            if event.data == DONE:
                self.done = True
                kept.append(event)
                continue
            obj = _loads(event.data)
            action, got = self._observe(obj)
            content = content or got
            if action == _PASS:
                kept.append(event)
                continue
            changed = True
            if action == _REWRITE:
                kept.append(dataclasses.replace(event, data=_dumps(obj).decode("utf-8")))
        if not changed:
            return raw, content
        return b"".join(encode_event(e) for e in kept), content
