"""Prefix-aware placement end to end (plan.py rule 8, ppd/placement.py): simulated P and D workers
publish their KV events, the gateway follows every one of them, and a Turn 2 that goes through P goes
to the P holding the conversation's history; an unsynced stream, or placement least_loaded, takes the
least-loaded P as before."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.app import DEPS
from gateway.deps import Deps
from gateway.residency import KvTracking
from gateway.session_lookup import remember_turn
from gateway.sessions import explicit_key
from ppd.kv_events import BlockHasher, KvEventsConfig
from simulator.server.worker_group import WorkerGroup
from tests.simulator.client import start_group
from tests.support.gateway_app import kv_events_settings, served_gateway
from tests.support.metrics import sample, total
from tests.support.polling import eventually

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
EVENTS = KvEventsConfig(True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")


@pytest.fixture
async def workers() -> AsyncIterator[WorkerGroup]:
    group = await start_group("2P1D", kv_events=EVENTS)
    try:
        yield group
    finally:
        await group.stop()


class Gateway:
    def __init__(self, server: TestServer, http: aiohttp.ClientSession, workers: WorkerGroup) -> None:
        self.server, self.http, self.workers = server, http, workers

    @property
    def kv(self) -> KvTracking:
        deps: Deps = self.server.app[DEPS]
        assert deps.kv is not None
        return deps.kv

    async def chat(
        self, messages: list[dict[str, Any]], headers: dict[str, str] | None = None
    ) -> tuple[dict[str, str], str]:
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        url = str(self.server.make_url("/v1/chat/completions"))
        async with self.http.post(url, json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            answer: str = (await resp.json())["choices"][0]["message"]["content"]
            return dict(resp.headers), answer

    async def metrics(self) -> str:
        async with self.http.get(str(self.server.make_url("/metrics"))) as resp:
            return await resp.text()

    async def holds(self, worker: str, messages: list[dict[str, Any]]) -> bool:
        """Whether the gateway sees ``worker`` hold every whole block of the prompt ``messages``."""
        url = next(w.url for w in self.workers.workers if w.settings.worker_id == worker)
        async with self.http.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages}) as resp:
            tokens: list[int] = (await resp.json())["tokens"]
        hashes = BlockHasher.from_environ(os.environ).chain(tokens)
        return bool(hashes) and self.kv.residency.resident_blocks(worker, hashes) == len(hashes)


async def _gateway(workers: WorkerGroup, placement: str) -> AsyncIterator[Gateway]:
    ws = {w.settings.worker_id: w for w in workers.workers}
    config: dict[str, Any] = {
        "mode": "pd",
        "workers": [{"id": i, "role": w.settings.role, "url": w.url} for i, w in ws.items()],
        "pool": {"health_interval_s": 3600.0},
        "sessions": {"sweep_interval_s": 3600.0},
        "routing": {"placement": placement},
        "kv_events": kv_events_settings(ws),
    }
    async with served_gateway(config) as (server, http):
        gw = Gateway(server, http, workers)
        await eventually(
            lambda: _true(all(gw.kv.residency.synced(w) for w in ws)), what="every worker's events synced"
        )
        yield gw


@pytest.fixture
async def gateway(workers: WorkerGroup) -> AsyncIterator[Gateway]:
    async for gw in _gateway(workers, "prefix"):
        yield gw


@pytest.fixture
async def least_loaded(workers: WorkerGroup) -> AsyncIterator[Gateway]:
    async for gw in _gateway(workers, "least_loaded"):
        yield gw


async def _first_turn(gw: Gateway) -> tuple[list[dict[str, Any]], str]:
    """Turn 1 of a conversation, once the gateway sees its P hold the prompt; (history, that P)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Describe the harbour at dawn " * 8}]
    headers, answer = await gw.chat(messages)
    p = headers["X-PPD-Prefill-Worker"]
    await eventually(lambda: gw.holds(p, messages), what=f"the gateway seeing {p} hold turn 1")
    return [
        *messages,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and at dusk?"},
    ], p


