"""Acceptance (issue 15): D evicts a conversation's prefix, and the gateway, which follows the
workers' KV events, routes the next turn as a cold one (reason kv_evicted), on the simulator and on
real vLLM. Both clusters run with a small KV cache (conftest.py); other traffic on the same D fills
it until the conversation's first block is gone. Behind both front doors (front_doors.py)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ppd.kv_events import BlockHasher, BlockRemoved, BlockStored
from tests.conformance.conftest import KV_EVENTS_SEED
from tests.conformance.front_doors import FrontDoor, running
from tests.conformance.test_kv_events import BLOCK, replay
from tests.conformance.workers import Cluster, http
from tests.support.gateway_config import worker_tables
from tests.support.metrics import sample
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration
#: Filler prompts sent straight to D, at most this many (their tokens exceed the KV cache of conftest.py).
MAX_FILLERS = 40
FILLER_TOKENS = 3000


@pytest.fixture(scope="module")
def kv_gateway(
    cluster: Cluster, front_door: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FrontDoor]:
    """A gateway following the cluster's KV events; no DecisionService, so Turn 2+ takes the
    fallback, local, unless the events say the context is gone."""
    tmp: Path = tmp_path_factory.mktemp(f"kv-gateway-{cluster.engine}-{front_door}")
    lines = ['mode = "ppd"', "", "[decision]", 'address = "127.0.0.1:1"', "deadline_ms = 50.0"]
    lines += ['fallback = "local"', "", "[pool]", "health_interval_s = 0.5", ""]
    lines += ["[kv_events]", f'hash_seed = "{KV_EVENTS_SEED}"', f"block_size = {BLOCK}", ""]
    lines += ["[kv_events.endpoints]", *(f'{w["id"]} = "{w["kv_events"]}"' for w in cluster.workers), ""]
    lines += ["[kv_events.replay_endpoints]"]
    lines += [*(f'{w["id"]} = "{w["kv_events_replay"]}"' for w in cluster.workers), ""]
    lines += [*worker_tables(cluster.workers), ""]
    with running(front_door, lines, tmp, "kv-gateway") as door:
        yield door


def _metrics(gateway: FrontDoor) -> bytes:
    return gateway.metrics()


def _events_seen(gateway: FrontDoor, worker: str) -> float:
    return sample(_metrics(gateway), "ppd_gateway_kv_events_total", {"worker": worker}) or 0.0


def _synced(gateway: FrontDoor, worker: str) -> bool:
    return sample(_metrics(gateway), "ppd_gateway_kv_events_synced", {"worker": worker}) == 1.0


def _published(cluster: Cluster, worker: str) -> int:
    endpoint = next(w["kv_events_replay"] for w in cluster.workers if w["id"] == worker)
    return sum(len(b.events) for _, b in replay(endpoint))


def _chat(gateway: FrontDoor, model: str, messages: list[Any]) -> tuple[Any, str]:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
    with client:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=4, temperature=0
        )
    return raw.headers, raw.parse().choices[0].message.content or ""


def test_d_evicts_the_prefix_and_the_next_turn_is_routed_cold(
    cluster: Cluster, kv_gateway: FrontDoor
) -> None:
    wait_until(
        lambda: all(_synced(kv_gateway, w["id"]) for w in cluster.workers),
        deadline_s=60.0,
        what="the gateway synced on every worker's KV events",
    )
    # Every event published so far came to the gateway in its first resync (not counted as live).
    baseline = {
        w["id"]: _published(cluster, w["id"]) - _events_seen(kv_gateway, w["id"]) for w in cluster.workers
    }
    messages: list[Any] = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "tell me a story " * 12}]
    headers, answer = _chat(kv_gateway, cluster.model, messages)
    assert headers["X-PPD-Reason"] == "turn_one"
    d = headers["X-PPD-Decode-Worker"]
    d_url = cluster.url(d)
    d_replay = next(w["kv_events_replay"] for w in cluster.workers if w["id"] == d)
    tokens = http(d_url + "/tokenize", {"model": cluster.model, "messages": messages}).json()["tokens"]
    first = BlockHasher(KV_EVENTS_SEED, BLOCK).chain(tokens)[0]

    def gateway_caught_up() -> bool:  # the gateway applied every event D published since it synced
        return _events_seen(kv_gateway, d) + baseline[d] >= _published(cluster, d)

    stored = [
        h for _, b in replay(d_replay) for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    assert first in stored
    wait_until(gateway_caught_up, deadline_s=30.0, what="the gateway applying D's events of turn 1")

    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "go on"}]
    headers, answer = _chat(kv_gateway, cluster.model, messages)
    assert (headers["X-PPD-Path"], headers["X-PPD-Decode-Worker"]) == ("local", d)  # resident

    rng = random.Random(7)
    for _ in range(MAX_FILLERS):
        filler = [rng.randrange(1000, 100_000) for _ in range(FILLER_TOKENS)]
        reply = http(d_url + "/v1/completions", {"model": cluster.model, "prompt": filler, "max_tokens": 1})
        assert reply.status == 200, reply.body
        evictions = [e for _, b in replay(d_replay) for e in b.events if isinstance(e, BlockRemoved)]
        if first in {h for e in evictions for h in e.block_hashes}:
            # vLLM's shape: one block per event, the GPU tier, group 0.
            assert all(len(e.block_hashes) == 1 for e in evictions)
            assert all((e.medium, dict(e.extra)) == ("GPU", {"group_idx": 0}) for e in evictions)
            break
    else:
        pytest.fail(f"{d} did not evict the conversation's first block after {MAX_FILLERS} fillers")
    wait_until(gateway_caught_up, deadline_s=30.0, what="the gateway applying D's events")

    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    headers, _ = _chat(kv_gateway, cluster.model, messages)
    assert (headers["X-PPD-Path"], headers["X-PPD-Reason"]) == ("pd", "kv_evicted")
    assert (
        sample(_metrics(kv_gateway), "ppd_gateway_decisions_total", {"path": "pd", "reason": "kv_evicted"})
        == 1
    )
