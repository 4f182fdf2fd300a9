"""The official `openai` client works against the gateway unchanged, streaming and not, multi-turn."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.gateway.conftest import MODEL, StackFactory


async def _converse(client: openai.AsyncOpenAI, *, stream: bool, turns: int) -> list[tuple[str, str, str]]:
    messages: list[Any] = []
    seen: list[tuple[str, str, str]] = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"turn {t} question"})
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=5, stream=stream
        )
        h = raw.headers
        seen.append((h["x-ppd-path"], h["x-ppd-reason"], h["x-ppd-turn"]))
        if stream:
            text = ""
            async for chunk in raw.parse():  # type: ignore[union-attr]
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
        else:
            completion = raw.parse()
            text = completion.choices[0].message.content or ""  # type: ignore[union-attr]
            assert completion.usage is not None  # type: ignore[union-attr]
        assert text
        messages.append({"role": "assistant", "content": text})
    return seen


async def test_openai_client_multi_turn(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="local")
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    try:
        for stream in (False, True):
            seen = await _converse(client, stream=stream, turns=3)
            assert seen == [
                ("pd", "turn_one", "1"),
                ("local", "mode_local", "2"),
                ("local", "mode_local", "3"),
            ]
        models = await client.models.list()
        assert models.data[0].id == MODEL
    finally:
        await client.close()


async def test_openai_client_sees_errors_as_exceptions(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="local")
    for d in ("D0", "D1"):
        stack.workers[d].knobs.break_after = 1
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5, stream=True
        )
        with pytest.raises(openai.APIError, match="mid-stream"):
            async for _ in stream:
                pass
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=[], max_tokens=5)
        assert info.value.status_code == 400
    finally:
        await client.close()
