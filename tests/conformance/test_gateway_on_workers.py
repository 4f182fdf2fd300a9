"""The gateway end to end on each engine's workers, driven by the official ``openai`` client, behind
each front door (front_doors.py: ``standalone`` and ``envoy``).

The assertions read the workers' own counters (``vllm:prompt_tokens_by_source_total``), so on real
vLLM they show where the KV really came from: pulled from P, hit in D's prefix cache, or computed.
What the picker cannot do yet is an ``xfail(strict=True)`` naming it (front_doors.PICKER_CANNOT).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from tests.conformance.front_doors import FRONT_DOORS, FrontDoor, running
from tests.conformance.workers import Cluster
from tests.support.gateway_config import worker_tables
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration
#: Prefix-cache hits come in whole KV blocks (32 tokens on vLLM's CPU backend, 16 in the simulator).
BLOCK = 32


def _config(cluster: Cluster, health_interval_s: float) -> list[str]:
    """The gateway's config on the cluster's workers not crashed yet."""
    lines = ['mode = "ppd"', "allow_mode_header = true", ""]  # the tests force a mode (X-PPD-Mode)
    lines += ["[decision]", 'address = "127.0.0.1:1"', "deadline_ms = 200.0", ""]
    lines += ["[pool]", f"health_interval_s = {health_interval_s}", ""]
    live = [w for w in cluster.workers if w["id"] not in cluster.crashed]
    return [*lines, *worker_tables(live), ""]


@pytest.fixture(scope="session")
def gateway(
    cluster: Cluster, front_door: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FrontDoor]:
    tmp: Path = tmp_path_factory.mktemp(f"gateway-{cluster.engine}-{front_door}")
    with running(front_door, _config(cluster, 0.5), tmp, "gateway") as door:
        yield door


def _client(gateway: FrontDoor, mode: str | None = None, session: str | None = None) -> openai.OpenAI:
    headers = {}
    if mode is not None:
        headers["X-PPD-Mode"] = mode
    if session is not None:
        headers["X-Session-ID"] = session
    return openai.OpenAI(
        base_url=f"{gateway.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        default_headers=headers,
    )


class Conversation:
    """One conversation through the gateway; each turn's headers and usage are kept."""

    def __init__(self, cluster: Cluster, gateway: FrontDoor) -> None:
        self.cluster, self.gateway = cluster, gateway
        self.session = f"conv-{uuid.uuid4().hex}"
        self.messages: list[Any] = []

    def turn(self, text: str, *, mode: str | None = None, max_tokens: int = 8) -> tuple[Any, Any]:
        self.messages.append({"role": "user", "content": f"{self.session} {text}"})
        with _client(self.gateway, mode, self.session) as client:  # its connections closed after
            raw = client.chat.completions.with_raw_response.create(
                model=self.cluster.model, messages=self.messages, max_tokens=max_tokens, temperature=0
            )
        answer = raw.parse()
        self.messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        return raw.headers, answer


def test_turn_one_takes_p_then_d_and_d_pulls_the_prompt(cluster: Cluster, gateway: FrontDoor) -> None:
    conv = Conversation(cluster, gateway)
    before = {d: cluster.by_source(d) for d in cluster.ids("decode")}
    headers, answer = conv.turn("Tell me about the sea.")
    assert (headers["x-ppd-path"], headers["x-ppd-reason"], headers["x-ppd-turn"]) == ("pd", "turn_one", "1")
    assert headers["x-ppd-prefill-worker"] == "P0"
    d = headers["x-ppd-decode-worker"]
    after = cluster.by_source(d)
    delta = {source: after[source] - before[d][source] for source in after}
    # What D did not hold in its prefix cache it pulled from P; it computed none of the prompt.
    assert delta["local_compute"] == 0, delta
    assert delta["external_kv_transfer"] + delta["local_cache_hit"] == answer.usage.prompt_tokens, delta
    assert delta["external_kv_transfer"] > 0


