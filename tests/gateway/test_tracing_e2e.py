"""OpenTelemetry tracing end to end, against a real OTLP/gRPC receiver (tests/support/otlp_receiver.py):
the simulator cluster exporting vLLM's `llm_request` spans (`--otlp-traces-endpoint`), the
DecisionService with `--tracing`, and each front door (`gateway serve`, and `gateway picker` behind the
real Envoy) with `[tracing]` on. One trace per request, its spans parented as gateway/request_trace.py
says, the traceparent reaching the workers (their spans' parents are our leg spans) and the
DecisionService (its span's parent is the gateway's decision span); at ratio 0 nothing is exported."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conformance.front_doors import FRONT_DOORS, running
from tests.gateway.processes import REPO, Process, start
from tests.support.otlp_receiver import CLIENT, SERVER, OtlpReceiver, ReceivedSpan, otlp_receiver

pytestmark = pytest.mark.integration
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TABLE = REPO / "tests" / "testdata" / "tables" / "good.ppdt"
ROOT = {"standalone": ("ppd-gateway", "ppd.gateway.request"), "envoy": ("ppd-picker", "ppd.picker.request")}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as r, pytest.MonkeyPatch.context() as env:
        # The batch span processor's delay (OpenTelemetry's own variable): spans leave within 50 ms.
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        yield r


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tracing")


@pytest.fixture(scope="module")
def cluster(tmp: Path, receiver: OtlpReceiver) -> Iterator[Process]:
    args = ["simulator", "cluster", "--topology", "1P1D", "--base-port", "0"]
    proc = start([*args, "--otlp-traces-endpoint", receiver.endpoint], tmp, "cluster")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def decision(tmp: Path, receiver: OtlpReceiver) -> Iterator[Process]:
    tables = tmp / "tables"
    tables.mkdir()
    shutil.copy(TABLE, tables / TABLE.name)
    args = ["decision_service", "serve", "--tables", str(tables), "--port", "0", "--metrics-port", "0"]
    proc = start([*args, "--tracing", "--tracing-endpoint", receiver.endpoint], tmp, "decision")
    yield proc
    proc.stop()


def _config(cluster: Process, decision: Process, receiver: OtlpReceiver, ratio: float) -> list[str]:
    lines = ['mode = "ppd"']
    for w in cluster.ready["workers"]:
        lines.append(f'[[workers]]\nid = "{w["id"]}"\nrole = "{w["role"]}"\nurl = "{w["url"]}"\n')
    lines.append(f'[decision]\naddress = "127.0.0.1:{decision.ready["grpc"]}"\ndeadline_ms = 10000.0\n')
    lines.append("[pool]\nhealth_interval_s = 0.5\n")
    lines.append(f'[tracing]\nenabled = true\nsampling_ratio = {ratio}\nendpoint = "{receiver.endpoint}"\n')
    return lines


def _converse(url: str, first: str) -> list[Any]:
    """Two streamed turns of one conversation; their response headers."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": first}]
    headers = []
    for t in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        headers.append(raw.headers)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"and then ({t})"}]
    return headers


def _one(spans: list[ReceivedSpan], name: str, parent: ReceivedSpan) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.parent_span_id == parent.span_id]
    assert len(found) == 1, f"{name} under {parent.name}: {found}"
    return found[0]


def _roots(spans: list[ReceivedSpan], door: str) -> dict[str, ReceivedSpan]:
    service, name = ROOT[door]
    return {s.attributes["ppd.request_id"]: s for s in spans if s.service == service and s.name == name}


