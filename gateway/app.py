"""The HTTP face of the gateway: `create_app(settings)` builds an aiohttp application whose cleanup
context owns the one shared client session, the DecisionService channel and the background tasks.
`create_app` takes the `Upstream` and the `DecisionClient` (ports.py) and the clocks (handed to
runtime.running, which builds and closes the running parts), so tests can
run the whole app on fakes; by default it builds the aiohttp and gRPC ones.

Routes: the OpenAI API as vLLM serves it (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/tokenize`, `/detokenize`, `/health`, `/metrics`) and the bearer-token admin API for worker
registration (`/admin/workers`). Errors are rendered once, here, as OpenAI-style bodies. A completion
is read here and served by forwarding.py, which writes its answer through `_Client` (the
`ClientConnection` of ports.py over aiohttp's response).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from gateway.deps import Deps
from gateway.errors import (
    BadRequestError,
    GatewayError,
    JsonTooDeepError,
    NotFoundError,
    PayloadTooLargeError,
    UnauthorizedError,
    error_body,
)
from gateway.forwarding import Forwarder
from gateway.metrics import GatewayMetrics
from gateway.openai_types import parse_json_object
from gateway.own_address import refuse_own_services
from gateway.pool import WorkerSpec
from gateway.ports import ClientRequest, DecisionClient, Upstream
from gateway.runtime import new_id, running
from gateway.sessions import SessionStore
from gateway.settings import Settings
from gateway.types import Clock, Endpoint, Role
from ppd.rate_limited_log import RateLimitedLog

__all__ = ["DEPS", "create_app", "server_options"]

log = logging.getLogger(__name__)
DEPS = web.AppKey("deps", Deps)
FORWARDER = web.AppKey("forwarder", Forwarder)
# Lines about what any client can cause at will (a body nested too deep): one a minute at most.
CLIENT_LOG = web.AppKey("client_log", RateLimitedLog)
_MAX_ENDPOINT = 512  # characters of a registered KV event endpoint
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HEALTH_ROLES: tuple[Role, ...] = ("decode", "replica", "prefill")


def create_app(
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
) -> web.Application:
    """The gateway app. `upstream` and `decisions` default to the aiohttp and gRPC clients built from
    `settings` (with `metrics`, the app's registry); the app starts and closes whichever it holds."""
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[_errors])
    app[CLIENT_LOG] = RateLimitedLog(log)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        async with running(
            settings,
            upstream=upstream,
            decisions=decisions,
            metrics=metrics,
            clock=clock,
            timer=timer,
            wall_clock=wall_clock,
            new_id=new_id,
            sessions=sessions,
        ) as deps:
            app[DEPS] = deps
            app[FORWARDER] = Forwarder(deps)
            yield

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/tokenize", _passthrough)
    app.router.add_post("/detokenize", _passthrough)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/admin/workers", _list_workers)
    app.router.add_post("/admin/workers", _register_worker)
    app.router.add_delete("/admin/workers/{worker_id}", _deregister_worker)
    return app


