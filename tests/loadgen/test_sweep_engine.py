"""The ``endpoints`` sweep engine: a grid swept through the front door of a stack started separately.

The stack is ``ppd-up --engine sim`` (its gateway, simulated vLLM workers with
``VLLM_SERVER_DEV_MODE=1``; also with ``--data-plane envoy``, Envoy and the picker); the failure tests
use one simulated worker as the front door (a short context window, no dev routes) or a closed port.
``ppd-table sweep --engine endpoints`` finds the engine through its entry point, so these tests need
the project installed (``make venv``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from decision_service.table import Table
from devstack.ready import start_ready
from loadgen.sweep_engine import Deployment, EndpointsEngine, WorkerRef, parse_worker
from ppd.decision.v1 import decision_pb2, decision_pb2_grpc
from table_builder.cli import main
from table_builder.records import read_records
from tests.support.gateway_config import worker_tables
from tests.support.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: A context window too small for a `huge_*` workload (5120 tokens before Turn 2), long enough for a
#: request that holds a worker's queue for many seconds.
SHORT_WINDOW = 4096


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, Any]]:
    """ppd-up on the simulator (1P1D, port 0), its workers serving vLLM's dev routes and publishing
    their KV events (its gateway follows them, so it places legs by prefix); its ready line."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    tables = str(ROOT / "tables" / "example")
    argv = [sys.executable, "-m", "devstack.stack", "--engine", "sim", "--topology", "1P1D", "--port", "0",
            "--tables", tables, "--kv-events", "--log-level", "WARNING",
            "--ready-timeout", "110"]  # fmt: skip
    proc, ready = start_ready(argv, timeout_s=150.0, name="ppd-up", env=env, cwd=ROOT)
    try:
        yield ready
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def lone_worker() -> Iterator[str]:
    """One simulated decode worker with a 4096-token window and no dev routes: its URL."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    argv = [sys.executable, "-m", "simulator", "worker", "--role", "decode", "--port", "0",
            "--max-model-len", str(SHORT_WINDOW), "--spin-us", "0"]  # fmt: skip
    proc, ready = start_ready(argv, timeout_s=60.0, name="ppd-sim worker", env=env, cwd=ROOT)
    try:
        yield str(ready["url"])
    finally:
        _stop(proc)


def _workers(ready: dict[str, Any]) -> list[str]:
    flags = []
    for worker in ready["workers"]:
        flags += ["--worker", f"{worker['role']}={worker['url']}"]
    return flags


def _sweep(url: str, out: Path, *extra: str, workloads: str = "small_mid_bal", qps: str = "2,4") -> list[str]:
    return ["sweep", "--engine", "endpoints", "--url", url, "--shape", "1P1D", "--modes", "pd,local",
            "--workloads", workloads, "--qps", qps, "--duration", "2", "--min-samples", "1",
            "--out", str(out), "--quiet", *extra]  # fmt: skip


def _route(grpc_port: int) -> decision_pb2.RouteResponse:
    """The served answer for a Turn-2 request of small_mid_bal at 2 QPS."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = decision_pb2_grpc.DecisionServiceStub(channel)
        request = decision_pb2.RouteRequest(
            turn=2, new_input_tokens=256, expected_output_tokens=256, context_tokens=256, qps=2.0
        )
        answer: decision_pb2.RouteResponse = stub.Route(request, timeout=10)
        return answer


# ---------------------------------------------------------------------------------------- no servers


def test_a_worker_flag_is_a_url_or_role_and_url() -> None:
    assert parse_worker("http://10.0.0.5:8000/") == WorkerRef("http://10.0.0.5:8000", "unknown")
    assert parse_worker("decode=http://d:8000") == WorkerRef("http://d:8000", "decode")
    with pytest.raises(ValueError, match="must be one of prefill, decode, replica"):
        parse_worker("gpu=http://d:8000")
    with pytest.raises(ValueError, match="expected URL or ROLE=URL"):
        parse_worker("decode=d:8000")


def test_without_url_the_endpoints_engine_is_a_usage_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["sweep", "--engine", "endpoints", "--shape", "1P1D", "--out", str(tmp_path / "sweep"), "--quiet"]
    assert main(argv) == 2
    assert "the endpoints engine needs --url" in caplog.text
    assert not (tmp_path / "sweep").exists()


