"""End to end with real processes: the simulator cluster, the DecisionService and `python -m gateway`,
driven by the official `openai` client, behind each front door (tests/conformance/front_doors.py:
`gateway serve`, and `gateway picker` behind the real Envoy). Faults come from the simulator's
/admin/faults."""

from __future__ import annotations

import json
import shutil
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from tests.conformance.front_doors import FRONT_DOORS, FrontDoor, running
from tests.gateway.processes import REPO, Process, start
from tests.support.metrics import sample, samples, total

pytestmark = pytest.mark.integration
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TABLE = REPO / "tests" / "testdata" / "tables" / "good.ppdt"
TABLE_REASONS = {
    "table",
    "weights",
    "nearest_cell",
    "default",
    "live_signal",
    "pd_failed_in_cell",
    "local_failed_in_cell",
}


def _config(
    workers: list[dict[str, str]], *, decision: str = "", extra: str = "", stream: bool = True
) -> list[str]:
    lines = [f'mode = "ppd"\nadmin_token = "tok"\n{extra}']
    for w in workers:
        lines.append(f'[[workers]]\nid = "{w["id"]}"\nrole = "{w["role"]}"\nurl = "{w["url"]}"\n')
    lines.append(f'[decision]\naddress = "{decision}"\ndeadline_ms = 10000.0\nfallback = "pd"\n')
    lines.append(f"stream = {str(stream).lower()}\n")
    lines.append("[pool]\nhealth_interval_s = 0.5\n")
    return lines


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module", params=FRONT_DOORS)
def door(request: pytest.FixtureRequest) -> str:
    """The front door of this module's tests (each with its own cluster: a test downs a worker)."""
    kind: str = request.param
    return kind


@pytest.fixture(scope="module")
def cluster(tmp: Path, door: str) -> Iterator[Process]:
    proc = start(["simulator", "cluster", "--topology", "2P2D", "--base-port", "0"], tmp, f"cluster-{door}")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def decision(tmp: Path) -> Iterator[Process]:
    tables = tmp / "tables"
    tables.mkdir()
    shutil.copy(TABLE, tables / TABLE.name)
    args = ["decision_service", "serve", "--tables", str(tables), "--port", "0", "--metrics-port", "0"]
    proc = start(args, tmp, "decision")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(cluster: Process, decision: Process, tmp: Path, door: str) -> Iterator[FrontDoor]:
    config = _config(cluster.ready["workers"], decision=f"127.0.0.1:{decision.ready['grpc']}")
    with running(door, config, tmp, f"gateway-{door}") as front:
        yield front


def _url(gateway: FrontDoor) -> str:
    return gateway.url


def _worker(cluster: Process, worker_id: str) -> str:
    return str(next(w["url"] for w in cluster.ready["workers"] if w["id"] == worker_id))


def _http(url: str, body: Any = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, resp.read()


def _faults(cluster: Process, worker_id: str, **faults: Any) -> None:
    assert _http(_worker(cluster, worker_id) + "/admin/faults", faults)[0] == 200


def _converse(
    client: openai.OpenAI, *, turns: int, stream: bool, first: str = "Tell me a story"
) -> list[Any]:
    messages: list[Any] = [{"role": "user", "content": first}]
    headers = []
    for t in range(turns):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=12, stream=stream
        )
        headers.append(raw.headers)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)  # type: ignore[union-attr]
        else:
            text = raw.parse().choices[0].message.content or ""  # type: ignore[union-attr]
        assert text
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"go on ({t})"}]
    return headers


