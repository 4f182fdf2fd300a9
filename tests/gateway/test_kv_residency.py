"""KV residency end to end: simulated workers publish their KV events, the gateway follows them
(gateway/kv_subscriber.py -> residency.py) and routes a conversation whose prefix D evicted as a
cold one (reason kv_evicted); and the subscriber's handling of a broken event stream."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest

from gateway.app import DEPS
from gateway.deps import Deps
from gateway.kv_subscriber import KvSubscriber
from gateway.metrics import GatewayMetrics
from gateway.residency import Residency
from ppd.kv_events import (
    END_SEQ,
    BlockHasher,
    BlockStored,
    EventBatch,
    KvEventsConfig,
    encode_batch,
    encode_seq,
)
from simulator.server.worker_group import WorkerGroup
from tests.gateway.fake_decision import FakeDecision
from tests.simulator.client import start_group
from tests.support.gateway_app import kv_events_settings, served_gateway
from tests.support.metrics import sample, total
from tests.support.polling import eventually

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
EVENTS = KvEventsConfig(True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")


@pytest.fixture
async def workers() -> AsyncIterator[WorkerGroup]:
    # 40 blocks of 16 tokens per worker: a few long prompts sent to D evict a conversation's prefix.
    group = await start_group("1P1D", kv_events=EVENTS, kv_capacity_tokens=640)
    try:
        yield group
    finally:
        await group.stop()


@pytest.fixture
async def decision() -> AsyncIterator[FakeDecision]:
    svc = await FakeDecision().start()  # answers LOCAL, reason TABLE
    yield svc
    await svc.stop()


class Gateway:
    def __init__(self, server: TestServer, http: aiohttp.ClientSession) -> None:
        self.server, self.http = server, http

    @property
    def deps(self) -> Deps:
        return self.server.app[DEPS]

    async def chat(self, messages: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, Any]]:
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        async with self.http.post(str(self.server.make_url("/v1/chat/completions")), json=body) as resp:
            assert resp.status == 200, await resp.text()
            return dict(resp.headers), await resp.json()

    async def metrics(self) -> str:
        async with self.http.get(str(self.server.make_url("/metrics"))) as resp:
            return await resp.text()


@pytest.fixture
async def gateway(workers: WorkerGroup, decision: FakeDecision) -> AsyncIterator[Gateway]:
    ws = {w.settings.worker_id: w for w in workers.workers}
    config: dict[str, Any] = {
        "mode": "ppd",
        "workers": [{"id": i, "role": w.settings.role, "url": w.url} for i, w in ws.items()],
        "decision": {"address": decision.address, "deadline_ms": 10000.0},
        "pool": {"health_interval_s": 3600.0},
        "sessions": {"sweep_interval_s": 3600.0},
        "kv_events": kv_events_settings(ws),
    }
    async with served_gateway(config) as (server, http):
        yield Gateway(server, http)


async def _tokens(http: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]]) -> list[int]:
    async with http.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages}) as resp:
        tokens: list[int] = (await resp.json())["tokens"]
        return tokens


async def test_d_evicts_the_prefix_and_the_next_turn_is_routed_cold(
    workers: WorkerGroup, gateway: Gateway, decision: FakeDecision
) -> None:
    d0 = next(w for w in workers.workers if w.settings.worker_id == "D0")
    kv = gateway.deps.kv
    assert kv is not None
    await eventually(lambda: _true(kv.residency.synced("D0")), what="D0's event stream synced")

    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me about lighthouses " * 6}]
    headers, body = await gateway.chat(messages)
    assert (headers["X-PPD-Path"], headers["X-PPD-Reason"]) == ("pd", "turn_one")
    first = BlockHasher.from_environ(os.environ).chain(await _tokens(gateway.http, d0.url, messages))
    await eventually(
        lambda: _true(kv.residency.resident_blocks("D0", first) == len(first)),
        what="the gateway seeing D0 hold turn 1",
    )
    messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}]
    messages += [{"role": "user", "content": "and their keepers?"}]
    headers, body = await gateway.chat(messages)
    assert (headers["X-PPD-Path"], headers["X-PPD-Reason"]) == ("local", "table")  # resident: asked
    asked = len(decision.seen)
    assert decision.seen[-1].context_tokens > 0

    # Other traffic on D0 fills its small cache: the conversation's blocks are evicted.
    for i in range(6):
        payload = {"model": MODEL, "prompt": f"{i} unrelated filler text " * 40, "max_tokens": 1}
        async with gateway.http.post(f"{d0.url}/v1/completions", json=payload) as resp:
            assert resp.status == 200
    await eventually(
        lambda: _true(kv.residency.resident_blocks("D0", first) == 0), what="the gateway seeing the eviction"
    )

    messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}]
    messages += [{"role": "user", "content": "and today?"}]
    headers, _ = await gateway.chat(messages)
    assert (headers["X-PPD-Path"], headers["X-PPD-Reason"]) == ("pd", "kv_evicted")
    assert len(decision.seen) == asked  # routed like a cold turn: the DecisionService was not asked
    text = await gateway.metrics()
    assert sample(text, "ppd_gateway_decisions_total", {"path": "pd", "reason": "kv_evicted"}) == 1
    assert (sample(text, "ppd_gateway_kv_tracked_blocks", {"worker": "D0"}) or 0) > 0
    assert sample(text, "ppd_gateway_kv_events_synced", {"worker": "D0"}) == 1


async def test_a_partly_evicted_context_is_scored_on_its_resident_part(
    workers: WorkerGroup, gateway: Gateway, decision: FakeDecision
) -> None:
    d0 = next(w for w in workers.workers if w.settings.worker_id == "D0")
    kv = gateway.deps.kv
    assert kv is not None
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Explain tides and the moon " * 8}]
    _, body = await gateway.chat(messages)
    first = BlockHasher.from_environ(os.environ).chain(await _tokens(gateway.http, d0.url, messages))
    await eventually(
        lambda: _true(kv.residency.resident_blocks("D0", first) == len(first)),
        what="the gateway seeing D0 hold turn 1",
    )
    messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}]
    messages += [{"role": "user", "content": "and spring tides?"}]
    headers, body = await gateway.chat(messages)
    full = decision.seen[-1]
    assert headers["X-PPD-Reason"] == "table"
    # As if D0 had announced BlockRemoved for turn 1's blocks from block 2 on (the stream stays synced).
    for h in first[2:]:
        del kv.residency.state("D0").blocks[h]
    messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}]
    messages += [{"role": "user", "content": "and neap tides?"}]
    headers, _ = await gateway.chat(messages)
    part = decision.seen[-1]
    assert headers["X-PPD-Reason"] == "table"  # still asked: part of the context is resident
    assert part.context_tokens == 2 * 16
    assert part.new_input_tokens > full.new_input_tokens + full.context_tokens - 2 * 16


async def _true(value: bool) -> bool:
    return value


# ------------------------------------------------------------------ a broken stream, with a fake publisher


class FakePublisher:
    """A PUB socket and a ROUTER replay socket speaking vLLM's framing, driven by the test."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        self.sent: list[tuple[int, bytes]] = []
        self.replays = 0
        self._task = asyncio.get_running_loop().create_task(self._serve())

    @property
    def endpoint(self) -> str:
        return self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str:
        return self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    async def send(self, seq: int, *hashes: int, publish: bool = True) -> None:
        payload = encode_batch(EventBatch(0.0, (BlockStored(hashes, None, (), 16),), 0))
        self.sent.append((seq, payload))
        if publish:
            await self.pub.send_multipart((b"", encode_seq(seq), payload))

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            for seq, payload in self.sent:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart((client, b"", b"", encode_seq(seq), payload))
            await self.router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


