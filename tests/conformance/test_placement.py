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

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def test_a_pd_turn_two_goes_to_the_p_holding_the_history(
    cluster: Cluster, placing_gateway: FrontDoor
) -> None:
    workers = {w["id"]: w for w in _as_gateway_workers(cluster)}
    source = {wid: src for wid, src, _ in _ROLES}  # the gateway's id -> the cluster's
    # Every event published before now reached the gateway in its resync (not counted as applied).
    baseline = {
        w: _events_published(workers[w]["kv_events_replay"]) - _events_applied(placing_gateway, w)
        for w in ("P0", "P1")
    }
    conv = Conversation(cluster, placing_gateway)
    # Turn 1: a prompt of several blocks, so a prefix hit is many tokens, not one block by chance.
    first, _ = conv.turn("Remember these harbours in order: " + ", ".join(f"harbour {i}" for i in range(60)))
    assert (first["x-ppd-path"], first["x-ppd-turn"]) == ("pd", "1")
    p = first["x-ppd-prefill-worker"]
    other = next(w for w in ("P0", "P1") if w != p)
    tokens = http(
        cluster.url(source[p]) + "/tokenize", {"model": cluster.model, "messages": conv.messages[:-1]}
    ).json()["tokens"]
    blocks = len(tokens) // BLOCK
    assert blocks >= 4, f"Turn 1's prompt is {len(tokens)} tokens, want at least 4 blocks"
    wait_until(
        lambda: (
            _events_applied(placing_gateway, p) + baseline[p]
            >= _events_published(workers[p]["kv_events_replay"])
        ),
        deadline_s=30.0,
        what=f"the gateway applying every KV event {p} ({source[p]}) published for Turn 1",
    )
    before = {w: cluster.by_source(source[w]) for w in ("P0", "P1")}
    tokenized = _tokenize_calls(placing_gateway)
    # Least-loaded placement would most often take the other P now (both idle, p picked last); which
    # P the prefix moved a leg to, deterministically, is tests/gateway/test_placement.py's business.
    second, answer = conv.turn("Which harbour came third?", mode="pd")
    assert (second["x-ppd-path"], second["x-ppd-turn"]) == ("pd", "2")
    assert second["x-ppd-prefill-worker"] == p, f"Turn 2 went to {second['x-ppd-prefill-worker']}, not {p}"
    after = {w: cluster.by_source(source[w]) for w in ("P0", "P1")}
    hit = after[p]["local_cache_hit"] - before[p]["local_cache_hit"]
    # Turn 1's whole prompt, to a whole block, came from p's prefix cache; p saw all of Turn 2's.
    assert hit >= blocks * BLOCK, (hit, len(tokens), before[p], after[p])
    assert sum(after[p].values()) - sum(before[p].values()) == answer.usage.prompt_tokens
    assert after[other] == before[other], f"{other}, the prefill worker without the history, saw Turn 2"
    # Placed by the marks of Turn 1's prompt, which P returned (return_token_ids): no /tokenize asked.
    assert _tokenize_calls(placing_gateway) == tokenized
