"""vLLM's spans join the gateway's trace, on each engine's workers, behind each front door: the session
cluster exports its `llm_request` spans to the session's OTLP receiver (conftest.py, `otlp`), and a
gateway with `[tracing]` on sends each P and D leg its span's traceparent (through Envoy for the
picker). On real vLLM this is vLLM's own tracing (vllm/v1/engine/output_processor.py); the simulator
exports the same span."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.conformance.front_doors import running
from tests.conformance.workers import Cluster
from tests.support.gateway_config import worker_tables
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.integration
_ROOT = {"standalone": "ppd.gateway.request", "envoy": "ppd.picker.request"}


def test_the_workers_spans_are_children_of_the_gateways_legs(
    cluster: Cluster, front_door: str, otlp: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if cluster.process is None:
        pytest.skip("an external cluster (PPD_TEST_CLUSTER) exports its spans elsewhere, if at all")
    tmp: Path = tmp_path_factory.mktemp(f"tracing-{cluster.engine}-{front_door}")
    live = [w for w in cluster.workers if w["id"] not in cluster.crashed]
    config = [
        'mode = "pd"',
        "[tracing]",
        "enabled = true",
        f'endpoint = "{otlp.endpoint}"',
        "",
        *worker_tables(live),
    ]
    with running(front_door, config, tmp, "gateway") as door:
        client = openai.OpenAI(base_url=door.url + "/v1", api_key="unused", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model=cluster.model,
            messages=[{"role": "user", "content": f"traced on {cluster.engine} via {front_door}"}],
            max_tokens=4,
        )
    request_id = raw.headers["x-request-id"]
    assert raw.headers["x-ppd-path"] == "pd"

    def legs_and_workers(spans: list[ReceivedSpan]) -> bool:
        roots = [
            s
            for s in spans
            if s.name == _ROOT[front_door] and s.attributes.get("ppd.request_id") == request_id
        ]
        if not roots:
            return False
        mine = [s for s in spans if s.trace_id == roots[0].trace_id]
        return len([s for s in mine if s.name == "llm_request"]) == 2

    spans = otlp.wait_for(
        legs_and_workers, what=f"P's and D's llm_request spans of {request_id}", deadline_s=60
    )
    root = next(
        s for s in spans if s.name == _ROOT[front_door] and s.attributes["ppd.request_id"] == request_id
    )
    mine = {s.span_id: s for s in spans if s.trace_id == root.trace_id}
    workers = [s for s in mine.values() if s.name == "llm_request"]
    parents = sorted(mine[s.parent_span_id].name for s in workers)
    assert parents == ["ppd.decode", "ppd.prefill"]
    for span in workers:
        leg = mine[span.parent_span_id]
        assert leg.parent_span_id == root.span_id
        assert span.attributes["gen_ai.usage.prompt_tokens"] > 0
        assert span.start_ns >= leg.start_ns  # vLLM's arrival is after our leg sent the request
