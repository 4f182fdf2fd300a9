"""vLLM's `kv_load_failure_policy` over real HTTP on 127.0.0.1: a KV load that fails (dead remote, expired
lease, declined read) answers 500 under "fail" (the default) and an ordinary answer under "recompute",
the prompt computed locally. Measured on vLLM 0.32: D given a dead remote answers 500 "Internal server
error" (fail) or 200 with `prompt_tokens_by_source{source="local_compute"}` grown by the prompt (recompute),
and stays healthy either way."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from devstack.ready import start_ready
from simulator.core.faults import Faults
from simulator.core.kv_load_policy import KvLoadFailurePolicy
from simulator.core.profile import load_profile
from simulator.core.topology import Role, Topology, WorkerSpec
from simulator.core.worker_settings import DEFAULT_MODEL, WorkerSettings
from simulator.server.worker import Worker
from simulator.server.worker_group import GroupSettings, WorkerGroup
from tests.simulator.client import post, sse
from tests.support.metrics import total
from tests.support.nixl import prefill_kv_params

pytestmark = pytest.mark.integration

PROMPT = " ".join(f"word{i}" for i in range(120))
DEAD_REMOTE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "dead-engine",
    "remote_request_id": "x",
    "remote_block_ids": [[1, 2, 3]],
    "remote_host": "127.0.0.1",
    "remote_port": 9,  # discard port: nothing listens
}
INTERNAL_ERROR = {
    "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
}


async def start(topology: Topology, **worker: Any) -> WorkerGroup:
    base = replace(WorkerSettings(worker_id="W", role="replica"), **worker)
    group = WorkerGroup(
        GroupSettings(topology=topology, base_port=0, worker=base, spin_s=0.0), load_profile()
    )
    await group.start()
    return group


def alone(worker_id: str, role: Role) -> Topology:
    """One worker with a fabric of its own, as if it ran in its own process."""
    return Topology(name=worker_id, workers=(WorkerSpec(id=worker_id, role=role),))


def by_source(text: str, source: str) -> float:
    value = total(text, "vllm:prompt_tokens_by_source_total", source=source)
    assert value is not None, source
    return value


async def sources(http: aiohttp.ClientSession, worker: Worker) -> tuple[float, float]:
    """(local_compute, external_kv_transfer) prompt tokens of a worker's /metrics."""
    async with http.get(f"{worker.url}/metrics") as response:
        text = await response.text()
    return by_source(text, "local_compute"), by_source(text, "external_kv_transfer")


