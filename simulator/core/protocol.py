"""Parse and validate vLLM 0.33 OpenAI-compatible request bodies into frozen values (pure, no I/O).

Invariants:
- Rule 1: a body either becomes a `GenerationRequest` or raises `ApiError` with vLLM's status and message;
  no other exception escapes (the server relies on this so bad input never kills a worker).
- Rule 2: unknown fields are accepted and ignored, as vLLM does (it logs them).
- Rule 3: validation order follows vLLM: field types, `stream_options` without `stream`, model name,
  tokenization and context length, then sampling parameters (`min_tokens <= max_tokens`).
- Rule 4: the work a body causes is linear in its size and comes in steps. `*_steps` functions are
  generators that yield between slices of work (about `SLICE_CHARS` characters of text, `SLICE_MESSAGES`
  messages or `SLICE_ITEMS` token ids) and return the parsed value; the server runs them on its event
  loop and lets other requests in at each yield, and `parse_*` runs them to the end at once. A chat
  request with more messages than can fit in the context window (each message renders to at least 5
  tokens) is refused before any message is read or tokenized.

Why one module (about 570 lines): the completion, chat, tokenize and detokenize bodies share one set of
field checkers, the sliced-step machinery of Rule 4 and the request value they build; the tokenizer
and the response rendering are apart (``tokenizer``, ``responses``).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

from simulator.core.api_error import ApiError
from simulator.core.tokenizer import ChatMessage, Llama3Tokenizer, render_chat_parts

__all__ = [
    "SLICE_ITEMS",
    "SLICE_MESSAGES",
    "GenerationRequest",
    "KvTransferRequest",
    "ServingLimits",
    "Steps",
    "chat_messages",
    "chat_steps",
    "completion_steps",
    "detokenize_steps",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_tokenize",
    "run_steps",
    "tokenize_steps",
]

Kind = Literal["completion", "chat"]
_MAX_SEED = 2**63 - 1
SLICE_ITEMS = 1 << 14  # token ids checked between two yields (~1 ms)
SLICE_MESSAGES = 1 << 10  # messages (or text parts) validated or rendered between two yields (~2 ms)

T = TypeVar("T")
Steps = Generator[None, None, T]  # yields between slices of work, returns the parsed value


def run_steps(steps: Steps[T]) -> T:
    """Run a `*_steps` generator to its end (no yielding to anyone)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            value: T = done.value
            return value


@dataclass(frozen=True, slots=True)
class ServingLimits:
    """What the served model accepts (vLLM's `--served-model-name`, `--max-model-len`)."""

    model: str
    max_model_len: int