async def _cache_hits(gw: Gateway, worker: str) -> float:
    """The worker's own count of prompt tokens served from its prefix cache (vLLM's metric)."""
    url = next(w.url for w in gw.workers.workers if w.settings.worker_id == worker)
    async with gw.http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return total(text, "vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}) or 0.0


async def test_a_pd_turn_two_goes_to_the_p_holding_the_history(gateway: Gateway) -> None:
    messages, p = await _first_turn(gateway)
    hits = await _cache_hits(gateway, p)
    # The least-loaded P is the other one now (equal load: the one picked least recently).
    headers, _ = await gateway.chat(messages)
    assert (headers["X-PPD-Path"], headers["X-PPD-Turn"]) == ("pd", "2")
    assert headers["X-PPD-Prefill-Worker"] == p
    assert await _cache_hits(gateway, p) >= hits + 16 * 4  # P served turn 1's blocks from its cache
    text = await gateway.metrics()
    assert sample(text, "ppd_gateway_placements_total", {"role": "prefill", "by": "prefix"}) == 1
    assert sample(text, "ppd_gateway_placements_total", {"role": "decode", "by": "least_loaded"}) == 1
    # No /tokenize: Turn 1 opens with a message never seen (nothing to place by), Turn 2 is placed by
    # the marks of the prompt P returned on Turn 1 (return_token_ids); mode pd asks no ψ count.
    assert sample(text, "ppd_gateway_worker_tokenize_total", {"purpose": "token_ids"}) is None
    assert sample(text, "ppd_gateway_worker_tokenize_total", {"purpose": "count"}) is None


async def test_a_turn_one_opening_like_an_earlier_one_goes_to_the_p_holding_its_blocks(
    gateway: Gateway,
) -> None:
    system = {"role": "system", "content": "You are the harbour master's assistant. " * 24}
    first = [system, {"role": "user", "content": "When does the ferry leave?"}]
    headers, _ = await gateway.chat(first)
    p = headers["X-PPD-Prefill-Worker"]
    await eventually(lambda: gateway.holds(p, first), what=f"the gateway seeing {p} hold the first opening")
    hits = await _cache_hits(gateway, p)
    # Another conversation opening with the same system prompt: least loaded would take the other P.
    second = [system, {"role": "user", "content": "Where is the lighthouse?"}]
    headers, _ = await gateway.chat(second)
    assert (headers["X-PPD-Turn"], headers["X-PPD-Prefill-Worker"]) == ("1", p)
    assert await _cache_hits(gateway, p) >= hits + 16 * 8  # the system prompt's blocks, from p's cache
    text = await gateway.metrics()
    assert sample(text, "ppd_gateway_placements_total", {"role": "prefill", "by": "prefix"}) == 1
    # Placed by what the first conversation's P returned (openings.py): no /tokenize either time.
    assert sample(text, "ppd_gateway_worker_tokenize_total", {"purpose": "token_ids"}) is None


async def test_a_session_without_marks_is_placed_by_the_prompts_token_ids(gateway: Gateway) -> None:
    """A session no P leg marked (written by a gateway before marks, or P said no token ids): Turn 2
    asks a worker's /tokenize once and still goes to the P holding the history."""
    session_id = "no-marks"
    sent = {"X-Session-ID": session_id}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Describe the harbour at dawn " * 8}]
    headers, answer = await gateway.chat(messages, sent)
    p = headers["X-PPD-Prefill-Worker"]
    await eventually(lambda: gateway.holds(p, messages), what=f"the gateway seeing {p} hold turn 1")
    deps: Deps = gateway.server.app[DEPS]
    session = await deps.sessions.get(explicit_key(session_id))
    assert session is not None
    assert session.prompt_marks  # P returned the prompt's token ids
    await remember_turn(deps.sessions, dataclasses.replace(session, prompt_marks=""), explicit_id=session_id)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and at dusk?"}]
    headers, _ = await gateway.chat(messages, sent)
    assert (headers["X-PPD-Turn"], headers["X-PPD-Prefill-Worker"]) == ("2", p)
    text = await gateway.metrics()
    assert sample(text, "ppd_gateway_worker_tokenize_total", {"purpose": "token_ids"}) == 1
    after = await deps.sessions.get(explicit_key(session_id))
    assert after is not None
    assert after.prompt_marks  # marked again by Turn 2's P


async def test_an_unsynced_stream_falls_back_to_the_least_loaded_p(gateway: Gateway) -> None:
    messages, p = await _first_turn(gateway)
    # As after a sequence gap. Its subscriber asks for a replay only when it next wakes up, on a
    # message from that P: none comes before turn 2 is placed.
    gateway.kv.residency.lost(p)
    headers, _ = await gateway.chat(messages)
    assert headers["X-PPD-Path"] == "pd"
    assert headers["X-PPD-Prefill-Worker"] != p
    text = await gateway.metrics()
    assert sample(text, "ppd_gateway_placements_total", {"role": "prefill", "by": "prefix"}) is None


async def test_least_loaded_placement_ignores_the_history(least_loaded: Gateway) -> None:
    messages, p = await _first_turn(least_loaded)
    headers, _ = await least_loaded.chat(messages)
    assert headers["X-PPD-Prefill-Worker"] != p
    # Nothing to look up: the prompt's token ids are never asked for.
    text = await least_loaded.metrics()
    assert sample(text, "ppd_gateway_worker_tokenize_total", {"purpose": "token_ids"}) is None


async def _true(value: bool) -> bool:
    return value


# ------------------------------------------------------------------ workers registered through the admin API

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.asynccontextmanager
async def _registered_gateway(workers: WorkerGroup, *, accept: bool) -> AsyncIterator[Gateway]:
    """P1 and D0 configured with their events; P0 left to register through the admin API."""
    ws = {w.settings.worker_id: w for w in workers.workers if w.settings.worker_id != "P0"}
    config: dict[str, Any] = {
        "mode": "pd",
        "admin_token": TOKEN,
        "workers": [{"id": i, "role": w.settings.role, "url": w.url} for i, w in ws.items()],
        "pool": {"health_interval_s": 3600.0},
        "sessions": {"sweep_interval_s": 3600.0},
        "kv_events": {
            "endpoints": {i: w.describe()["kv_events"] for i, w in ws.items()},
            "replay_endpoints": {i: w.describe()["kv_events_replay"] for i, w in ws.items()},
            "hash_seed": os.environ.get("PYTHONHASHSEED", ""),
            "block_size": 16,
            "accept_registered": accept,
        },
    }
    async with served_gateway(config) as (server, http):
        yield Gateway(server, http, workers)


async def _register(gw: Gateway, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    url = str(gw.server.make_url("/admin/workers"))
    async with gw.http.post(url, json=body, headers=AUTH) as resp:
        reply: dict[str, Any] = await resp.json()
        return resp.status, reply


def _p0(workers: WorkerGroup) -> dict[str, Any]:
    p0 = next(w for w in workers.workers if w.settings.worker_id == "P0")
    return {"id": "P0", "role": "prefill", "url": p0.url, "kv_events": p0.describe()["kv_events"]} | {
        "kv_events_replay": p0.describe()["kv_events_replay"]
    }


async def test_a_registered_p_is_tracked_placed_on_and_forgotten_when_it_leaves(workers: WorkerGroup) -> None:
    async with _registered_gateway(workers, accept=True) as gw:
        registered = (201, {"id": "P0", "registered": True, "heartbeat_expiry_s": 30.0})
        assert await _register(gw, _p0(workers)) == registered
        async with gw.http.get(str(gw.server.make_url("/admin/workers")), headers=AUTH) as resp:
            assert (await resp.json())["placement"] == "prefix"  # the default, with [kv_events]
        assert (await _register(gw, _p0(workers)))[0] == 200  # a heartbeat: the same stream goes on
        synced = ("P0", "P1", "D0")
        await eventually(
            lambda: _true(all(gw.kv.residency.synced(w) for w in synced)),
            what="the registered P0's events synced",
        )
        # Nothing resident anywhere: turn 1 takes the least-loaded P, equal loads by id: the registered P0.
        messages, p = await _first_turn(gw)
        assert p == "P0"
        headers, _ = await gw.chat(messages)  # least loaded would take P1 now (P0 was picked last)
        assert headers["X-PPD-Prefill-Worker"] == "P0"

        async with gw.http.delete(str(gw.server.make_url("/admin/workers/P0")), headers=AUTH) as resp:
            assert resp.status == 200
        assert "P0" not in gw.kv.residency.workers
        text = await gw.metrics()
        assert sample(text, "ppd_gateway_kv_events_synced", {"worker": "P0"}) is None
        assert sample(text, "ppd_gateway_kv_events_synced", {"worker": "P1"}) == 1


@pytest.mark.parametrize(
    ("accept", "change", "message"),
    [
        (False, {}, "does not track registered workers' KV events"),
        (True, {"kv_events": "http://10.0.0.1:5557"}, "kv_events must be a ZMQ endpoint"),
        (True, {"kv_events": 5557}, "kv_events must be a ZMQ endpoint"),
        (True, {"kv_events_replay": "tcp://a b:1"}, "kv_events_replay must be a ZMQ endpoint"),
    ],
)
async def test_a_registration_naming_events_it_cannot_follow_is_refused(
    workers: WorkerGroup, accept: bool, change: dict[str, Any], message: str
) -> None:
    async with _registered_gateway(workers, accept=accept) as gw:
        status, reply = await _register(gw, _p0(workers) | change)
        assert status == 400
        assert message in reply["error"]["message"]
        assert gw.server.app[DEPS].pool.view().get("P0") is None  # refused before it joined