@pytest.mark.parametrize("stream", [False, True])
def test_multi_turn_through_the_openai_client(gateway: FrontDoor, stream: bool) -> None:
    client = openai.OpenAI(base_url=_url(gateway) + "/v1", api_key="unused", max_retries=0)
    headers = _converse(client, turns=4, stream=stream)
    assert (headers[0]["x-ppd-path"], headers[0]["x-ppd-reason"], headers[0]["x-ppd-turn"]) == (
        "pd",
        "turn_one",
        "1",
    )
    for t, h in enumerate(headers[1:], start=2):
        assert h["x-ppd-turn"] == str(t)
        assert h["x-ppd-path"] in ("local", "pd")
        assert h["x-ppd-reason"] in TABLE_REASONS, h["x-ppd-reason"]
        assert h["x-ppd-table-version"]
        assert h["x-ppd-session-id"] == headers[0]["x-ppd-session-id"]
        assert h["x-ppd-decode-worker"] == headers[0]["x-ppd-decode-worker"]
    assert sample(gateway.metrics(), "ppd_gateway_route_rpc_seconds_count", outcome="ok") is not None


def test_models_tokenize_and_health_pass_through(gateway: FrontDoor) -> None:
    url = _url(gateway)
    assert json.loads(_http(url + "/v1/models")[1])["data"][0]["id"] == MODEL
    tok = json.loads(_http(url + "/tokenize", {"model": MODEL, "prompt": "Hello world"})[1])
    assert tok["count"] >= 2
    assert _http(url + "/health")[0] == 200


def test_route_unary_form(cluster: Process, decision: Process, tmp: Path, door: str) -> None:
    # RouteStreams are the default (every other test here); `stream = false` makes unary Route calls.
    config = _config(cluster.ready["workers"], decision=f"127.0.0.1:{decision.ready['grpc']}", stream=False)
    with running(door, config, tmp, f"gateway-unary-{door}") as gw:
        client = openai.OpenAI(base_url=_url(gw) + "/v1", api_key="unused", max_retries=0)
        headers = _converse(client, turns=3, stream=True, first="unary form")
        assert [h["x-ppd-turn"] for h in headers] == ["1", "2", "3"]
        assert all(h["x-ppd-reason"] in TABLE_REASONS for h in headers[1:])


def test_prefill_errors_retry_on_the_other_p(gateway: FrontDoor, cluster: Process) -> None:
    _faults(cluster, "P0", error_rate=1.0)
    try:
        client = openai.OpenAI(base_url=_url(gateway) + "/v1", api_key="unused", max_retries=0)
        for i in range(3):
            h = _converse(client, turns=1, stream=True, first=f"retry {i}")[0]
            assert (h["x-ppd-path"], h["x-ppd-prefill-worker"]) == ("pd", "P1")
        _faults(cluster, "P1", error_rate=1.0)
        h = _converse(client, turns=1, stream=False, first="both down")[0]
        assert (h["x-ppd-path"], h["x-ppd-reason"]) == ("local", "prefill_failed")
    finally:
        _faults(cluster, "P0", error_rate=0.0)
        _faults(cluster, "P1", error_rate=0.0)


