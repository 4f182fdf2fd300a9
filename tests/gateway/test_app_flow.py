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


async def test_turn_is_remembered_before_the_client_sees_done(make_stack: StackFactory) -> None:
    """A client may send its next turn the instant it reads [DONE]; that turn must find this one."""
    import json

    from gateway.sessions import content_key
    from tests.gateway.conftest import MODEL

    stack = await make_stack(mode="local")
    for worker in stack.workers.values():
        worker.knobs.linger_after_done_s = 0.5  # the worker closes its response a little later
    messages = [{"role": "user", "content": "quick"}]
    body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": 3}
    text = ""
    async with stack.http.post(stack.url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                key = content_key(MODEL, [*messages, {"role": "assistant", "content": text}])
                assert await stack.deps.sessions.get(key) is not None
                break
            if line.startswith(b"data: "):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content", "")
    assert text


async def test_the_app_runs_on_the_upstream_and_decision_client_it_is_given() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.app import create_app
    from gateway.routing import Decision
    from gateway.settings import Settings
    from tests.gateway.fakes import FakeDecisions, FakeUpstream

    workers = [
        {"id": "P0", "role": "prefill", "url": "http://p0.test"},
        {"id": "D0", "role": "decode", "url": "http://d0.test"},
    ]
    settings = Settings.from_mapping(
        {"mode": "ppd", "workers": workers, "pool": {"health_interval_s": 3600.0}}
    )
    upstream = FakeUpstream()
    decisions = FakeDecisions(Decision("local", "table", table_version="v9"))
    app = create_app(settings, upstream=upstream, decisions=decisions)
    async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as http:
        body: dict[str, Any] = {"model": "m", "messages": _conversation("hi"), "max_tokens": 4}
        first = await http.post("/v1/chat/completions", json=body)
        assert (first.status, first.headers["X-PPD-Path"]) == (200, "pd")
        answer = (await first.json())["choices"][0]["message"]["content"]
        body["messages"] += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
        second = await http.post("/v1/chat/completions", json=body)
        assert (second.headers["X-PPD-Reason"], second.headers["X-PPD-Table-Version"]) == ("table", "v9")
        assert decisions.started
        assert [c.worker for c in upstream.calls] == ["P0", "D0", "D0"]
    assert decisions.closed
    assert upstream.closed
