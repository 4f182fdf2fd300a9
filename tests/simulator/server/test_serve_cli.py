"""`python -m simulator cluster|worker` as real processes: ready line, a P/D pair sent exactly as a proxy
sends it (the official openai client on the decode leg), a plain follow-up turn that hits D's prefix
cache, start-up fault flags, and a clean exit on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from devstack.ready import start_ready
from tests.support.metrics import total
from tests.support.nixl import prefill_kv_params

pytestmark = pytest.mark.integration

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
READY_TIMEOUT_S = 120.0
QUESTION = "Summarise the history of the printing press in Europe, " * 8


def start(*args: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    # the process prints one JSON line once ready (or exits)
    return start_ready(
        [sys.executable, "-m", "simulator", "--log-level", "WARNING", *args],
        timeout_s=READY_TIMEOUT_S,
        stderr=subprocess.PIPE,
    )


def stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)  # drains and closes the pipes
    return proc.returncode


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    proc, ready = start("cluster", "--topology", "1P3D", "--base-port", "0", "--spin-us", "0")
    try:
        yield ready
    finally:
        assert stop(proc) == 0


def post_json(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, json.loads(response.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        value = total(response.read(), name)
    assert value is not None
    return value


def test_ready_line_lists_every_worker(cluster: dict[str, Any]) -> None:
    assert cluster["topology"] == "1P3D"
    assert [(w["id"], w["role"]) for w in cluster["workers"]] == [
        ("P0", "prefill"),
        ("D0", "decode"),
        ("D1", "decode"),
        ("D2", "decode"),
    ]
    assert len({w["url"] for w in cluster["workers"]}) == 4
    for w in cluster["workers"]:
        with urllib.request.urlopen(f"{w['url']}/health", timeout=30) as response:
            assert response.status == 200


def test_pd_pair_then_local_follow_up(cluster: dict[str, Any]) -> None:
    p_url, d_url = cluster["workers"][0]["url"], cluster["workers"][2]["url"]
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
    client_body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_completion_tokens": 24,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request_id = str(uuid.uuid4())
    # The prefill leg, as vLLM's toy proxy builds it.
    p_body = {k: v for k, v in client_body.items() if k not in ("stream_options", "min_tokens")}
    p_body |= {
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "kv_transfer_params": prefill_kv_params(),
    }
    headers = {"Authorization": "Bearer sk-test", "X-Request-Id": request_id}
    status, p_resp = post_json(f"{p_url}/v1/chat/completions", p_body, headers)
    assert status == 200
    assert p_resp["id"] == f"chatcmpl-{request_id}"
    params = p_resp["kv_transfer_params"]
    assert params["do_remote_prefill"] is True

    # The decode leg: the original body plus P's params, streamed with the official client.
    client = openai.OpenAI(base_url=f"{d_url}/v1", api_key="sk-test", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"kv_transfer_params": params},
        extra_headers={"X-Request-Id": request_id},
    )
    text = ""
    usage = None
    ids = set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert ids == {f"chatcmpl-{request_id}"}
    assert usage is not None
    assert usage.completion_tokens == 24
    assert usage.prompt_tokens == p_resp["usage"]["prompt_tokens"]
    assert text
    assert metric(d_url, "vllm:external_prefix_cache_hits_total") >= params["remote_num_tokens"] - 1

    # Turn 2 goes straight to the same D (append-prefill): D's prefix cache holds turn 1.
    hits_before = metric(d_url, "vllm:prefix_cache_hits_total")
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Shorter, please."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    hits = metric(d_url, "vllm:prefix_cache_hits_total") - hits_before
    assert hits >= (usage.total_tokens // 16 - 1) * 16


def test_single_worker_with_fault_flags() -> None:
    proc, ready = start("worker", "--role", "decode", "--port", "0", "--error-rate", "1", "--spin-us", "0")
    try:
        assert ready["id"] == "D0"
        assert ready["role"] == "decode"
        assert ready["url"].startswith("http://127.0.0.1:")
        with pytest.raises(urllib.error.HTTPError) as info:
            post_json(f"{ready['url']}/v1/completions", {"prompt": "hi", "max_tokens": 1}, {})
        assert info.value.code == 500
        info.value.close()
        with urllib.request.urlopen(f"{ready['url']}/admin/faults", timeout=30) as response:
            assert json.loads(response.read())["error_rate"] == 1.0
    finally:
        assert stop(proc) == 0


def test_bidirectional_flags_reach_the_workers() -> None:
    proc, ready = start(
        "cluster", "--topology", "1P1D", "--base-port", "0", "--spin-us", "0", "--bidirectional-kv-xfer",
        "--decoder-kv-blocks-ttl", "100", "--kv-recompute-threshold", "0",
    )  # fmt: skip
    try:
        p_url, d_url = (w["url"] for w in ready["workers"])
        history: list[dict[str, str]] = [{"role": "user", "content": QUESTION}]
        body: dict[str, Any] = {"model": MODEL, "messages": history, "max_tokens": 3, "ignore_eos": True}
        kv = prefill_kv_params()
        _, p_resp = post_json(
            f"{p_url}/v1/chat/completions", body | {"max_tokens": 1, "kv_transfer_params": kv}, {}
        )
        _, d_resp = post_json(
            f"{d_url}/v1/chat/completions", body | {"kv_transfer_params": p_resp["kv_transfer_params"]}, {}
        )
        d_params = d_resp["kv_transfer_params"]
        assert d_params["do_remote_decode"] is True
        # Workers and test share the machine's monotonic clock, as vLLM's perf_counter() deadline.
        assert 90.0 < d_params["remote_blocks_expiry_time"] - time.monotonic() <= 100.0
        history += [
            {"role": "assistant", "content": d_resp["choices"][0]["message"]["content"]},
            {"role": "user", "content": "More."},
        ]
        turn2 = body | {"messages": history, "max_tokens": 1, "kv_transfer_params": d_params}
        status, _ = post_json(f"{p_url}/v1/chat/completions", turn2, {})
        assert status == 200
        # Only a couple of tokens beyond P's cached blocks: pulled because the threshold is 0.
        assert metric(p_url, "vllm:nixl_xfer_time_seconds_count") == 1
    finally:
        assert stop(proc) == 0


def test_bad_topology_is_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "simulator", "cluster", "--topology", "P3D"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "bad topology" in result.stderr


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--kv-events-config", '{"nope": 1}', "unknown field"), ("--block-size", "0", "block_size")],
)
def test_bad_kv_flags_are_usage_errors(flag: str, value: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "simulator", "worker", "--port", "0", flag, value],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_a_taken_port_is_a_clean_error() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "simulator", "worker", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 1
    assert "cannot serve" in result.stderr
    assert "Traceback" not in result.stderr


def test_vllm_server_dev_mode_is_read_as_vllm_reads_it() -> None:
    from simulator.server.serve_cli import server_dev_mode

    assert not server_dev_mode({})
    assert not server_dev_mode({"VLLM_SERVER_DEV_MODE": "0"})
    assert server_dev_mode({"VLLM_SERVER_DEV_MODE": "1"})
    with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE must be an integer"):
        server_dev_mode({"VLLM_SERVER_DEV_MODE": "yes"})
