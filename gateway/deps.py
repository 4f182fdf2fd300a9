"""Everything a gateway request handler needs, built once at start-up and held in one typed object
(aiohttp's AppKey idea) instead of module globals or stringly-typed app state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.trace import Tracer

from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.ports import DecisionClient, Upstream
from gateway.psi import QpsMeter, Tokenizers
from gateway.request_log import RequestLog
from gateway.residency import KvTracking
from gateway.sessions import SessionStore
from gateway.settings import Settings
from gateway.slo import SloControl
from gateway.types import Clock

__all__ = ["Deps"]


@dataclass(slots=True)
class Deps:
    settings: Settings
    pool: WorkerPool
    sessions: SessionStore
    tokenizers: Tokenizers
    qps: QpsMeter
    metrics: GatewayMetrics
    decisions: DecisionClient
    upstream: Upstream
    request_log: RequestLog | None
    # Seconds, monotonic: `clock` for expiry and rates (sessions, pool, QPS), `timer` for the
    # latencies of one request (TTFT, TPOT, overhead); `wall_clock` for the request log's start_time.
    clock: Clock
    timer: Clock
    wall_clock: Clock
    new_id: Callable[[], str]
    # The SLO controllers on the weights; None when no SLO target is set.
    slo: SloControl | None = None
    # KV residency from the workers' KV events ([kv_events]); None when not configured.
    kv: KvTracking | None = None
    # The tracer of the request path (ppd/tracing_export.py); None when tracing is off: no spans.
    tracer: Tracer | None = None

    def placement(self) -> str:
        """The placement legs get (ppd/placement.py): `[routing] placement`, but least_loaded without
        `[kv_events]`, where no residency is known (what `GET /admin/workers` says, for sweeps)."""
        return self.settings.routing.placement if self.kv is not None else "least_loaded"