def server_options(settings: Settings) -> dict[str, Any]:
    """aiohttp server settings for the gateway's own listener. aiohttp closes a connection whose
    request head is not complete `keepalive_timeout` after it opened (or after its last response):
    that is the header-read timeout, and idle keep-alive connections go after the same time."""
    return {"keepalive_timeout": settings.limits.header_timeout_s}


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
    deps = request.app.get(DEPS)
    try:
        response = await handler(request)
    except GatewayError as exc:
        if isinstance(exc, JsonTooDeepError):
            request.app[CLIENT_LOG].log(
                "%s %s from %s answered 400: %s", request.method, request.path, request.remote, exc
            )
        status, body = exc.to_openai_error()
        response = web.json_response(body, status=status, headers=exc.response_headers())
    except web.HTTPRequestEntityTooLarge as exc:
        response = web.json_response(
            error_body(exc.text or "body too large", "BadRequestError", 413), status=413
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = web.json_response(error_body(exc.reason, "NotFoundError", exc.status), status=exc.status)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        response = web.json_response(
            error_body("internal gateway error", "InternalServerError", 500), status=500
        )
    if deps is not None:
        deps.metrics.requests.labels(endpoint, str(response.status)).inc()
    return response


class _Client:
    """The ClientConnection (ports.py) of one aiohttp request."""

    __slots__ = ("_request", "response")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    async def reply(self, body: bytes, headers: Mapping[str, str]) -> None:
        self.response = web.Response(body=body, status=200, content_type="application/json", headers=headers)

    async def open_stream(self, headers: Mapping[str, str]) -> None:
        self.response = web.StreamResponse(status=200, headers=headers)
        await self.response.prepare(self._request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        await self.response.write(data)

    async def end(self) -> None:
        assert self.response is not None
        await self.response.write_eof()


async def _completion(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    deps = request.app[DEPS]
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLargeError(
            f"request body over the limit of {deps.settings.max_body_bytes} bytes"
        ) from None
    client = _Client(request)
    await request.app[FORWARDER].handle(ClientRequest(endpoint, raw, request.headers), client)
    assert client.response is not None, "the forwarder returned without answering"
    return client.response


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "completions")


def _any_worker(deps: Deps) -> str:
    return deps.pool.view().passthrough().url


async def _models(request: web.Request) -> web.StreamResponse:
    deps = request.app[DEPS]
    with contextlib.suppress(GatewayError):
        reply = await deps.upstream.get(_any_worker(deps) + "/v1/models")
        if reply.status == 200:
            return web.Response(body=reply.body, content_type="application/json")
    model = deps.settings.served_model
    card = {"id": model, "object": "model", "created": 0, "owned_by": "vllm", "root": model, "parent": None}
    return web.json_response({"object": "list", "data": [card]})


async def _passthrough(request: web.Request) -> web.StreamResponse:
    deps = request.app[DEPS]
    body = parse_json_object(await request.read(), max_depth=deps.settings.limits.max_json_depth)
    headers: dict[str, str] = {}
    if deps.settings.worker_api_key:
        headers["Authorization"] = f"Bearer {deps.settings.worker_api_key}"
    reply = await deps.upstream.post(_any_worker(deps) + request.path, body, headers)
    return web.Response(body=reply.body, status=reply.status, content_type="application/json")


async def _health(request: web.Request) -> web.StreamResponse:
    deps = request.app[DEPS]
    pool = deps.pool
    live = {role: pool.count(role, live=True) for role in _HEALTH_ROLES}
    serving = live["replica"] > 0 or live["decode"] > 0
    body: dict[str, Any] = {"status": "ok" if serving else "unavailable", "workers": live}
    body["decision_service"] = {True: "serving", False: "not_serving", None: "unknown"}[
        deps.decisions.serving
    ]
    if deps.slo is not None:
        body["slo"] = deps.slo.health()
    return web.json_response(body, status=200 if serving else 503)


async def _metrics(request: web.Request) -> web.StreamResponse:
    deps = request.app[DEPS]
    return web.Response(body=deps.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


def _authorize(request: web.Request) -> Deps:
    deps = request.app[DEPS]
    token = deps.settings.admin_token
    if not token:
        raise UnauthorizedError("the admin API is disabled (no admin_token configured)")
    given = request.headers.get("Authorization", "")
    if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].encode(), token.encode()):
        raise UnauthorizedError("missing or wrong bearer token")
    return deps


async def _list_workers(request: web.Request) -> web.StreamResponse:
    deps = _authorize(request)
    return web.json_response({"workers": deps.pool.describe(), "placement": deps.placement()})


async def _register_worker(request: web.Request) -> web.StreamResponse:
    deps = _authorize(request)
    body = parse_json_object(await request.read(), max_depth=deps.settings.limits.max_json_depth)
    if not all(isinstance(body.get(k), str) for k in ("id", "role", "url")):
        raise BadRequestError('expected {"id": str, "role": prefill|decode|replica, "url": str}')
    spec = WorkerSpec(body["id"], body["role"], body["url"].rstrip("/"))
    events = _kv_event_endpoints(deps, body)
    await _refuse_own_services(request, deps, spec.url)
    new = deps.pool.register(spec)
    if events is not None and deps.kv is not None and deps.kv.streams is not None:
        deps.kv.streams.follow(spec.id, *events)
    if new:
        log.info("worker %s (%s) registered at %s", spec.id, spec.role, spec.url)
    return web.json_response(
        {"id": spec.id, "registered": new, "heartbeat_expiry_s": deps.settings.pool.heartbeat_expiry_s},
        status=201 if new else 200,
    )


def _kv_event_endpoints(deps: Deps, body: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """A registration's KV event publisher and replay socket (optional fields ``kv_events``,
    ``kv_events_replay``): ZMQ tcp:// or ipc:// endpoints, accepted only where the gateway tracks
    registered workers ([kv_events] accept_registered)."""
    endpoint, replay = body.get("kv_events"), body.get("kv_events_replay")
    if endpoint is None and replay is None:
        return None
    if deps.kv is None or deps.kv.streams is None:
        raise BadRequestError(
            "this gateway does not track registered workers' KV events ([kv_events] accept_registered "
            "is off); register without kv_events",
            param="kv_events",
        )
    for name, value in (("kv_events", endpoint), ("kv_events_replay", replay)):
        if value is None and name == "kv_events_replay":
            continue
        if not (
            isinstance(value, str)
            and value.startswith(("tcp://", "ipc://"))
            and len(value) <= _MAX_ENDPOINT
            and value.isprintable()
            and not any(c.isspace() for c in value)
        ):
            raise BadRequestError(
                f"{name} must be a ZMQ endpoint, tcp://host:port or ipc://path, of at most "
                f"{_MAX_ENDPOINT} printable characters",
                param=name,
            )
    assert isinstance(endpoint, str)
    return endpoint, replay if isinstance(replay, str) else None


async def _refuse_own_services(request: web.Request, deps: Deps, url: str) -> None:
    """A worker URL reaching this gateway (its bind host, or the address the registration arrived on,
    on this listener's port) or the DecisionService's gRPC port would have the gateway call itself or
    speak HTTP/1 to gRPC: compared by resolved address (own_address.py)."""
    own: list[tuple[str, int]] = []
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        port = int(sockname[1])
        own += [(deps.settings.host, port), (str(sockname[0]), port)]
    await refuse_own_services(
        url,
        own=own,
        decision_address=deps.settings.decision.address,
        timeout_s=deps.settings.timeouts.connect_s,
    )


async def _deregister_worker(request: web.Request) -> web.StreamResponse:
    deps = _authorize(request)
    worker_id = request.match_info["worker_id"]
    if not deps.pool.deregister(worker_id):
        raise NotFoundError(f"no registered worker {worker_id!r}")
    if deps.kv is not None and deps.kv.streams is not None:
        deps.kv.streams.unfollow(worker_id)
    log.info("worker %s deregistered", worker_id)
    return web.json_response({"id": worker_id, "removed": True})
