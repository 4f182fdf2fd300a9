"""The admin API: bearer token on every route, and registrations validated (ids, URLs, never the
gateway itself or the DecisionService), with credentials never accepted or printed."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gateway.settings import Settings, SettingsError
from tests.gateway.conftest import Reply, Stack, StackFactory

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _call(stack: Stack, method: str, path: str, headers: dict[str, str]) -> Reply:
    async with stack.http.request(method, stack.url + path, headers=headers) as resp:
        return Reply(resp.status, dict(resp.headers), await resp.json())


async def _register(stack: Stack, **spec: Any) -> Reply:
    body = {"id": "D9", "role": "decode", "url": "http://127.0.0.1:9", **spec}
    return await stack.post("/admin/workers", body, headers=AUTH)


@pytest.mark.parametrize(("method", "path"), [("GET", "/admin/workers"), ("DELETE", "/admin/workers/D9")])
@pytest.mark.parametrize(
    ("token", "auth"),
    [("", "Bearer x"), ("", None), (TOKEN, None), (TOKEN, "Bearer wrong"), (TOKEN, TOKEN)],
)
async def test_listing_and_removing_need_the_bearer_token(
    make_stack: StackFactory, method: str, path: str, token: str, auth: str | None
) -> None:
    stack = await make_stack(admin_token=token)
    if token:
        assert (await _register(stack)).status == 201
    reply = await _call(stack, method, path, {"Authorization": auth} if auth else {})
    assert reply.status == 401
    assert reply.body["error"]["type"] == "AuthenticationError"
    assert "workers" not in reply.body
    assert stack.deps.pool.is_live("D9") == bool(token)  # nothing was removed


async def test_listing_and_removing_with_the_token(make_stack: StackFactory) -> None:
    stack = await make_stack(admin_token=TOKEN)
    assert (await _register(stack)).status == 201
    listed = await _call(stack, "GET", "/admin/workers", AUTH)
    assert listed.status == 200
    assert "D9" in [w["id"] for w in listed.body["workers"]]
    # [routing] placement is "prefix" by default, but without [kv_events] legs go to the least loaded.
    assert listed.body["placement"] == "least_loaded"
    removed = await _call(stack, "DELETE", "/admin/workers/D9", AUTH)
    assert (removed.status, removed.body) == (200, {"id": "D9", "removed": True})
    assert stack.deps.pool.view().get("D9") is None


@pytest.mark.parametrize(
    "worker_id", ["D\r\nFAKE worker D0 registered", "x" * 100_000, "", "a/b", "a b", "caf\u00e9"]
)
async def test_worker_ids_are_validated(make_stack: StackFactory, worker_id: str) -> None:
    stack = await make_stack(admin_token=TOKEN)
    reply = await _register(stack, id=worker_id)
    assert reply.status == 400
    assert reply.body["error"]["param"] == "id"
    assert [s.id for s in stack.deps.pool.specs()] == ["P0", "P1", "D0", "D1"]


@pytest.mark.parametrize(
    "url",
    [
        "ftp://127.0.0.1:9",
        "http://",
        "http:///path",
        "127.0.0.1:9",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:9/?x=1",
        "http://127.0.0.1:9/#f",
        "http://127.0.0.1:9/a b",
        "http://user:hunter2@127.0.0.1:9",
        "https://hunter2@127.0.0.1:9",
        "http://user:hunter2@127.0.0.1:99999",
        "http://user:hunter2@127.0.0.1:9/?q",
        "http://user:" + "hunter2" * 40 + "@127.0.0.1:9",
        "http://" + "h" * 3000 + ":9",
    ],
)
async def test_worker_urls_are_validated_and_credentials_never_echoed(
    make_stack: StackFactory, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await make_stack(admin_token=TOKEN)
    caplog.set_level(logging.DEBUG)
    reply = await _register(stack, url=url)
    assert reply.status == 400
    assert reply.body["error"]["param"] == "url"
    assert "hunter2" not in reply.body["error"]["message"]
    assert "hunter2" not in caplog.text
    assert stack.deps.pool.view().get("D9") is None


async def test_the_gateways_own_address_is_refused(make_stack: StackFactory) -> None:
    stack = await make_stack(admin_token=TOKEN)
    port = stack.server.port
    assert port is not None
    for url in (
        stack.url,
        f"http://localhost:{port}",
        f"http://127.0.0.1:{port}/v1",
        f"http://0.0.0.0:{port}",
    ):
        reply = await _register(stack, url=url)
        assert reply.status == 400, url
        assert "own address" in reply.body["error"]["message"]
    assert stack.deps.pool.view().get("D9") is None
    # Not this listener (bound to 127.0.0.1 only): another loopback address, or another port.
    assert (await _register(stack, url=f"http://127.0.0.2:{port}")).status == 201
    assert (await _register(stack, id="D8", url=f"http://127.0.0.1:{port - 1}")).status == 201


async def test_the_decision_services_grpc_address_is_refused(make_stack: StackFactory) -> None:
    stack = await make_stack(admin_token=TOKEN, decision={"address": "127.0.0.1:1"})
    reply = await _register(stack, url="http://localhost:1")
    assert reply.status == 400
    assert "DecisionService" in reply.body["error"]["message"]


def test_static_workers_with_credentials_are_refused_without_printing_them() -> None:
    worker = {"id": "D0", "role": "decode", "url": "http://admin:hunter2@10.0.0.7:8000"}
    with pytest.raises(SettingsError) as info:
        Settings.from_mapping({"workers": [worker]})
    assert "credentials" in str(info.value)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "host",
    [
        "127.1",
        "2130706433",
        "0x7f000001",
        "0177.0.0.1",
        "0",
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "localhost.",
        "LOCALHOST",
    ],
)
async def test_the_gateways_own_address_is_refused_however_it_is_spelt(
    make_stack: StackFactory, host: str
) -> None:
    """Resolved addresses are compared, not names: each of these reaches 127.0.0.1 (`localhost.` where
    a resolver answers for it; without one it does not resolve, which is refused too)."""
    stack = await make_stack(admin_token=TOKEN)
    reply = await _register(stack, url=f"http://{host}:{stack.server.port}")
    assert reply.status == 400, reply.body
    message = reply.body["error"]["message"]
    assert "own address" in message or (host == "localhost." and "does not resolve" in message)
    assert reply.body["error"]["param"] == "url"
    assert stack.deps.pool.view().get("D9") is None


@pytest.mark.parametrize("host", ["127.1", "[::ffff:127.0.0.1]", "LocalHost", "0"])
@pytest.mark.parametrize("address", ["127.0.0.1:1", "localhost:1", "dns:///localhost:1", "ipv4:127.0.0.1:1"])
async def test_the_decision_services_address_is_refused_however_it_is_spelt(
    make_stack: StackFactory, host: str, address: str
) -> None:
    stack = await make_stack(admin_token=TOKEN, decision={"address": address})
    reply = await _register(stack, url=f"http://{host}:1")
    assert reply.status == 400, reply.body
    assert "DecisionService" in reply.body["error"]["message"]


async def test_a_wildcard_bind_is_reached_on_every_local_address(make_stack: StackFactory) -> None:
    """A gateway bound to 0.0.0.0 listens on every address of the host: loopback ones included."""
    stack = await make_stack(admin_token=TOKEN, host="0.0.0.0")
    port = stack.server.port
    assert port is not None
    for host in ("127.0.0.2", "127.0.0.1", "0.0.0.0"):
        reply = await _register(stack, url=f"http://{host}:{port}")
        assert reply.status == 400, (host, reply.body)
    assert (await _register(stack, url=f"http://127.0.0.2:{port - 1}")).status == 201


async def test_a_worker_host_that_does_not_resolve_is_a_400(make_stack: StackFactory) -> None:
    stack = await make_stack(admin_token=TOKEN)
    reply = await _register(stack, url="http://no-such-host.invalid:8000")
    assert reply.status == 400
    assert reply.body["error"]["param"] == "url"
    assert "does not resolve" in reply.body["error"]["message"]
    assert stack.deps.pool.view().get("D9") is None


async def test_registered_workers_are_capped(make_stack: StackFactory) -> None:
    stack = await make_stack(admin_token=TOKEN, pool={"max_registered_workers": 2})
    assert (await _register(stack, id="R1")).status == 201
    assert (await _register(stack, id="R2")).status == 201
    full = await _register(stack, id="R3")
    assert full.status == 409
    assert "pool.max_registered_workers" in full.body["error"]["message"]
    assert full.body["error"]["type"] == "ConflictError"
    assert stack.deps.pool.view().get("R3") is None
    assert (await _register(stack, id="R1")).status == 200  # a heartbeat is never refused
    assert (await _call(stack, "DELETE", "/admin/workers/R1", AUTH)).status == 200
    assert (await _register(stack, id="R3")).status == 201
    assert Settings().pool.max_registered_workers == 256


async def test_a_registration_nested_too_deep_is_a_400(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await make_stack(admin_token=TOKEN)
    raw = (
        b'{"id": "D9", "role": "decode", "url": "http://127.0.0.1:9", "x": '
        + b"[" * 1000
        + b"]" * 1000
        + b"}"
    )
    reply = await stack.post("/admin/workers", None, raw=raw, headers=AUTH)
    assert reply.status == 400
    assert "limits.max_json_depth" in reply.body["error"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert stack.deps.pool.view().get("D9") is None
