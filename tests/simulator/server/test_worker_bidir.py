"""Bidirectional KV mode (vLLM's `bidirectional_kv_xfer`, docs/vllm-protocol.md 3.4) over HTTP on 127.0.0.1.

Turn 1 goes P -> D as a proxy sends it; D's final chunk then carries its own `kv_transfer_params`
(`do_remote_decode: true`) and D keeps the blocks. Turn 2 goes to P with D's params (as the multi-turn
proxy forwards them): P pulls the prompt prefix it lacks from D, prefills the rest and answers like any
prefill leg.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from simulator.core.worker_settings import DEFAULT_MODEL
from simulator.server.worker import Worker
from tests.simulator.client import metric, post, sse, start_alone, start_group
from tests.support.nixl import prefill_kv_params

pytestmark = pytest.mark.integration

QUESTION = " ".join(f"word{i}" for i in range(150))
P_LEG_KEYS = {
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
    "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
    "remote_blocks_expiry_time", "remote_registration_generation", "transfer_mode",
    "remote_prefill_cached_tokens",
}  # fmt: skip


def chat(history: list[dict[str, str]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": DEFAULT_MODEL, "messages": history, "max_tokens": max_tokens, "ignore_eos": True} | extra


def p_leg(client: dict[str, Any], kv: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg a proxy derives from a client body (docs/vllm-protocol.md 1.2, 3.4)."""
    body = {k: v for k, v in client.items() if k not in ("stream_options", "min_tokens")}
    return body | {"stream": False, "max_tokens": 1, "kv_transfer_params": kv}


def from_decoder(params: dict[str, Any]) -> dict[str, Any]:
    """D's params as the multi-turn proxy sends them to P on the next turn."""
    return params | {"do_remote_decode": True, "do_remote_prefill": False}


