"""The gRPC server: DecisionService + grpc.health.v1 + server reflection, and its lifecycle.

Health (both the overall "" entry and the DecisionService entry) is NOT_SERVING until a table
that can answer requests without a key is loaded, follows the table set afterwards, and turns
NOT_SERVING for good when shutdown begins (`enter_graceful_shutdown`), before `stop(grace)` lets
in-flight calls finish. Load balancers therefore drain the process before it closes its port.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from decision_service.holder import TableHolder, TableSet
from decision_service.metrics import DecisionMetrics, start_metrics_endpoint
from decision_service.servicer import DecisionServicer, add_to_server
from decision_service.settings import Settings
from ppd.decision.v1 import decision_pb2
from ppd.tracing_export import build_tracing

__all__ = ["SERVICE_NAME", "DecisionServer", "build_server", "serve", "server_options"]

logger = logging.getLogger(__name__)

SERVICE_NAME: str = decision_pb2.DESCRIPTOR.services_by_name["DecisionService"].full_name
_HEALTH_ENTRIES = ("", SERVICE_NAME)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(slots=True)
class DecisionServer:
    """A bound, not yet started server. `port` is the port actually bound (port 0 resolved)."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    holder: TableHolder
    port: int

    async def start(self) -> None:
        await self._follow(self.holder.current)
        self.holder.subscribe(self._follow)
        await self.server.start()

    async def stop(self, grace_s: float | None) -> None:
        """NOT_SERVING first, then let in-flight calls finish for up to `grace_s` seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)

    async def _follow(self, tables: TableSet) -> None:
        status = _SERVING if tables.ready else _NOT_SERVING
        for entry in _HEALTH_ENTRIES:
            await self.health.set(entry, status)


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """The gRPC core options of the server, from its settings."""
    min_ping_ms = round(settings.keepalive_min_ping_interval_s * 1000)
    return [
        # Several processes may share one port only when asked to (--workers/--reuse-port); by
        # default a second server on a busy port must fail instead of silently splitting traffic.
        ("grpc.so_reuseport", 1 if settings.reuse_port else 0),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        # Keepalive policy, agreed with the clients' keepalive (the gateway and Envoy ping every
        # 10 s, also on a channel with no call in flight). gRPC's own default allows one ping per
        # 5 minutes without data and answers the third early one with GOAWAY too_many_pings.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_ms),
    ]


def build_server(
    settings: Settings, holder: TableHolder, metrics: DecisionMetrics, *, tracer: trace.Tracer | None = None
) -> DecisionServer:
    """Register the services and bind the port; call `start()` on the result to serve. `tracer`: the
    Route calls' spans (None: tracing off)."""
    server = grpc.aio.server(options=server_options(settings))
    servicer = DecisionServicer(holder, metrics, max_batch_items=settings.max_batch_items, tracer=tracer)
    add_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{settings.host}:{settings.port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc reports a failed bind as RuntimeError
        raise OSError(f"cannot bind gRPC to {address} (in use, or not an address of this host)") from exc
    return DecisionServer(server=server, health=health, holder=holder, port=port)


async def serve(settings: Settings, announce: Callable[[Mapping[str, object]], None]) -> None:
    """Run until SIGTERM/SIGINT: load tables, serve gRPC and metrics, watch the directory.

    `announce` receives the bound ports once the server accepts calls.
    SIGHUP rescans the tables directory at once.
    """
    metrics = DecisionMetrics()
    holder = TableHolder(settings.tables_dir, default_key=settings.default_key, listener=metrics)
    await holder.refresh()
    if not holder.current.ready:
        logger.warning(
            "no usable table in %s yet; health stays NOT_SERVING until one arrives", settings.tables_dir
        )
    tracing = build_tracing(settings.tracing, service_name="ppd-decision", scope="decision_service")
    server = build_server(settings, holder, metrics, tracer=tracing.tracer if tracing is not None else None)
    endpoint = start_metrics_endpoint(metrics, settings.metrics_host, settings.metrics_port)
    stop = asyncio.Event()
    background: set[asyncio.Task[object]] = set()
    loop = asyncio.get_running_loop()

    def rescan() -> None:
        logger.info("SIGHUP: rescanning %s", settings.tables_dir)
        task: asyncio.Task[object] = loop.create_task(holder.refresh())
        background.add(task)
        task.add_done_callback(background.discard)

    def request_stop(signum: int) -> None:
        logger.info("%s: shutting down (grace %.1f s)", signal.Signals(signum).name, settings.grace_s)
        stop.set()

    try:
        await server.start()
        loop.add_signal_handler(signal.SIGHUP, rescan)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, request_stop, signum)
        watcher = loop.create_task(holder.watch(settings.reload_interval_s, stop))
        logger.info(
            "decision service on %s:%d (metrics on %s:%d), tables from %s",
            settings.host,
            server.port,
            settings.metrics_host,
            endpoint.port,
            settings.tables_dir,
        )
        announce({"grpc": server.port, "metrics": endpoint.port})
        await stop.wait()
        await watcher
        await server.stop(settings.grace_s)
    finally:
        for signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        endpoint.close()
        if tracing is not None:
            await asyncio.to_thread(tracing.close)  # exports the spans still queued
        logger.info("decision service stopped")
