"""vLLM response bodies and SSE chunks (pure rendering)."""

from __future__ import annotations

import pytest

from simulator.core.protocol import ServingLimits, parse_chat, parse_completion
from simulator.core.responses import ResponseRenderer, Usage, sse_event
from simulator.core.tokenizer import Llama3Tokenizer
from simulator.core.worker_settings import DEFAULT_MODEL

LIMITS = ServingLimits(model=DEFAULT_MODEL, max_model_len=4096)


def test_renderer_chunks(tok: Llama3Tokenizer) -> None:
    req = parse_chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        tok,
        LIMITS,
    )
    r = ResponseRenderer(req, response_id="chatcmpl-abc", created=1)
    first = r.role_chunk(None)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    mid = r.delta_chunk(text=" x", token_ids=[1], finish_reason=None, usage=None)
    assert "kv_transfer_params" not in mid
    last = r.delta_chunk(text="", token_ids=[2], finish_reason="length", usage=None)
    assert last["kv_transfer_params"] is None
    usage = r.usage_chunk(Usage(prompt_tokens=5, completion_tokens=2))
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_fast_delta_event_matches_the_slow_path(tok: Llama3Tokenizer, kind: str) -> None:
    if kind == "chat":
        req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True}, tok, LIMITS)
    else:
        req = parse_completion({"prompt": "hi", "stream": True}, tok, LIMITS)
    r = ResponseRenderer(req, response_id="x-1", created=5)
    for text in (" word", 'quote " and \\ back', "caf\u00e9 \u2603", ""):
        slow = sse_event(r.delta_chunk(text=text, token_ids=[1], finish_reason=None, usage=None))
        assert r.delta_event(text) == slow
    assert tok.token_text(tok.word_ids[0]) == tok.decode([tok.word_ids[0]])