@dataclass(frozen=True, slots=True)
class KvTransferRequest:
    """The `kv_transfer_params` a request arrived with (NixlConnector pull mode)."""

    do_remote_decode: bool
    do_remote_prefill: bool
    remote_engine_id: str | None
    remote_request_id: str | None
    remote_block_ids: tuple[tuple[int, ...], ...]
    remote_host: str | None
    remote_port: int | None
    remote_num_tokens: int | None
    remote_prefill_cached_tokens: int
    remote_blocks_expiry_time: float | None = None  # a decode worker's bidirectional params only


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated `/v1/completions` or `/v1/chat/completions` request."""

    kind: Kind
    model: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage_stats: bool
    seed: int | None
    return_token_ids: bool
    echo: bool
    request_id: str | None
    kv_transfer: KvTransferRequest | None
    max_tokens_given: bool = True  # False: a chat request without max_tokens / max_completion_tokens


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _opt_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{key}: Input should be a valid boolean", key)
    return value


def _opt_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{key}: Input should be a valid integer", key)
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise _bad(f"{key}: Input should be a valid integer, got a number with a fractional part", key)
        value = int(value)
    return value


def _opt_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(f"{key}: Input should be a valid string", key)
    return value


def _check_number(body: Mapping[str, Any], key: str) -> None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise _bad(f"{key}: Input should be a valid number", key)


def _kv_transfer(body: Mapping[str, Any]) -> KvTransferRequest | None:
    raw = body.get("kv_transfer_params")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise _bad("kv_transfer_params: Input should be a valid dictionary", "kv_transfer_params")
    blocks: list[tuple[int, ...]] = []
    raw_blocks = raw.get("remote_block_ids")
    if raw_blocks is not None:
        if not isinstance(raw_blocks, list):
            raise _bad("kv_transfer_params.remote_block_ids must be a list", "kv_transfer_params")
        for group in raw_blocks:
            if isinstance(group, int) and not isinstance(group, bool):
                blocks.append((group,))  # older single-group form: a flat list of ints
            elif isinstance(group, list) and all(
                isinstance(b, int) and not isinstance(b, bool) for b in group
            ):
                blocks.append(tuple(group))
            else:
                raise _bad(
                    "kv_transfer_params.remote_block_ids must hold lists of ints", "kv_transfer_params"
                )
    try:
        port = _opt_int(raw, "remote_port")
        num_tokens = _opt_int(raw, "remote_num_tokens")
        cached = _opt_int(raw, "remote_prefill_cached_tokens")
        engine = raw.get("remote_engine_id")
        remote_request = raw.get("remote_request_id")
        host = raw.get("remote_host")
        _check_number(raw, "remote_blocks_expiry_time")
    except ApiError as exc:
        raise _bad(f"kv_transfer_params.{exc.param}: invalid value", "kv_transfer_params") from exc
    return KvTransferRequest(
        do_remote_decode=bool(raw.get("do_remote_decode", False)),
        do_remote_prefill=bool(raw.get("do_remote_prefill", False)),
        remote_engine_id=engine if isinstance(engine, str) else None,
        remote_request_id=remote_request if isinstance(remote_request, str) else None,
        remote_block_ids=tuple(blocks),
        remote_host=host if isinstance(host, str) else None,
        remote_port=port,
        remote_num_tokens=num_tokens,
        remote_prefill_cached_tokens=cached or 0,
        remote_blocks_expiry_time=_finite(raw.get("remote_blocks_expiry_time")),
    )


def _finite(value: object) -> float | None:
    """A number already type-checked by `_check_number` (or None); NaN and infinities read as None."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return None
    return float(value)


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    stream = _opt_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not isinstance(options, Mapping):
        raise _bad("stream_options: Input should be a valid dictionary", "stream_options")
    if not stream:
        raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    include = _opt_bool(options, "include_usage", False)
    continuous = _opt_bool(options, "continuous_usage_stats", False)
    return stream, include, continuous


def _model(body: Mapping[str, Any], limits: ServingLimits) -> str:
    model = _opt_str(body, "model")
    if model is None:
        return limits.model
    if model != limits.model:
        raise ApiError(
            404, f"The model `{model}` does not exist. Valid aliases: {limits.model}.", param="model"
        )
    return model


def _check_common_fields(body: Mapping[str, Any]) -> None:
    for key in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        _check_number(body, key)
    _opt_int(body, "top_k")
    n = _opt_int(body, "n")
    if n is not None and n != 1:
        raise _bad("The simulator serves n=1 only.", "n")


def _too_long(limits: ServingLimits, tokens: int, *, floor_of_messages: int | None = None) -> ApiError:
    """vLLM's context-length error; with `floor_of_messages`, `tokens` is a lower bound from the count."""
    has = f"{tokens} input tokens"
    if floor_of_messages is not None:
        has = f"at least {has} ({floor_of_messages} messages)"
    return _bad(
        f"This model's maximum context length is {limits.max_model_len} tokens. However, your request "
        f"has {has}. Please reduce the length of the input messages.",
        "input_tokens",
    )