def test_decision_service_stopped_falls_back(cluster: Process, tmp: Path, door: str) -> None:
    tables = tmp / f"tables-{door}"
    tables.mkdir()
    shutil.copy(TABLE, tables / TABLE.name)
    args = ["decision_service", "serve", "--tables", str(tables), "--port", "0", "--metrics-port", "0"]
    svc = start(args, tmp, f"decision-{door}")
    try:
        config = _config(cluster.ready["workers"], decision=f"127.0.0.1:{svc.ready['grpc']}")
        with running(door, config, tmp, f"gateway-no-oracle-{door}") as gw:
            client = openai.OpenAI(base_url=_url(gw) + "/v1", api_key="unused", max_retries=0)
            svc.stop()
            headers = _converse(client, turns=3, stream=True, first="no oracle")
            for h in headers[1:]:
                assert h["x-ppd-path"] == "pd"
                assert h["x-ppd-reason"].startswith("fallback_")
                assert h["x-ppd-fallback"] == "1"
    finally:
        svc.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_workers_request(
    gateway: FrontDoor, cluster: Process, stream: bool
) -> None:
    """The served command (`python -m gateway serve`), not only the app: its server cancels the handler."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"long, stream={stream}"}],
        "stream": stream,
        "max_tokens": 20000,
    }
    decoders = [w["url"] for w in cluster.ready["workers"] if w["role"] == "decode"]
    generated = sum(_metric(d, "vllm:generation_tokens_total") for d in decoders)
    data = json.dumps(body).encode()
    client = socket.create_connection(("127.0.0.1", urlsplit(gateway.url).port or 80), timeout=30)
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(data), data)
    )
    try:
        for _ in range(1200):
            if sum(_metric(d, "vllm:num_requests_running") for d in decoders) == 1:
                break
            time.sleep(0.05)
        assert sum(_metric(d, "vllm:num_requests_running") for d in decoders) == 1
    finally:
        client.close()  # the client goes away mid-answer
    for _ in range(1200):  # the worker would need minutes to finish 20000 tokens by itself
        if sum(_metric(d, "vllm:num_requests_running") for d in decoders) == 0:
            break
        time.sleep(0.05)
    assert sum(_metric(d, "vllm:num_requests_running") for d in decoders) == 0
    assert sum(_metric(d, "vllm:generation_tokens_total") for d in decoders) - generated < 20000


def _metric(worker_url: str, name: str) -> float:
    return total(_http(worker_url + "/metrics")[1], name) or 0.0


def _admin(gateway: FrontDoor, path: str) -> Any:
    req = urllib.request.Request(_url(gateway) + path, headers={"Authorization": "Bearer tok"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_a_request_past_the_models_length_never_reaches_a_worker(
    gateway: FrontDoor, cluster: Process
) -> None:
    """The issue's case: max_tokens 10^9 with a long prompt ran a whole prefill on P before D said 400."""
    # The pool publishes its counts after a whole round of probes, each worker's /v1/models card read.
    gateway.await_live("decode", 2)
    if gateway.kind == "standalone":  # the picker has no admin API
        workers = _admin(gateway, "/admin/workers")["workers"]
        assert all(w["max_model_len"] == {MODEL: 131072} for w in workers)  # simulate --max-model-len
    urls = [w["url"] for w in cluster.ready["workers"]]
    assert all(samples(_http(u + "/metrics")[1], "vllm:prompt_tokens_total") for u in urls)
    prompt_tokens = sum(_metric(u, "vllm:prompt_tokens_total") for u in urls)
    client = openai.OpenAI(base_url=_url(gateway) + "/v1", api_key="unused", max_retries=0)
    long_prompt = [{"role": "user", "content": "word " * 20_000}]
    for max_tokens in (10**9, 131072, 120_000):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=long_prompt, max_tokens=max_tokens)  # type: ignore[arg-type]
        assert "maximum context length is 131072" in str(info.value)
    assert sum(_metric(u, "vllm:prompt_tokens_total") for u in urls) == prompt_tokens


def test_dead_decode_worker_rebinds_the_session(gateway: FrontDoor, cluster: Process) -> None:
    """Runs last in this module for its front door: the downed worker stays down."""
    client = openai.OpenAI(base_url=_url(gateway) + "/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "rebind me"}]
    first = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8)
    old = first.headers["x-ppd-decode-worker"]
    messages += [{"role": "assistant", "content": first.parse().choices[0].message.content}]
    messages += [{"role": "user", "content": "still there?"}]
    _faults(cluster, old, down=True)
    if gateway.kind == "envoy":
        # The picker re-plans only a D its pool knows is gone; one gone before that is Envoy's 503
        # (a strict xfail in tests/conformance/test_gateway_on_workers.py).
        gateway.await_live("decode", 1)
    second = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8)
    assert second.parse().choices[0].message.content
    assert second.headers["x-ppd-path"] == "pd"
    assert second.headers["x-ppd-reason"] in ("decode_gone", "decode_unreachable")
    assert second.headers["x-ppd-decode-worker"] != old
    assert second.headers["x-ppd-turn"] == "2"
