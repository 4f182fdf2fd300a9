"""Prometheus metrics of the decision service, on their own registry and HTTP port.

Names follow the Prometheus conventions: `ppd_` prefix, `_total` counters, base units (seconds).
The hot path only touches label children bound once at construction (`decision_counter`), so a
Route call pays one dictionary lookup and two lock-protected increments for its metrics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from decision_service.route import PATHS, Reason

__all__ = ["DecisionMetrics", "MetricsEndpoint", "start_metrics_endpoint"]

logger = logging.getLogger(__name__)

# Route handler latency: the handler runs in tens of microseconds; the tail matters up to ~10 ms.
_LATENCY_BUCKETS = (
    10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3,
)  # fmt: skip


class DecisionMetrics:
    """Every metric the service exports, bound to one private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.decisions = Counter(
            "ppd_decisions",
            "Routing decisions answered, by decision (pd|local|bidir) and reason code.",
            ["decision", "reason"],
            registry=self.registry,
        )
        self.route_errors = Counter(
            "ppd_route_errors",
            "Route items answered with an error instead of a decision, by gRPC status code name.",
            ["code"],
            registry=self.registry,
        )
        self.route_latency = Histogram(
            "ppd_route_latency_seconds",
            "Time inside the unary Route handler for answered calls, request message to response message.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.reloads = Counter(
            "ppd_table_reloads",
            "Table file loads by result: loaded, removed, or the reason a file was rejected.",
            ["result"],
            registry=self.registry,
        )
        self.tables_loaded = Gauge("ppd_tables_loaded", "Tables currently served.", registry=self.registry)
        self.table_info = Info(
            "ppd_table",
            "One series per served table: its key, version and file.",
            ["key"],
            registry=self.registry,
        )
        # Children bound once: (path, reason) -> counter child. Paths and reasons come from the core.
        self.decision_counter = {
            (path, reason): self.decisions.labels(path, reason.name.lower())
            for path in PATHS
            for reason in Reason
        }
        self._error_children: dict[str, Counter] = {}
        self._info_lock = threading.Lock()

    def count_error(self, code_name: str) -> None:
        child = self._error_children.get(code_name)
        if child is None:
            child = self._error_children[code_name] = self.route_errors.labels(code_name)
        child.inc()

    def reload(self, result: str) -> None:
        self.reloads.labels(result).inc()

    def tables_changed(self, tables: Iterable[tuple[str, str, Path]]) -> None:
        """Replace the info series with one per (key, version, path) now served."""
        with self._info_lock:
            self.table_info.clear()
            count = 0
            for key, version, path in tables:
                self.table_info.labels(key).info({"version": version, "file": str(path)})
                count += 1
            self.tables_loaded.set(count)


@dataclass(frozen=True, slots=True)
class MetricsEndpoint:
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_endpoint(metrics: DecisionMetrics, host: str, port: int) -> MetricsEndpoint:
    """Serve `/metrics` from a daemon thread; port 0 picks a free port (read it from `.port`)."""
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsEndpoint(port=server.server_port, _server=server, _thread=thread)
