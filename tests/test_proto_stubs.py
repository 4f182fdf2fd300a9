"""The checked-in stubs are what `make proto` generates from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GENERATED = ("decision_pb2.py", "decision_pb2.pyi", "decision_pb2_grpc.py", "decision_pb2_grpc.pyi")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stubs")
    subprocess.run([sys.executable, str(REPO / "proto" / "generate.py"), "--out", str(out)], check=True)
    return out


@pytest.mark.parametrize("name", GENERATED)
def test_checked_in_stubs_are_fresh(regenerated: Path, name: str) -> None:
    fresh = (regenerated / "ppd" / "decision" / "v1" / name).read_bytes()
    checked_in = (REPO / "ppd" / "decision" / "v1" / name).read_bytes()
    assert fresh == checked_in, f"ppd/decision/v1/{name} is stale: run `make proto` and commit the result"


def test_service_name_comes_from_the_descriptor() -> None:
    from ppd.decision.v1 import decision_pb2

    service = decision_pb2.DESCRIPTOR.services_by_name["DecisionService"]
    assert service.full_name == "ppd.decision.v1.DecisionService"
    assert set(service.methods_by_name) == {"Route", "RouteBatch", "RouteStream", "DescribeTable"}
