"""vLLM's bidirectional KV mode (docs/vllm-protocol.md 3.4) through the gateway, on each engine's workers.

The shared cluster starts P0 and D1 with ``bidirectional_kv_xfer`` (``--bidir-workers P0,D1``; D0
without it, so the other tests see what they always saw: D0 still answers ``kv_transfer_params: null``).
This test runs its own gateway over P0 and D1 only, in static mode ``bidir``: Turn 1 is P/D and D1
returns its blocks' params on the final chunk; Turn 2 sends them to P0, which pulls the history from D1
(P0's ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` grows) and computes only
the rest; D1 pulls the result back; Turn 3 continues the same way. Behind both front doors
(front_doors.py); through Envoy the picker observes every answer D1 may send its params with
(picker.py rule 7), takes them out of the client's answer and keeps them for the next turn.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.front_doors import FrontDoor, running
from tests.conformance.workers import Cluster, http
from tests.support.gateway_config import worker_tables

pytestmark = pytest.mark.integration
BIDIR_WORKERS = ("P0", "D1")
#: Turn 1's answer, long enough that P's pull from D is above vLLM's kv_recompute_threshold (64).
ANSWER_TOKENS = 160


@pytest.fixture(scope="module")
def bidir_gateway(
    cluster: Cluster, front_door: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FrontDoor]:
    if cluster.process is None:
        pytest.skip("an external cluster may not run bidirectional_kv_xfer on P0 and D1")
    tmp: Path = tmp_path_factory.mktemp(f"gateway-bidir-{cluster.engine}-{front_door}")
    lines = ['mode = "bidir"', "", "[routing]", "bidir = true", "", "[pool]", "health_interval_s = 0.5", ""]
    lines += [*worker_tables(w for w in cluster.workers if w["id"] in BIDIR_WORKERS), ""]
    with running(front_door, lines, tmp, "gateway-bidir") as door:
        yield door


def _turn(
    gateway: FrontDoor, model: str, session: str, messages: list[dict[str, Any]], max_tokens: int
) -> tuple[Any, Any]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        f"{gateway.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Session-ID": session},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return resp.headers, json.loads(resp.read())


#: Conversations tried for a Turn-1 answer whose text keeps its tokens (most do).
_CONVERSATIONS_TRIED = 8


def _answer_tokens_in_history(cluster: Cluster, messages: list[dict[str, Any]], answer: Any) -> int:
    """How many tokens Turn 1's answer adds to the next prompt, as D1 tokenizes the history."""
    tokenized = http(cluster.url("D1") + "/tokenize", {"model": cluster.model, "messages": messages}).json()
    return len(tokenized["tokens"]) - int(answer["usage"]["prompt_tokens"])


def test_turn_two_takes_the_bidirectional_path_and_p_pulls_the_history_from_d(
    cluster: Cluster, bidir_gateway: FrontDoor
) -> None:
    session = ""
    messages: list[dict[str, Any]] = []

    def turn(text: str | None, max_tokens: int) -> tuple[Any, Any]:
        if text is not None:
            messages.append({"role": "user", "content": text})
        headers, answer = _turn(bidir_gateway, cluster.model, session, list(messages), max_tokens)
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        return headers, answer

    # Turn 1: P/D; D1 keeps its blocks and returns their params on the final answer, to the gateway
    # alone: it keeps them for Turn 2, the client's answer carries none (their shape: the test below).
    # The tiny model's weights are random: for some prompts its greedy answer is mostly special tokens,
    # which the answer's text leaves out, so the next prompt holds little of what D1 computed and there
    # is nothing for P to pull. Such a conversation proves nothing: start another (new text, new id).
    for _ in range(_CONVERSATIONS_TRIED):
        session = f"bidir-{uuid.uuid4().hex}"
        messages[:] = [{"role": "user", "content": f"{session} Tell me a long story."}]
        first, answer = turn(None, ANSWER_TOKENS)
        if _answer_tokens_in_history(cluster, messages, answer) >= ANSWER_TOKENS - 64:
            break
    else:
        pytest.fail(f"{_CONVERSATIONS_TRIED} conversations in a row answered mostly special tokens")
    assert (first["X-PPD-Path"], first["X-PPD-Decode-Worker"]) == ("pd", "D1")
    assert answer.get("kv_transfer_params") is None

    # Turn 2: P0 gets D1's params, pulls the history from D1, appends; D1 pulls the result back.
    p_before, d_before = cluster.by_source("P0"), cluster.by_source("D1")
    second, answer2 = turn("And then?", 8)
    assert (second["X-PPD-Path"], second["X-PPD-Reason"], second["X-PPD-Turn"]) == (
        "bidir",
        "mode_bidir",
        "2",
    )
    assert (second["X-PPD-Prefill-Worker"], second["X-PPD-Decode-Worker"]) == ("P0", "D1")
    assert answer2["choices"][0]["message"]["content"] is not None
    p_after, d_after = cluster.by_source("P0"), cluster.by_source("D1")
    p_delta = {s: p_after[s] - p_before[s] for s in p_after}
    d_delta = {s: d_after[s] - d_before[s] for s in d_after}
    prompt2 = answer2["usage"]["prompt_tokens"]
    assert sum(p_delta.values()) == prompt2, p_delta  # P saw the whole history ...
    # ... and got the part its own prefix cache lacked (Turn 1's answer, at least) from D1.
    assert p_delta["external_kv_transfer"] >= ANSWER_TOKENS - 64, p_delta
    assert p_delta["local_compute"] < prompt2 - ANSWER_TOKENS, p_delta
    assert d_delta["local_compute"] == 0, d_delta  # D computed nothing: cached or pulled back from P
    assert d_delta["external_kv_transfer"] > 0, d_delta

    # Turn 3 continues on the same path with the params D1 returned after Turn 2.
    third, answer3 = turn("And the end?", 4)
    assert (third["X-PPD-Path"], third["X-PPD-Turn"], third["X-PPD-Decode-Worker"]) == ("bidir", "3", "D1")
    assert answer3["choices"][0]["finish_reason"] == "length"


def test_d_in_bidirectional_mode_returns_its_blocks_params_after_a_p_leg(cluster: Cluster) -> None:
    """What the gateway keeps from D1's answer (the protocol, worker to worker): D's own params."""
    if cluster.process is None:
        pytest.skip("an external cluster may not run bidirectional_kv_xfer on P0 and D1")
    body: dict[str, Any] = {
        "model": cluster.model,
        "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} Tell me a long story."}],
        "temperature": 0,
        "ignore_eos": True,
    }
    p_leg = body | {
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    first = http(cluster.url("P0") + "/v1/chat/completions", p_leg)
    assert first.status == 200, first.body
    d_leg = body | {"max_tokens": ANSWER_TOKENS, "kv_transfer_params": first.json()["kv_transfer_params"]}
    second = http(cluster.url("D1") + "/v1/chat/completions", d_leg)
    assert second.status == 200, second.body
    answer = second.json()
    params = answer["kv_transfer_params"]
    assert params["do_remote_decode"] is True
    assert params["do_remote_prefill"] is False
    assert params["remote_blocks_expiry_time"] is not None
    assert params["remote_block_ids"]
    assert params["remote_num_tokens"] == answer["usage"]["prompt_tokens"] + ANSWER_TOKENS - 1
