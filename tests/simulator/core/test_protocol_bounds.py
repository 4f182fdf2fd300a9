"""The work one request can cause is bounded and comes in slices (pure parts): tokenization is linear and
exact in pieces, a chat history that cannot fit is refused on its message count, and the parsers yield
between slices."""

from __future__ import annotations

import json
from typing import Any

import pytest
import quicktok
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.core.api_error import ApiError
from simulator.core.protocol import (
    SLICE_ITEMS,
    ServingLimits,
    Steps,
    chat_steps,
    completion_steps,
    detokenize_steps,
    parse_chat,
    parse_completion,
    parse_tokenize,
    run_steps,
    tokenize_steps,
)
from simulator.core.responses import tokenize_body_steps
from simulator.core.tokenizer import SLICE_CHARS, ChatMessage, Llama3Tokenizer

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LIMITS = ServingLimits(model=MODEL, max_model_len=4096)
TOK = Llama3Tokenizer()  # read-only after construction; shared by the property tests below
REFERENCE = quicktok.get_encoding("llama3")  # its encode_with_special is exact (and quadratic)

# Text that exercises every rule of the Llama-3 split pattern and the cut points: specials (and near
# misses), runs of spaces and newlines, digits, contractions, punctuation, non-ASCII letters and spaces.
_ATOMS = [
    "a", "Hello", " world", " ", "  ", "\n", "\r\n", "\t", "\x0b", "\x85", "\u00a0", "\u3000", "1", "234",
    "'s", "'LL", "!", "?.", "~", "é", "中文", "😀", "<|", "|>", "<|eot_id", "<|eot_id|>",
    "<|start_header_id|>", "<|begin_of_text|>", "<|reserved_special_token_7|>",
]  # fmt: skip
_text = st.lists(st.sampled_from(_ATOMS), max_size=60).map("".join)


@settings(max_examples=400, deadline=None)
@given(_text, st.integers(1, 9), st.booleans())
def test_pieces_encode_exactly_the_whole_text(text: str, slice_chars: int, bos: bool) -> None:
    pieces = list(TOK.encode_pieces(text, add_special_tokens=bos, slice_chars=slice_chars))
    expected: list[int] = REFERENCE.encode_with_special(text)
    if bos and (not expected or expected[0] != TOK.bos_id):
        expected = [TOK.bos_id, *expected]
    assert [i for piece in pieces for i in piece] == expected
    assert all(pieces)
    assert TOK.encode(text, add_special_tokens=bos) == expected