def test_a_bad_worker_flag_is_a_usage_error_before_anything_is_contacted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = _sweep("http://192.0.2.1:8000", tmp_path / "sweep", "--worker", "gpu=http://192.0.2.2:8000")
    assert main(argv) == 2
    assert "the role before '=' must be one of prefill, decode, replica" in caplog.text
    assert not (tmp_path / "sweep").exists()


def test_an_unreadable_admin_token_file_is_a_usage_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = _sweep("http://192.0.2.1:8000", tmp_path / "sweep", "--admin-token-file", str(tmp_path / "none"))
    assert main(argv) == 2
    assert "--admin-token-file:" in caplog.text
    assert str(tmp_path / "none") in caplog.text
    assert not (tmp_path / "sweep").exists()


@pytest.mark.integration
def test_a_point_whose_front_door_went_away_is_not_kept() -> None:
    from ppd.catalog import parse_workload
    from table_builder.sweep import GridPoint, SweepError

    with socket_closed() as url:
        deployment = Deployment(MODEL, 131072, (), ("0.33.0",), "none")
        engine = EndpointsEngine(url=url, deployment=deployment, duration_s=1.0)
        point = GridPoint("1P1D", "llama-3.1-8b", "pd", parse_workload("small_mid_bal"), 8.0)
        with pytest.raises(
            SweepError, match=f"every request of 1P1D_pd_small_mid_bal_8 failed to connect to {url}"
        ):
            engine.run(point)


@pytest.mark.integration
def test_an_unreachable_front_door_is_named_and_nothing_is_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket_closed() as url:
        assert main(_sweep(url, tmp_path / "sweep")) == 1
    assert f"cannot reach {url}/v1/models" in caplog.text
    assert not (tmp_path / "sweep").exists()