def completion(stream: bool, **extra: Any) -> dict[str, Any]:
    body = {"model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True} | extra
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def answer(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, body) of a plain answer, or (200, the usage) of a stream that ended normally, or
    (500, the error event) of a stream that failed after its headers."""
    if not body.get("stream"):
        return await post(http, url, body)
    events = await sse(http, url, body)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        return 500, errors[0]
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-2])  # the tokens were streamed
    return 200, {"usage": events[-2]["usage"]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_a_dead_remote(http: aiohttp.ClientSession, policy: KvLoadFailurePolicy, stream: bool) -> None:
    group = await start(alone("D0", "decode"), kv_load_failure_policy=policy)
    try:
        d = group.workers[0]
        url = f"{d.url}/v1/completions"
        compute0, external0 = await sources(http, d)
        status, body = await answer(http, url, completion(stream, kv_transfer_params=DEAD_REMOTE))
        compute, external = await sources(http, d)
        if policy == "fail":
            assert status == 500
            assert body == INTERNAL_ERROR
            assert compute == compute0
        else:
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 6
            assert compute - compute0 == body["usage"]["prompt_tokens"]
        assert external == external0
        async with http.get(f"{d.url}/health") as health:
            assert health.status == 200
        status, body = await post(http, url, completion(False))  # D still serves
        assert status == 200, body
    finally:
        await group.stop()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_an_expired_prefill_lease(http: aiohttp.ClientSession, policy: KvLoadFailurePolicy) -> None:
    """P's pin already expired when D comes to read it (`lease_expiry_s: 0`): the same policy applies."""
    group = await start(
        Topology.parse("1P1D"), kv_load_failure_policy=policy, faults=Faults(lease_expiry_s=0.0)
    )
    try:
        p, d = group.workers
        p_body = completion(False, max_tokens=1, kv_transfer_params=prefill_kv_params())
        status, p_resp = await post(http, f"{p.url}/v1/completions", p_body)
        assert status == 200, p_resp
        compute0, external0 = await sources(http, d)
        d_body = completion(False, kv_transfer_params=p_resp["kv_transfer_params"])
        status, body = await post(http, f"{d.url}/v1/completions", d_body)
        compute, external = await sources(http, d)
        assert external == external0
        if policy == "fail":
            assert (status, body) == (500, INTERNAL_ERROR)
        else:
            assert status == 200, body
            assert compute - compute0 == body["usage"]["prompt_tokens"]
        assert p.engine.stats().num_pinned == 0
    finally:
        await group.stop()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_a_declined_read_past_the_decoders_expiry(
    http: aiohttp.ClientSession, policy: KvLoadFailurePolicy
) -> None:
    """Bidirectional mode: P declines to read D's blocks past their advertised expiry."""
    group = await start(
        Topology.parse("1P1D"),
        bidirectional_kv_xfer=True,
        kv_recompute_threshold=0,
        enable_prompt_tokens_details=True,
        kv_load_failure_policy=policy,
    )
    try:
        p, d = group.workers
        status, p_resp = await post(
            http,
            f"{p.url}/v1/completions",
            completion(False, max_tokens=1, kv_transfer_params=prefill_kv_params()),
        )
        assert status == 200, p_resp
        status, d_resp = await post(
            http,
            f"{d.url}/v1/completions",
            completion(False, max_tokens=80, kv_transfer_params=p_resp["kv_transfer_params"]),
        )
        assert status == 200, d_resp
        d_params = d_resp["kv_transfer_params"]
        stale = d_params | {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_blocks_expiry_time": d_params["remote_blocks_expiry_time"] - 480.0,
        }
        turn2 = completion(False, prompt=PROMPT + d_resp["choices"][0]["text"] + " More.", max_tokens=1)
        compute0, external0 = await sources(http, p)
        status, body = await post(http, f"{p.url}/v1/completions", turn2 | {"kv_transfer_params": stale})
        compute, external = await sources(http, p)
        assert external == external0
        if policy == "fail":
            assert (status, body) == (500, INTERNAL_ERROR)
        else:
            assert status == 200, body
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["kv_transfer_params"]["do_remote_prefill"] is True  # an ordinary P leg's answer
            # P's prefix cache held turn 1's prompt blocks; the rest of the prompt was computed here.
            usage = body["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert 0 < cached < usage["prompt_tokens"] - 64
            assert compute - compute0 == usage["prompt_tokens"] - cached
    finally:
        await group.stop()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "simulator", *args], capture_output=True, text=True, timeout=60, check=False
    )


def post_json(url: str, body: dict[str, Any]) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


@contextlib.contextmanager
def serving(*args: str) -> Iterator[dict[str, Any]]:
    """`python -m simulator ARGS` as a process, until its ready line; SIGTERM stops it cleanly."""
    command = [sys.executable, "-m", "simulator", "--log-level", "ERROR", *args, "--spin-us", "0"]
    # one JSON line once every worker is healthy
    proc, ready = start_ready(command, timeout_s=120.0, stderr=subprocess.PIPE)
    try:
        yield ready
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_the_cluster_flag_reaches_the_worker_it_names() -> None:
    spec = ("--kv-load-failure-policy", "D1=recompute")
    with serving("cluster", "--topology", "1P2D", "--base-port", "0", *spec) as ready:
        urls = {w["id"]: w["url"] for w in ready["workers"]}
        body = completion(False, kv_transfer_params=DEAD_REMOTE)
        assert post_json(f"{urls['D0']}/v1/completions", body) == 500
        assert post_json(f"{urls['D1']}/v1/completions", body) == 200


def test_the_worker_flag() -> None:
    with serving(
        "worker", "--role", "decode", "--port", "0", "--kv-load-failure-policy", "recompute"
    ) as ready:
        body = completion(False, kv_transfer_params=DEAD_REMOTE)
        assert post_json(f"{ready['url']}/v1/completions", body) == 200


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cluster", "--topology", "1P2D", "--kv-load-failure-policy", "D7=recompute"], "no worker 'D7'"),
        (["cluster", "--topology", "1P2D", "--kv-load-failure-policy", "D1=retry"], "unknown policy 'retry'"),
        (["cluster", "--topology", "1P2D", "--kv-load-failure-policy", "retry"], "unknown policy 'retry'"),
        (["worker", "--kv-load-failure-policy", "retry"], "invalid choice: 'retry'"),
    ],
)
def test_a_bad_policy_is_a_usage_error(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
