"""The simulated workers over real HTTP on 127.0.0.1: vLLM routes, bodies, streaming, P/D, prefix cache."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from simulator.core.profile import load_profile
from simulator.core.sampler import SamplerSettings
from simulator.core.topology import Topology
from simulator.core.worker_settings import DEFAULT_MODEL, WorkerSettings
from simulator.server.worker_group import GroupSettings, WorkerGroup
from tests.simulator.client import metric, post, sse, start_alone, start_group
from tests.support.nixl import prefill_kv_params

pytestmark = pytest.mark.integration

LONG_PROMPT = " ".join(f"word{i}" for i in range(120))


@pytest.fixture
async def group() -> AsyncIterator[WorkerGroup]:
    g = await start_group("1P2D", enable_prompt_tokens_details=True)
    yield g
    await g.stop()


async def test_small_routes(group: WorkerGroup, http: aiohttp.ClientSession) -> None:
    url = group.worker("D0").url
    async with http.get(f"{url}/health") as r:
        assert r.status == 200
        assert await r.read() == b""
    async with http.get(f"{url}/version") as r:
        assert await r.json() == {"version": "0.33.0"}
    async with http.get(f"{url}/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == card["root"] == DEFAULT_MODEL
    assert card["owned_by"] == "vllm"
    assert card["max_model_len"] == 131072
    status, tok = await post(http, f"{url}/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert status == 200
    assert tok == {
        "count": 3,
        "max_model_len": 131072,
        "tokens": [128000, 15339, 1917],
        "token_strs": tok["token_strs"],
    }
    assert tok["token_strs"][1:] == ["hello", " world"]
    status, chat_tok = await post(http, f"{url}/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    assert chat_tok["tokens"][0] == 128000
    assert chat_tok["token_strs"] is None
    status, detok = await post(http, f"{url}/detokenize", {"tokens": [15339, 1917]})
    assert (status, detok) == (200, {"prompt": "hello world"})
    async with http.get(f"{url}/load") as r:
        assert await r.json() == {"server_load": 0}


async def test_metrics_have_vllm_names_and_labels(group: WorkerGroup, http: aiohttp.ClientSession) -> None:
    url = group.worker("D0").url
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    labels = f'engine="0",model_name="{DEFAULT_MODEL}"'
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert f"{name}{{{labels}}}" in text, name
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:iteration_tokens_total",
    ):
        assert f"# TYPE {name} histogram" in text, name
    assert 'vllm:num_requests_waiting_by_reason{engine="0",model_name=' in text
    assert 'reason="deferred"' in text


async def test_completion_body_ids_and_determinism(group: WorkerGroup, http: aiohttp.ClientSession) -> None:
    body = {"prompt": "Tell me a story", "max_tokens": 12, "seed": 3}
    status, first = await post(
        http, f"{group.worker('D0').url}/v1/completions", body, **{"X-Request-Id": "abc"}
    )
    assert status == 200
    assert first["id"] == "cmpl-abc"
    assert first["object"] == "text_completion"
    assert first["model"] == DEFAULT_MODEL
    choice = first["choices"][0]
    assert choice["finish_reason"] == "length"
    assert first["usage"]["prompt_tokens"] == 5
    assert first["usage"]["completion_tokens"] == 12
    assert first["usage"]["total_tokens"] == 17
    assert first["kv_transfer_params"] is None
    _, again = await post(http, f"{group.worker('D1').url}/v1/completions", body)
    assert again["choices"][0]["text"] == choice["text"]
    assert again["id"].startswith("cmpl-")
    _, tok = await post(
        http, f"{group.worker('D1').url}/tokenize", {"prompt": choice["text"], "add_special_tokens": False}
    )
    assert tok["count"] == 12


async def test_chat_stream_with_usage(group: WorkerGroup, http: aiohttp.ClientSession) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = await sse(http, f"{group.worker('D0').url}/v1/chat/completions", body, **{"X-Request-Id": "s1"})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["id"] == "chatcmpl-s1" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert len(content) == 4
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, None, "length"]
    assert "kv_transfer_params" in content[-1]
    assert "kv_transfer_params" not in content[0]
    assert [c["usage"]["completion_tokens"] for c in content] == [1, 2, 3, 4]
    final = chunks[-1]
    assert final["choices"] == []
    assert final["usage"]["completion_tokens"] == 4
    assert final["usage"]["prompt_tokens"] == content[0]["usage"]["prompt_tokens"]


async def test_completion_stream_without_usage(group: WorkerGroup, http: aiohttp.ClientSession) -> None:
    body = {"prompt": "hello", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": False}}
    events = await sse(http, f"{group.worker('D1').url}/v1/completions", body)
    assert events[-1] == "[DONE]"
    assert len(events) == 4
    assert all("usage" not in e for e in events[:-1])
    assert events[0]["object"] == "text_completion"


@pytest.mark.parametrize(
    ("raw", "status", "fragment"),
    [
        (b"{not json", 400, "json_invalid"),
        (
            b'{"prompt": "x", "stream_options": {"include_usage": true}}',
            400,
            "Stream options can only be defined",
        ),
        (b'{"prompt": "x", "max_tokens": 3, "min_tokens": 9}', 400, "min_tokens must be less than or equal"),
        (b'{"prompt": "x", "max_tokens": 99999999999}', 400, "is too large"),
        (b'{"prompt": "x", "model": "nope"}', 404, "does not exist"),
        (b'{"prompt": "x", "max_tokens": -4}', 400, "at least 1"),
        (b'"just a string"', 400, "JSON object"),
    ],
)
async def test_bad_input_gets_vllm_errors(
    group: WorkerGroup, http: aiohttp.ClientSession, raw: bytes, status: int, fragment: str
) -> None:
    url = group.worker("D0").url
    async with http.post(
        f"{url}/v1/completions", data=raw, headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == status
        body = await r.json()
    assert fragment in body["error"]["message"]
    assert body["error"]["code"] == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    async with http.get(f"{url}/health") as r:
        assert r.status == 200


async def test_huge_body_unknown_route_and_method(http: aiohttp.ClientSession) -> None:
    g = await start_group("1R", max_body_bytes=64 * 1024)
    try:
        url = g.workers[0].url
        big = json.dumps({"prompt": "x" * 200_000}).encode()
        async with http.post(f"{url}/v1/completions", data=big) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == 413
        async with http.get(f"{url}/v1/completions") as r:
            assert r.status == 405
            assert (await r.json())["error"]["code"] == 405
        async with http.get(f"{url}/nope") as r:
            assert r.status == 404
        status, _ = await post(http, f"{url}/v1/completions", {"prompt": "fine", "max_tokens": 1})
        assert status == 200
    finally:
        await g.stop()


async def test_eos_min_tokens_and_ignore_eos(http: aiohttp.ClientSession) -> None:
    g = await start_group("1R", sampler=SamplerSettings(mean_natural_tokens=1))
    try:
        url = f"{g.workers[0].url}/v1/completions"
        _, stop = await post(http, url, {"prompt": "x", "max_tokens": 20})
        assert stop["choices"][0]["finish_reason"] == "stop"
        assert stop["usage"]["completion_tokens"] == 1
        assert stop["choices"][0]["text"] == ""
        _, held = await post(http, url, {"prompt": "x", "max_tokens": 20, "min_tokens": 5})
        assert held["choices"][0]["finish_reason"] == "stop"
        assert held["usage"]["completion_tokens"] == 6
        _, full = await post(http, url, {"prompt": "x", "max_tokens": 20, "ignore_eos": True})
        assert full["choices"][0]["finish_reason"] == "length"
        assert full["usage"]["completion_tokens"] == 20
    finally:
        await g.stop()


def _pd_bodies(stream: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    client = {"model": DEFAULT_MODEL, "prompt": LONG_PROMPT, "max_tokens": 6, "min_tokens": 2}
    if stream:
        client |= {"stream": True, "stream_options": {"include_usage": True}}
    p_body = {k: v for k, v in client.items() if k not in ("min_tokens", "stream_options")}
    p_body |= {
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": prefill_kv_params(),
    }
    return client, p_body


async def test_pd_pair_like_a_proxy(group: WorkerGroup, http: aiohttp.ClientSession) -> None:
    p, d = group.worker("P0"), group.worker("D0")
    client, p_body = _pd_bodies()
    status, p_resp = await post(http, f"{p.url}/v1/completions", p_body, **{"X-Request-Id": "pd-1"})
    assert status == 200
    assert p_resp["id"] == "cmpl-pd-1"
    assert p_resp["usage"]["completion_tokens"] == 1
    assert p_resp["choices"][0]["finish_reason"] == "length"
    params = p_resp["kv_transfer_params"]
    assert set(params) == {
        "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
        "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
        "remote_blocks_expiry_time", "remote_registration_generation", "transfer_mode",
        "remote_prefill_cached_tokens",
    }  # fmt: skip
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_engine_id"] == p.engine_id
    assert params["remote_request_id"].startswith("cmpl-pd-1-0-")
    assert params["remote_num_tokens"] == p_resp["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"][0]) == -(-params["remote_num_tokens"] // 16)
    assert params["transfer_mode"] == "pull"
    assert params["remote_port"] == p.port
    assert p.engine.stats().num_pinned == 1

    d_body = client | {"kv_transfer_params": params}
    status, d_resp = await post(http, f"{d.url}/v1/completions", d_body, **{"X-Request-Id": "pd-1"})
    assert status == 200, d_resp
    assert d_resp["id"] == "cmpl-pd-1"
    assert d_resp["usage"]["completion_tokens"] == 6
    assert d_resp["usage"]["prompt_tokens_details"] == {
        "cached_tokens": params["remote_prefill_cached_tokens"]
    }
    assert d_resp["kv_transfer_params"] is None
    assert p.engine.stats().num_pinned == 0
    external = await metric(http, d.url, "vllm:external_prefix_cache_hits_total")
    assert external == params["remote_num_tokens"] - 1
    transferred = await metric(http, d.url, "vllm:nixl_xfer_time_seconds_count")
    assert transferred == 1
    assert await metric(http, d.url, "vllm:request_queue_time_seconds_count") == 1
    assert await metric(http, d.url, "vllm:request_queue_time_seconds_sum") > 0  # it waited for the KV


async def test_pd_streaming_decode_leg(group: WorkerGroup, http: aiohttp.ClientSession) -> None:
    client, p_body = _pd_bodies(stream=True)
    _, p_resp = await post(
        http, f"{group.worker('P0').url}/v1/completions", p_body, **{"X-Request-Id": "pd-s"}
    )
    d_body = client | {"kv_transfer_params": p_resp["kv_transfer_params"]}
    events = await sse(http, f"{group.worker('D1').url}/v1/completions", d_body, **{"X-Request-Id": "pd-s"})
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 6
    finishing = [e for e in events[:-2] if e["choices"][0]["finish_reason"] is not None]
    assert len(finishing) == 1
    assert finishing[0]["kv_transfer_params"] is None


async def test_expired_lease_fails_decode_like_vllm(http: aiohttp.ClientSession) -> None:
    g = await start_group("1P1D", kv_lease_duration_s=0.05)
    try:
        p, d = g.workers
        client, p_body = _pd_bodies()
        _, p_resp = await post(http, f"{p.url}/v1/completions", p_body)
        # Wait for P to report the expiry (no timer race: we poll the fact, not the clock).
        for _ in range(2000):
            if await metric(http, p.url, "vllm:nixl_num_kv_expired_reqs_total") >= 1:
                break
            await asyncio.sleep(0.01)
        status, body = await post(
            http, f"{d.url}/v1/completions", client | {"kv_transfer_params": p_resp["kv_transfer_params"]}
        )
        assert status == 500
        assert body == {
            "error": {
                "message": "Internal server error",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
        assert await metric(http, d.url, "vllm:nixl_num_failed_transfers_total") == 1
        async with http.get(f"{d.url}/health") as r:
            assert r.status == 200
    finally:
        await g.stop()


async def test_unknown_prefill_engine_fails_decode(group: WorkerGroup, http: aiohttp.ClientSession) -> None:
    client, _ = _pd_bodies()
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "nobody",
        "remote_request_id": "x",
        "remote_block_ids": [[1]],
    }
    status, body = await post(
        http, f"{group.worker('D0').url}/v1/completions", client | {"kv_transfer_params": params}
    )
    assert status == 500
    assert body["error"]["message"] == "Internal server error"


async def test_plain_follow_up_turn_hits_the_prefix_cache(
    group: WorkerGroup, http: aiohttp.ClientSession
) -> None:
    url = group.worker("D1").url
    history = [{"role": "user", "content": LONG_PROMPT}]
    _, turn1 = await post(http, f"{url}/v1/chat/completions", {"messages": history, "max_tokens": 40})
    answer = turn1["choices"][0]["message"]["content"]
    hits_before = await metric(http, url, "vllm:prefix_cache_hits_total")
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    _, turn2 = await post(http, f"{url}/v1/chat/completions", {"messages": history, "max_tokens": 4})
    hits = await metric(http, url, "vllm:prefix_cache_hits_total") - hits_before
    cached = turn2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == hits
    # Everything of turn 1 (prompt + answer) is reused, in whole 16-token blocks.
    assert hits >= (turn1["usage"]["total_tokens"] // 16 - 1) * 16
    assert hits % 16 == 0


async def test_pd_across_processes_uses_the_side_channel(http: aiohttp.ClientSession) -> None:
    prefill = await start_alone("P0", "prefill")
    decode = await start_alone("D0", "decode")
    try:
        p, d = prefill.workers[0], decode.workers[0]
        assert d.fabric.source(p.engine_id) is None
        client, p_body = _pd_bodies()
        _, p_resp = await post(http, f"{p.url}/v1/completions", p_body)
        params = p_resp["kv_transfer_params"]
        status, d_resp = await post(http, f"{d.url}/v1/completions", client | {"kv_transfer_params": params})
        assert status == 200, d_resp
        assert d_resp["usage"]["completion_tokens"] == 6
        assert await metric(http, d.url, "vllm:nixl_xfer_time_seconds_count") == 1
        for _ in range(2000):  # the release travels back asynchronously
            if p.engine.stats().num_pinned == 0:
                break
            await asyncio.sleep(0.01)
        assert p.engine.stats().num_pinned == 0
        # The lease is gone once read: a second claim is refused (410). D itself would not even ask
        # again: its prefix cache now holds the whole prompt (a full local hit needs no pull).
        claim = {"remote_request_id": params["remote_request_id"]}
        status, body = await post(http, f"{p.url}/_nixl/claim", claim)
        assert (status, body) == (410, {"claimed": False})
        status, _ = await post(http, f"{d.url}/v1/completions", client | {"kv_transfer_params": params})
        assert status == 200
        assert await metric(http, d.url, "vllm:nixl_xfer_time_seconds_count") == 1
    finally:
        await decode.stop()
        await prefill.stop()


async def test_side_channel_to_a_dead_prefill_worker_fails_cleanly(http: aiohttp.ClientSession) -> None:
    decode = await start_alone("D0", "decode")
    try:
        client, _ = _pd_bodies()
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "gone",
            "remote_request_id": "x",
            "remote_host": "127.0.0.1",
            "remote_port": 9,  # discard port: nothing listens
        }
        url = f"{decode.workers[0].url}/v1/completions"
        status, body = await post(http, url, client | {"kv_transfer_params": params})
        assert status == 500
        assert body["error"]["code"] == 500
    finally:
        await decode.stop()


async def test_rejected_decode_leg_frees_the_prefill_blocks(
    group: WorkerGroup, http: aiohttp.ClientSession
) -> None:
    p, d = group.worker("P0"), group.worker("D0")
    client, p_body = _pd_bodies()
    _, p_resp = await post(http, f"{p.url}/v1/completions", p_body)
    assert p.engine.stats().num_pinned == 1
    bad = client | {"min_tokens": 99, "kv_transfer_params": p_resp["kv_transfer_params"]}
    status, body = await post(http, f"{d.url}/v1/completions", bad)
    assert status == 400
    assert "min_tokens" in body["error"]["message"]
    assert p.engine.stats().num_pinned == 0


async def test_workers_on_one_node_pair_share_a_link(http: aiohttp.ClientSession) -> None:
    base = WorkerSettings(worker_id="W", role="replica")
    nodes = {"P0": "prefill-node", "D0": "decode-node", "D1": "decode-node"}
    settings = GroupSettings(
        topology=Topology.parse("1P2D"), base_port=0, worker=base, nodes=nodes, spin_s=0.0
    )
    g = WorkerGroup(settings, load_profile())
    await g.start()
    try:
        for i, d in enumerate(("D0", "D1")):
            client, p_body = _pd_bodies()
            client["prompt"] = p_body["prompt"] = f"{i} {LONG_PROMPT}"
            _, p_resp = await post(http, f"{g.worker('P0').url}/v1/completions", p_body)
            status, _ = await post(
                http,
                f"{g.worker(d).url}/v1/completions",
                client | {"kv_transfer_params": p_resp["kv_transfer_params"]},
            )
            assert status == 200
        assert g.fabric.link_pairs() == [("prefill-node", "decode-node")]
    finally:
        await g.stop()


async def test_echo_with_and_without_streaming(group: WorkerGroup, http: aiohttp.ClientSession) -> None:
    url = f"{group.worker('D0').url}/v1/completions"
    _, full = await post(http, url, {"prompt": "Once upon a time", "max_tokens": 3, "echo": True, "seed": 1})
    assert "<|begin_of_text|>" not in full["choices"][0]["text"]
    assert full["choices"][0]["text"].startswith("Once upon a time")
    events = await sse(
        http, url, {"prompt": "Once upon a time", "max_tokens": 3, "echo": True, "seed": 1, "stream": True}
    )
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert streamed == full["choices"][0]["text"]


async def test_many_concurrent_pd_pairs_leave_nothing_behind(
    group: WorkerGroup, http: aiohttp.ClientSession
) -> None:
    async def pair(i: int) -> int:
        client, p_body = _pd_bodies(stream=i % 2 == 0)
        client["prompt"] = p_body["prompt"] = f"conversation {i}: {LONG_PROMPT}"
        rid = {"X-Request-Id": f"many-{i}"}
        _, p_resp = await post(http, f"{group.worker('P0').url}/v1/completions", p_body, **rid)
        d_url = f"{group.worker(f'D{i % 2}').url}/v1/completions"
        d_body = client | {"kv_transfer_params": p_resp["kv_transfer_params"]}
        if client.get("stream"):
            events = await sse(http, d_url, d_body, **rid)
            return int(events[-2]["usage"]["completion_tokens"])
        status, d_resp = await post(http, d_url, d_body, **rid)
        assert status == 200
        return int(d_resp["usage"]["completion_tokens"])

    counts = await asyncio.gather(*(pair(i) for i in range(24)))
    assert counts == [6] * 24
    for w in group.workers:
        assert w.engine.load() == 0
        assert w.engine.stats().num_pinned == 0
        assert w.driver.num_active == 0


async def test_http10_stream_is_not_chunk_framed(group: WorkerGroup) -> None:
    """The direct-write fast path frames chunks itself; it must stay off when aiohttp does not chunk."""
    d = group.worker("D0")
    body = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", d.port)
    writer.write(
        b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    raw = await reader.read()  # HTTP/1.0: the server closes the connection at the end
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert b"chunked" not in head.lower()
    events = [e for e in payload.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events)
    assert events[-1] == b"data: [DONE]"
    assert len(events) == 5


async def test_http11_stream_takes_the_direct_write_path(
    group: WorkerGroup, http: aiohttp.ClientSession
) -> None:
    """aiohttp chunks an HTTP/1.1 stream without `response.chunked` saying so; the direct-write path must
    still be taken (it was silently off once), and its framing must parse as aiohttp's would."""
    d = group.worker("D0")
    body = {"prompt": "hi", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    seen = 0
    async with http.post(f"{d.url}/v1/completions", json=body) as response:
        assert response.headers["Transfer-Encoding"] == "chunked"
        async for line in response.content:
            if line.startswith(b"data: {"):
                json.loads(line[len(b"data: ") :])
                seen += 1
                if seen == 3:
                    assert d.driver.num_direct == 1
                    break
    for _ in range(500):  # the client went away: the request is aborted and its handle dropped
        if d.driver.num_active == 0:
            break
        await asyncio.sleep(0.01)
    assert d.driver.num_active == 0


async def test_reset_prefix_cache_is_a_dev_route_that_empties_the_cache(http: aiohttp.ClientSession) -> None:
    """vLLM serves POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 (404 otherwise); after a
    reset, the same prompt finds nothing cached."""
    plain = await start_alone("D0", "decode")
    dev = await start_alone("D1", "decode", server_dev_mode=True)
    try:
        async with http.post(f"{plain.workers[0].url}/reset_prefix_cache") as r:
            assert r.status == 404
        url = dev.workers[0].url
        body = {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 4}
        await post(http, f"{url}/v1/chat/completions", body)
        _, again = await post(http, f"{url}/v1/chat/completions", body)
        assert again["usage"]["prompt_tokens"] > 0
        hits = await metric(http, url, "vllm:prefix_cache_hits_total")
        assert hits > 0  # the second request reused the first one's blocks
        assert await post(http, f"{url}/reset_prefix_cache", None) == (200, {"success": True})
        await post(http, f"{url}/v1/chat/completions", body)
        assert await metric(http, url, "vllm:prefix_cache_hits_total") == hits  # nothing left to hit
    finally:
        await plain.stop()
        await dev.stop()
