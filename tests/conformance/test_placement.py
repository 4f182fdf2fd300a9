"""Prefix-aware placement on each engine's workers (docs/concepts/placement.md), behind each front door:
with two prefill workers, a pd Turn 2 goes to the P that prefilled Turn 1, and the worker's own
``vllm:prompt_tokens_by_source_total{source="local_cache_hit"}`` shows it reused the history.

Two prefill workers without starting a second cluster: the shared 1P2D cluster's D1 also serves P legs.
In NixlConnector's pull mode the proxy decides who acts as P (a P leg is a request with
``do_remote_decode``, whatever the worker's ``kv_role``: docs/vllm-protocol.md 1.1), so the gateway
here lists P0 and D1 (as ``P1``) as its prefill workers and D0 as its only decode worker, and follows
all three workers' KV events.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conformance.conftest import KV_EVENTS_SEED
from tests.conformance.front_doors import FrontDoor, running
from tests.conformance.test_gateway_on_workers import Conversation
from tests.conformance.test_kv_events import BLOCK, replay
from tests.conformance.workers import Cluster, http
from tests.support.gateway_config import worker_tables
from tests.support.metrics import sample
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration

#: The gateway's workers: its id, the cluster worker it is, its role in this gateway.
_ROLES = (("P0", "P0", "prefill"), ("P1", "D1", "prefill"), ("D0", "D0", "decode"))


def _as_gateway_workers(cluster: Cluster) -> list[dict[str, Any]]:
    by_id = {w["id"]: w for w in cluster.workers}
    return [{**by_id[source], "id": wid, "role": role} for wid, source, role in _ROLES]


@pytest.fixture(scope="module")
def placing_gateway(
    cluster: Cluster, front_door: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FrontDoor]:
    """Placement by prefix (the default) over two P and one D, every worker's KV events followed."""
    assert "D1" not in cluster.crashed, "runs before the tests that crash workers (conftest.py)"
    tmp: Path = tmp_path_factory.mktemp(f"placing-gateway-{cluster.engine}-{front_door}")
    workers = _as_gateway_workers(cluster)
    lines = ['mode = "ppd"', "allow_mode_header = true", ""]
    lines += ["[decision]", 'address = "127.0.0.1:1"', "deadline_ms = 200.0", ""]
    lines += ["[pool]", "health_interval_s = 0.5", "", "[routing]", 'placement = "prefix"', ""]
    lines += ["[kv_events]", f'hash_seed = "{KV_EVENTS_SEED}"', f"block_size = {BLOCK}", ""]
    lines += ["[kv_events.endpoints]", *(f'{w["id"]} = "{w["kv_events"]}"' for w in workers), ""]
    lines += ["[kv_events.replay_endpoints]"]
    lines += [*(f'{w["id"]} = "{w["kv_events_replay"]}"' for w in workers), ""]
    lines += [*worker_tables(workers), ""]
    with running(front_door, lines, tmp, "placing-gateway") as door:
        wait_until(
            lambda: all(
                sample(door.metrics(), "ppd_gateway_kv_events_synced", {"worker": w["id"]}) == 1.0
                for w in workers
            ),
            deadline_s=60.0,
            what="the gateway synced on the KV events of P0, P1 (D1) and D0",
        )
        yield door


def _events_applied(door: FrontDoor, worker: str) -> float:
    return sample(door.metrics(), "ppd_gateway_kv_events_total", {"worker": worker}) or 0.0


def _tokenize_calls(door: FrontDoor) -> float:
    return sample(door.metrics(), "ppd_gateway_worker_tokenize_total", {"purpose": "token_ids"}) or 0.0


def _events_published(endpoint: str) -> int:
    return sum(len(b.events) for _, b in replay(endpoint))


class _Events:
    """How far the gateway has applied each prefill worker's KV events: every event published before
    this is made reached the gateway in its resync, or live since (then counted as applied)."""

    def __init__(self, cluster: Cluster, door: FrontDoor) -> None:
        self.door = door
        self.workers = {w["id"]: w for w in _as_gateway_workers(cluster)}
        self.baseline = {w: self._published(w) - _events_applied(door, w) for w in ("P0", "P1")}

    def _published(self, worker: str) -> int:
        return _events_published(self.workers[worker]["kv_events_replay"])

    def await_applied(self, worker: str, what: str) -> None:
        wait_until(
            lambda: _events_applied(self.door, worker) + self.baseline[worker] >= self._published(worker),
            deadline_s=30.0,
            what=f"the gateway applying every KV event {worker} published for {what}",
        )


#: The gateway's id -> the cluster worker it is.
_SOURCE = {wid: src for wid, src, _ in _ROLES}