def test_a_local_turn_two_is_served_from_ds_cache(cluster: Cluster, gateway: FrontDoor) -> None:
    conv = Conversation(cluster, gateway)
    first, answer = conv.turn("Remember this: the lighthouse keeper counts waves every night.", max_tokens=16)
    d = first["x-ppd-decode-worker"]
    before = cluster.by_source(d)
    second, _ = conv.turn("And then?", mode="local")
    assert (second["x-ppd-path"], second["x-ppd-turn"], second["x-ppd-decode-worker"]) == ("local", "2", d)
    assert "x-ppd-prefill-worker" not in second
    after = cluster.by_source(d)
    assert after["external_kv_transfer"] == before["external_kv_transfer"]
    # The history (Turn 1's prompt, at least) is a prefix-cache hit, to a whole block.
    assert after["local_cache_hit"] - before["local_cache_hit"] >= answer.usage.prompt_tokens - BLOCK


def test_a_forced_pd_turn_two_goes_through_p(cluster: Cluster, gateway: FrontDoor) -> None:
    conv = Conversation(cluster, gateway)
    conv.turn("Start somewhere.")
    p_before = cluster.by_source("P0")
    second, answer = conv.turn("Now go through prefill.", mode="pd")
    assert (second["x-ppd-path"], second["x-ppd-prefill-worker"], second["x-ppd-turn"]) == ("pd", "P0", "2")
    p_after = cluster.by_source("P0")
    p_tokens = sum(p_after.values()) - sum(p_before.values())
    assert p_tokens == answer.usage.prompt_tokens  # P saw the whole history (computed or cached)


def test_a_client_disconnect_aborts_the_request_on_the_worker(cluster: Cluster, gateway: FrontDoor) -> None:
    body = {
        "model": cluster.model,
        "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} go on for a long time"}],
        "stream": True,
        "max_tokens": 3000,
        "ignore_eos": True,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"{gateway.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    resp = urllib.request.urlopen(req, timeout=120)
    d = resp.headers["X-PPD-Decode-Worker"]
    generated = cluster.metric(d, "vllm:generation_tokens_total")
    assert resp.readline().startswith(b"data: ")
    assert cluster.metric(d, "vllm:num_requests_running") == 1
    resp.close()  # the client goes away mid-stream
    wait_until(
        lambda: cluster.metric(d, "vllm:num_requests_running") == 0,
        deadline_s=60.0,
        what=f"{d}'s request aborted",
    )
    assert cluster.metric(d, "vllm:generation_tokens_total") - generated < 3000


def test_a_non_streaming_client_disconnect_aborts_the_request_on_the_worker(
    cluster: Cluster, gateway: FrontDoor
) -> None:
    body = json.dumps(
        {
            "model": cluster.model,
            "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} a long answer, not streamed"}],
            "max_tokens": 3000,
            "ignore_eos": True,
            "temperature": 0,
        }
    ).encode()
    decodes = cluster.ids("decode")

    def busy() -> float:
        return sum(cluster.metric(d, "vllm:num_requests_running") for d in decodes)

    generated = sum(cluster.metric(d, "vllm:generation_tokens_total") for d in decodes)
    with socket.create_connection(("127.0.0.1", urlsplit(gateway.url).port or 80), timeout=60) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: busy() == 1, deadline_s=60.0, what="the request running on a decode worker")
    # The client went away before any answer: the worker must drop the request.
    wait_until(lambda: busy() == 0, deadline_s=60.0, what="the request aborted on its worker")
    assert sum(cluster.metric(d, "vllm:generation_tokens_total") for d in decodes) - generated < 3000


