"""Each failure the gateway's policy names, provoked against in-process fake workers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.gateway.conftest import MODEL, Reply, Stack, StackFactory
from tests.support.metrics import sample


async def _two_turns(stack: Stack, *, stream: bool = False) -> tuple[Reply, list[dict[str, Any]]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = await stack.chat(messages, stream=stream)
    assert first.status == 200
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "next"}]
    return first, messages


def _no_completions_reached(stack: Stack) -> bool:
    return all(not w.completions() for w in stack.workers.values())


# ---------------------------------------------------------------- bad input: 4xx, nothing upstream


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (json.dumps({"model": MODEL}).encode(), "messages"),
        (json.dumps({"model": MODEL, "messages": []}).encode(), "messages"),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), "messages"),
        (json.dumps({"model": MODEL, "messages": [{"content": "x"}]}).encode(), "messages"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 3}]}).encode(), "messages"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user"}], "stream": "yes"}).encode(), "stream"),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user"}], "max_tokens": "9"}).encode(),
            "max_tokens",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user"}], "session_id": 7}).encode(),
            "session_id",
        ),
    ],
)
async def test_bad_input_is_a_400_and_reaches_no_worker(
    make_stack: StackFactory, raw: bytes, param: str | None
) -> None:
    stack = await make_stack()
    reply = await stack.post("/v1/chat/completions", None, raw=raw)
    assert reply.status == 400
    assert reply.body["error"]["code"] == 400
    assert reply.body["error"]["param"] == param
    assert _no_completions_reached(stack)


@pytest.mark.parametrize("value", ["-1", "nine", str(2**63), "1" * 30])
async def test_an_expected_output_hint_out_of_range_is_a_400(make_stack: StackFactory, value: str) -> None:
    # A hint the DecisionService's int64 fields cannot carry is the client's error, not a 500.
    stack = await make_stack()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    reply = await stack.post("/v1/chat/completions", body, headers={"X-PPD-Expected-Output-Tokens": value})
    assert reply.status == 400
    assert reply.body["error"]["param"] == "X-PPD-Expected-Output-Tokens"
    assert _no_completions_reached(stack)


async def test_oversize_body_is_a_413(make_stack: StackFactory) -> None:
    stack = await make_stack(max_body_bytes=2048)
    reply = await stack.chat([{"role": "user", "content": "x" * 4096}])
    assert reply.status == 413
    assert reply.body["error"]["code"] == 413
    assert _no_completions_reached(stack)


async def test_bad_mode_header_is_a_400(make_stack: StackFactory) -> None:
    stack = await make_stack(allow_mode_header=True)
    reply = await stack.chat([{"role": "user", "content": "x"}], headers={"X-PPD-Mode": "fraction:7"})
    assert reply.status == 400
    assert _no_completions_reached(stack)


async def test_completions_without_prompt_is_a_400(make_stack: StackFactory) -> None:
    stack = await make_stack()
    reply = await stack.post("/v1/completions", {"model": MODEL})
    assert (reply.status, reply.body["error"]["param"]) == (400, "prompt")


# ---------------------------------------------------------------- no worker of a role


@pytest.mark.parametrize(
    ("roles", "missing"),
    [({"D0": "decode"}, "prefill"), ({"P0": "prefill"}, "decode")],
)
async def test_no_worker_of_a_role_is_a_503_naming_it(
    make_stack: StackFactory, roles: dict[str, str], missing: str
) -> None:
    stack = await make_stack(roles)
    reply = await stack.chat([{"role": "user", "content": "x"}])
    assert reply.status == 503
    assert missing in reply.body["error"]["message"]


async def test_replica_mode_without_replicas_is_a_503(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="replica")
    reply = await stack.chat([{"role": "user", "content": "x"}])
    assert reply.status == 503
    assert "replica" in reply.body["error"]["message"]


# ---------------------------------------------------------------- prefill failures


async def test_prefill_error_retries_on_another_p(make_stack: StackFactory) -> None:
    stack = await make_stack()
    stack.workers["P0"].knobs.status = 500
    stack.workers["P1"].knobs.status = None
    reply = await stack.chat([{"role": "user", "content": "x"}])
    assert reply.status == 200
    assert (reply.path, reply.headers["X-PPD-Prefill-Worker"]) == ("pd", "P1")
    # P0 was tried first or not at all (least loaded, ties by pick order); either way one P answered.
    assert len(stack.workers["P1"].completions()) == 1


async def test_every_prefill_fails_then_local_prefill_on_d(make_stack: StackFactory) -> None:
    stack = await make_stack()
    for p in ("P0", "P1"):
        stack.workers[p].knobs.status = 503
    reply = await stack.chat([{"role": "user", "content": "x"}])
    assert reply.status == 200
    assert (reply.path, reply.reason) == ("local", "prefill_failed")
    d = stack.workers[reply.headers["X-PPD-Decode-Worker"]]
    assert "kv_transfer_params" not in d.completions()[-1].body
    assert sum(len(stack.workers[p].completions()) for p in ("P0", "P1")) == 2


async def test_every_prefill_fails_then_503_by_config(make_stack: StackFactory) -> None:
    stack = await make_stack(policy={"prefill_failure": "error"})
    for p in ("P0", "P1"):
        stack.workers[p].knobs.status = 500
    reply = await stack.chat([{"role": "user", "content": "x"}])
    assert reply.status == 503
    assert "prefill" in reply.body["error"]["message"]
    assert not stack.workers["D0"].completions()
    assert not stack.workers["D1"].completions()


async def test_prefill_timeout_retries_on_another_p(make_stack: StackFactory) -> None:
    stack = await make_stack(timeouts={"prefill_s": 0.2})
    stack.workers["P0"].knobs.hang = True
    stack.workers["P1"].knobs.hang = True
    reply = await stack.chat([{"role": "user", "content": "x"}])
    assert (reply.status, reply.path, reply.reason) == (200, "local", "prefill_failed")
    labels = {"worker": "P0", "role": "prefill", "kind": "timeout"}
    assert sample(stack.deps.metrics.registry, "ppd_gateway_upstream_errors_total", labels) == 1


async def test_prefill_client_error_is_passed_on_without_retry(make_stack: StackFactory) -> None:
    stack = await make_stack()
    for p in ("P0", "P1"):
        stack.workers[p].knobs.status = 400
    reply = await stack.chat([{"role": "user", "content": "x"}])
    assert reply.status == 400
    assert reply.body["error"]["message"] == "fake 400"
    assert sum(len(stack.workers[p].completions()) for p in ("P0", "P1")) == 1


# ---------------------------------------------------------------- decode failures


@pytest.mark.parametrize(("worker_status", "client_status"), [(500, 502), (503, 502), (400, 400), (422, 422)])
@pytest.mark.parametrize("stream", [False, True])
async def test_decode_error_before_the_response_is_an_http_error(
    make_stack: StackFactory, worker_status: int, client_status: int, stream: bool
) -> None:
    stack = await make_stack()
    for d in ("D0", "D1"):
        stack.workers[d].knobs.status = worker_status
    reply = await stack.chat([{"role": "user", "content": "x"}], stream=stream)
    assert reply.status == client_status
    assert reply.body["error"]["code"] == client_status
    assert not reply.events


async def test_decode_breaks_mid_stream_gives_an_sse_error_event_then_done(make_stack: StackFactory) -> None:
    stack = await make_stack()
    for d in ("D0", "D1"):
        stack.workers[d].knobs.break_after = 2
    reply = await stack.chat([{"role": "user", "content": "x"}], stream=True)
    assert reply.status == 200
    assert reply.events[-1] == "[DONE]"
    assert "error" in reply.events[-2]
    assert reply.events[-2]["error"]["code"] == 502
    assert sample(stack.deps.metrics.registry, "ppd_gateway_stream_errors_total", cause="upstream") == 1


async def test_stream_without_done_is_reported_not_hidden(make_stack: StackFactory) -> None:
    stack = await make_stack()
    for d in ("D0", "D1"):
        stack.workers[d].knobs.no_done = True
    reply = await stack.chat([{"role": "user", "content": "x"}], stream=True)
    assert reply.events[-1] == "[DONE]"
    assert "before [DONE]" in reply.events[-2]["error"]["message"]


async def test_worker_error_event_passes_through(make_stack: StackFactory) -> None:
    stack = await make_stack()
    for d in ("D0", "D1"):
        stack.workers[d].knobs.error_event = True
    reply = await stack.chat([{"role": "user", "content": "x"}], stream=True)
    assert reply.events[-2]["error"]["message"] == "fake engine error"
    assert reply.events[-1] == "[DONE]"


async def test_decode_idle_timeout_mid_stream_is_an_error_event(make_stack: StackFactory) -> None:
    stack = await make_stack(timeouts={"idle_s": 0.2})
    for d in ("D0", "D1"):
        stack.workers[d].knobs.chunk_delay_s = 5.0
    reply = await stack.chat([{"role": "user", "content": "x"}], stream=True)
    assert reply.status == 200
    assert "error" in reply.events[-2]
    assert reply.events[-1] == "[DONE]"


async def test_sessions_decode_worker_died_rebinds_through_p(make_stack: StackFactory) -> None:
    stack = await make_stack()
    first, messages = await _two_turns(stack)
    old = first.headers["X-PPD-Decode-Worker"]
    await stack.workers[old].close()  # the port closes: connection refused
    second = await stack.chat(messages)
    assert second.status == 200
    assert (second.path, second.reason) == ("pd", "decode_gone")
    new = second.headers["X-PPD-Decode-Worker"]
    assert new != old
    messages += [{"role": "assistant", "content": second.text}, {"role": "user", "content": "again"}]
    third = await stack.chat(messages)
    assert (third.path, third.headers["X-PPD-Decode-Worker"], third.headers["X-PPD-Turn"]) == (
        "local",
        new,
        "3",
    )
    assert sample(stack.deps.metrics.registry, "ppd_gateway_session_rebinds_total") == 1


async def test_sessions_decode_worker_left_the_pool_rebinds_through_p(make_stack: StackFactory) -> None:
    stack = await make_stack()
    first, messages = await _two_turns(stack)
    old = first.headers["X-PPD-Decode-Worker"]
    stack.deps.pool.set_health(old, False)  # what the health check does when /health fails
    second = await stack.chat(messages)
    assert (second.status, second.path, second.reason) == (200, "pd", "decode_gone")
    assert second.headers["X-PPD-Decode-Worker"] != old


# ---------------------------------------------------------------- client disconnect


async def test_client_disconnect_cancels_the_upstream_stream(make_stack: StackFactory) -> None:
    stack = await make_stack()
    for wid in ("D0", "D1"):
        stack.workers[wid].knobs.chunk_delay_s = 0.05
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "max_tokens": 10_000,
    }
    async with aiohttp.ClientSession() as http:
        resp = await http.post(stack.url + "/v1/chat/completions", json=body)
        assert resp.status == 200
        await resp.content.readline()  # the stream has started
        resp.close()  # the client goes away
    d = stack.workers[resp.headers["X-PPD-Decode-Worker"]]
    await asyncio.wait_for(d.aborted_event.wait(), timeout=30)
    assert d.aborted == 1


async def test_client_disconnect_while_waiting_for_p_cancels_p(make_stack: StackFactory) -> None:
    stack = await make_stack({"P0": "prefill", "D0": "decode"})
    stack.workers["P0"].knobs.hang = True
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(http.post(stack.url + "/v1/chat/completions", json=body))
        await asyncio.wait_for(stack.workers["P0"].started_event.wait(), timeout=30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # The gateway's handler is cancelled and closes its P request: P sees the abort, D sees nothing.
    await asyncio.wait_for(stack.workers["P0"].aborted_event.wait(), timeout=30)
    for _ in range(200):
        if sample(stack.deps.metrics.registry, "ppd_gateway_requests_in_flight") == 0:
            break
        await asyncio.sleep(0.01)
    assert sample(stack.deps.metrics.registry, "ppd_gateway_requests_in_flight") == 0
    assert not stack.workers["D0"].completions()


# ---------------------------------------------------------------- security


async def test_client_authorization_is_not_forwarded_by_default(make_stack: StackFactory) -> None:
    stack = await make_stack(worker_api_key="worker-key")
    reply = await stack.chat(
        [{"role": "user", "content": "x"}], headers={"Authorization": "Bearer client-key"}
    )
    assert reply.status == 200
    seen = [s for w in stack.workers.values() for s in w.completions()]
    assert seen  # a worker was called, so the header check below checked something
    assert all(s.headers.get("Authorization") == "Bearer worker-key" for s in seen)


async def test_client_authorization_is_forwarded_when_configured(make_stack: StackFactory) -> None:
    stack = await make_stack(forward_authorization=True)
    await stack.chat([{"role": "user", "content": "x"}], headers={"Authorization": "Bearer client-key"})
    seen = [s for w in stack.workers.values() for s in w.completions()]
    assert seen
    assert all(s.headers.get("Authorization") == "Bearer client-key" for s in seen)


async def test_client_kv_transfer_params_never_reach_a_worker(make_stack: StackFactory) -> None:
    stack = await make_stack()
    evil = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 1}
    reply = await stack.chat([{"role": "user", "content": "x"}], kv_transfer_params=evil)
    assert reply.status == 200
    for w in stack.workers.values():
        for seen in w.completions():
            assert seen.body.get("kv_transfer_params", {}).get("remote_host") != "10.0.0.1"


@pytest.mark.parametrize(
    ("token", "auth", "status"),
    [
        ("", "Bearer x", 401),
        ("s3cret", None, 401),
        ("s3cret", "Bearer wrong", 401),
        ("s3cret", "s3cret", 401),
    ],
)
async def test_admin_api_needs_the_bearer_token(
    make_stack: StackFactory, token: str, auth: str | None, status: int
) -> None:
    stack = await make_stack(admin_token=token)
    headers = {"Authorization": auth} if auth else {}
    reg = {"id": "D9", "role": "decode", "url": "http://127.0.0.1:9"}
    reply = await stack.post("/admin/workers", reg, headers=headers)
    assert reply.status == status
    assert stack.deps.pool.view().get("D9") is None
