"""What a turn leaves behind (gateway/turn_report.py): the provenance headers, its metrics and its
request-log line."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.metrics import GatewayMetrics
from gateway.openai_types import parse_completion_request
from gateway.psi import Psi, TokenCount
from gateway.request_log import RequestLog
from gateway.routing import Decision
from gateway.settings import LimitSettings, LogSettings
from gateway.turn import TurnInputs, TurnOutcome
from gateway.turn_report import PROVENANCE_HEADERS, TurnReport, exploration, provenance_headers
from ppd.modes import Mode
from tests.support.metrics import sample as sample_of


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
