"""A simulated worker publishes vLLM's KV cache events (simulator/server/kv_events.py) from its own
block pool: stores of the prompt's full blocks with vLLM's hash chain, evictions under a small KV
budget, one batch per engine step, and the replay socket."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import aiohttp
import pytest
import zmq
import zmq.asyncio

from ppd.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventsConfig,
    decode_batch,
    decode_seq,
    encode_seq,
    parse_kv_events_config,
)
from simulator.server.worker_group import WorkerGroup
from tests.simulator.client import post, start_group
from tests.support.polling import eventually

CONFIG = KvEventsConfig(
    enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"
)


@pytest.fixture
async def replica() -> AsyncIterator[WorkerGroup]:
    # 6 blocks of 16 tokens: a second 60-token prompt must evict most of the first one's blocks.
    group = await start_group("1R", kv_events=CONFIG, kv_capacity_tokens=96)
    try:
        yield group
    finally:
        await group.stop()


async def _replay(endpoint: str, start: int = 0) -> list[tuple[int, EventBatch]]:
    """Every buffered batch from `start` on, through the worker's ROUTER replay socket."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        await sock.send_multipart((b"", encode_seq(start)))
        out: list[tuple[int, EventBatch]] = []
        while True:
            frames = await sock.recv_multipart()
            _, _topic, seq, payload = frames
            if seq == END_SEQ:
                return out
            out.append((decode_seq(seq), decode_batch(payload)))
    finally:
        sock.close(linger=0)
        ctx.term()


async def _tokens(http: aiohttp.ClientSession, url: str, text: str) -> list[int]:
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": text}
    status, body = await post(http, f"{url}/tokenize", body)
    assert status == 200
    tokens: list[int] = body["tokens"]
    return tokens


async def _complete(http: aiohttp.ClientSession, url: str, text: str) -> None:
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": text, "max_tokens": 1}
    status, _ = await post(http, f"{url}/v1/completions", body)
    assert status == 200


async def test_stores_carry_vllms_hash_chain_and_a_small_budget_evicts(
    replica: WorkerGroup, http: aiohttp.ClientSession
) -> None:
    worker = replica.workers[0]
    described = worker.describe()
    assert described["kv_events"].startswith("tcp://127.0.0.1:")
    first = "alpha " * 60
    second = "omega " * 60
    await _complete(http, worker.url, first)
    await _complete(http, worker.url, second)
    batches = await _replay(described["kv_events_replay"])
    assert [seq for seq, _ in batches] == list(range(len(batches)))  # from 0, no gap
    events = [e for _, b in batches for e in b.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    hasher = BlockHasher.from_environ(os.environ)
    first_chain = hasher.chain(await _tokens(http, worker.url, first))
    second_chain = hasher.chain(await _tokens(http, worker.url, second))
    assert [h for e in stored for h in e.block_hashes] == first_chain + second_chain
    assert stored[0].parent_block_hash is None
    assert stored[0].block_size == 16
    assert list(stored[0].token_ids) == (await _tokens(http, worker.url, first))[: 16 * len(first_chain)]
    assert removed  # the first prompt was evicted for the second
    assert set(removed) <= set(first_chain)


async def test_a_live_subscriber_gets_the_batches_in_sequence(
    replica: WorkerGroup, http: aiohttp.ClientSession
) -> None:
    worker = replica.workers[0]
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(worker.describe()["kv_events"])
    try:
        seen: list[int] = []
        # A SUB socket misses what is sent before its subscription reaches the publisher (ZMQ's slow
        # joiner): send requests until one batch arrives, then check the sequence is contiguous.
        for i in range(50):
            await _complete(http, worker.url, f"turn {i} " * 20)
            if await sub.poll(200):
                break
        for _ in range(3):
            await _complete(http, worker.url, "again " * 30 + str(len(seen)))
        while await sub.poll(500):
            topic, seq, payload = await sub.recv_multipart()
            assert topic == b""
            decode_batch(payload)
            seen.append(decode_seq(seq))
        assert len(seen) >= 2
        assert seen == list(range(seen[0], seen[0] + len(seen)))
    finally:
        sub.close(linger=0)
        ctx.term()


def test_config_parses_vllms_fields_and_refuses_others() -> None:
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
    assert config.enabled
    assert config.offset(2).endpoint == "tcp://*:5559"
    assert config.offset(2).replay_endpoint is None
    assert KvEventsConfig(True, endpoint="tcp://*:0").offset(3).endpoint == "tcp://*:0"
    assert not parse_kv_events_config("{}").enabled
    for bad in ("[]", "{", '{"nope": 1}', '{"publisher": "kafka"}', '{"buffer_steps": 0}'):
        with pytest.raises(ValueError, match="--kv-events-config"):
            parse_kv_events_config(bad)


async def test_a_restarted_engine_announces_an_empty_cache(
    replica: WorkerGroup, http: aiohttp.ClientSession
) -> None:
    """A crash (the `down` fault) loses the engine and its prefix cache; the fresh engine's first
    event says so, so a subscriber does not keep believing in the lost blocks."""
    worker = replica.workers[0]
    await _complete(http, worker.url, "remember me " * 20)
    status, _ = await post(http, f"{worker.url}/admin/faults", {"down": True, "down_for_s": 0.1})
    assert status == 200

    async def cleared() -> bool:
        events = [e for _, b in await _replay(worker.describe()["kv_events_replay"]) for e in b.events]
        return isinstance(events[-1], AllBlocksCleared)

    await eventually(cleared, what="AllBlocksCleared after the restart")
