"""The gateway app end to end against in-process fake workers: paths, sessions, provenance."""

from __future__ import annotations

from typing import Any

from tests.gateway.conftest import StackFactory


def _conversation(*turns: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": t} for t in turns]


async def test_turn_one_goes_pd_then_later_turns_local(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="local")
    messages = [{"role": "user", "content": "hi there"}]
    first = await stack.chat(messages)
    assert first.status == 200, first.body
    assert (first.path, first.reason, first.headers["X-PPD-Turn"]) == ("pd", "turn_one", "1")
    d = first.headers["X-PPD-Decode-Worker"]
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    second = await stack.chat(messages)
    assert (second.path, second.reason, second.headers["X-PPD-Turn"]) == ("local", "mode_local", "2")
    assert second.headers["X-PPD-Decode-Worker"] == d
    assert second.headers["X-PPD-Session-Id"] == first.headers["X-PPD-Session-Id"]


async def test_streaming_turns(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="local")
    messages = [{"role": "user", "content": "hi"}]
    first = await stack.chat(messages, stream=True)
    assert first.status == 200
    assert first.events[-1] == "[DONE]"
    # The gateway asked D for usage; the client did not, so it never sees the usage-only chunk.
    assert all(e == "[DONE]" or e["choices"] for e in first.events)
    d = stack.workers[first.headers["X-PPD-Decode-Worker"]]
    assert d.completions()[-1].body["stream_options"] == {"include_usage": True}
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and?"}]
    second = await stack.chat(messages, stream=True)
    assert (second.path, second.headers["X-PPD-Turn"]) == ("local", "2")
