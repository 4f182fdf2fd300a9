"""The picker's process: the gateway's running parts (runtime.running), the ext_proc servicer
(picker.py) on grpc.aio with gRPC health and server reflection, and `/metrics` and `/health` over
HTTP, until SIGTERM/SIGINT.

Health (the Endpoint Picker protocol's names): "", `liveness`, `readiness` and
`envoy.service.ext_proc.v3.ExternalProcessor` are SERVING once the server accepts calls, and
NOT_SERVING while it shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Mapping

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from gateway.deps import Deps
from gateway.picker import SERVICE_NAME, Picker
from gateway.runtime import running
from gateway.settings import Settings

__all__ = ["HEALTH_NAMES", "serve_picker"]

log = logging.getLogger(__name__)
HEALTH_NAMES = ("", "liveness", "readiness", SERVICE_NAME)


def _metrics_app(deps: Deps) -> web.Application:
    async def metrics(_: web.Request) -> web.StreamResponse:
        return web.Response(body=deps.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def health(_: web.Request) -> web.StreamResponse:
        live = {role: deps.pool.count(role, live=True) for role in ("decode", "replica", "prefill")}
        serving = live["replica"] > 0 or live["decode"] > 0
        body = {"status": "ok" if serving else "unavailable", "workers": live}
        return web.json_response(body, status=200 if serving else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


async def serve_picker(
    settings: Settings,
    *,
    grpc_port: int,
    metrics_port: int,
    announce: Callable[[Mapping[str, object]], None],
) -> None:
    """Serve until SIGTERM/SIGINT; `announce` gets {"grpc": port, "metrics": port} once both listen."""
    async with running(settings, service_name="ppd-picker") as deps:
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(Picker(deps), server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        address = f"{settings.host}:{grpc_port}"
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc reports a failed bind as RuntimeError
            raise OSError(f"cannot bind gRPC to {address}") from exc
        runner = web.AppRunner(_metrics_app(deps), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, settings.host, metrics_port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        metrics_bound = sockets[0].getsockname()[1] if sockets else metrics_port
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await server.start()
        for name in HEALTH_NAMES:
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        announce({"grpc": bound, "metrics": metrics_bound})
        log.info(
            "picker listening on %s:%d (gRPC ext_proc), metrics on %d", settings.host, bound, metrics_bound
        )
        try:
            await stop.wait()
        finally:
            log.info("picker shutting down")
            for name in HEALTH_NAMES:
                await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            await server.stop(grace=settings.timeouts.connect_s)
            await runner.cleanup()
