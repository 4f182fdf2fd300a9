"""What a turn leaves behind (gateway/turn_report.py): the provenance headers, its metrics and its
request-log line."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from decision_service.table import TableSpec, write_table
from gateway.forwarding import Forwarder
from gateway.metrics import GatewayMetrics
from gateway.openai_types import parse_completion_request
from gateway.ports import ClientRequest
from gateway.psi import Psi, TokenCount
from gateway.request_log import RequestLog
from gateway.routing import Decision
from gateway.settings import LimitSettings, LogSettings, Settings
from gateway.slo import SloControl
from gateway.turn import TurnInputs, TurnOutcome
from gateway.turn_report import PROVENANCE_HEADERS, TurnReport, exploration, provenance_headers
from ppd.modes import Mode
from ppd.records import CLIENT_DISCONNECTED
from table_builder.cli import main as table_builder_main
from tests.gateway.fakes import FakeClient, ManualClock, forwarder_on_fakes
from tests.support.metrics import sample as sample_of
from tests.support.records import base_table


def _turn(*, turn: int = 2, session_reset: str = "") -> TurnInputs:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    return TurnInputs(
        request_id="r1",
        start=100.0,
        start_wall=1_700_000_000.0,
        req=parse_completion_request(json.dumps(body).encode(), "chat", LimitSettings()),
        mode=Mode("fraction", 0.5),
        explicit_id=None,
        session=None,
        session_id="s1",
        turn=turn,
        psi=Psi(TokenCount(12, "exact"), n_out=40, n_ctx=300),
        workload="chat",
        chain=None,
        session_reset=session_reset,
    )


def test_provenance_headers_name_the_path_the_workers_and_the_decision() -> None:
    outcome = TurnOutcome(
        decision=Decision("pd", "fallback_timeout", table_version="v3", fallback=True),
        path="pd",
        reason="fallback_timeout",
        prefill_worker="P0",
        decode_worker="D1",
    )
    headers = provenance_headers(_turn(session_reset="fork"), outcome)
    assert headers == {
        "X-PPD-Path": "pd",
        "X-PPD-Reason": "fallback_timeout",
        "X-PPD-Turn": "2",
        "X-PPD-Table-Version": "v3",
        "X-PPD-Session-Id": "s1",
        "X-PPD-Mode": "fraction:0.5",
        "X-PPD-Decode-Worker": "D1",
        "X-PPD-Prefill-Worker": "P0",
        "X-PPD-Fallback": "1",
        "X-PPD-Session-Reset": "fork",
        "X-Request-Id": "r1",
    }
    assert set(headers) == set(PROVENANCE_HEADERS) - {"X-PPD-Explored"}
    explored = Decision("pd", "explore", table_version="v3", explored=True, propensity=0.1)
    assert provenance_headers(_turn(), TurnOutcome(decision=explored, path="pd"))["X-PPD-Explored"] == "1"
    local = provenance_headers(
        _turn(), TurnOutcome(decision=Decision("local", "mode_fraction"), path="local")
    )
    assert set(local) == set(PROVENANCE_HEADERS) - {
        "X-PPD-Table-Version",
        "X-PPD-Prefill-Worker",
        "X-PPD-Fallback",
        "X-PPD-Session-Reset",
        "X-PPD-Explored",
    }


def test_finish_observes_the_latencies_and_writes_one_record(tmp_path: Path) -> None:
    metrics = GatewayMetrics()
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    report = TurnReport(metrics, log, LogSettings(run_id="run", shape="1P3D", target_qps=2.0))
    outcome = TurnOutcome(path="local", reason="mode_fraction", completion_tokens=5, ok=True)
    outcome.ttft, outcome.last_token, outcome.overhead = 0.5, 100.9, 0.001
    report.finish(_turn(), outcome, end=101.0)
    log.close()

    def sample(name: str, labels: dict[str, str]) -> float | None:
        return sample_of(metrics.registry, name, labels)

    assert sample("ppd_gateway_decisions_total", {"path": "local", "reason": "mode_fraction"}) == 1
    assert sample("ppd_gateway_token_counts_total", {"source": "exact"}) == 1
    assert (
        sample("ppd_gateway_time_to_first_token_seconds_sum", {"path": "local", "turn_class": "later"}) == 0.5
    )
    # (last token - first token) / (5 - 1) tokens after the first
    tpot = sample("ppd_gateway_time_per_output_token_seconds_sum", {"path": "local", "turn_class": "later"})
    assert tpot is not None
    assert abs(tpot - 0.1) < 1e-9
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert (record["run_id"], record["mode"], record["n_in"], record["n_out"], record["n_ctx"]) == (
        "run",
        "fraction:0.5",
        12,
        5,
        300,
    )
    assert (record["path"], record["ok"], record["e2e_ms"], record["start_time"]) == (
        "local",
        True,
        1000.0,
        1_700_000_000.0,
    )
    assert abs(record["tpot_ms"] - 100.0) < 1e-6


def test_a_turn_that_never_got_a_path_is_logged_as_pd_with_its_expected_output(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    TurnReport(GatewayMetrics(), log, LogSettings()).finish(
        _turn(), TurnOutcome(error="no live decode worker in the pool"), end=100.25
    )
    log.close()
    record = json.loads(path.read_text())
    assert (record["path"], record["n_out"], record["ok"], record["ttft_ms"]) == ("pd", 40, False, None)
    assert record["error"] == "no live decode worker in the pool"


def test_a_turn_moved_off_its_drawn_path_is_not_marked_explored(tmp_path: Path) -> None:
    # The draw sent it local (explored), but the decode worker was gone and it went through P.
    drawn = Decision("local", "explore", explored=True, propensity=0.1)
    moved = TurnOutcome(decision=drawn, path="pd", reason="decode_gone", completion_tokens=3, ok=True)
    assert exploration(moved) == (False, 1.0)
    assert "X-PPD-Explored" not in provenance_headers(_turn(), moved)
    kept = TurnOutcome(decision=drawn, path="local", reason="explore", completion_tokens=3, ok=True)
    assert exploration(kept) == (True, 0.1)
    metrics = GatewayMetrics()
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path))
    report = TurnReport(metrics, log, LogSettings(run_id="run", shape="1P3D", target_qps=2.0))
    report.finish(_turn(), moved, end=101.0)
    log.close()
    line = json.loads(path.read_text().splitlines()[0])
    assert line["path"] == "pd"
    assert "explored" not in line  # left out at its default: not explored, propensity 1
    assert sample_of(metrics.registry, "ppd_gateway_explorations_total", {"path": "pd"}) is None


# --- the closed loop's evidence (issue 24): what the refresh and the SLO controller are fed ----------

REPO = Path(__file__).resolve().parents[2]
DEPLOYED = REPO / "deploy" / "k8s" / "overlays" / "1p3d" / "gateway-config.yaml"
WORKERS = [
    {"id": "P0", "role": "prefill", "url": "http://p0.test"},
    {"id": "D0", "role": "decode", "url": "http://d0.test"},
]


def _deployed_log(request_log: Path) -> dict[str, Any]:
    """The [log] section deploy/k8s ships, writing to ``request_log``."""
    (doc,) = [d for d in yaml.safe_load_all(DEPLOYED.read_text()) if d]
    section: dict[str, Any] = tomllib.loads(doc["data"]["gateway.toml"])["log"]
    return {**section, "request_log": str(request_log)}


def _client_request(messages: list[dict[str, Any]], headers: dict[str, str]) -> ClientRequest:
    body = {"model": "m", "messages": messages, "stream": True, "max_tokens": 8}
    return ClientRequest("chat", json.dumps(body).encode(), headers)


async def _two_turns(forwarder: Forwarder, name: str, second: FakeClient, **headers: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"tell me about {name}"}]
    first = FakeClient()
    await forwarder.handle(_client_request(messages, {"X-Session-ID": name, **headers}), first)
    answer = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in first.events[:-1])
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    await forwarder.handle(_client_request(messages, {"X-Session-ID": name, **headers}), second)


def _refresh(logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """`ppd-table refresh` as the CronJob runs it, over a base table of the deployed shape and model."""
    table = base_table()
    (tmp_path / "base").mkdir()
    base = write_table(tmp_path / "base" / "t.ppdt", TableSpec(table.header, table.figures))
    args = ["refresh", "--logs", str(logs), "--base", str(base), "--out", str(tmp_path / "out.ppdt")]
    capsys.readouterr()
    assert table_builder_main([*args, "--skip-bad-lines", "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


async def test_a_client_gone_mid_answer_is_logged_as_such_and_is_no_evidence_against_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = tmp_path / "gateways" / "ppd-gateway-0"
    logs.mkdir(parents=True)
    log = RequestLog(str(logs / "requests.jsonl"))
    config = {"mode": "ppd", "workers": WORKERS, "log": _deployed_log(logs / "requests.jsonl")}
    forwarder, _ = forwarder_on_fakes(config, request_log=log)  # the table answers local
    await _two_turns(forwarder, "honest", FakeClient())
    await _two_turns(forwarder, "gone", FakeClient(gone_after_writes=1))  # closed after the first event
    log.close()
    lines = [json.loads(x) for x in (logs / "requests.jsonl").read_text().splitlines()]
    gone = [x for x in lines if x["conversation_id"] == "gone" and x["turn"] == 2]
    assert [(x["path"], x["ok"], x["error"]) for x in gone] == [("local", False, CLIENT_DISCONNECTED)]
    # As deployed: shape, model and run id set, no workload label, no target_qps.
    assert {(x["workload"], x["target_qps"]) for x in lines} == {("", 0.0)}
    report = _refresh(logs.parent, tmp_path, capsys)
    assert report["skipped_lines"] == 0
    assert report["used"] == 1  # the honest Turn 2
    assert report["left_out"]["client disconnected (no failure of the path)"] == 1


async def test_a_clients_workload_header_is_logged_only_where_the_operator_allows_it(tmp_path: Path) -> None:
    def workloads(path: Path) -> set[str]:
        return {json.loads(x)["workload"] for x in path.read_text().splitlines()}

    for allow, expected in ((None, {""}), (False, {""}), (True, {"small_tiny"})):
        path = tmp_path / f"{allow}.jsonl"
        log = RequestLog(str(path))
        section: dict[str, Any] = {"request_log": str(path), "shape": "1P3D"}
        if allow is not None:
            section["workload_header"] = allow
        config = {"mode": "ppd", "workers": WORKERS, "log": section}
        forwarder, _ = forwarder_on_fakes(config, request_log=log)
        await _two_turns(forwarder, "labelled", FakeClient(), **{"X-PPD-Workload": "small_tiny"})
        log.close()
        assert workloads(path) == expected, allow
    assert LogSettings().workload_header is False


def test_the_slo_controller_sees_only_the_turns_its_weights_route() -> None:
    # One client's huge Turn 1 (30 s TTFT) every 4 s: Turn 1 always goes P/D, whatever the weights,
    # so it must not move w_tpot; neither may a replica turn. Turn 2+ on pd/local/bidir count.
    clock = ManualClock(100.0)
    slo = SloControl.from_config(
        Settings.from_mapping({"slo": {"ttft_p99_ms": 100.0, "interval_s": 1.0, "min_samples": 5}}).slo,
        GatewayMetrics(),
        clock,
    )
    assert slo is not None
    report = TurnReport(GatewayMetrics(), None, LogSettings(), slo=slo)
    for i in range(60):
        clock.advance(1.0)
        slow = TurnOutcome(path="pd", reason="turn_one", completion_tokens=5, ok=True)
        slow.ttft, slow.last_token = 30.0, 130.0
        first, later = (dataclasses.replace(_turn(turn=t), start=100.0 + i) for t in (1, 2))
        if i % 4 == 0:
            report.finish(first, slow, end=131.0)
        replica = TurnOutcome(path="replica", reason="mode_replica", completion_tokens=5, ok=True)
        replica.ttft, replica.last_token = 30.0, 130.0
        report.finish(later, replica, end=131.0)
        for path in ("pd", "local", "bidir"):
            fast = TurnOutcome(path=path, reason="table", completion_tokens=5, ok=True)
            fast.ttft, fast.last_token = 0.05, 100.45
            report.finish(later, fast, end=101.0)
        slo.weights("")
    state = slo.states()["default"]
    assert state.ttft_samples > 0
    assert state.ttft_p99_ms == pytest.approx(50.0)
    assert slo.weights("") == (1.0, 1.0), state