def _token_limits(
    body: Mapping[str, Any],
    *,
    requested: int | None,
    prompt_len: int,
    limits: ServingLimits,
) -> tuple[int, int]:
    if prompt_len > limits.max_model_len or (requested is None and prompt_len >= limits.max_model_len):
        raise _too_long(limits, prompt_len)
    if requested is None:
        max_tokens = limits.max_model_len - prompt_len
    else:
        if requested < 1:
            raise _bad(f"max_tokens must be at least 1, got {requested}.", "max_tokens")
        if requested > limits.max_model_len - prompt_len:
            raise _bad(
                f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum "
                f"context length is {limits.max_model_len} tokens and your request has {prompt_len} input "
                f"tokens ({requested} > {limits.max_model_len} - {prompt_len}).",
                "max_tokens",
            )
        max_tokens = requested
    min_tokens = _opt_int(body, "min_tokens") or 0
    if min_tokens < 0:
        raise _bad(f"min_tokens must be greater than or equal to 0, got {min_tokens}.", "min_tokens")
    if min_tokens > max_tokens:
        raise _bad(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            "min_tokens",
        )
    return max_tokens, min_tokens


def _seed(body: Mapping[str, Any]) -> int | None:
    seed = _opt_int(body, "seed")
    if seed is not None and not -_MAX_SEED - 1 <= seed <= _MAX_SEED:
        raise _bad("seed: Input should be a 64-bit integer", "seed")
    return seed


def _request_id(body: Mapping[str, Any]) -> str | None:
    return _opt_str(body, "request_id")


def _encode_steps(tokenizer: Llama3Tokenizer, text: str, *, add_special_tokens: bool) -> Steps[list[int]]:
    ids: list[int] = []
    for piece in tokenizer.encode_pieces(text, add_special_tokens=add_special_tokens):
        ids += piece
        yield
    return ids


def _render_steps(messages: list[ChatMessage], *, add_generation_prompt: bool) -> Steps[str]:
    parts: list[str] = []
    for i, part in enumerate(render_chat_parts(messages, add_generation_prompt=add_generation_prompt)):
        parts.append(part)
        if i % SLICE_MESSAGES == SLICE_MESSAGES - 1:
            yield
    return "".join(parts)


def _all_ints(items: list[Any]) -> Steps[bool]:
    for start in range(0, len(items), SLICE_ITEMS):
        if not all(
            isinstance(t, int) and not isinstance(t, bool) for t in items[start : start + SLICE_ITEMS]
        ):
            return False
        yield
    return True


def _check_vocabulary(ids: list[int], tokenizer: Llama3Tokenizer, param: str) -> None:
    if ids and not (tokenizer.is_known(min(ids)) and tokenizer.is_known(max(ids))):
        bad = next(t for t in ids if not tokenizer.is_known(t))
        raise _bad(f"Token id {bad} is out of vocabulary", param)


def _prompt_ids_steps(
    raw: object, tokenizer: Llama3Tokenizer, *, add_special_tokens: bool
) -> Steps[list[int]]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]  # a batch of one prompt
    if isinstance(raw, str):
        return (yield from _encode_steps(tokenizer, raw, add_special_tokens=add_special_tokens))
    if isinstance(raw, list) and not raw:
        raise _bad("Prompt cannot be empty", "prompt")
    if isinstance(raw, list) and (yield from _all_ints(raw)):
        ids: list[int] = raw
        _check_vocabulary(ids, tokenizer, "prompt")
        return ids
    if isinstance(raw, list) and len(raw) > 1:
        raise _bad("The simulator serves one prompt per request.", "prompt")
    raise _bad("prompt must be a string, a list of token ids, or a list of one of those", "prompt")


class _Options(NamedTuple):
    """The fields both generation endpoints read the same way."""

    stream: bool
    include_usage: bool
    continuous: bool
    ignore_eos: bool
    return_token_ids: bool
    seed: int | None
    request_id: str | None
    kv: KvTransferRequest | None
    model: str