class socket_closed:  # noqa: N801 - a context manager used like a function
    """A URL on 127.0.0.1 whose port nothing listens on (bound, then closed)."""

    def __enter__(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        return None


# ---------------------------------------------------------------------------------------- one worker


@pytest.mark.integration
def test_a_workload_too_long_for_the_model_is_refused_up_front(
    lone_worker: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = _sweep(lone_worker, tmp_path / "sweep", workloads="small_mid_bal,huge_mid_bal")
    assert main(argv) == 2
    assert "workload huge_mid_bal needs" in caplog.text
    assert f"max_model_len {SHORT_WINDOW}" in caplog.text
    assert "small_mid_bal needs" not in caplog.text  # only the one that does not fit is named
    assert not (tmp_path / "sweep").exists()


@pytest.mark.integration
def test_without_the_dev_route_the_sweep_says_so_once_and_runs(
    lone_worker: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "sweep"
    argv = _sweep(lone_worker, out, "--worker", lone_worker, "--no-build", qps="4")
    assert main(argv) == 0
    assert caplog.text.count("no POST /reset_prefix_cache") == 1  # two points, one line
    assert f"unknown at {lone_worker}: no POST /reset_prefix_cache" in caplog.text
    assert "VLLM_SERVER_DEV_MODE=1" in caplog.text
    records = read_records(sorted((out / "records").rglob("*.jsonl")))
    assert {r.mode for r in records} == {"pd", "local"}
    assert records
    assert all(r.ok for r in records)


@pytest.mark.integration
def test_without_a_worker_list_the_log_says_isolation_is_limited(
    lone_worker: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert main(_sweep(lone_worker, tmp_path / "sweep", "--dry-run")) == 0
    assert "no worker list" in caplog.text
    assert "not by draining the workers' queues" in caplog.text
    assert not (tmp_path / "sweep").exists()  # a dry run writes nothing


@pytest.mark.integration
def test_a_queue_that_never_drains_stops_the_sweep_naming_the_worker(
    lone_worker: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request another client keeps running (an endless answer) holds the worker's queue."""
    import urllib.request

    body = json.dumps({"model": MODEL, "prompt": "hold", "max_tokens": SHORT_WINDOW - 8, "ignore_eos": True,
                       "stream": True}).encode()  # fmt: skip
    request = urllib.request.Request(
        f"{lone_worker}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    # Its answer is streamed and never read: the worker keeps it running until the connection closes.
    response = urllib.request.urlopen(request, timeout=60)
    try:
        argv = _sweep(lone_worker, tmp_path / "sweep", "--worker", f"decode={lone_worker}",
                      "--settle-timeout", "0.5", qps="4")  # fmt: skip
        assert main(argv) == 1
        assert "did not drain within 0.5 s" in caplog.text
        assert f"decode at {lone_worker}: 1 running, 0 waiting" in caplog.text
        assert "--settle-timeout" in caplog.text
        assert not list((tmp_path / "sweep").rglob("*.jsonl"))  # no point ran
    finally:
        response.close()  # the worker aborts the request (a client that goes away)


# ---------------------------------------------------------------------------------------- the stack


@pytest.mark.integration
def test_a_sweep_through_the_gateway_builds_a_table_that_is_checked_and_served(
    stack: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep"
    argv = _sweep(stack["gateway"], out, *_workers(stack))
    assert main([*argv, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "endpoints: 4 points = 1 shape(s) x 2 mode(s) x 1 workload(s) x 2 QPS level(s)" in plan
    assert "1P1D_local_small_mid_bal_4" in plan
    assert "4 x 2 s of arrivals = 8 s" in plan
    assert not out.exists()

    assert main(argv) == 0
    records = read_records(sorted((out / "records").rglob("*.jsonl")))
    assert {(r.mode, r.target_qps) for r in records} == {(m, q) for m in ("pd", "local") for q in (2.0, 4.0)}
    later = [r for r in records if r.turn == 2]
    assert later
    assert all(r.ok for r in records)
    assert all(r.path == r.mode for r in later)  # the gateway took the path each run asked for
    # Provenance from the workers themselves, in the manifest and in the table's labels.
    settings = json.loads((out / "sweep.json").read_text())["settings"]
    assert settings["workers"] == "decode=1,prefill=1"
    assert settings["vllm"] == "0.33.0"
    assert (settings["served_model"], settings["max_model_len"]) == (MODEL, 131072)
    table_path = out / "1P1D__llama-3.1-8b.ppdt"
    table = Table.open(table_path)
    try:
        labels = dict(table.header.provenance["labels"])
    finally:
        table.close()
    assert labels["engine"] == "endpoints"
    assert labels["workers"] == "decode=1,prefill=1"
    # ppd-up's gateway has no admin token, so it cannot say it places by prefix: --placement's default.
    assert table.header.placement == "least_loaded"
    assert main(["check", str(table_path)]) == 0

    # A rerun against the same deployment resumes: nothing runs again.
    stamps = {p: p.stat().st_mtime_ns for p in (out / "records").rglob("*.jsonl")}
    assert main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "records").rglob("*.jsonl")} == stamps

    # The table is served: a DecisionService on it answers Route from it.
    proc, ports = start_ready(
        [sys.executable, "-m", "decision_service", "serve", "--tables", str(out), "--port", "0",
         "--metrics-port", "0", "--log-level", "WARNING"],
        timeout_s=60.0, name="ppd-decision",
    )  # fmt: skip
    try:
        answer = _route(int(ports["grpc"]))
    finally:
        _stop(proc)
    assert answer.table_key == "1P1D/llama-3.1-8b"
    assert answer.decision in (decision_pb2.DECISION_PD, decision_pb2.DECISION_LOCAL)


@pytest.mark.integration
def test_the_prefix_caches_are_reset_between_points(stack: dict[str, Any]) -> None:
    """With the dev route on, isolate() empties every worker's prefix cache (no hit for a prompt seen
    before it), after the queues drained."""
    import asyncio
    import urllib.request

    from tests.support.metrics import total

    decode = next(w["url"] for w in stack["workers"] if w["role"] == "decode")
    body = json.dumps({"model": MODEL, "prompt": " ".join(["sea"] * 200), "max_tokens": 2}).encode()

    def complete() -> None:
        request = urllib.request.Request(
            f"{decode}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200

    def hits() -> float:
        with urllib.request.urlopen(f"{decode}/metrics", timeout=30) as response:
            value = total(response.read().decode(), "vllm:prefix_cache_hits_total", {})
        return value or 0.0

    complete()
    before = hits()
    complete()
    wait_until(lambda: hits() > before, deadline_s=30, what="a prefix-cache hit for the repeated prompt")
    deployment = Deployment(MODEL, 131072, (WorkerRef(decode, "decode"),), ("0.33.0",), "flags")
    engine = EndpointsEngine(url=stack["gateway"], deployment=deployment, settle_timeout_s=30.0)
    asyncio.run(engine.isolate("test"))
    after_reset = hits()
    complete()
    assert hits() == after_reset  # nothing cached any more


@pytest.mark.integration
def test_the_gateways_worker_list_checks_the_shape_and_an_ignored_mode_header_stops_the_sweep(
    stack: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second gateway on the stack's workers, as production configures one: the admin API on (so
    the engine reads its workers and its placement: by prefix, as it follows the workers' KV events)
    and X-PPD-Mode not followed (allow_mode_header off)."""
    token = tmp_path / "admin-token"
    token.write_text("s3cret\n")
    lines = [
        'mode = "pd"',
        f'served_model = "{MODEL}"',
        'admin_token = "s3cret"',
        "allow_mode_header = false",
    ]
    config = tmp_path / "gateway.toml"
    workers = stack["workers"]
    lines += ["", "[kv_events.endpoints]", *(f'{w["id"]} = "{w["kv_events"]}"' for w in workers)]
    lines += [
        "",
        "[kv_events.replay_endpoints]",
        *(f'{w["id"]} = "{w["kv_events_replay"]}"' for w in workers),
    ]
    config.write_text("\n".join(lines + worker_tables(workers)) + "\n")
    proc, ready = start_ready(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", "0"],
        timeout_s=60.0, name="ppd-gateway", cwd=ROOT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{ready['http']}"
        out = tmp_path / "sweep"
        wrong_shape = _sweep(url, out, "--admin-token-file", str(token), "--shape", "1P3D", qps="4")
        assert main(wrong_shape) == 2
        assert "--shape 1P3D but the deployment has 1 prefill and 1 decode workers" in caplog.text
        assert not out.exists()
        # The gateway says it places by prefix: a table claiming least_loaded is refused.
        other = _sweep(url, out, "--admin-token-file", str(token), "--placement", "least_loaded", "--dry-run")
        assert main(other) == 2
        assert "runs place legs by prefix, not --placement least_loaded" in caplog.text

        assert main(_sweep(url, out, "--admin-token-file", str(token), qps="4")) == 1
    finally:
        _stop(proc)
    assert "the front door does not follow the header" in caplog.text
    assert "allow_mode_header = true" in caplog.text
    settings = json.loads((out / "sweep.json").read_text())["settings"]
    assert settings["workers"] == "decode=1,prefill=1"  # read from the gateway's GET /admin/workers
    assert settings["placement"] == "prefix"  # and its placement, which the table's header takes
    assert (out / "records" / "1P1D" / "pd" / "small_mid_bal_4.jsonl").is_file()  # pd ran pd
    assert not list((out / "records" / "1P1D").glob("local/*.jsonl"))  # the local run was not kept


@pytest.mark.integration
def test_a_sweep_through_envoy_and_the_picker_takes_each_asked_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The other front door: Envoy carries the requests, the picker routes them (ppd-up --data-plane
    envoy); the picker has no admin API, so the workers come from --worker."""
    tables = str(ROOT / "tables" / "example")
    argv = [sys.executable, "-m", "devstack.stack", "--engine", "sim", "--topology", "1P1D", "--port", "0",
            "--data-plane", "envoy", "--tables", tables, "--log-level", "WARNING",
            "--ready-timeout", "110"]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    proc, ready = start_ready(argv, timeout_s=150.0, name="ppd-up --data-plane envoy", env=env, cwd=ROOT)
    try:
        assert ready["data_plane"] == "envoy"
        out = tmp_path / "sweep"
        assert main(_sweep(ready["gateway"], out, *_workers(ready), "--no-build", qps="4")) == 0
    finally:
        _stop(proc)
    records = read_records(sorted((out / "records").rglob("*.jsonl")))
    later = [r for r in records if r.turn == 2]
    assert {r.mode for r in later} == {"pd", "local"}
    assert all(r.ok for r in records)
    assert all(r.path == r.mode for r in later)  # the picker took the path each run asked for
    assert "reset_prefix_cache" not in caplog.text  # the workers' dev route answered