@pytest.mark.parametrize("door", FRONT_DOORS)
def test_one_trace_per_request_through_gateway_service_and_workers(
    cluster: Process, decision: Process, receiver: OtlpReceiver, tmp: Path, door: str
) -> None:
    config = _config(cluster, decision, receiver, 1.0)
    with running(door, config, tmp, f"gateway-traced-{door}") as front:
        headers = _converse(front.url, f"traced through {door}")
    ids = [h["x-request-id"] for h in headers]

    def complete(spans: list[ReceivedSpan]) -> bool:
        roots = _roots(spans, door)
        if not all(i in roots for i in ids):
            return False
        traces = {roots[i].trace_id for i in ids}
        workers = [s for s in spans if s.service == "vllm" and s.trace_id in traces]
        service = [s for s in spans if s.service == "ppd-decision" and s.trace_id in traces]
        return len(workers) >= 3 and len(service) >= 1  # P and D of turn 1, D (or P and D) of turn 2

    spans = receiver.wait_for(complete, what=f"the spans of both turns through {door}")
    roots = _roots(spans, door)
    first, second = roots[ids[0]], roots[ids[1]]
    assert first.trace_id != second.trace_id  # one trace per request
    assert first.kind == SERVER
    assert first.parent_span_id == ""
    for root, h in ((first, headers[0]), (second, headers[1])):
        own = [s for s in spans if s.trace_id == root.trace_id]
        for step in ("ppd.parse", "ppd.session_lookup", "ppd.psi"):
            _one(own, step, root)
        attrs = root.attributes
        assert (attrs["ppd.turn"], attrs["ppd.path"], attrs["ppd.reason"]) == (
            int(h["x-ppd-turn"]),
            h["x-ppd-path"],
            h["x-ppd-reason"],
        )
        assert attrs["ppd.worker.decode"] == h["x-ppd-decode-worker"]
        assert attrs["ppd.tokens.prompt"] == attrs["ppd.tokens.context"] + attrs["ppd.tokens.new"] > 0
        decode = _one(own, "ppd.decode", root)
        assert decode.kind == CLIENT
        assert decode.attributes["ppd.worker"] == h["x-ppd-decode-worker"]
        # The traceparent reached D (through Envoy for the picker): vLLM's span is the leg's child.
        assert _one(own, "llm_request", decode).service == "vllm"
        if h["x-ppd-path"] == "pd":
            prefill = _one(own, "ppd.prefill", root)
            assert prefill.attributes["ppd.worker"] == h["x-ppd-prefill-worker"]
            assert _one(own, "llm_request", prefill).attributes["gen_ai.request.max_tokens"] == 1
        if door == "standalone":  # the picker does not see D's first token (Envoy streams it)
            _one(own, "ppd.decode.first_token", decode)
    assert first.attributes["ppd.reason"] == "turn_one"
    assert not [s for s in spans if s.trace_id == first.trace_id and s.name == "ppd.decision"]
    # Turn 2 asked the DecisionService: its server span is the child of the gateway's client span.
    own = [s for s in spans if s.trace_id == second.trace_id]
    asked = _one(own, "ppd.decision", second)
    assert asked.kind == CLIENT
    served = _one(own, "ppd.decision.Route", asked)
    assert (served.service, served.kind) == ("ppd-decision", SERVER)
    assert served.attributes["ppd.table.version"] == headers[1]["x-ppd-table-version"]
    assert served.attributes["ppd.turn"] == 2
    assert served.attributes["ppd.cell"]
    assert served.attributes["ppd.path"] == asked.attributes["ppd.path"]


@pytest.mark.parametrize("door", FRONT_DOORS)
def test_ratio_zero_exports_nothing(
    cluster: Process, decision: Process, receiver: OtlpReceiver, tmp: Path, door: str
) -> None:
    since = time.time_ns()
    config = _config(cluster, decision, receiver, 0.0)
    with running(door, config, tmp, f"gateway-unsampled-{door}") as front:
        headers = _converse(front.url, f"not traced through {door}")
    assert [h["x-ppd-turn"] for h in headers] == ["1", "2"]
    # The front door flushed its spans when it stopped: none were made, and none downstream either (the
    # workers and the DecisionService follow the unsampled traceparent; untraced decisions take no span).
    assert [s for s in receiver.spans() if s.start_ns >= since] == []