def _options(body: Mapping[str, Any], limits: ServingLimits) -> _Options:
    stream, include_usage, continuous = _stream_flags(body)
    _check_common_fields(body)
    return _Options(
        stream,
        include_usage,
        continuous,
        ignore_eos=_opt_bool(body, "ignore_eos", False),
        return_token_ids=_opt_bool(body, "return_token_ids", False),
        seed=_seed(body),
        request_id=_request_id(body),
        kv=_kv_transfer(body),
        model=_model(body, limits),
    )


def _generation_request(
    kind: Kind,
    body: Mapping[str, Any],
    o: _Options,
    *,
    prompt: list[int],
    requested: int | None,
    echo: bool,
    limits: ServingLimits,
    max_tokens_given: bool,
) -> GenerationRequest:
    max_tokens, min_tokens = _token_limits(body, requested=requested, prompt_len=len(prompt), limits=limits)
    return GenerationRequest(
        kind=kind,
        model=o.model,
        prompt_ids=tuple(prompt),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=o.ignore_eos,
        stream=o.stream,
        include_usage=o.include_usage,
        continuous_usage_stats=o.continuous,
        seed=o.seed,
        return_token_ids=o.return_token_ids,
        echo=echo,
        request_id=o.request_id,
        kv_transfer=o.kv,
        max_tokens_given=max_tokens_given,
    )


def parse_completion(body: object, tokenizer: Llama3Tokenizer, limits: ServingLimits) -> GenerationRequest:
    """Validate a `/v1/completions` body."""
    return run_steps(completion_steps(body, tokenizer, limits))


def completion_steps(
    body: object, tokenizer: Llama3Tokenizer, limits: ServingLimits
) -> Steps[GenerationRequest]:
    """`parse_completion` in steps (Rule 4)."""
    if not isinstance(body, Mapping):
        raise _bad("Request body must be a JSON object")
    options = _options(body, limits)
    requested = _opt_int(body, "max_tokens")
    if requested is None and "max_tokens" not in body:
        requested = 16
    echo = _opt_bool(body, "echo", False)
    add_special = _opt_bool(body, "add_special_tokens", True)
    if "prompt" not in body:
        raise _bad("prompt: Field required", "prompt")
    prompt = yield from _prompt_ids_steps(body["prompt"], tokenizer, add_special_tokens=add_special)
    if not prompt:
        raise _bad("Prompt cannot be empty", "prompt")
    return _generation_request(
        "completion",
        body,
        options,
        prompt=prompt,
        requested=requested,
        echo=echo,
        limits=limits,
        max_tokens_given=True,
    )


def chat_messages(raw: object) -> list[ChatMessage]:
    """Validate an OpenAI `messages` array of text messages."""
    return run_steps(_chat_messages_steps(raw, None, None))


