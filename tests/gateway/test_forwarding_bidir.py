"""vLLM's bidirectional path through the request path (gateway/forwarding.py, plan.py rule 6) on fakes:
D's returned params are kept per session with their expiry, sent to P on the next turn, and P's to D;
missing, expired or failing params fall back to full PD with a reason."""

from __future__ import annotations

import json
from typing import Any

from gateway.forwarding import Forwarder
from gateway.ports import ClientRequest
from gateway.routing import Decision
from gateway.sessions import explicit_key
from tests.gateway.fakes import (
    KV_PARAMS,
    FakeClient,
    FakeDecisions,
    FakeUpstream,
    ManualClock,
    chunk,
    forwarder_on_fakes,
    sse,
)

MODEL = "example-org/unknown-model"
WORKERS = [
    {"id": "P0", "role": "prefill", "url": "http://p0.test"},
    {"id": "D0", "role": "decode", "url": "http://d0.test"},
]
#: What vLLM's D returns on its final chunk in bidirectional mode (pull_scheduler.request_finished).
D_PARAMS: dict[str, Any] = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[4, 5]],
    "remote_engine_id": "engine-D0",
    "remote_request_id": "chatcmpl-id1-abcd",
    "remote_host": "localhost",
    "remote_port": 5601,
    "tp_size": 1,
    "remote_num_tokens": 11,
    "remote_blocks_expiry_time": 812.5,
    "transfer_mode": "pull",
}
FIRST = [{"role": "user", "content": "tell me about the sea"}]
SECOND = [*FIRST, {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "and rivers?"}]
THIRD = [*SECOND, {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "and lakes?"}]
START = 1_700_000_000.0


def _request(messages: list[dict[str, Any]], *, stream: bool = False, mode: str = "") -> ClientRequest:
    body = {"model": MODEL, "messages": messages, "stream": stream, "max_tokens": 8}
    headers = {"X-Session-ID": "conv-1", **({"X-PPD-Mode": mode} if mode else {})}
    return ClientRequest("chat", json.dumps(body).encode(), headers)


def _setup(upstream: FakeUpstream, **routing: Any) -> tuple[Forwarder, Any, ManualClock]:
    wall = ManualClock(START)
    config = {
        "mode": "bidir",
        "allow_mode_header": True,
        "served_model": MODEL,
        "workers": WORKERS,
        "routing": routing,
    }
    forwarder, deps = forwarder_on_fakes(config, upstream=upstream, wall_clock=wall)
    return forwarder, deps, wall


async def _turn(forwarder: Forwarder, request: ClientRequest) -> FakeClient:
    client = FakeClient()
    await forwarder.handle(request, client)
    return client


async def test_ds_params_are_kept_with_their_expiry_and_sent_to_p_on_the_next_turn() -> None:
    upstream = FakeUpstream(decode_kv_params=D_PARAMS)
    forwarder, deps, _ = _setup(upstream, bidir_params_ttl_s=100.0)
    first = await _turn(forwarder, _request(FIRST))
    assert (first.headers["X-PPD-Path"], first.headers["X-PPD-Reason"]) == ("pd", "turn_one")
    session = await deps.sessions.get(explicit_key("conv-1"))
    assert session is not None
    assert json.loads(session.decode_kv_params) == D_PARAMS
    assert session.decode_kv_expires_at == START + 100.0
    upstream.calls.clear()
    second = await _turn(forwarder, _request(SECOND))
    assert (second.headers["X-PPD-Path"], second.headers["X-PPD-Reason"]) == ("bidir", "mode_bidir")
    assert second.headers["X-PPD-Prefill-Worker"] == "P0"
    p_call, d_call = upstream.calls
    assert (p_call.worker, p_call.body["max_tokens"], p_call.body["stream"]) == ("P0", 1, False)
    assert p_call.body["kv_transfer_params"] == D_PARAMS  # D's params, unmodified
    assert (d_call.worker, d_call.body["kv_transfer_params"]) == ("D0", KV_PARAMS)  # D pulls P's back
    assert dict(p_call.headers)["X-Request-Id"] == dict(d_call.headers)["X-Request-Id"]


async def test_params_on_the_final_stream_chunk_are_kept() -> None:
    final = chunk("lo") | {"kv_transfer_params": D_PARAMS}
    upstream = FakeUpstream(stream_parts=sse(chunk("hel"), final))
    forwarder, deps, _ = _setup(upstream)
    await _turn(forwarder, _request(FIRST, stream=True))
    session = await deps.sessions.get(explicit_key("conv-1"))
    assert session is not None
    assert json.loads(session.decode_kv_params) == D_PARAMS
    assert session.decode_kv_expires_at == START + 450.0  # the default, vLLM's proxy's TTL