def test_a_short_sharegpt_load_run_completes(cluster: Cluster, gateway: FrontDoor, tmp_path: Path) -> None:
    out = tmp_path / "records.jsonl"
    run = subprocess.run(
        [
            sys.executable, "-m", "loadgen.cli", "run",
            "--url", gateway.url, "--workload", "sharegpt",
            "--qps", "2", "--duration", "3", "--turns", "2", "--out", str(out), "--model", cluster.model,
            "--max-context-tokens", "3000", "--max-output-tokens", "32", "--no-progress",
        ],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records
    assert all(r["ok"] for r in records), [r.get("error") for r in records if not r["ok"]]
    assert {r["turn"] for r in records} == {1, 2}


@contextmanager
def _unprobed_doors(cluster: Cluster, tmp: Path) -> Iterator[dict[str, FrontDoor]]:
    """Both front doors on the workers not crashed yet, their pools probing hourly: a worker crashed
    after they started is found gone by the request that needs it, never by a probe (whose timing
    would decide the path: a pool that knows P is down answers Turn 1 with 503, no live prefill)."""
    if cluster.process is None:
        pytest.skip("an external cluster's workers are not ours to crash")
    with ExitStack() as doors:
        yield {
            kind: doors.enter_context(running(kind, _config(cluster, 3600.0), tmp, kind))
            for kind in FRONT_DOORS
        }


#: Turn-1s through the second door to land on the first door's D.
_CRASH_TRIES = 6


@pytest.fixture(scope="module")
def crashed_decode(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[Conversation, str]]]:
    """Each front door's conversation after Turn 1 on one D, that D then crashed (one crash for both
    doors: the cluster has two Ds), by door."""
    with _unprobed_doors(cluster, tmp_path_factory.mktemp(f"crash-d-{cluster.engine}")) as doors:
        conversations: dict[str, tuple[Conversation, str]] = {}
        for door in doors.values():
            for _ in range(_CRASH_TRIES):
                conv = Conversation(cluster, door)
                first, _ = conv.turn("Where will my next turn go?")
                d = first["x-ppd-decode-worker"]
                if not conversations or d == next(iter(conversations.values()))[1]:
                    conversations[door.kind] = (conv, d)
                    break
            else:
                pytest.fail(f"{_CRASH_TRIES} Turn-1s through {door.kind} never chose the other door's D")
        cluster.crash(next(iter(conversations.values()))[1])
        yield conversations


@pytest.fixture(scope="module")
def crashed_prefill(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, FrontDoor]]:
    """Both front doors on the live workers, then P0 crashed, by door."""
    with _unprobed_doors(cluster, tmp_path_factory.mktemp(f"crash-p-{cluster.engine}")) as doors:
        cluster.crash("P0")
        yield doors


@pytest.mark.crashes_workers
@pytest.mark.parametrize("door", FRONT_DOORS)
def test_a_crashed_decode_worker_rebinds_the_session_through_p(
    cluster: Cluster, crashed_decode: dict[str, tuple[Conversation, str]], door: str
) -> None:
    conv, old = crashed_decode[door]
    second, answer = conv.turn("Still there?")
    assert answer.choices[0].message.content
    assert second["x-ppd-path"] == "pd"
    assert second["x-ppd-reason"] in ("decode_gone", "decode_unreachable")
    assert second["x-ppd-decode-worker"] != old
    assert second["x-ppd-prefill-worker"] == "P0"
    assert second["x-ppd-turn"] == "2"


@pytest.mark.crashes_workers
@pytest.mark.parametrize("door", FRONT_DOORS)
def test_a_crashed_prefill_worker_falls_back_to_prefill_on_d(
    cluster: Cluster, crashed_prefill: dict[str, FrontDoor], door: str
) -> None:
    conv = Conversation(cluster, crashed_prefill[door])
    headers, answer = conv.turn("A new conversation with no prefill worker left.")
    assert answer.choices[0].message.content
    assert (headers["x-ppd-path"], headers["x-ppd-reason"]) == ("local", "prefill_failed")
    d = headers["x-ppd-decode-worker"]
    assert cluster.by_source(d)["local_compute"] > 0
