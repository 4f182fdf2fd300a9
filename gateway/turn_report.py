"""What a turn leaves behind: its provenance headers, its metrics and its request-log line.

Rule 1: every routed response carries the provenance headers (`PROVENANCE_HEADERS`,
docs/reference/http-headers.md); `X-PPD-Explored: 1` marks a request exploring the path the table did
not choose.
Rule 2: at the end of every turn, served or not, `finish` counts the decision and the token-count
source, observes TTFT, TPOT and the gateway's own overhead, and writes one request-log line in the
benchmark record schema; an explored request, or one whose path was drawn with a propensity below 1,
also counts in `ppd_gateway_explorations_total` (explored only) and carries `explored`/`propensity` in
its line (ppd/records.py leaves them out at their defaults, so with exploration off the lines are as
they always were). A served turn 2+ on a path the decision chooses between (gateway/slo.py rule 4)
also feeds its TTFT and TPOT to the SLO controller.
A front door that did not see the answer (the Envoy picker's unobserved turns) counts the metrics
without a line: a line without the answer's timings would be evidence of nothing.
Rule 3: the line says what happened, `error` in the gateway's words; a client gone before its answer
ended is `ppd.records.CLIENT_DISCONNECTED` (the table refresh leaves such lines out of its evidence).
"""

from __future__ import annotations

from gateway.metrics import GatewayMetrics
from gateway.request_log import RequestLog
from gateway.settings import LogSettings
from gateway.slo import SloControl, routed
from gateway.turn import TurnInputs, TurnOutcome
from ppd.records import UncheckedRecord

__all__ = [
    "PROVENANCE_HEADERS",
    "TurnReport",
    "exploration",
    "provenance_headers",
]

PROVENANCE_HEADERS = (
    "X-PPD-Path",
    "X-PPD-Reason",
    "X-PPD-Turn",
    "X-PPD-Table-Version",
    "X-PPD-Session-Id",
    "X-PPD-Mode",
    "X-PPD-Decode-Worker",
    "X-PPD-Prefill-Worker",
    "X-PPD-Fallback",
    "X-PPD-Session-Reset",
    "X-PPD-Explored",
    "X-Request-Id",
)


def exploration(outcome: TurnOutcome) -> tuple[bool, float]:
    """(explored, propensity) of the path the turn took: the draw's, unless a failure moved the turn
    off the drawn path (a gone decode worker, a failed prefill), which nobody drew."""
    decision = outcome.decision
    if decision is None or (outcome.path and outcome.path != decision.path):
        return False, 1.0
    return decision.explored, decision.propensity


def provenance_headers(turn: TurnInputs, outcome: TurnOutcome) -> dict[str, str]:
    decision = outcome.decision
    headers = {
        "X-PPD-Path": outcome.path,
        "X-PPD-Reason": outcome.reason,
        "X-PPD-Turn": str(turn.turn),
        "X-PPD-Session-Id": turn.session_id,
        "X-PPD-Mode": str(turn.mode),
        "X-PPD-Decode-Worker": outcome.decode_worker,
        "X-Request-Id": turn.request_id,
    }
    if decision is not None and decision.table_version:
        headers["X-PPD-Table-Version"] = decision.table_version
    if outcome.prefill_worker:
        headers["X-PPD-Prefill-Worker"] = outcome.prefill_worker
    if turn.session_reset:
        headers["X-PPD-Session-Reset"] = turn.session_reset
    if decision is not None and decision.fallback:
        headers["X-PPD-Fallback"] = "1"
    if exploration(outcome)[0]:
        headers["X-PPD-Explored"] = "1"
    return headers


class TurnReport:
    """Rule 2, with the app's metrics and request log."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        request_log: RequestLog | None,
        settings: LogSettings,
        *,
        slo: SloControl | None = None,
        table_key: str = "",
    ) -> None:
        self._m = metrics
        self._log = request_log
        self._s = settings
        self._slo = slo
        self._table_key = table_key

    def finish(self, turn: TurnInputs, outcome: TurnOutcome, *, end: float, line: bool = True) -> None:
        """Rule 2; `line` False: the metrics only, no request-log line (a turn whose answer the
        front door did not see: the Envoy picker's unobserved turns, picker.py rule 6)."""
        m = self._m
        if outcome.path:
            m.decisions.labels(outcome.path, outcome.reason).inc()
        explored, propensity = exploration(outcome)
        if explored:
            m.explorations.labels(outcome.path).inc()
        m.token_counts.labels(turn.psi.n_in.source).inc()
        n_out = outcome.completion_tokens if outcome.completion_tokens is not None else turn.psi.n_out
        tpot: float | None = None
        if outcome.overhead is not None:
            m.overhead.labels(outcome.path or "pd").observe(outcome.overhead)
        if outcome.ok and outcome.ttft is not None:
            m.ttft.labels(outcome.path, turn.turn_class).observe(outcome.ttft)
            if outcome.last_token is not None and n_out > 1:
                tpot = (outcome.last_token - (turn.start + outcome.ttft)) / (n_out - 1)
                m.tpot.labels(outcome.path, turn.turn_class).observe(tpot)
            if self._slo is not None and routed(turn.turn, outcome.path):
                self._slo.observe(self._table_key, ttft_s=outcome.ttft, tpot_s=tpot, started=turn.start)
        if self._log is None or not line:
            return
        s = self._s
        self._log.write(
            UncheckedRecord(
                run_id=s.run_id,
                shape=s.shape,
                model=s.model or turn.req.model,
                mode=str(turn.mode),
                target_qps=s.target_qps,
                workload=turn.workload,
                conversation_id=turn.session_id,
                turn=turn.turn,
                n_in=turn.psi.n_in.tokens,
                n_out=n_out,
                n_ctx=turn.psi.n_ctx,
                path=outcome.path or "pd",
                ttft_ms=outcome.ttft * 1000.0 if outcome.ttft is not None else None,
                tpot_ms=tpot * 1000.0 if tpot is not None else None,
                e2e_ms=(end - turn.start) * 1000.0,
                ok=outcome.ok,
                error=outcome.error,
                start_time=turn.start_wall,
                explored=explored,
                propensity=propensity,
            )
        )
