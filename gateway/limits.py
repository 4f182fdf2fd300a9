"""Bounds on what one client request can make the gateway hold or a worker compute. Pure.

Rule 1 (identifiers): every identifier a client supplies (`X-Session-ID`, `session_id`,
`conversation_id`, `request_id`, `X-PPD-Workload`) is 1 to `limits.max_id_length` printable ASCII
characters, no spaces or controls: safe in a header, a log line and a request-log field, and the memory
the session store spends on ids is bounded by configuration whatever clients send.
Rule 2 (model length): what the served model's length (`max_model_len`, learnt from the workers'
`/v1/models`) makes impossible is refused before any worker is called, so P never prefills a request D
will refuse. The prompt is counted as a *lower bound* of the worker's own count (chat-template, system
preamble and special tokens the gateway cannot see are left out; text holding a special-token marker
`<|` counts nothing), so the gateway never refuses what a worker would serve.
Rule 3 (cost): the exact count runs only when a cheap upper bound (the text's UTF-8 bytes: a byte-level
BPE token covers at least one byte; O(1) per ASCII string) says the request may not fit, so ordinary
requests pay nothing for it (with a 128k-token model, only prompts over about 128 KB are counted).
Rule 4 (nesting): every JSON body the gateway reads (completions, `/tokenize`, `/detokenize`, admin) is
at most `limits.max_json_depth` levels deep (the body object is level 1), checked on the bytes right
after parsing, before anything walks the value: the content key, the relay and the upstream client
recurse per level (Python's own limit is 1000 frames; orjson writes at most 254 levels), so a deeper
body is a 400, never a RecursionError. The check pairs the brackets outside strings (C-speed
`bytes` operations, one pass per level; a body with fewer brackets than the limit is not scanned).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import BadRequestError, JsonTooDeepError
from gateway.psi import message_text, request_limit

__all__ = [
    "LimitSettings",
    "check_client_id",
    "check_json_depth",
    "check_model_length",
    "is_client_id",
    "json_depth_exceeds",
    "prompt_token_floor",
]

_CLIENT_ID = re.compile(r"[\x21-\x7e]+")
# Tokens per message the gateway can be sure of: Llama-3's <|start_header_id|> role <|end_header_id|>
# <|eot_id|> (ChatML's <|im_start|> role \n <|im_end|> likewise), never merged with the content.
_FLOOR_TOKENS_PER_MESSAGE = 4
_SPECIAL_MARKER = "<|"
# Every byte but the four brackets (deleted), and the brackets as one kind of pair.
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_ONE_KIND = bytes.maketrans(b"{}", b"[]")


@dataclass(frozen=True, slots=True)
class LimitSettings:
    # Chat messages per request; more -> 400.
    max_messages: int = 2048
    # Longest client-supplied identifier (session ids, request_id, X-PPD-Workload); longer -> 400.
    max_id_length: int = 256
    # A connection that has not sent a whole request head this long after it opened (or after its
    # previous response) is closed; idle keep-alive connections close after the same time.
    header_timeout_s: float = 75.0
    # Deepest nesting of arrays and objects in a JSON body (the body object is level 1); deeper -> 400.
    max_json_depth: int = 128


class _Counter(Protocol):
    def count(self, text: str) -> int: ...


def is_client_id(value: object, *, max_length: int) -> bool:
    """Rule 1's identifier: 1 to `max_length` printable ASCII characters, no spaces or controls."""
    return isinstance(value, str) and len(value) <= max_length and _CLIENT_ID.fullmatch(value) is not None


def check_client_id(value: object, name: str, *, max_length: int) -> str:
    """The identifier itself, or BadRequestError naming `name` (the field or header)."""
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"'{name}' must be a non-empty string", param=name)
    if len(value) > max_length:
        raise BadRequestError(f"'{name}' is longer than {max_length} characters", param=name)
    if not is_client_id(value, max_length=max_length):
        raise BadRequestError(
            f"'{name}' may hold only printable ASCII characters (no spaces or control characters)",
            param=name,
        )
    return value


def json_depth_exceeds(raw: bytes, max_depth: int) -> bool:
    """Whether the valid JSON `raw` nests arrays and objects more than `max_depth` levels deep."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    # Outside strings only: escaped backslashes, then escaped quotes go; every other run between quotes
    # is a string. (Valid JSON has no backslash outside a string.)
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(unescaped.split(b'"')[::2]).translate(_ONE_KIND, _NOT_BRACKETS)
    # Each pass deletes the innermost pairs, one level of nesting: `depth` passes empty it.
    for _ in range(max_depth):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def check_json_depth(raw: bytes, max_depth: int) -> None:
    """JsonTooDeepError (a 400) when the valid JSON `raw` is nested past `max_depth` (rule 4)."""
    if json_depth_exceeds(raw, max_depth):
        raise JsonTooDeepError(max_depth)


def check_model_length(
    body: Mapping[str, Any],
    messages: Sequence[Mapping[str, Any]],
    *,
    max_model_len: int | None,
    counter: _Counter | None,
) -> None:
    """BadRequestError when the request cannot fit in `max_model_len` (None: not known, no check)."""
    if max_model_len is None:
        return
    requested = request_limit(body)
    if requested is not None and requested >= max_model_len:
        raise BadRequestError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum "
            f"context length is {max_model_len} tokens.",
            param="max_tokens",
        )
    room = max_model_len - requested if requested is not None else max_model_len - 1
    if _prompt_token_ceiling(body, messages) <= room:
        return
    floor = prompt_token_floor(body, messages, counter)
    if floor is None or floor <= room:
        return
    if requested is not None:
        raise BadRequestError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum "
            f"context length is {max_model_len} tokens and your request has at least {floor} input "
            f"tokens ({requested} > {max_model_len} - {floor}).",
            param="max_tokens",
        )
    raise BadRequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, your request has at "
        f"least {floor} input tokens. Please reduce the length of the input.",
        param="messages" if messages else "prompt",
    )


def prompt_token_floor(
    body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], counter: _Counter | None
) -> int | None:
    """At most the worker's prompt tokens; None when the gateway cannot tell (no tokenizer)."""
    if messages:
        if counter is None:
            return None
        total = 0
        for message in messages:
            text = message_text(message)
            total += _FLOOR_TOKENS_PER_MESSAGE
            if _SPECIAL_MARKER not in text:
                # Templates trim the content; a token never spans the special token around it.
                total += counter.count(text.strip())
        return total
    prompt = _single_prompt(body.get("prompt"))
    if isinstance(prompt, list):
        return len(prompt)  # token ids: exact for any model
    if counter is None or _SPECIAL_MARKER in prompt:
        return None
    return counter.count(prompt)


def _prompt_token_ceiling(body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]) -> int:
    """At least `prompt_token_floor`, without tokenizing."""
    if messages:
        return sum(_message_bytes(m) + _FLOOR_TOKENS_PER_MESSAGE for m in messages)
    prompt = _single_prompt(body.get("prompt"))
    return len(prompt) if isinstance(prompt, list) else _utf8_length(prompt)


def _message_bytes(message: Mapping[str, Any]) -> int:
    content = message.get("content")
    if isinstance(content, str):
        return _utf8_length(content)
    if isinstance(content, list):
        return sum(
            _utf8_length(p["text"])
            for p in content
            if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return 0


def _utf8_length(text: str) -> int:
    # The parser refused lone surrogates, so every string encodes.
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _single_prompt(prompt: Any) -> str | list[Any]:
    """The one prompt of a completions request (validation already refused batches)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str | list) else ""
