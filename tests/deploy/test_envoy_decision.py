"""The decision scenario with the real Envoy in front of real `decision_service serve` replicas:
Route over gRPC and as JSON, verify.sh, and a replica stopped under a steady stream of calls."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ppd.decision.v1 import decision_pb2, decision_pb2_grpc
from tests.deploy.envoy_harness import SCENARIOS, Envoy
from tests.deploy.processes import REPO, Announced
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration

SERVICE = "ppd.decision.v1.DecisionService"
GOOD_TABLE = REPO / "tests" / "testdata" / "tables" / "good.ppdt"
QUERY = {
    "request_id": "deploy-test",
    "turn": 2,
    "new_input_tokens": 256,
    "expected_output_tokens": 64,
    "context_tokens": 1024,
    "qps": 2.0,
}


@dataclass
class DecisionStack:
    envoy: Envoy
    replicas: list[Announced]
    exits: ExitStack = field(default_factory=ExitStack)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.envoy.listeners['decision']}"

    def ports(self) -> set[int]:
        return {int(r.info["grpc"]) for r in self.replicas}


@contextmanager
def decision_stack(folder: Path, descriptor_set: Path, replicas: int) -> Iterator[DecisionStack]:
    tables = folder / "tables"
    tables.mkdir()
    shutil.copy(GOOD_TABLE, tables / GOOD_TABLE.name)
    with ExitStack() as stack:
        started = Announced.start_all(
            [
                (
                    [sys.executable, "-m", "decision_service", "serve", "--tables", str(tables),
                     "--port", "0", "--metrics-port", "0", "--grace", "5"],
                    folder / f"replica{i}.log",
                )
                for i in range(replicas)
            ]
        )  # fmt: skip
        for child in started:
            stack.callback(child.close)
        envoy = Envoy.start(
            "decision",
            folder / "envoy",
            cluster="decision",
            upstream_ports=[int(c.info["grpc"]) for c in started],
            extra={"DESCRIPTOR_PATH": str(descriptor_set)},
        )
        stack.callback(envoy.close)
        result = DecisionStack(envoy=envoy, replicas=started)
        envoy.await_healthy("decision", result.ports())
        yield result


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, descriptor_set: Path) -> Iterator[DecisionStack]:
    with decision_stack(tmp_path_factory.mktemp("decision"), descriptor_set, replicas=2) as s:
        yield s


def post_json(url: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return int(err.code), json.loads(err.read() or b"{}")


def test_grpc_route_through_envoy(stack: DecisionStack) -> None:
    with grpc.insecure_channel(stack.target) as channel:
        stub = decision_pb2_grpc.DecisionServiceStub(channel)
        answer = stub.Route(decision_pb2.RouteRequest(**QUERY), timeout=10)  # type: ignore[arg-type]
    assert answer.decision in (decision_pb2.DECISION_PD, decision_pb2.DECISION_LOCAL)
    assert answer.request_id == "deploy-test"


def test_route_stream_through_envoy_answers_in_order(stack: DecisionStack) -> None:
    requests = [decision_pb2.RouteRequest(**{**QUERY, "request_id": f"s{i}"}) for i in range(5)]  # type: ignore[arg-type]
    with grpc.insecure_channel(stack.target) as channel:
        stub = decision_pb2_grpc.DecisionServiceStub(channel)
        answers = list(stub.RouteStream(iter(requests), timeout=30))
    assert [a.request_id for a in answers] == [f"s{i}" for i in range(5)]


def test_health_watch_through_envoy_reports_serving(stack: DecisionStack) -> None:
    with grpc.insecure_channel(stack.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=30)
        first = next(iter(watch))
        watch.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING


def test_long_lived_streams_have_no_route_or_idle_timeout(stack: DecisionStack) -> None:
    """A gateway holds RouteStream and a health Watch open for hours, often quiet."""
    config = yaml.safe_load((stack.envoy.folder / "envoy.yaml").read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert "request_timeout" not in hcm  # it would end every client stream after that time
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    for path in (f"/{SERVICE}/RouteStream", "/grpc.health.v1.Health/Watch"):
        (route,) = [r["route"] for r in routes if path in (r["match"].get("path"), r["match"].get("prefix"))]
        assert (route["timeout"], route["idle_timeout"]) == ("0s", "0s")


def test_plain_http_json_reaches_route(stack: DecisionStack) -> None:
    status, answer = post_json(f"http://{stack.target}/{SERVICE}/Route", QUERY)
    assert status == 200, answer
    assert answer["decision"] in ("DECISION_PD", "DECISION_LOCAL")
    assert answer["request_id"] == "deploy-test"
    assert answer["table_version"]


def test_plain_http_json_turn_one_is_pd(stack: DecisionStack) -> None:
    status, answer = post_json(f"http://{stack.target}/{SERVICE}/Route", {**QUERY, "turn": 1})
    assert status == 200, answer
    assert (answer["decision"], answer["reason"]) == ("DECISION_PD", "REASON_TURN_ONE")


def test_plain_http_json_bad_query_is_400_with_the_grpc_message(stack: DecisionStack) -> None:
    """INVALID_ARGUMENT comes back as HTTP 400 with the status as JSON (convert_grpc_status)."""
    status, answer = post_json(f"http://{stack.target}/{SERVICE}/Route", {**QUERY, "turn": 0})
    assert status == 400
    assert answer["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "turn" in str(answer["message"])


def test_plain_http_json_unknown_table_is_404(stack: DecisionStack) -> None:
    status, answer = post_json(f"http://{stack.target}/{SERVICE}/Route", {**QUERY, "table_key": "9P9D/none"})
    assert status == 404
    assert answer["code"] == grpc.StatusCode.NOT_FOUND.value[0]


def test_verify_script_passes_against_the_live_scenario(stack: DecisionStack) -> None:
    env = {
        **os.environ,
        "ENVOY": stack.target,
        "ADMIN": stack.envoy.admin.removeprefix("http://"),
        "GRPCURL": str(Path(sys.executable).parent / "grpcurl"),
        "MIN_HEALTHY": "2",
    }
    result = subprocess.run(
        ["bash", str(SCENARIOS / "decision" / "verify.sh")],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decision scenario verified" in result.stdout


class RouteStream:
    """Client threads sending Route calls through Envoy back to back, recording every failure."""

    def __init__(self, target: str, threads: int = 2) -> None:
        self.target = target
        self.ok = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> RouteStream:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def _run(self) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub = decision_pb2_grpc.DecisionServiceStub(channel)
            request = decision_pb2.RouteRequest(**QUERY)  # type: ignore[arg-type]
            while not self._stop.is_set():
                try:
                    answer = stub.Route(request, timeout=10)
                except grpc.RpcError as err:
                    with self._lock:
                        self.failures.append(f"{err.code()}: {err.details()}")
                    continue
                with self._lock:
                    if answer.decision in (decision_pb2.DECISION_PD, decision_pb2.DECISION_LOCAL):
                        self.ok += 1
                    else:
                        self.failures.append(f"no decision in {answer}")

    def count(self) -> int:
        with self._lock:
            return self.ok


def test_stopping_a_replica_under_steady_load_fails_no_call(tmp_path: Path, descriptor_set: Path) -> None:
    with decision_stack(tmp_path, descriptor_set, replicas=3) as s:
        victim, *survivors = s.replicas
        victim_port = int(victim.info["grpc"])
        with RouteStream(s.target) as calls:
            # Every replica carries traffic before one goes.
            wait_until(
                lambda: all(h.stats.get("rq_success", 0) > 0 for h in s.envoy.hosts("decision").values()),
                deadline_s=30,
                what="every replica to have answered through Envoy",
            )
            assert victim.terminate(grace_s=60) == 0, victim.log.read_text()
            s.envoy.await_healthy("decision", {int(r.info["grpc"]) for r in survivors})
            after_stop = calls.count()
            wait_until(
                lambda: calls.count() >= after_stop + 200, deadline_s=60, what="200 calls after the stop"
            )
        assert calls.failures == [], calls.failures[:5]
        assert calls.ok > 200
        assert victim_port not in s.envoy.healthy_ports("decision")