def _chat(door: FrontDoor, model: str, messages: list[Any]) -> tuple[Any, Any]:
    with openai.OpenAI(base_url=f"{door.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=4, temperature=0
        )
    return raw.headers, raw.parse()


def test_a_pd_turn_two_goes_to_the_p_holding_the_history(
    cluster: Cluster, placing_gateway: FrontDoor
) -> None:
    events = _Events(cluster, placing_gateway)
    conv = Conversation(cluster, placing_gateway)
    # Turn 1: a prompt of several blocks, so a prefix hit is many tokens, not one block by chance.
    first, _ = conv.turn("Remember these harbours in order: " + ", ".join(f"harbour {i}" for i in range(60)))
    assert (first["x-ppd-path"], first["x-ppd-turn"]) == ("pd", "1")
    p = first["x-ppd-prefill-worker"]
    other = next(w for w in ("P0", "P1") if w != p)
    tokens = http(
        cluster.url(_SOURCE[p]) + "/tokenize", {"model": cluster.model, "messages": conv.messages[:-1]}
    ).json()["tokens"]
    blocks = len(tokens) // BLOCK
    assert blocks >= 4, f"Turn 1's prompt is {len(tokens)} tokens, want at least 4 blocks"
    events.await_applied(p, "Turn 1")
    before = {w: cluster.by_source(_SOURCE[w]) for w in ("P0", "P1")}
    tokenized = _tokenize_calls(placing_gateway)
    # Least-loaded placement would most often take the other P now (both idle, p picked last); which
    # P the prefix moved a leg to, deterministically, is tests/gateway/test_placement.py's business.
    second, answer = conv.turn("Which harbour came third?", mode="pd")
    assert (second["x-ppd-path"], second["x-ppd-turn"]) == ("pd", "2")
    assert second["x-ppd-prefill-worker"] == p, f"Turn 2 went to {second['x-ppd-prefill-worker']}, not {p}"
    after = {w: cluster.by_source(_SOURCE[w]) for w in ("P0", "P1")}
    hit = after[p]["local_cache_hit"] - before[p]["local_cache_hit"]
    # Turn 1's whole prompt, to a whole block, came from p's prefix cache; p saw all of Turn 2's.
    assert hit >= blocks * BLOCK, (hit, len(tokens), before[p], after[p])
    assert sum(after[p].values()) - sum(before[p].values()) == answer.usage.prompt_tokens
    assert after[other] == before[other], f"{other}, the prefill worker without the history, saw Turn 2"
    # Placed by the marks of Turn 1's prompt, which P returned (return_token_ids): no /tokenize asked.
    assert _tokenize_calls(placing_gateway) == tokenized


def test_a_turn_one_opening_like_an_earlier_one_goes_to_the_p_holding_its_blocks(
    cluster: Cluster, placing_gateway: FrontDoor
) -> None:
    events = _Events(cluster, placing_gateway)
    tokenized = _tokenize_calls(placing_gateway)
    system = {"role": "system", "content": f"{uuid.uuid4().hex} You keep the harbour's log. " * 12}
    first_messages = [system, {"role": "user", "content": "When does the ferry leave?"}]
    first, _ = _chat(placing_gateway, cluster.model, first_messages)
    assert first["x-ppd-turn"] == "1"
    p = first["x-ppd-prefill-worker"]
    other = next(w for w in ("P0", "P1") if w != p)
    second_messages = [system, {"role": "user", "content": "Where is the lighthouse?"}]
    prompts = [
        http(cluster.url(_SOURCE[p]) + "/tokenize", {"model": cluster.model, "messages": m}).json()["tokens"]
        for m in (first_messages, second_messages)
    ]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b) // BLOCK
    assert shared >= 4, f"the two prompts share {shared} blocks, want at least 4"
    events.await_applied(p, "the first conversation")
    before = {w: cluster.by_source(_SOURCE[w]) for w in ("P0", "P1")}
    # Another conversation opening with the same system prompt: least loaded would most often take
    # the other P; it goes to p, placed by what p returned for the first (gateway/openings.py).
    second, answer = _chat(placing_gateway, cluster.model, second_messages)
    assert (second["x-ppd-turn"], second["x-ppd-prefill-worker"]) == ("1", p)
    after = {w: cluster.by_source(_SOURCE[w]) for w in ("P0", "P1")}
    assert after[p]["local_cache_hit"] - before[p]["local_cache_hit"] >= shared * BLOCK
    assert sum(after[p].values()) - sum(before[p].values()) == answer.usage.prompt_tokens
    assert after[other] == before[other], f"{other}, the prefill worker without the system prompt, saw it"
    assert _tokenize_calls(placing_gateway) == tokenized  # neither Turn 1 asked a worker's /tokenize
