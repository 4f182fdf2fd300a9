"""The worker API the gateway relies on, asserted identically on the simulator and on real vLLM.

Each test runs once per engine (``cluster`` is parametrized in conftest.py). Where the two differ,
the simulator is what gets fixed: real vLLM is the reference.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from typing import Any

import pytest

from simulator.core.tokenizer import ChatMessage, Llama3Tokenizer
from tests.conformance.workers import Cluster, http
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration

TOKENIZER = Llama3Tokenizer()


def _fresh(text: str) -> str:
    """A prompt no earlier test sent (so no prefix-cache hit blurs the counts)."""
    return f"{uuid.uuid4().hex} {text}"


def _chat(cluster: Cluster, content: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cluster.model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        **extra,
    }
    return body


def _chat_tokens(content: str) -> int:
    return len(TOKENIZER.encode_chat([ChatMessage("user", content)]))


def _sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    events: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        done = False
        for line in resp:
            text = line.decode().strip()
            if not text.startswith("data: "):
                continue
            if text == "data: [DONE]":
                done = True
                break
            events.append(json.loads(text[len("data: ") :]))
    assert done, "the stream ended without data: [DONE]"
    return events


def test_models_lists_the_served_model_with_its_length(cluster: Cluster) -> None:
    for worker in cluster.workers:
        data = http(worker["url"] + "/v1/models").json()["data"]
        assert len(data) == 1
        assert data[0]["object"] == "model"
        assert isinstance(data[0]["max_model_len"], int)
        assert data[0]["max_model_len"] >= 4096
        assert http(worker["url"] + "/health").status == 200


def test_chat_counts_prompt_tokens_as_quicktok_and_ignore_eos_runs_to_max_tokens(cluster: Cluster) -> None:
    d = cluster.ids("decode")[0]
    content = _fresh("Count these tokens exactly, please.")
    reply = http(
        cluster.url(d) + "/v1/chat/completions", _chat(cluster, content, max_tokens=7, ignore_eos=True)
    )
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["prompt_tokens"] == _chat_tokens(content)
    assert answer["usage"]["completion_tokens"] == 7
    assert answer["usage"]["total_tokens"] == _chat_tokens(content) + 7


def test_streamed_chat_ends_with_a_usage_chunk(cluster: Cluster) -> None:
    d = cluster.ids("decode")[0]
    content = _fresh("Stream to me.")
    body = _chat(
        cluster, content, max_tokens=5, ignore_eos=True, stream=True, stream_options={"include_usage": True}
    )
    events = _sse(cluster.url(d) + "/v1/chat/completions", body)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    *chunks, last = events
    assert last["choices"] == []
    usage = last["usage"]
    n = _chat_tokens(content)
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (n, 5, n + 5)
    finals = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["length"]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"


@pytest.mark.parametrize("stream", [False, True])
def test_completions_count_the_bos_and_honour_max_tokens(cluster: Cluster, stream: bool) -> None:
    d = cluster.ids("decode")[0]
    prompt = _fresh("Once upon a time")
    want_prompt = len(TOKENIZER.encode(prompt, add_special_tokens=True))
    body: dict[str, Any] = {
        "model": cluster.model, "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0,
    }  # fmt: skip
    if stream:
        events = _sse(
            cluster.url(d) + "/v1/completions",
            body | {"stream": True, "stream_options": {"include_usage": True}},
        )
        usage = events[-1]["usage"]
        assert events[-1]["choices"] == []
        assert all(e["object"] == "text_completion" for e in events)
    else:
        reply = http(cluster.url(d) + "/v1/completions", body)
        assert reply.status == 200, reply.body
        assert reply.json()["object"] == "text_completion"
        usage = reply.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (want_prompt, 6)


def test_tokenize_counts_equal_quicktok(cluster: Cluster) -> None:
    d = cluster.url(cluster.ids("decode")[0])
    text = "Tokenize me: naïve café, 12345, ✓."
    prompt = http(d + "/tokenize", {"model": cluster.model, "prompt": text}).json()
    assert prompt["count"] == len(TOKENIZER.encode(text, add_special_tokens=True))
    assert prompt["tokens"] == TOKENIZER.encode(text, add_special_tokens=True)
    messages = http(
        d + "/tokenize", {"model": cluster.model, "messages": [{"role": "user", "content": text}]}
    )
    assert messages.json()["count"] == _chat_tokens(text)
    assert messages.json()["max_model_len"] == http(d + "/v1/models").json()["data"][0]["max_model_len"]


def test_metrics_the_gateway_reads_have_their_names_and_labels(cluster: Cluster) -> None:
    for worker in cluster.workers:
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            samples = cluster.samples(worker["id"], name)
            assert samples, f"{worker['id']} has no {name}"
            for labels in samples:
                assert dict(labels).get("model_name") == cluster.model
                assert "engine" in dict(labels)
        sources = {
            dict(k).get("source") for k in cluster.samples(worker["id"], "vllm:prompt_tokens_by_source_total")
        }
        assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}


def test_prefill_returns_the_params_decode_pulls_with(cluster: Cluster) -> None:
    p, d = cluster.ids("prefill")[0], cluster.ids("decode")[0]
    content = _fresh("Ship my KV cache over, please, all of it.")
    n = _chat_tokens(content)
    leg = _chat(
        cluster,
        content,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    first = http(cluster.url(p) + "/v1/chat/completions", leg)
    assert first.status == 200, first.body
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == n
    assert params["tp_size"] == 1
    assert isinstance(params["remote_engine_id"], str)
    assert params["remote_engine_id"]
    assert isinstance(params["remote_request_id"], str)
    assert params["remote_request_id"]
    assert isinstance(params["remote_host"], str)
    assert isinstance(params["remote_port"], int)
    assert params["remote_block_ids"]
    assert all(isinstance(b, int) for b in params["remote_block_ids"][0])
    before = cluster.by_source(d)
    second = http(
        cluster.url(d) + "/v1/chat/completions",
        _chat(cluster, content, max_tokens=4, kv_transfer_params=params),
    )
    assert second.status == 200, second.body
    assert second.json()["kv_transfer_params"] is None
    assert second.json()["usage"]["prompt_tokens"] == n
    after = cluster.by_source(d)
    delta = {source: after[source] - before[source] for source in after}
    # D computes nothing itself: what it did not hold in its prefix cache, it pulled from P.
    assert delta == {
        "local_compute": 0,
        "local_cache_hit": delta["local_cache_hit"],
        "external_kv_transfer": n - delta["local_cache_hit"],
    }, delta
    assert delta["external_kv_transfer"] > 0


@pytest.mark.parametrize(
    ("body", "status", "error_type", "param"),
    [
        pytest.param({"model": "no-such-model"}, 404, "NotFoundError", "model", id="unknown-model"),
        pytest.param({"max_tokens": 10**6}, 400, "BadRequestError", "max_tokens", id="past-max-length"),
        pytest.param({"max_tokens": 0}, 400, "BadRequestError", "max_tokens", id="max-tokens-zero"),
        pytest.param(
            {"stream_options": {"include_usage": True}}, 400, "BadRequestError", "stream_options",
            id="stream-options-without-stream",
        ),
    ],
)  # fmt: skip
def test_bad_requests_get_vllms_status_and_error_body(
    cluster: Cluster, body: dict[str, Any], status: int, error_type: str, param: str
) -> None:
    d = cluster.url(cluster.ids("decode")[0])
    reply = http(d + "/v1/chat/completions", _chat(cluster, "hi", max_tokens=2) | body)
    assert reply.status == status, reply.body
    error = reply.json()["error"]
    assert (error["code"], error["type"], error["param"]) == (status, error_type, param)
    assert isinstance(error["message"], str)
    assert error["message"]


def test_bad_json_gets_vllms_validation_error(cluster: Cluster) -> None:
    reply = http(cluster.url(cluster.ids("decode")[0]) + "/v1/chat/completions", raw=b"{bad json")
    assert reply.status == 400
    error = reply.json()["error"]
    assert (error["code"], error["type"], error["param"]) == (400, "Bad Request", "body.1")


@pytest.mark.parametrize(("decode", "status"), [("D0", 500), ("D1", 200)], ids=["fail", "recompute"])
def test_a_dead_remote_follows_the_kv_load_failure_policy(cluster: Cluster, decode: str, status: int) -> None:
    content = _fresh("My prefill worker is gone.")
    n = _chat_tokens(content)
    dead = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
        "remote_engine_id": "dead-engine", "remote_request_id": "dead-request", "remote_host": "127.0.0.1",
        "remote_port": 9, "tp_size": 1, "remote_num_tokens": n,
    }  # fmt: skip
    before = cluster.by_source(decode)
    reply = http(
        cluster.url(decode) + "/v1/chat/completions",
        _chat(cluster, content, max_tokens=3, kv_transfer_params=dead),
    )
    assert reply.status == status, reply.body
    after = cluster.by_source(decode)
    assert after["external_kv_transfer"] == before["external_kv_transfer"]
    if status == 500:
        assert reply.json()["error"]["type"] == "InternalServerError"
    else:
        assert reply.json()["usage"]["prompt_tokens"] == n
        assert after["local_compute"] - before["local_compute"] >= n - 32  # all but a cached block
    wait_until(
        lambda: http(cluster.url(decode) + "/health").status == 200, deadline_s=60.0, what=f"{decode} healthy"
    )
