"""The gateway's Prometheus metrics, on a registry of its own (one per app, no global state)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["GatewayMetrics"]

R = TypeVar("R", bound=str)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_OVERHEAD_BUCKETS = (
    0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01,
    0.02, 0.05, 0.1,
)  # fmt: skip
_ADMISSION_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.05, 0.1)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "ppd_gateway_requests",
            "Client requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.decisions = Counter(
            "ppd_gateway_decisions",
            "Routing decisions by path taken and reason",
            ["path", "reason"],
            registry=r,
        )
        # KV residency from the workers' events (gateway/residency.py); only with [kv_events] set.
        self.kv_tracked_blocks = Gauge(
            "ppd_gateway_kv_tracked_blocks",
            "KV blocks the gateway believes resident on a worker, from its KV events (bounded per worker)",
            ["worker"],
            registry=r,
        )
        self.kv_events_synced = Gauge(
            "ppd_gateway_kv_events_synced",
            "1 while a worker's KV event stream is complete (residency used), 0 while awaiting a resync",
            ["worker"],
            registry=r,
        )
        self.kv_events = Counter(
            "ppd_gateway_kv_events", "KV events received, by worker", ["worker"], registry=r
        )
        self.kv_event_gaps = Counter(
            "ppd_gateway_kv_event_gaps",
            "Times a worker's KV event stream broke (sequence gap, bad message, lost connection)",
            ["worker"],
            registry=r,
        )
        self.kv_event_errors = Counter(
            "ppd_gateway_kv_event_errors",
            "KV event stream failures by kind (bad_message, connection_lost, replay_timeout, "
            "replay_incomplete, replay_over_cap, buffer_over_cap, subscriber_restart)",
            ["worker", "kind"],
            registry=r,
        )
        self.placements = Counter(
            "ppd_gateway_placements",
            "Workers placed for a leg (P of a leg through P, D of Turn 1 or a rebind; ppd/placement.py) "
            "by role and by what chose them: prefix (the resident prefix moved the choice away from "
            "the least loaded) or least_loaded",
            ["role", "by"],
            registry=r,
        )
        self.worker_tokenize = Counter(
            "ppd_gateway_worker_tokenize",
            "Calls to a worker's /tokenize, by purpose: count (psi's new-input tokens) or token_ids "
            "(the prompt's block hashes for KV residency and placement)",
            ["purpose"],
            registry=r,
        )
        self.explorations = Counter(
            "ppd_gateway_explorations",
            "ppd-mode Turn 2+ requests sent down the path the table did not choose, by that path",
            ["path"],
            registry=r,
        )
        self.fallbacks = Counter(
            "ppd_gateway_decision_fallbacks",
            "ppd-mode decisions that used the configured fallback, by cause",
            ["cause"],
            registry=r,
        )
        self.route_rpc = Histogram(
            "ppd_gateway_route_rpc_seconds",
            "DecisionService Route latency seen by the gateway, by outcome",
            ["outcome"],
            buckets=_RPC_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "ppd_gateway_time_to_first_token_seconds",
            "Time from request arrival to the first content chunk relayed",
            ["path", "turn_class"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "ppd_gateway_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request",
            ["path", "turn_class"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "ppd_gateway_overhead_seconds",
            "The gateway's own time on the way to the first token of a stream: request handling, "
            "decision and planning, the gaps around the prefill leg, relaying the first chunk",
            ["path"],
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "ppd_gateway_upstream_errors",
            "Failed calls to workers by worker, role and kind",
            ["worker", "role", "kind"],
            registry=r,
        )
        self.prefill_retries = Counter(
            "ppd_gateway_prefill_retries", "P legs retried on another prefill worker", registry=r
        )
        # Outlier detection (gateway/outliers.py) and the retry budget (gateway/retry_budget.py).
        self.worker_ejections = Counter(
            "ppd_gateway_worker_ejections",
            "Workers taken out of rotation for failing requests, by reason (consecutive_errors, "
            "error_rate, probe_failed)",
            ["worker", "role", "reason"],
            registry=r,
        )
        self.workers_ejected = Gauge(
            "ppd_gateway_workers_ejected",
            "Workers out of rotation now (backoff running or awaiting their probe), by role",
            ["role"],
            registry=r,
        )
        self.retries = Counter(
            "ppd_gateway_retries",
            "Requests retried on another worker before their first byte reached the client, by reason",
            ["reason"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "ppd_gateway_retry_budget_exhausted",
            "Retries refused by the retry budget (the request answered with the error it had), by reason",
            ["reason"],
            registry=r,
        )
        # Admission control ([admission], gateway/admission_gate.py); labelled series absent while off.
        self.admission_shed = Counter(
            "ppd_gateway_admission_shed",
            "Requests shed with 429 by admission control, by reason (queue_full, wait_exceeded, "
            "displaced) and priority class",
            ["reason", "priority"],
            registry=r,
        )
        self.admission_queue_depth = Gauge(
            "ppd_gateway_admission_queue_depth",
            "Requests waiting for admission, by priority class",
            ["priority"],
            registry=r,
        )
        self.admission_inflight = Gauge(
            "ppd_gateway_admission_in_flight",
            "Requests admitted and not yet finished (what the in-flight bound counts)",
            registry=r,
        )
        self.admission_wait = Histogram(
            "ppd_gateway_admission_wait_seconds",
            "Time from arrival to admission or shedding, by priority class and result (admitted, shed)",
            ["priority", "result"],
            buckets=_ADMISSION_BUCKETS,
            registry=r,
        )
        self.session_resets = Counter(
            "ppd_gateway_session_resets",
            "Requests naming a session whose history does not extend what that session was sent, by how "
            "they were treated (new_history: a new conversation; fork: an earlier state of it)",
            ["reason"],
            registry=r,
        )
        self.session_lookups = Counter(
            "ppd_gateway_session_lookups",
            "Chat requests that looked their session up by content, by result (exact: the state of "
            "the whole history; prefix: an earlier turn's, the later ones never seen here; miss: none)",
            ["result"],
            registry=r,
        )
        self.rebinds = Counter(
            "ppd_gateway_session_rebinds", "Sessions moved to another decode worker", registry=r
        )
        self.token_counts = Counter(
            "ppd_gateway_token_counts",
            "New-input token counts by source (exact tokenizer, worker /tokenize, estimate)",
            ["source"],
            registry=r,
        )
        self.stream_errors = Counter(
            "ppd_gateway_stream_errors",
            "Streams that ended with an SSE error event or a client disconnect, by cause",
            ["cause"],
            registry=r,
        )
        self.sessions = Gauge("ppd_gateway_sessions", "Session entries held", registry=r)
        # The shared session store ([sessions] redis_url, gateway/redis_sessions.py).
        self.session_store_degraded = Gauge(
            "ppd_gateway_session_store_degraded",
            "1 while the shared session store (Redis) fails and sessions stay in this replica's memory",
            registry=r,
        )
        self.session_store_errors = Counter(
            "ppd_gateway_session_store_errors",
            "Shared session store calls that failed (timeout, unreachable, error) and entries that could "
            "not be read (bad_entry), by cause",
            ["cause"],
            registry=r,
        )
        self.session_store_bad_entries = Counter(
            "ppd_gateway_session_store_bad_entries",
            "Shared session store entries that could not be read and counted as missing, by reason "
            "(too_large, wrong_type, not_json, too_deep, version, field)",
            ["reason"],
            registry=r,
        )
        self.qps = Gauge(
            "ppd_gateway_qps",
            "Conversations started per second fed to decisions (window, hysteresis)",
            registry=r,
        )
        self.inflight = Gauge("ppd_gateway_requests_in_flight", "Client requests being served", registry=r)
        self.workers = Gauge("ppd_gateway_workers", "Workers in the pool", ["role", "state"], registry=r)
        # The SLO controller (gateway/slo.py), one series per table key; absent while it is off.
        self.slo_w_tpot = Gauge(
            "ppd_gateway_slo_w_tpot",
            "w_tpot the SLO controller sends with Route requests",
            ["table_key"],
            registry=r,
        )
        self.slo_w_ttft = Gauge(
            "ppd_gateway_slo_w_ttft", "w_ttft the SLO controller sends (its base)", ["table_key"], registry=r
        )
        self.slo_direction = Gauge(
            "ppd_gateway_slo_direction",
            "The SLO controller's last move of w_tpot: 1 up, -1 down, 0 hold",
            ["table_key"],
            registry=r,
        )
        self.slo_tpot_p99 = Gauge(
            "ppd_gateway_slo_tpot_p99_seconds",
            "Windowed P99 of time per output token the SLO controller sees (NaN: too few samples)",
            ["table_key"],
            registry=r,
        )
        self.slo_ttft_p99 = Gauge(
            "ppd_gateway_slo_ttft_p99_seconds",
            "Windowed P99 of time to first token the SLO controller sees (NaN: too few samples)",
            ["table_key"],
            registry=r,
        )

    def bind_sessions(self, count: Callable[[], int]) -> None:
        self.sessions.set_function(lambda: float(count()))

    def bind_qps(self, rate: Callable[[], float]) -> None:
        self.qps.set_function(rate)

    def bind_ejected(self, roles: Sequence[R], count: Callable[[R], int]) -> None:
        """`ppd_gateway_workers_ejected{role}` read from the pool when scraped."""
        for role in roles:
            self.workers_ejected.labels(role).set_function(functools.partial(_as_float, count, role))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _as_float(count: Callable[[R], int], role: R) -> float:
    return float(count(role))
