"""vLLM's bidirectional path over HTTP on simulated workers (simulator/, `bidirectional_kv_xfer` on P and
D, as vLLM returns D's `kv_transfer_params`): the gateway keeps D's params for the session's next turn
but never passes them to the client, streamed or not; and a `/v1/completions` request naming a session
continues it (and so may use those params) only when its prompt extends what the session was sent and
answered."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.app import DEPS
from gateway.sessions import explicit_key
from simulator.server.worker_group import WorkerGroup
from tests.simulator.client import start_group
from tests.support.gateway_app import served_gateway

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KV = "kv_transfer_params"


class Gateway:
    def __init__(self, server: TestServer, http: aiohttp.ClientSession) -> None:
        self.server, self.http = server, http

    async def post(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int, dict[str, str], list[dict[str, Any]]]:
        """Status, headers and the answer's JSON objects: the body, or every streamed event's."""
        async with self.http.post(str(self.server.make_url(path)), json=body, headers=headers) as resp:
            raw = await resp.read()
            if not resp.content_type.startswith("text/event-stream"):
                return resp.status, dict(resp.headers), [json.loads(raw)]
            events = [b.removeprefix(b"data: ") for b in raw.split(b"\n\n") if b.startswith(b"data: ")]
            assert events[-1] == b"[DONE]", raw
            return resp.status, dict(resp.headers), [json.loads(e) for e in events[:-1]]

    async def stored_params(self, session_id: str) -> dict[str, Any]:
        session = await self.server.app[DEPS].sessions.get(explicit_key(session_id))
        assert session is not None
        assert session.decode_kv_params, "the gateway kept no D params"
        params: dict[str, Any] = json.loads(session.decode_kv_params)
        return params


@pytest.fixture
async def workers() -> AsyncIterator[WorkerGroup]:
    group = await start_group("1P1D", bidirectional_kv_xfer=True)
    try:
        yield group
    finally:
        await group.stop()


@pytest.fixture
async def gateway(workers: WorkerGroup) -> AsyncIterator[Gateway]:
    config: dict[str, Any] = {
        "mode": "pd",
        "allow_mode_header": True,  # the tests ask for bidir per request, as a benchmark does
        "routing": {"bidir": True},
        "workers": [w.describe() for w in workers.workers],
        "pool": {"health_interval_s": 3600.0},
        "sessions": {"sweep_interval_s": 3600.0},
    }
    async with served_gateway(config) as (server, http):
        yield Gateway(server, http)


def _text(answer: list[dict[str, Any]]) -> str:
    parts = []
    for obj in answer:
        for choice in obj.get("choices") or ():
            holder = choice.get("message") or choice.get("delta") or {}
            parts.append(holder.get("content") or choice.get("text") or "")
    return "".join(parts)


def _leaked(answer: list[dict[str, Any]]) -> list[Any]:
    return [obj[KV] for obj in answer if obj.get(KV) is not None]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_ds_kv_params_stay_in_the_gateway(gateway: Gateway, endpoint: str, stream: bool) -> None:
    session = f"keep-{endpoint}-{stream}"
    headers = {"X-Session-ID": session, "X-PPD-Mode": "bidir"}
    first_words = "Tell me about the lighthouses of the northern coast " * 8
    if endpoint == "chat":
        path = "/v1/chat/completions"
        messages: list[dict[str, Any]] = [{"role": "user", "content": first_words}]
        body: dict[str, Any] = {"messages": messages}
    else:
        path, body = "/v1/completions", {"prompt": first_words}
    body |= {"model": MODEL, "max_tokens": 8, "stream": stream}
    status, got, answer = await gateway.post(path, body, headers)
    assert (status, got["X-PPD-Path"], got["X-PPD-Reason"]) == (200, "pd", "turn_one")
    assert _leaked(answer) == []  # D's host, port, engine id and block ids are the gateway's
    assert (await gateway.stored_params(session))["do_remote_decode"] is True  # ... and kept there
    if endpoint == "chat":
        body["messages"] = [*messages, {"role": "assistant", "content": _text(answer)}]
        body["messages"].append({"role": "user", "content": "and the southern ones?"})
    else:
        body["prompt"] = first_words + _text(answer) + " And the southern ones?"
    status, got, answer = await gateway.post(path, body, headers)
    assert (status, got["X-PPD-Path"], got["X-PPD-Turn"]) == (200, "bidir", "2")
    assert _leaked(answer) == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completions_prompt_that_does_not_extend_the_named_session_is_a_new_conversation(
    gateway: Gateway, stream: bool
) -> None:
    """A stranger sending a victim's session id with its own prompt is never served on the victim's
    stored D params (P would compute the stranger's tokens on top of the victim's KV)."""
    victim = {"X-Session-ID": "victim", "X-PPD-Mode": "bidir"}
    prompt = "My account number is 12345 and my secret plan is " * 6
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": stream}
    status, first, answer = await gateway.post("/v1/completions", body, victim)
    assert (status, first["X-PPD-Path"]) == (200, "pd")
    stranger = body | {"prompt": "Unrelated question from someone else " * 6}
    status, got, _ = await gateway.post("/v1/completions", stranger, victim)
    assert status == 200
    assert (got["X-PPD-Path"], got["X-PPD-Reason"], got["X-PPD-Turn"]) == ("pd", "turn_one", "1")
    assert got["X-PPD-Session-Reset"] == "new_history"
    # The victim's stored prompt alone (without the answer it got) does not extend it either.
    status, got, answer = await gateway.post("/v1/completions", body, victim)
    assert (got["X-PPD-Turn"], got["X-PPD-Session-Reset"]) == ("1", "new_history")
    # What extends the session (its prompt and the answer, then more) continues it.
    follow = body | {"prompt": prompt + _text(answer) + " Go on."}
    status, got, _ = await gateway.post("/v1/completions", follow, victim)
    assert (status, got["X-PPD-Path"], got["X-PPD-Turn"]) == (200, "bidir", "2")
    assert "X-PPD-Session-Reset" not in got


async def test_a_chat_history_with_another_answer_is_never_served_on_the_sessions_d_params(
    gateway: Gateway,
) -> None:
    """Someone who knows a session's id and its user messages, but not the answer the gateway
    returned, continues the conversation without its stored D params (full PD); the real history
    with the real answer gets them."""
    victim = {"X-Session-ID": "chat-victim", "X-PPD-Mode": "bidir"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "My secret plan, in detail, is " * 8}]
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 8}
    status, first, answer = await gateway.post("/v1/chat/completions", body, victim)
    assert (status, first["X-PPD-Path"]) == (200, "pd")
    guessed = [*messages, {"role": "assistant", "content": "a guess"}, {"role": "user", "content": "go on"}]
    status, got, _ = await gateway.post("/v1/chat/completions", body | {"messages": guessed}, victim)
    assert status == 200
    assert (got["X-PPD-Path"], got["X-PPD-Reason"], got["X-PPD-Turn"]) == ("pd", "bidir_no_params", "2")
    # The stranger's turn stored its own params; the victim's next turn extends the victim's history,
    # which is no longer the session's last one: a fork from the state its exact history names.
    real = [*messages, {"role": "assistant", "content": _text(answer)}, {"role": "user", "content": "go on"}]
    status, got, _ = await gateway.post("/v1/chat/completions", body | {"messages": real}, victim)
    assert (status, got["X-PPD-Turn"], got["X-PPD-Session-Reset"]) == (200, "2", "fork")
    assert got["X-PPD-Path"] == "bidir"


async def test_the_real_answer_gets_the_sessions_d_params(gateway: Gateway) -> None:
    headers = {"X-Session-ID": "chat-owner", "X-PPD-Mode": "bidir"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me about the tides " * 8}]
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 8}
    _, _, answer = await gateway.post("/v1/chat/completions", body, headers)
    real = [*messages, {"role": "assistant", "content": _text(answer)}, {"role": "user", "content": "go on"}]
    status, got, _ = await gateway.post("/v1/chat/completions", body | {"messages": real}, headers)
    assert (status, got["X-PPD-Path"], got["X-PPD-Turn"]) == (200, "bidir", "2")