def _chat_messages_steps(
    raw: object, tokenizer: Llama3Tokenizer | None, limits: ServingLimits | None
) -> Steps[list[ChatMessage]]:
    """Validate `messages`; with `limits`, first refuse more messages than the context window can hold."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages: must be a non-empty list", "messages")
    if tokenizer is not None and limits is not None:
        floor = tokenizer.min_chat_tokens(len(raw))
        if floor > limits.max_model_len:
            raise _too_long(limits, floor, floor_of_messages=len(raw))
    out: list[ChatMessage] = []
    for i, item in enumerate(raw):
        if i % SLICE_MESSAGES == SLICE_MESSAGES - 1:
            yield
        if not isinstance(item, Mapping):
            raise _bad(f"messages[{i}]: Input should be a valid dictionary", "messages")
        role = item.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role: Field required", "messages")
        content = item.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):
            content = yield from _text_parts_steps(i, content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content: Input should be a valid string", "messages")
        out.append(ChatMessage(role=role, content=content))
    return out


def _text_parts_steps(i: int, parts: list[Any]) -> Steps[str]:
    """A content array of text parts, joined as vLLM joins them (one newline between parts)."""
    texts: list[str] = []
    for j, part in enumerate(parts):
        if j % SLICE_MESSAGES == SLICE_MESSAGES - 1:
            yield
        if not (isinstance(part, Mapping) and part.get("type") == "text"):
            raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"messages[{i}].content: text part without text", "messages")
        texts.append(text)
    return "\n".join(texts)


def parse_chat(body: object, tokenizer: Llama3Tokenizer, limits: ServingLimits) -> GenerationRequest:
    """Validate a `/v1/chat/completions` body (`max_completion_tokens` wins over `max_tokens`)."""
    return run_steps(chat_steps(body, tokenizer, limits))


def chat_steps(body: object, tokenizer: Llama3Tokenizer, limits: ServingLimits) -> Steps[GenerationRequest]:
    """`parse_chat` in steps (Rule 4)."""
    if not isinstance(body, Mapping):
        raise _bad("Request body must be a JSON object")
    options = _options(body, limits)
    requested = _opt_int(body, "max_completion_tokens")
    if requested is None:
        requested = _opt_int(body, "max_tokens")
    add_generation_prompt = _opt_bool(body, "add_generation_prompt", True)
    add_special = _opt_bool(body, "add_special_tokens", False)
    if "messages" not in body:
        raise _bad("messages: Field required", "messages")
    messages = yield from _chat_messages_steps(body["messages"], tokenizer, limits)
    rendered = yield from _render_steps(messages, add_generation_prompt=add_generation_prompt)
    prompt = yield from _encode_steps(tokenizer, rendered, add_special_tokens=add_special)
    return _generation_request(
        "chat",
        body,
        options,
        prompt=list(prompt),
        requested=requested,
        echo=False,
        limits=limits,
        max_tokens_given=requested is not None,
    )


def parse_tokenize(body: object, tokenizer: Llama3Tokenizer, limits: ServingLimits) -> tuple[list[int], bool]:
    """Validate a `/tokenize` body (completion or chat form); returns (ids, return_token_strs)."""
    return run_steps(tokenize_steps(body, tokenizer, limits))


def tokenize_steps(
    body: object, tokenizer: Llama3Tokenizer, limits: ServingLimits
) -> Steps[tuple[list[int], bool]]:
    """`parse_tokenize` in steps (Rule 4). Like vLLM's `/tokenize`, no context-length check: the reply
    carries `max_model_len` for the client to compare."""
    if not isinstance(body, Mapping):
        raise _bad("Request body must be a JSON object")
    _model(body, limits)
    strs = _opt_bool(body, "return_token_strs", False)
    if "messages" in body:
        add_generation_prompt = _opt_bool(body, "add_generation_prompt", True)
        add_special = _opt_bool(body, "add_special_tokens", False)
        messages = yield from _chat_messages_steps(body["messages"], None, None)
        rendered = yield from _render_steps(messages, add_generation_prompt=add_generation_prompt)
        ids = yield from _encode_steps(tokenizer, rendered, add_special_tokens=add_special)
        return ids, strs
    if "prompt" not in body:
        raise _bad("prompt: Field required", "prompt")
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise _bad("prompt: Input should be a valid string", "prompt")
    add_special = _opt_bool(body, "add_special_tokens", True)
    return (yield from _encode_steps(tokenizer, prompt, add_special_tokens=add_special)), strs


def parse_detokenize(body: object, tokenizer: Llama3Tokenizer, limits: ServingLimits) -> list[int]:
    """Validate a `/detokenize` body; returns the token ids."""
    return run_steps(detokenize_steps(body, tokenizer, limits))


def detokenize_steps(body: object, tokenizer: Llama3Tokenizer, limits: ServingLimits) -> Steps[list[int]]:
    """`parse_detokenize` in steps (Rule 4)."""
    if not isinstance(body, Mapping):
        raise _bad("Request body must be a JSON object")
    _model(body, limits)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not (yield from _all_ints(tokens)):
        raise _bad("tokens: Input should be a valid list of integers", "tokens")
    _check_vocabulary(tokens, tokenizer, "tokens")
    return tokens