async def test_a_sequence_gap_falls_back_to_belief_until_the_replay_resyncs() -> None:
    pub = FakePublisher()
    residency = Residency(["D0"], max_blocks=100)
    metrics = GatewayMetrics()
    sub = KvSubscriber(
        residency, {"D0": pub.endpoint}, {"D0": pub.replay_endpoint}, metrics, resync_interval_s=0.05
    )
    sub.start()
    try:
        await eventually(lambda: _true(residency.synced("D0")), what="the first (empty) resync")
        # ZMQ's slow joiner: publish until the subscriber sees the stream.
        seq = 0
        while residency.resident_blocks("D0", [100]) != 1:
            await pub.send(seq, 100)
            seq += 1
            await asyncio.sleep(0.02)
        await pub.send(seq, 1, publish=False)  # lost on the way
        await pub.send(seq + 1, 2)  # the gap shows here; the replay (which has seq) repairs it
        await eventually(
            lambda: _true(residency.synced("D0") and residency.resident_blocks("D0", [1]) == 1),
            what="resynced from the replay, with the lost batch",
        )
        assert total_gaps(metrics) >= 1
        assert pub.replays >= 2
    finally:
        await sub.close()
        await pub.close()


async def test_a_stream_without_replay_stays_on_belief_after_a_gap() -> None:
    pub = FakePublisher()
    residency = Residency(["D0"], max_blocks=100)
    sub = KvSubscriber(residency, {"D0": pub.endpoint}, {}, GatewayMetrics())
    sub.start()
    try:
        while not residency.synced("D0"):  # synced by seq 0 alone, which a slow joiner may miss
            await pub.send(0, 5)
            await asyncio.sleep(0.02)
        await pub.send(1, 6, publish=False)
        await pub.send(2, 7)
        await eventually(lambda: _true(not residency.synced("D0")), what="the gap seen")
        assert residency.resident_blocks("D0", [5]) is None
    finally:
        await sub.close()
        await pub.close()


def total_gaps(metrics: GatewayMetrics) -> float:
    return total(generate_latest(metrics.registry).decode(), "ppd_gateway_kv_event_gaps_total", {}) or 0.0