def test_a_long_text_comes_in_slices() -> None:
    text = "word " * (4 * SLICE_CHARS // 5)  # 4 slices' worth, cut before spaces
    pieces = list(TOK.encode_pieces(text, add_special_tokens=False))
    assert len(pieces) >= 4
    assert [i for piece in pieces for i in piece] == REFERENCE.encode_ordinary(text)


_messages = st.lists(
    st.builds(ChatMessage, st.sampled_from(["system", "user", "assistant", "x", "<|eot_id|>"]), _text),
    min_size=1,
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(_messages, st.booleans())
def test_min_chat_tokens_is_a_lower_bound(messages: list[ChatMessage], generation_prompt: bool) -> None:
    tokens = TOK.encode_chat(messages, add_generation_prompt=generation_prompt)
    assert len(tokens) >= TOK.min_chat_tokens(len(messages))


def test_min_chat_tokens_is_reached() -> None:
    empty = [ChatMessage("system", ""), ChatMessage("a", ""), ChatMessage("b", "")]
    assert len(TOK.encode_chat(empty, add_generation_prompt=False)) == TOK.min_chat_tokens(3)


def _messages_floor_over(limit: int) -> int:
    """The fewest messages whose rendering cannot fit in `limit` tokens."""
    n = 1
    while TOK.min_chat_tokens(n) <= limit:
        n += 1
    return n


def test_more_messages_than_fit_are_refused_before_they_are_read() -> None:
    n = _messages_floor_over(LIMITS.max_model_len)
    # Not even dictionaries: refused on the count alone, with vLLM's context-length error.
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": [None] * n}, TOK, LIMITS)
    error = info.value.body()["error"]
    assert (error["code"], error["type"], error["param"]) == (400, "BadRequestError", "input_tokens")
    assert error["message"] == (
        f"This model's maximum context length is {LIMITS.max_model_len} tokens. However, your request has "
        f"at least {TOK.min_chat_tokens(n)} input tokens ({n} messages). Please reduce the length of the "
        "input messages."
    )
    # One message fewer may fit: it is read (and here refused for what it holds).
    with pytest.raises(ApiError, match=r"messages\[0\]: Input should be a valid dictionary"):
        parse_chat({"messages": [None] * (n - 1)}, TOK, LIMITS)
    # /tokenize has no context-length check (vLLM's neither): it counts what it is given.
    ids, _ = parse_tokenize({"messages": [{"role": "user", "content": ""}] * n}, TOK, LIMITS)
    assert len(ids) > LIMITS.max_model_len


def test_a_history_that_fits_by_count_is_tokenized_and_counted_exactly() -> None:
    messages = [{"role": "user", "content": "hello there"}] * (_messages_floor_over(LIMITS.max_model_len) - 1)
    ids, _ = parse_tokenize({"messages": messages}, TOK, LIMITS)
    assert len(ids) > LIMITS.max_model_len
    with pytest.raises(ApiError, match=f"your request has {len(ids)} input tokens"):
        parse_chat({"messages": messages, "max_tokens": 1}, TOK, LIMITS)


def test_token_id_prompts_are_checked_in_bulk() -> None:
    with pytest.raises(ApiError, match="Token id -1 is out of vocabulary"):
        parse_completion({"prompt": [1, -1, 2]}, TOK, LIMITS)
    with pytest.raises(ApiError, match="your request has 5000 input tokens"):
        parse_completion({"prompt": [1] * 5000, "max_tokens": 1}, TOK, LIMITS)
    with pytest.raises(ApiError, match="prompt must be"):
        parse_completion({"prompt": [True]}, TOK, LIMITS)


def _yields(steps: Steps[Any]) -> tuple[int, Any]:
    count = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return count, done.value
        count += 1


def test_parsers_yield_between_slices_and_agree_with_the_one_shot_parse() -> None:
    big = ServingLimits(model=MODEL, max_model_len=10**6)
    text = "word " * SLICE_CHARS  # ~5 slices of text
    count, req = _yields(completion_steps({"prompt": text, "max_tokens": 1}, TOK, big))
    assert count >= 4
    assert req == parse_completion({"prompt": text, "max_tokens": 1}, TOK, big)
    history = [{"role": "user", "content": "hi"}] * (2 * SLICE_ITEMS)
    count, req = _yields(chat_steps({"messages": history, "max_tokens": 1}, TOK, big))
    assert count >= 2
    assert req == run_steps(chat_steps({"messages": history, "max_tokens": 1}, TOK, big))
    count, (ids, _) = _yields(tokenize_steps({"prompt": text}, TOK, LIMITS))
    assert count >= 4
    assert ids == TOK.encode(text, add_special_tokens=True)
    count, ids = _yields(detokenize_steps({"tokens": [1] * (3 * SLICE_ITEMS)}, TOK, LIMITS))
    assert count >= 3
    assert ids == [1] * (3 * SLICE_ITEMS)


@pytest.mark.parametrize("with_strs", [False, True])
def test_the_tokenize_reply_is_serialized_in_slices(with_strs: bool) -> None:
    ids = [9906, 1917] * (SLICE_ITEMS + 1)
    token_str = TOK.token_str if with_strs else None
    count, text = _yields(tokenize_body_steps(ids, max_model_len=4096, token_str=token_str))
    assert count >= (4 if with_strs else 2)
    assert json.loads(text) == {
        "count": len(ids),
        "max_model_len": 4096,
        "tokens": ids,
        "token_strs": [TOK.token_str(i) for i in ids] if with_strs else None,
    }
    assert json.loads(run_steps(tokenize_body_steps([], max_model_len=1, token_str=token_str))) == {
        "count": 0,
        "max_model_len": 1,
        "tokens": [],
        "token_strs": [] if with_strs else None,
    }
