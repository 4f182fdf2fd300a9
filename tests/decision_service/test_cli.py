"""The real command: `python -m decision_service serve`, its JSON line, reloads, signals, --help."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ppd.decision.v1 import decision_pb2_grpc as pb_grpc
from tests.decision_service.harness import turn2
from tests.decision_service.process import ServeProcess, serve_process
from tests.decision_service.tables import DEFAULT_KEY, version_of, write_table_file
from tests.support.metrics import sample, samples
from tests.support.polling import eventually

pytestmark = pytest.mark.integration


def scrape(served: ServeProcess) -> str:
    with urllib.request.urlopen(served.metrics_url, timeout=10) as response:
        body: bytes = response.read()
    return body.decode()


async def test_serve_announces_ports_answers_and_exports_metrics(loaded_dir: Path) -> None:
    with serve_process(loaded_dir) as served:
        assert set(served.ports) == {"grpc", "metrics"}
        assert all(isinstance(port, int) and port > 0 for port in served.ports.values())
        async with grpc.aio.insecure_channel(served.grpc_target) as channel:
            stub = pb_grpc.DecisionServiceStub(channel)
            response = await stub.Route(turn2(request_id="cli"))
            assert response.table_key == DEFAULT_KEY
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Route(turn2(turn=0))
        text = scrape(served)
        assert samples(text, "ppd_decisions_total")
        assert samples(text, "ppd_route_latency_seconds_bucket")
        assert sample(text, "ppd_table_reloads_total", result="loaded") == 1
        file = str(loaded_dir / "1p3d.ppdt")
        assert sample(text, "ppd_table_info", file=file, key=DEFAULT_KEY, version=version_of()) == 1
        assert sample(text, "ppd_route_errors_total", code="INVALID_ARGUMENT") == 1
        status, log = served.stop()
        assert status == 0, log
        assert "Traceback" not in log


async def test_poll_picks_up_a_new_table_and_rejects_a_bad_one(tables_dir: Path) -> None:
    with serve_process(tables_dir, "--reload-interval", "0.05") as served:
        async with grpc.aio.insecure_channel(served.grpc_target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest())
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            first = write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY)

            async def serving() -> bool:
                reply = await health.Check(health_pb2.HealthCheckRequest())
                return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

            await eventually(serving)
            (tables_dir / "a.ppdt").write_bytes(b"garbage, not a table")

            async def rejected() -> bool:
                return sample(scrape(served), "ppd_table_reloads_total", result="bad_magic") == 1

            await eventually(rejected)
            stub = pb_grpc.DecisionServiceStub(channel)
            response = await stub.Route(turn2())
            assert response.table_version == first
        status_code, log = served.stop()
    assert status_code == 0
    assert "a.ppdt" in log
    assert "bad_magic" in log


async def test_sighup_reloads_at_once(tables_dir: Path) -> None:
    first = write_table_file(tables_dir / "a.ppdt", seed=1)
    # A poll interval far beyond the test's deadline: only SIGHUP can explain the reload.
    with serve_process(tables_dir, "--reload-interval", "3600") as served:
        async with grpc.aio.insecure_channel(served.grpc_target) as channel:
            stub = pb_grpc.DecisionServiceStub(channel)
            assert (await stub.Route(turn2())).table_version == first
            second = write_table_file(tables_dir / "a.ppdt", seed=2)
            served.process.send_signal(signal.SIGHUP)

            async def reloaded() -> bool:
                return (await stub.Route(turn2())).table_version == second

            await eventually(reloaded)
        status, _ = served.stop()
    assert status == 0


async def test_sigint_also_stops_cleanly(loaded_dir: Path) -> None:
    with serve_process(loaded_dir) as served:
        served.process.send_signal(signal.SIGINT)
        status, log = served.stop()
    assert status == 0
    assert "Traceback" not in log


@pytest.mark.parametrize("which", ["--port", "--metrics-port"])
def test_busy_port_is_one_clear_error_line(loaded_dir: Path, which: str) -> None:
    with serve_process(loaded_dir) as first:
        busy = first.ports["grpc" if which == "--port" else "metrics"]
        ports = {"--port": "0", "--metrics-port": "0", which: str(busy)}
        result = subprocess.run(
            [sys.executable, "-m", "decision_service", "serve", "--tables", str(loaded_dir),
             *(item for pair in ports.items() for item in pair)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        first.stop()
    assert result.returncode == 1
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert "cannot serve" in result.stderr


def test_workers_parent_stops_all_when_one_dies(loaded_dir: Path) -> None:
    with serve_process(loaded_dir, "--workers", "2") as served:
        victim, survivor = (worker["pid"] for worker in served.ports["workers"])
        os.kill(victim, signal.SIGKILL)
        status = served.process.wait(timeout=60)
        _, log = served.process.communicate(timeout=60)
    assert status == 1
    assert f"worker {victim} exited unexpectedly" in log
    with pytest.raises(ProcessLookupError):
        os.kill(survivor, 0)


def test_workers_share_one_port(loaded_dir: Path) -> None:
    with serve_process(loaded_dir, "--workers", "2") as served:
        workers = served.ports["workers"]
        assert len(workers) == 2
        assert served.ports["metrics"] == workers[0]["metrics"]

        for _ in range(40):
            with grpc.insecure_channel(served.grpc_target) as channel:
                pb_grpc.DecisionServiceStub(channel).Route(turn2(), timeout=20)
        answered = set()
        for worker in workers:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{worker['metrics']}/metrics", timeout=10
            ) as response:
                counts = samples(response.read(), "ppd_decisions_total").values()
            if sum(counts) > 0:
                answered.add(worker["pid"])
        status, log = served.stop()
    assert status == 0, log
    assert answered  # 40 fresh connections: the kernel spread them (both is likely, one is certain)


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["serve", "--help"]],
    ids=["top", "serve"],
)
def test_help(argv: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "decision_service", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0
    assert "usage:" in result.stdout


def test_bad_setting_is_a_clear_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "decision_service", "serve", "--port", "70000"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "port must be in 0..65535" in result.stderr


def test_json_line_is_the_only_stdout(loaded_dir: Path) -> None:
    with serve_process(loaded_dir) as served:
        status, _ = served.stop()
    assert status == 0
    assert served.stdout_rest == ""
    assert json.dumps(served.ports)