async def test_expired_params_fall_back_to_full_pd() -> None:
    upstream = FakeUpstream(decode_kv_params=D_PARAMS)
    forwarder, _, wall = _setup(upstream, bidir_params_ttl_s=100.0)
    await _turn(forwarder, _request(FIRST))
    wall.now = START + 100.0
    upstream.calls.clear()
    second = await _turn(forwarder, _request(SECOND))
    assert (second.headers["X-PPD-Path"], second.headers["X-PPD-Reason"]) == ("pd", "bidir_expired")
    p_call, _ = upstream.calls
    assert p_call.body["kv_transfer_params"]["remote_block_ids"] is None  # a plain P leg: P recomputes


async def test_no_params_from_d_falls_back_to_full_pd() -> None:
    upstream = FakeUpstream()  # D answers kv_transfer_params null: bidirectional mode is off there
    forwarder, deps, _ = _setup(upstream)
    await _turn(forwarder, _request(FIRST))
    session = await deps.sessions.get(explicit_key("conv-1"))
    assert session is not None
    assert (session.decode_kv_params, session.decode_kv_expires_at) == ("", 0.0)
    second = await _turn(forwarder, _request(SECOND))
    assert (second.headers["X-PPD-Path"], second.headers["X-PPD-Reason"]) == ("pd", "bidir_no_params")


async def test_a_failing_bidirectional_p_leg_is_retried_as_full_pd() -> None:
    upstream = FakeUpstream(decode_kv_params=D_PARAMS, bidir_prefill_fails=True)
    forwarder, _, _ = _setup(upstream)
    await _turn(forwarder, _request(FIRST))
    upstream.calls.clear()
    second = await _turn(forwarder, _request(SECOND))
    assert (second.headers["X-PPD-Path"], second.headers["X-PPD-Reason"]) == ("pd", "bidir_prefill_failed")
    bidir_p, plain_p, d_call = upstream.calls
    assert bidir_p.body["kv_transfer_params"] == D_PARAMS
    assert plain_p.body["kv_transfer_params"]["remote_block_ids"] is None
    assert d_call.body["kv_transfer_params"] == KV_PARAMS


async def test_params_are_single_use_a_local_turn_leaves_none() -> None:
    upstream = FakeUpstream(decode_kv_params=D_PARAMS)
    forwarder, deps, _ = _setup(upstream)
    await _turn(forwarder, _request(FIRST))
    upstream.decode_kv_params = None  # a plain request on D (the local path) returns no params
    local = await _turn(forwarder, _request(SECOND, mode="local"))
    assert local.headers["X-PPD-Path"] == "local"
    session = await deps.sessions.get(explicit_key("conv-1"))
    assert session is not None
    assert session.decode_kv_params == ""
    third = await _turn(forwarder, _request(THIRD))
    assert (third.headers["X-PPD-Path"], third.headers["X-PPD-Reason"]) == ("pd", "bidir_no_params")


async def test_turn_three_continues_bidirectionally_with_turn_twos_params() -> None:
    upstream = FakeUpstream(decode_kv_params=D_PARAMS)
    forwarder, _, _ = _setup(upstream)
    await _turn(forwarder, _request(FIRST))
    turn_two = D_PARAMS | {"remote_request_id": "chatcmpl-id2-ef01", "remote_num_tokens": 25}
    upstream.decode_kv_params = turn_two  # what D returns after the bidirectional turn 2
    second = await _turn(forwarder, _request(SECOND))
    assert second.headers["X-PPD-Path"] == "bidir"
    upstream.calls.clear()
    third = await _turn(forwarder, _request(THIRD))
    assert (third.headers["X-PPD-Path"], third.headers["X-PPD-Turn"]) == ("bidir", "3")
    assert upstream.calls[0].body["kv_transfer_params"] == turn_two


async def test_the_capability_is_sent_only_when_the_gateway_can_serve_bidir_and_its_answer_is_served() -> (
    None
):
    for bidir in (False, True):
        decisions = FakeDecisions(Decision("bidir", "table", table_version="v2"))
        upstream = FakeUpstream(decode_kv_params=D_PARAMS)
        config = {"mode": "ppd", "served_model": MODEL, "workers": WORKERS, "routing": {"bidir": bidir}}
        forwarder, _ = forwarder_on_fakes(config, upstream=upstream, decisions=decisions)
        await _turn(forwarder, _request(FIRST))
        second = await _turn(forwarder, _request(SECOND))
        (query,) = decisions.queries
        assert query.capabilities == (frozenset({"bidir"}) if bidir else frozenset())
        assert (second.headers["X-PPD-Path"], second.headers["X-PPD-Reason"]) == ("bidir", "table")