async def turn1(
    http: aiohttp.ClientSession, p: Worker, d: Worker, answer_tokens: int, *, stream: bool = False
) -> tuple[list[dict[str, str]], dict[str, Any], Any]:
    """Turn 1 through P then D; returns the next turn's history, D's usage and D's params (or None)."""
    history = [{"role": "user", "content": QUESTION}]
    client = chat(history, answer_tokens)
    status, p_resp = await post(http, f"{p.url}/v1/chat/completions", p_leg(client, prefill_kv_params()))
    assert status == 200, p_resp
    d_body = client | {"kv_transfer_params": p_resp["kv_transfer_params"]}
    if stream:
        events = await sse(
            http,
            f"{d.url}/v1/chat/completions",
            d_body | {"stream": True, "stream_options": {"include_usage": True}},
        )
        assert events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
        finishing = [e for e in events[:-2] if e["choices"][0]["finish_reason"] is not None]
        assert len(finishing) == 1
        assert all(e.get("kv_transfer_params") is None for e in events[:-2] if e is not finishing[0])
        params = finishing[0]["kv_transfer_params"]
    else:
        status, d_resp = await post(http, f"{d.url}/v1/chat/completions", d_body)
        assert status == 200, d_resp
        usage, params = d_resp["usage"], d_resp["kv_transfer_params"]
        text = d_resp["choices"][0]["message"]["content"]
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Tell me more."}]
    return history, usage, params


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_leg_returns_its_blocks_params_on_the_final_chunk(
    http: aiohttp.ClientSession, stream: bool
) -> None:
    g = await start_group("1P1D", enable_prompt_tokens_details=True, bidirectional_kv_xfer=True)
    try:
        p, d = g.workers
        _, usage, params = await turn1(http, p, d, 40, stream=stream)
        assert set(params) == P_LEG_KEYS
        assert params["do_remote_prefill"] is False
        assert params["do_remote_decode"] is True
        assert params["remote_engine_id"] == d.engine_id
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", d.port)
        assert params["remote_request_id"].startswith("chatcmpl-")
        # D holds the KV of the prompt and of every output token but the last.
        assert params["remote_num_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
        assert len(params["remote_block_ids"][0]) == -(-params["remote_num_tokens"] // 16)
        assert params["transfer_mode"] == "pull"
        # Pinned for decoder_kv_blocks_ttl (480 s) on D's clock, with no heartbeats; P's lease is gone.
        expiry = params["remote_blocks_expiry_time"]
        assert expiry == d.engine.lease_expires_at(params["remote_request_id"])
        assert 470.0 < expiry - d.driver.now() <= 480.0
        assert d.engine.stats().num_pinned == 1
        assert p.engine.stats().num_pinned == 0
        assert await metric(http, d.url, "vllm:request_success_total", finished_reason="length") == 1
    finally:
        await g.stop()


async def test_next_turn_prefill_pulls_the_decoders_blocks(http: aiohttp.ClientSession) -> None:
    g = await start_group("1P1D", enable_prompt_tokens_details=True, bidirectional_kv_xfer=True)
    try:
        p, d = g.workers
        history, usage1, d_params = await turn1(http, p, d, 120)
        hits_before = await metric(http, p.url, "vllm:prefix_cache_hits_total")
        by_source = "vllm:prompt_tokens_by_source_total"
        compute_before = await metric(http, p.url, by_source, source="local_compute")

        client = chat(history, 10)
        status, p_resp = await post(
            http, f"{p.url}/v1/chat/completions", p_leg(client, from_decoder(d_params))
        )
        assert status == 200, p_resp
        assert p_resp["usage"]["completion_tokens"] == 1
        assert p_resp["choices"][0]["finish_reason"] == "length"
        prompt2 = p_resp["usage"]["prompt_tokens"]
        local = await metric(http, p.url, "vllm:prefix_cache_hits_total") - hits_before
        assert local == (usage1["prompt_tokens"] // 16) * 16  # P's own turn-1 prompt blocks
        pulled = d_params["remote_num_tokens"] - local
        assert pulled >= 64
        assert await metric(http, p.url, "vllm:nixl_xfer_time_seconds_count", absent=0.0) == 1
        assert await metric(http, p.url, "vllm:external_prefix_cache_hits_total") == pulled
        computed = await metric(http, p.url, by_source, source="local_compute")
        assert computed - compute_before == prompt2 - local - pulled  # the shorter prefill
        # P reports the pulled tokens as cached, to its client and to D (remote_prefill_cached_tokens).
        assert p_resp["usage"]["prompt_tokens_details"]["cached_tokens"] == local + pulled
        p_params = p_resp["kv_transfer_params"]
        assert (p_params["do_remote_prefill"], p_params["do_remote_decode"]) == (True, False)
        assert p_params["remote_prefill_cached_tokens"] == local + pulled
        assert p_params["remote_blocks_expiry_time"] is None
        # D's blocks were read once and unpinned; they stay in D's prefix cache.
        assert d.engine.stats().num_pinned == 0

        # D serves turn 2 from its own cache plus P's few new tokens, and hands its blocks back again.
        status, d_resp = await post(
            http, f"{d.url}/v1/chat/completions", client | {"kv_transfer_params": p_params}
        )
        assert status == 200, d_resp
        assert d_resp["usage"]["prompt_tokens_details"]["cached_tokens"] == local + pulled
        assert d_resp["kv_transfer_params"]["do_remote_decode"] is True
        assert d.engine.stats().num_pinned == 1
        assert await metric(http, d.url, "vllm:external_prefix_cache_hits_total") < (
            usage1["prompt_tokens"] + prompt2
        )
    finally:
        await g.stop()


@pytest.mark.parametrize("threshold", [64, 0])
async def test_pulls_below_the_recompute_threshold_are_skipped(
    http: aiohttp.ClientSession, threshold: int
) -> None:
    g = await start_group(
        "1P1D",
        enable_prompt_tokens_details=True,
        bidirectional_kv_xfer=True,
        kv_recompute_threshold=threshold,
    )
    try:
        p, d = g.workers
        # A short answer: D holds only ~10 tokens beyond P's cached turn-1 prompt blocks.
        history, usage1, d_params = await turn1(http, p, d, 8)
        local = (usage1["prompt_tokens"] // 16) * 16
        assert 0 < d_params["remote_num_tokens"] - local < 64
        status, p_resp = await post(
            http, f"{p.url}/v1/chat/completions", p_leg(chat(history, 4), from_decoder(d_params))
        )
        assert status == 200, p_resp
        transfers = await metric(http, p.url, "vllm:nixl_xfer_time_seconds_count", absent=0.0)
        external = await metric(http, p.url, "vllm:external_prefix_cache_hits_total")
        cached = p_resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        if threshold:
            assert (transfers, external, cached) == (0, 0, local)
        else:
            assert (transfers, external, cached) == (
                1,
                d_params["remote_num_tokens"] - local,
                local + external,
            )
        assert d.engine.stats().num_pinned == 0  # read, or told it will not be read
    finally:
        await g.stop()


async def test_expired_decoder_blocks_fail_the_prefill_like_vllm(http: aiohttp.ClientSession) -> None:
    g = await start_group(
        "1P1D", enable_prompt_tokens_details=True, bidirectional_kv_xfer=True, decoder_kv_blocks_ttl_s=0.3
    )
    try:
        p, d = g.workers
        history, _, d_params = await turn1(http, p, d, 120)
        for _ in range(3000):  # wait for D to report the expiry (poll the fact, not the clock)
            if await metric(http, d.url, "vllm:nixl_num_kv_expired_reqs_total") >= 1:
                break
            await asyncio.sleep(0.01)
        assert d.engine.stats().num_pinned == 0
        status, body = await post(
            http, f"{p.url}/v1/chat/completions", p_leg(chat(history, 4), from_decoder(d_params))
        )
        # vLLM's default kv_load_failure_policy=fail: the load failure ends the request with HTTP 500.
        assert status == 500
        assert body["error"] == {
            "message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500
        }  # fmt: skip
        declined = await metric(http, p.url, "vllm:nixl_num_kv_expired_reqs_total")
        refused = await metric(http, p.url, "vllm:nixl_num_failed_transfers_total")
        assert declined + refused == 1
        async with http.get(f"{p.url}/health") as r:
            assert r.status == 200
        # Without D's params the same turn is served by P locally.
        status, _ = await post(
            http, f"{p.url}/v1/chat/completions", p_leg(chat(history, 4), prefill_kv_params())
        )
        assert status == 200
    finally:
        await g.stop()


async def test_prefill_declines_a_read_past_the_advertised_expiry(http: aiohttp.ClientSession) -> None:
    g = await start_group("1P1D", enable_prompt_tokens_details=True, bidirectional_kv_xfer=True)
    try:
        p, d = g.workers
        history, _, d_params = await turn1(http, p, d, 120)
        stale = from_decoder(d_params) | {
            "remote_blocks_expiry_time": d_params["remote_blocks_expiry_time"] - 480.0
        }
        status, _ = await post(http, f"{p.url}/v1/chat/completions", p_leg(chat(history, 4), stale))
        assert status == 500
        assert await metric(http, p.url, "vllm:nixl_num_kv_expired_reqs_total") == 1
        assert await metric(http, p.url, "vllm:nixl_xfer_time_seconds_count", absent=0.0) == 0
        assert d.engine.stats().num_pinned == 1  # never asked for: D keeps them until its TTL
    finally:
        await g.stop()


async def test_without_the_flag_nothing_changes(http: aiohttp.ClientSession) -> None:
    g = await start_group("1P1D", enable_prompt_tokens_details=True)
    try:
        p, d = g.workers
        history, _, d_params = await turn1(http, p, d, 120)
        assert d_params is None
        assert d.engine.stats().num_pinned == 0
        _, _, streamed = await turn1(http, p, d, 20, stream=True)
        assert streamed is None
        # D-like params sent to a P without the flag are ignored: a local prefill, no pull.
        fake = {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": d.engine_id,
            "remote_request_id": "x", "remote_block_ids": [[1, 2, 3]], "remote_host": "127.0.0.1",
            "remote_port": d.port, "remote_num_tokens": 400,
        }  # fmt: skip
        status, p_resp = await post(http, f"{p.url}/v1/chat/completions", p_leg(chat(history, 4), fake))
        assert status == 200, p_resp
        assert await metric(http, p.url, "vllm:nixl_xfer_time_seconds_count", absent=0.0) == 0
        assert await metric(http, p.url, "vllm:external_prefix_cache_queries_total") == 0
    finally:
        await g.stop()


async def test_reverse_pull_across_processes_uses_the_side_channel(http: aiohttp.ClientSession) -> None:
    prefill = await start_alone(
        "P0", "prefill", bidirectional_kv_xfer=True, enable_prompt_tokens_details=True
    )
    decode = await start_alone("D0", "decode", bidirectional_kv_xfer=True, enable_prompt_tokens_details=True)
    try:
        p, d = prefill.workers[0], decode.workers[0]
        history, usage1, d_params = await turn1(http, p, d, 120)
        assert p.fabric.source(d.engine_id) is None
        status, p_resp = await post(
            http, f"{p.url}/v1/chat/completions", p_leg(chat(history, 4), from_decoder(d_params))
        )
        assert status == 200, p_resp
        pulled = d_params["remote_num_tokens"] - (usage1["prompt_tokens"] // 16) * 16
        assert await metric(http, p.url, "vllm:external_prefix_cache_hits_total") == pulled
        for _ in range(2000):  # the release travels back asynchronously
            if d.engine.stats().num_pinned == 0:
                break
            await asyncio.sleep(0.01)
        assert d.engine.stats().num_pinned == 0
    finally:
        await decode.stop()
        await prefill.stop()
