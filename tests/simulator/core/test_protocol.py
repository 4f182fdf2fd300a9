"""vLLM request bodies parsed and validated into frozen values: defaults, errors, KV params, /tokenize."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.core.api_error import ApiError
from simulator.core.protocol import (
    ServingLimits,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from simulator.core.tokenizer import ChatMessage, Llama3Tokenizer

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LIMITS = ServingLimits(model=MODEL, max_model_len=4096)


def test_completion_defaults_and_ids(tok: Llama3Tokenizer) -> None:
    req = parse_completion({"prompt": "hello world"}, tok, LIMITS)
    assert req.max_tokens == 16
    assert req.prompt_ids == (128000, 15339, 1917)
    assert req.model == MODEL
    assert req.kv_transfer is None
    ids = parse_completion({"prompt": [1, 2, 3], "max_tokens": 5, "unknown_field": 1}, tok, LIMITS)
    assert ids.prompt_ids == (1, 2, 3)


def test_chat_max_completion_tokens_wins(tok: Llama3Tokenizer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "max_completion_tokens": 7}
    assert parse_chat(body, tok, LIMITS).max_tokens == 7
    unlimited = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, tok, LIMITS)
    assert unlimited.max_tokens == LIMITS.max_model_len - len(unlimited.prompt_ids)


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (
            {"prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "Stream options can only be defined",
        ),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens must be less than or equal"),
        ({"prompt": "x", "min_tokens": -1}, 400, "min_tokens must be greater than or equal to 0"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
        ({"prompt": "x", "max_tokens": 10**12}, 400, "is too large"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "valid integer"),
        ({"prompt": "x", "max_tokens": 1.5}, 400, "fractional"),
        ({"prompt": "x", "stream": "yes"}, 400, "valid boolean"),
        ({"prompt": "x", "model": "gpt-9"}, 404, "does not exist"),
        ({"prompt": [10**9]}, 400, "out of vocabulary"),
        ({"prompt": []}, 400, "Prompt cannot be empty"),
        ({"prompt": "", "add_special_tokens": False}, 400, "Prompt cannot be empty"),
        ({"prompt": {"a": 1}}, 400, "prompt must be"),
        ({}, 400, "Field required"),
        ([1, 2], 400, "JSON object"),
        ({"prompt": "x", "kv_transfer_params": [1]}, 400, "kv_transfer_params"),
        ({"prompt": "x", "seed": 2**70}, 400, "seed"),
        ({"prompt": "x", "n": 3}, 400, "n=1"),
    ],
)
def test_completion_validation_errors(tok: Llama3Tokenizer, body: Any, status: int, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_completion(body, tok, LIMITS)
    assert info.value.status == status
    assert fragment in info.value.message
    error = info.value.body()["error"]
    assert error["code"] == status
    assert error["type"] in {"BadRequestError", "NotFoundError"}


def test_prompt_longer_than_context_is_rejected(tok: Llama3Tokenizer) -> None:
    with pytest.raises(ApiError, match="maximum context length"):
        parse_completion({"prompt": [1] * 5000, "max_tokens": 1}, tok, LIMITS)


@pytest.mark.parametrize(
    "messages",
    [[], "hi", [{"content": "x"}], [{"role": "user", "content": 5}], [{"role": "user", "content": [1]}]],
)
def test_chat_validation_errors(tok: Llama3Tokenizer, messages: Any) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": messages}, tok, LIMITS)
    assert info.value.status == 400


def test_chat_text_parts_are_joined(tok: Llama3Tokenizer) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    joined = parse_chat({"messages": [{"role": "user", "content": parts}]}, tok, LIMITS)
    plain = parse_chat({"messages": [{"role": "user", "content": "a\nb"}]}, tok, LIMITS)
    assert joined.prompt_ids == plain.prompt_ids


def test_kv_transfer_params_are_parsed(tok: Llama3Tokenizer) -> None:
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "P0-engine",
        "remote_request_id": "cmpl-x-0-abcdefgh",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_num_tokens": 40,
        "remote_prefill_cached_tokens": 16,
    }
    kv = parse_completion({"prompt": "x", "kv_transfer_params": params}, tok, LIMITS).kv_transfer
    assert kv is not None
    assert kv.do_remote_prefill
    assert kv.remote_block_ids == ((1, 2, 3),)
    assert kv.remote_prefill_cached_tokens == 16
    assert kv.remote_blocks_expiry_time is None
    # A decode worker's bidirectional params carry the expiry of its pinned blocks.
    d_params = params | {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_blocks_expiry_time": 812.5,
    }
    kv = parse_completion({"prompt": "x", "kv_transfer_params": d_params}, tok, LIMITS).kv_transfer
    assert kv is not None
    assert kv.remote_blocks_expiry_time == 812.5
    bad = params | {"remote_blocks_expiry_time": "soon"}
    with pytest.raises(ApiError, match="kv_transfer_params"):
        parse_completion({"prompt": "x", "kv_transfer_params": bad}, tok, LIMITS)


def test_tokenize_and_detokenize(tok: Llama3Tokenizer) -> None:
    ids, strs = parse_tokenize({"prompt": "hello world", "add_special_tokens": False}, tok, LIMITS)
    assert ids == [15339, 1917]
    assert not strs
    chat_ids, _ = parse_tokenize({"messages": [{"role": "user", "content": "hi"}]}, tok, LIMITS)
    assert chat_ids == tok.encode_chat([ChatMessage("user", "hi")])
    assert parse_detokenize({"tokens": [15339, 1917]}, tok, LIMITS) == [15339, 1917]
    with pytest.raises(ApiError):
        parse_detokenize({"tokens": ["a"]}, tok, LIMITS)
    with pytest.raises(ApiError):
        parse_tokenize({"prompt": 5}, tok, LIMITS)
