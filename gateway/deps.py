"""Everything a gateway request handler needs, built once at start-up and held in one typed object
(aiohttp's AppKey idea) instead of module globals or stringly-typed app state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.decision_client import DecisionClient
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.psi import QpsMeter, Tokenizers
from gateway.request_log import RequestLog
from gateway.sessions import SessionStore
from gateway.settings import Settings
from gateway.types import Clock
from gateway.upstream import Upstream

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
    clock: Clock
    wall_clock: Clock
    new_id: Callable[[], str]
