"""The gateway's running parts, built once at start-up from the settings and closed at shutdown, for
either front door (app.py's aiohttp server, picker_server.py's gRPC ext_proc server): the worker pool and
its monitor, the session store and its sweeper, the DecisionService client, the workers' HTTP client,
the request log, the SLO controllers, KV residency and its subscriber, and the tracer provider
(`[tracing]`, ppd/tracing_export.py: flushed at shutdown). `running(settings)` is an async
context manager yielding the `Deps` (deps.py) that the request path reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import get_args

from gateway.decision_client import GrpcDecisionClient
from gateway.deps import Deps
from gateway.kv_subscriber import KvSubscriber
from gateway.metrics import GatewayMetrics
from gateway.openings import Openings
from gateway.pool import WorkerPool
from gateway.ports import DecisionClient, Upstream
from gateway.probe import PoolMonitor
from gateway.psi import QpsMeter, Tokenizers
from gateway.redis_sessions import RedisSessionStore
from gateway.request_log import RequestLog
from gateway.residency import KvTracking, Residency
from gateway.sessions import InMemorySessionStore, SessionStore
from gateway.settings import Settings
from gateway.slo import SloControl
from gateway.stream_upstream import ProtocolStreamUpstream
from gateway.types import Clock, Role
from gateway.upstream import HttpUpstream
from ppd.kv_events import DEFAULT_NONE_HASH_SEED, BlockHasher
from ppd.tracing_export import build_tracing

__all__ = ["new_id", "running"]

log = logging.getLogger(__name__)


def new_id() -> str:
    return uuid.uuid4().hex


@contextlib.asynccontextmanager
async def running(
    settings: Settings,
    *,
    upstream: Upstream | None = None,
    decisions: DecisionClient | None = None,
    metrics: GatewayMetrics | None = None,
    clock: Clock = time.monotonic,
    timer: Clock = time.perf_counter,
    wall_clock: Clock = time.time,
    new_id: Callable[[], str] = new_id,
    sessions: SessionStore | None = None,
    request_log: bool = True,
    service_name: str = "ppd-gateway",
) -> AsyncIterator[Deps]:
    """The gateway's parts for the duration of the `async with`. `upstream` and `decisions` default
    to the aiohttp and gRPC clients built from `settings` (with `metrics`, the registry); whichever it
    holds is started and closed here. `request_log` False: no request log even if `[log]` names one
    (the picker, which does not see the answers yet). `service_name`: the spans' service.name unless
    `[tracing] service_name` sets one."""
    app_metrics = metrics or GatewayMetrics()
    workers = upstream or _upstream(settings)
    decider = decisions or GrpcDecisionClient(settings.decision, app_metrics, clock=clock)
    store, shared = _session_store(settings, sessions, app_metrics, clock)
    pool = WorkerPool(
        settings.workers,
        heartbeat_expiry_s=settings.pool.heartbeat_expiry_s,
        clock=clock,
        max_registered=settings.pool.max_registered_workers,
        outliers=settings.outliers,
    )
    qps = QpsMeter(
        window_s=settings.policy.qps_window_s, hysteresis=settings.policy.qps_hysteresis, clock=clock
    )
    request_log_file = (
        RequestLog(settings.log.request_log) if settings.log.request_log and request_log else None
    )
    kv, subscriber = _kv_tracking(settings, app_metrics)
    tracing = build_tracing(settings.tracing, service_name=service_name, scope="gateway")
    deps = Deps(
        settings=settings,
        pool=pool,
        sessions=store,
        tokenizers=Tokenizers(),
        qps=qps,
        metrics=app_metrics,
        decisions=decider,
        upstream=workers,
        request_log=request_log_file,
        clock=clock,
        timer=timer,
        wall_clock=wall_clock,
        new_id=new_id,
        slo=SloControl.from_config(settings.slo, app_metrics, clock),
        kv=kv,
        tracer=tracing.tracer if tracing is not None else None,
    )
    app_metrics.bind_sessions(store.__len__)
    app_metrics.bind_qps(qps.measured)
    app_metrics.bind_ejected(get_args(Role), pool.ejected)
    # Load the served model's tokenizer now, not on the first request (it takes ~0.5 s).
    deps.tokenizers.encoding(settings.served_model)
    await decider.start()
    monitor = PoolMonitor(
        pool, workers, settings.pool, app_metrics, on_gone=kv.streams.unfollow if kv and kv.streams else None
    )
    monitor.publish()
    tasks = [
        asyncio.create_task(monitor.run(), name="pool-monitor"),
        asyncio.create_task(_sweep(deps), name="session-sweeper"),
    ]
    if shared is not None:
        tasks.append(asyncio.create_task(shared.watch(), name="session-store-watch"))
    if subscriber is not None:
        subscriber.start()
    try:
        yield deps
    finally:
        await _shut_down(
            tasks,
            subscriber=subscriber,
            decider=decider,
            workers=workers,
            shared=shared,
            request_log=request_log_file,
        )
        if tracing is not None:
            await asyncio.to_thread(tracing.close)  # exports what is queued: not on the event loop


def _kv_tracking(
    settings: Settings, metrics: GatewayMetrics
) -> tuple[KvTracking | None, KvSubscriber | None]:
    """KV residency and its subscriber when [kv_events] names endpoints or accepts registered workers'
    publishers (then the tracking carries the subscriber as its streams' edge); (None, None) otherwise."""
    kv = settings.kv_events
    if not kv.endpoints and not kv.accept_registered:
        return None, None
    residency = Residency(kv.endpoints, max_blocks=kv.max_blocks_per_worker)
    hasher = BlockHasher(kv.hash_seed or DEFAULT_NONE_HASH_SEED, kv.block_size)
    subscriber = KvSubscriber.from_settings(residency, kv, metrics)
    streams = subscriber if kv.accept_registered else None
    return KvTracking(residency, hasher, streams, Openings(kv.max_openings)), subscriber


def _upstream(settings: Settings) -> Upstream:
    """The client to workers: aiohttp for everything, the streaming leg on httptools if so set."""
    base = HttpUpstream.create(settings.timeouts)
    up = settings.upstream
    if up.stream_client == "aiohttp":
        return base
    return ProtocolStreamUpstream(
        base, settings.timeouts, max_idle_per_host=up.max_idle_per_worker, keepalive_s=up.keepalive_s
    )


def _session_store(
    settings: Settings, given: SessionStore | None, metrics: GatewayMetrics, clock: Clock
) -> tuple[SessionStore, RedisSessionStore | None]:
    """The store the app uses, and the shared one it owns (to watch and close), if any: the one
    given, else Redis when `[sessions] redis_url` names it, else this process's memory."""
    if given is not None:  # `is not None`: an empty store is falsy (len 0)
        return given, None
    s = settings.sessions
    if s.redis_url:
        shared = RedisSessionStore.connect(
            s, metrics, clock=clock, max_id_length=settings.limits.max_id_length
        )
        return shared, shared
    return InMemorySessionStore(ttl_s=s.ttl_s, max_entries=s.max_entries, clock=clock), None


async def _shut_down(
    tasks: list[asyncio.Task[None]],
    *,
    subscriber: KvSubscriber | None,
    decider: DecisionClient,
    workers: Upstream,
    shared: RedisSessionStore | None,
    request_log: RequestLog | None,
) -> None:
    """Stop what the app started, the background tasks first, then close its clients and files."""
    if subscriber is not None:
        await subscriber.close()
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await decider.close()
    await workers.close()
    if shared is not None:
        await shared.close()
    if request_log is not None:
        request_log.close()


async def _sweep(deps: Deps) -> None:
    while True:
        await asyncio.sleep(deps.settings.sessions.sweep_interval_s)
        dropped = await deps.sessions.expire()
        if dropped:
            log.debug("expired %d idle sessions", dropped)
        if deps.request_log is not None:
            deps.request_log.flush()
