"""One simulated vLLM 0.33 worker: aiohttp routes over a real-time driven engine (the thin transport).

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /tokenize, /detokenize, /version,
/metrics, /load, /admin/faults (GET, POST), /reset_prefix_cache (POST, with `server_dev_mode` only, as
vLLM's dev route), and /_nixl/claim, /_nixl/release (the side channel a decode worker in another process
uses to read this worker's leases: `side_channel.py`). A generation
request's response (the SSE stream or the whole body) is written by `stream.py`. See
simulator/README.md.

The module stays whole (about 800 lines) because the routes, the fault middleware, the driver
callbacks and the KV-source side all share one worker's state on one loop without locks (Rule 4):
the engine that a crash replaces, the leases it pins, the remotes it reads and the tasks `stop()`
cancels. The parts that need none of that state live beside it (`stream.py`, `side_channel.py`).

Invariants:
- Rule 1: no exception escapes a handler as a traceback: `ApiError` becomes vLLM's error body, anything
  else is logged once and answered with HTTP 500 "Internal server error".
- Rule 2: P/D follows NixlConnector pull mode: `do_remote_decode` -> one token, blocks pinned, the full
  `kv_transfer_params` returned; `do_remote_prefill` -> the engine pulls the tokens it does not hold
  over the fabric's link, after checking the prefill worker's lease (expired -> a failed KV load, rule 2c).
- Rule 2b: bidirectional mode (`bidirectional_kv_xfer`, off by default) is the same pull with the roles
  swapped: a decode leg keeps its blocks pinned for `decoder_kv_blocks_ttl` and returns their params
  (`do_remote_decode: true`) on its final chunk; a prefill leg given such params pulls the prompt prefix
  it does not hold from that decode worker (unless below `kv_recompute_threshold`). Past the advertised
  expiry the prefill worker declines the read.
- Rule 2c: a failed KV load (expired lease, declined read, dead or unreachable remote) follows
  `kv_load_failure_policy`: "fail" (vLLM's default) ends the request with HTTP 500 (an SSE error event
  once streaming); "recompute" sends it back to the engine to prefill its prompt locally, and it answers
  as any request does.
- Rule 3: "down" behaves like a crashed process: the port closes, open connections are cut, requests in
  flight fail and the engine (prefix cache, pinned blocks) is lost; `down_for_s` brings up a fresh one.
- Rule 3b: a client that goes away aborts its request, streaming or not (vLLM aborts a non-streaming
  request on disconnect too): aiohttp cancels the handler (`handler_cancellation`), and the handler's
  cleanup aborts the engine request. Work that must outlive the request that started it (going down)
  runs as a task of its own.
- Rule 4: concurrency is one event loop: handlers, the driver task and the fabric's timer task share
  state without locks; anything that outlives a request (side-channel calls, going down) is a task held
  in `_tasks` and cancelled by `stop()`.
- Rule 5: no request holds the loop for long. Bodies are capped (`max_body_bytes`, 413), and parsing and
  tokenization run as `simulator.core.protocol` steps with a loop turn between slices, so the other workers
  of the process keep their step deadlines and SIGTERM is seen. Once `stop()` has begun, a request still
  being parsed is answered 503 at its next slice, and handlers get `_SHUTDOWN_GRACE_S` to finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from opentelemetry import trace

from ppd.kv_events import BlockHasher
from simulator.core.api_error import ApiError
from simulator.core.engine import Engine, EngineConfig, EngineRequest, KvPull, StepResult
from simulator.core.faults import Faults
from simulator.core.link import TransferDone
from simulator.core.protocol import (
    GenerationRequest,
    ServingLimits,
    Steps,
    chat_steps,
    completion_steps,
    detokenize_steps,
    tokenize_steps,
)
from simulator.core.responses import ResponseRenderer, tokenize_body_steps
from simulator.core.sampler import GeneratedBlocks, sample_output
from simulator.core.tokenizer import Llama3Tokenizer
from simulator.core.worker_settings import WorkerSettings
from simulator.server.deadline_board import DeadlineBoard
from simulator.server.fabric import Fabric
from simulator.server.jobs import JobHandle
from simulator.server.kv_events import KvEventPublisher
from simulator.server.metrics import FinishedRequest, WorkerMetrics
from simulator.server.realtime import DEFAULT_SPIN_S, RealtimeDriver, StepTiming
from simulator.server.side_channel import KvRemote, SideChannelClient, SideChannelServer
from simulator.server.stream import INTERNAL_ERROR, GenerationRun
from simulator.server.tracing import RequestSpanData, export_request_span

__all__ = ["VLLM_VERSION", "Worker"]

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
_MODEL_ROUTES = ("/v1/", "/tokenize", "/detokenize")
_GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
_SHUTTING_DOWN = "The server is shutting down"
_SHUTDOWN_GRACE_S = 3.0  # how long stop() lets requests in flight finish before cancelling them
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


@dataclass(slots=True)
class _Pinned:
    pinned_at: float
    being_read: bool = False


class Worker:
    """A worker's engine, driver, metrics, faults and HTTP site; `start()` binds the port."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        tokenizer: Llama3Tokenizer,
        fabric: Fabric,
        spin_s: float = DEFAULT_SPIN_S,
        timing: StepTiming | None = None,
        board: DeadlineBoard | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self.settings = settings
        self._tracer = tracer  # vLLM's --otlp-traces-endpoint: an `llm_request` span per request (tracing.py)
        self.tokenizer = tokenizer
        self.fabric = fabric
        self.limits = ServingLimits(model=settings.model, max_model_len=settings.max_model_len)
        self._block_size = settings.block_size or fabric.profile.scheduler.block_size
        self.metrics = WorkerMetrics(settings.model, block_size=self._block_size)
        self.faults = settings.faults
        self._fault_rng = random.Random(settings.fault_seed)  # noqa: S311 - fault injection, not crypto
        self._spin = spin_s
        self._timing = timing
        self._board = board if board is not None else DeadlineBoard()  # shared by the drivers of one loop
        self._generation_requests = 0
        self._closing = False  # stop() has begun: requests still being parsed are answered 503
        self._down = False  # requests are cut from the moment a crash is decided
        self._going_down = False  # the crash (closing the port, dropping the engine) has started
        self._restore_task: asyncio.Task[None] | None = None
        self._remote: dict[str, KvRemote] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._side_channel = SideChannelClient(settings.worker_id)
        self._pinned: dict[str, _Pinned] = {}
        self._synced: dict[str, int] = {}
        self.engine_id = ""
        kv_events = settings.kv_events
        self.kv_events: KvEventPublisher | None = None
        self._hasher: BlockHasher | None = None
        if kv_events is not None and kv_events.enabled:  # vLLM's chain, seeded from PYTHONHASHSEED
            self._hasher = BlockHasher.from_environ(os.environ, block_size=self._block_size)
            self.kv_events = KvEventPublisher(kv_events, block_size=self._block_size)
        self.engine, self.driver = self._new_engine()
        self._side_channel_server = SideChannelServer(self, now=self._now, read_json=self._read_json)
        self.app = self._build_app()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.port = settings.port

    # ------------------------------------------------------------------ lifecycle
    @property
    def node(self) -> str:
        return self.settings.node_name

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    @property
    def is_down(self) -> bool:
        return self._down

    def describe(self) -> dict[str, str]:
        out = {"id": self.settings.worker_id, "role": self.settings.role, "url": self.url}
        if self.kv_events is not None:
            out["kv_events"] = self.kv_events.endpoint
            if self.kv_events.replay_endpoint is not None:
                out["kv_events_replay"] = self.kv_events.replay_endpoint
        return out

    def _new_engine(self) -> tuple[Engine, RealtimeDriver]:
        restarted = bool(self.engine_id)
        if self.engine_id:
            self.fabric.unregister(self.engine_id)
        self.engine_id = f"{self.settings.worker_id}-{uuid.uuid4()}"
        self.fabric.register(self.engine_id, self)
        config = EngineConfig(
            lease_s=self.settings.kv_lease_duration_s,
            kv_recompute_threshold=self.settings.kv_recompute_threshold,
            kv_capacity_tokens=self.settings.kv_capacity_tokens,
            block_size=self._block_size,
        )
        engine = Engine(self.fabric.profile, config)
        if self.kv_events is not None:
            if restarted:  # a restarted engine starts with an empty cache: say so at once
                self.kv_events.cleared()
                self.kv_events.flush()
            engine.pool.sink = self.kv_events
        driver = RealtimeDriver(
            engine,
            spin_s=self._spin,
            on_pull=self._on_pull,
            on_step=self._on_step,
            timing=self._timing,
            board=self._board,
        )
        self._remote.clear()
        self._pinned.clear()
        self._synced.clear()
        return engine, driver

    async def start(self) -> None:
        self.driver.start()
        if self.kv_events is not None:
            self.kv_events.start()
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=_SHUTDOWN_GRACE_S,
        )
        await self._runner.setup()
        await self._listen(self.settings.port)
        if self.faults.down:
            await self._go_down()

    async def _listen(self, port: int) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, self.settings.host, port, reuse_address=True)
        await self._site.start()
        addresses = self._runner.addresses  # only this site is registered (a downed site unregisters)
        if addresses:
            self.port = int(addresses[0][1])

    def begin_stop(self) -> None:
        """Refuse the requests still being parsed from now on (`stop()` does this first)."""
        self._closing = True

    async def stop(self) -> None:
        self.begin_stop()
        pending = [*self._tasks, *([self._restore_task] if self._restore_task is not None else [])]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._restore_task = None
        await self._side_channel.close()
        await self.driver.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.fabric.unregister(self.engine_id)
        if self.kv_events is not None:
            await self.kv_events.close()

    async def _go_down(self) -> None:
        """Crash: close the port, cut connections, lose the engine."""
        if self._going_down:
            return
        self._going_down = True
        self._down = True
        logger.warning("worker %s going down (fault injection)", self.settings.worker_id)
        if self._site is not None:
            await self._site.stop()
            self._site = None
        if self._runner is not None and self._runner.server is not None:
            for connection in list(self._runner.server.connections):
                if connection.transport is not None:
                    connection.transport.abort()
        await self.driver.stop()
        if self.faults.down_for_s is not None:
            self._restore_task = asyncio.create_task(self._restore_after(self.faults.down_for_s))

    async def _restore_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.engine, self.driver = self._new_engine()
        self.driver.start()
        self.faults = Faults()
        self._generation_requests = 0
        await self._listen(self.port)
        self._down = False
        self._going_down = False
        logger.warning("worker %s is back up on port %d", self.settings.worker_id, self.port)

    # ------------------------------------------------------------------ app
    def _build_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._error_middleware, self._fault_middleware],
            client_max_size=self.settings.max_body_bytes,
        )
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/load", self._load)
        app.router.add_get("/admin/faults", self._get_faults)
        app.router.add_post("/admin/faults", self._post_faults)
        if self.settings.server_dev_mode:  # vLLM serves its dev routes only with VLLM_SERVER_DEV_MODE=1
            app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        self._side_channel_server.add_routes(app.router)
        return app

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPRequestEntityTooLarge as exc:
            body = ApiError(413, f"Request body too large: {exc.text}").body()
            return web.json_response(body, status=413)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            body = ApiError(exc.status, exc.reason).body()
            return web.json_response(body, status=exc.status, headers={"Allow": exc.headers.get("Allow", "")})
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            logger.exception("worker %s: unhandled error on %s", self.settings.worker_id, request.path)
            return web.json_response(ApiError(500, INTERNAL_ERROR).body(), status=500)

    @web.middleware
    async def _fault_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/admin/faults":
            return await handler(request)
        faults = self.faults
        if self._down or faults.refuse_connections:
            return self._cut(request)
        if request.path in _GENERATION_ROUTES:
            self._generation_requests += 1
            after = faults.down_after_requests
            if after is not None and self._generation_requests > after:
                # A task of its own: cutting this very connection cancels this handler (rule 3b).
                self._down = True
                task = asyncio.create_task(self._go_down())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return self._cut(request)
        if faults.added_latency_ms > 0 and request.path.startswith(_MODEL_ROUTES):
            await asyncio.sleep(faults.added_latency_ms / 1000.0)
        if (
            request.path in _GENERATION_ROUTES
            and faults.error_rate > 0
            and self._fault_rng.random() < faults.error_rate
        ):
            raise ApiError(500, INTERNAL_ERROR)
        return await handler(request)

    @staticmethod
    def _cut(request: web.Request) -> web.Response:
        """Reset the connection without a reply (aiohttp quietly drops the response returned here)."""
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=503)

    # ------------------------------------------------------------------ small routes
    async def _run_steps(self, steps: Steps[T]) -> T:
        """Run a parser's steps with a loop turn between slices (Rule 5)."""
        while True:
            try:
                next(steps)
            except StopIteration as done:
                value: T = done.value
                return value
            await asyncio.sleep(0)
            if self._closing:
                steps.close()
                raise ApiError(503, _SHUTTING_DOWN)

    async def _read_json(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            # vLLM's request validation (FastAPI/pydantic) answers type "Bad Request", param "body.<pos>".
            pos = exc.pos if isinstance(exc, json.JSONDecodeError) else 0
            detail = {"type": "json_invalid", "loc": f"body.{pos}", "msg": "JSON decode error"}
            raise ApiError(
                400, f"1 validation error:\n  {detail}", param=f"body.{pos}", error_type="Bad Request"
            ) from exc

    async def _health(self, request: web.Request) -> web.Response:
        """200 with an empty body; 503 once the engine died (vLLM's `/health` contract)."""
        del request
        return web.Response(status=503 if self.driver.dead else 200)

    async def _version(self, request: web.Request) -> web.Response:
        del request
        return web.json_response({"version": VLLM_VERSION})

    async def _models(self, request: web.Request) -> web.Response:
        del request
        model = self.settings.model
        card = {
            "id": model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": self.settings.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": int(time.time()),
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        ids, with_strs = await self._run_steps(tokenize_steps(body, self.tokenizer, self.limits))
        token_str = self.tokenizer.token_str if with_strs else None
        reply = tokenize_body_steps(ids, max_model_len=self.settings.max_model_len, token_str=token_str)
        return web.Response(text=await self._run_steps(reply), content_type="application/json")

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        ids = await self._run_steps(detokenize_steps(body, self.tokenizer, self.limits))
        return web.json_response({"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)})

    async def _load(self, request: web.Request) -> web.Response:
        del request
        return web.json_response({"server_load": self.engine.load()})

    async def _metrics(self, request: web.Request) -> web.Response:
        del request
        self._sync_metrics()
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's dev route: drop the prefix cache; `{"success": false}` while blocks are still held
        (running requests, blocks pinned for a pull), as vLLM answers, so a caller may retry."""
        del request
        logger.info("worker %s: resetting prefix cache", self.settings.worker_id)
        return web.json_response({"success": self.engine.pool.reset_prefix_cache()})

    async def _get_faults(self, request: web.Request) -> web.Response:
        del request
        return web.json_response(self.faults.as_json())

    async def _post_faults(self, request: web.Request) -> web.StreamResponse:
        raw = await self._read_json(request)
        faults = self.faults.updated(raw)
        if faults.down_after_requests != self.faults.down_after_requests:
            self._generation_requests = 0
        if faults.error_seed is not None and isinstance(raw, dict) and "error_seed" in raw:
            self._fault_rng = random.Random(faults.error_seed)  # noqa: S311 - fault injection
        self.faults = faults
        logger.info("worker %s faults now %s", self.settings.worker_id, faults.as_json())
        response = web.json_response(faults.as_json())
        if faults.down:
            self._down = True  # from now on every other request is cut, even before the port closes
            await response.prepare(request)
            await response.write_eof()
            task = asyncio.create_task(self._go_down())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return response

    def _sync_metrics(self) -> None:
        """Carry the engine's cumulative counters into the Prometheus counters (by difference)."""
        stats = self.engine.stats()
        m = self.metrics
        m.set_load(
            running=stats.num_running,
            waiting=stats.num_waiting_capacity,
            deferred=stats.num_waiting_deferred,
            kv_usage=stats.kv_cache_usage,
        )
        current = {
            "prefix_queries": stats.prefix_cache_queries,
            "prefix_hits": stats.prefix_cache_hits,
            "external_queries": stats.external_prefix_cache_queries,
            "external_hits": stats.external_prefix_cache_hits,
            "preemptions": stats.num_preemptions,
            "expired": stats.num_kv_expired,
            "local_compute": stats.prompt_tokens_local_compute,
            "local_cache_hit": stats.prompt_tokens_local_cache_hit,
            "external": stats.prompt_tokens_external,
        }
        delta = {key: value - self._synced.get(key, 0) for key, value in current.items()}
        self._synced = current
        m.add_engine_counts(
            prefix_queries=delta["prefix_queries"],
            prefix_hits=delta["prefix_hits"],
            external_queries=delta["external_queries"],
            external_hits=delta["external_hits"],
            preemptions=delta["preemptions"],
            expired=delta["expired"],
            local_compute=delta["local_compute"],
            local_cache_hit=delta["local_cache_hit"],
            external=delta["external"],
        )

    # ------------------------------------------------------------------ KV source (prefill side)
    def _now(self) -> float:
        """The current engine's clock (a restart brings a new driver)."""
        return self.driver.now()

    def claim_lease(self, remote_request_id: str, now: float) -> bool:
        if self._down:
            return False
        pinned = self._pinned.get(remote_request_id)
        if pinned is None or pinned.being_read or not self.engine.lease_alive(remote_request_id, now):
            return False
        early = self.faults.lease_expiry_s
        if early is not None and now - pinned.pinned_at >= early:
            del self._pinned[remote_request_id]
            self.engine.release(remote_request_id, now)
            self.metrics.on_lease_expired()
            self.driver.wake()
            return False
        pinned.being_read = True
        return True

    def release_lease(self, remote_request_id: str, now: float) -> None:
        if self._pinned.pop(remote_request_id, None) is not None and self.engine.release(
            remote_request_id, now
        ):
            self.driver.wake()

    # ------------------------------------------------------------------ driver callbacks
    def _on_step(self, result: StepResult) -> None:
        self.metrics.on_step(tokens=result.num_decodes + result.prefill_tokens, generated=len(result.sampled))
        if self.kv_events is not None:
            self.kv_events.flush()  # one batch per engine step, as vLLM's scheduler publishes

    def _on_pull(self, pull: KvPull, at: float) -> None:
        """Start reading the KV of a D request: claim P's lease, then move the bytes over the link.

        P in this process: the claim is a call. P elsewhere: the claim goes over HTTP to the
        `remote_host:remote_port` P advertised (the simulator's stand-in for NIXL's side channel).
        A bidirectional P leg reads a decode worker's blocks the same way, unless their advertised
        expiry has passed: then it declines the read, like vLLM's pull worker.
        """
        remote = self._remote.pop(pull.request_id, None)
        if remote is not None and remote.expires_at is not None and remote.expires_at <= at:
            logger.warning(
                "worker %s: declining the expired remote read for %s from engine %s",
                self.settings.worker_id,
                pull.request_id,
                remote.engine_id,
            )
            self.metrics.on_lease_expired()
            self._kv_load_failed(pull.request_id, at, "KV blocks expired")
            return
        source = self.fabric.source(remote.engine_id) if remote is not None else None
        if remote is not None and source is not None:
            rrid = remote.remote_request_id
            if source.claim_lease(rrid, at):
                self._transfer(pull, at, source.node, lambda t: source.release_lease(rrid, t))
                return
        elif remote is not None and remote.host and remote.port:
            task = asyncio.create_task(self._pull_over_side_channel(pull, remote))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._pull_failed(pull.request_id, at)

    def _pull_failed(self, request_id: str, at: float) -> None:
        self.metrics.on_transfer_failed()
        self._kv_load_failed(request_id, at, "lease expired or KV source gone")

    def _kv_load_failed(self, request_id: str, at: float, why: str) -> None:
        """Rule 2c: vLLM's `kv_load_failure_policy` fails the request or computes its prompt here."""
        recompute = self.settings.kv_load_failure_policy == "recompute"
        logger.warning(
            "worker %s: KV load failed for %s (%s); %s",
            self.settings.worker_id,
            request_id,
            why,
            "recomputing the prompt locally" if recompute else "failing the request",
        )
        if recompute:
            self.driver.kv_recompute(request_id, at)
        else:
            self.driver.kv_failed(request_id, at, f"KV load failed: {why}")

    def _transfer(self, pull: KvPull, at: float, source_node: str, release: Callable[[float], None]) -> None:
        driver = self.driver
        n_bytes = pull.n_tokens * self.fabric.kv_bytes_per_token

        def done(transfer: TransferDone) -> None:
            release(transfer.at)
            self.metrics.on_transfer(seconds=transfer.at - at, num_bytes=transfer.n_bytes)
            if driver is self.driver:
                driver.kv_loaded(pull.request_id, transfer.at, transfer.stall_s)

        self.fabric.transfer(source_node, self.node, n_bytes, at, done)

    async def _pull_over_side_channel(self, pull: KvPull, remote: KvRemote) -> None:
        driver = self.driver
        claimed = await self._side_channel.call(remote, "claim")
        if driver is not self.driver:
            return
        now = driver.now()
        if not claimed:
            self._pull_failed(pull.request_id, now)
            return

        def release(at: float) -> None:
            del at
            task = asyncio.create_task(self._side_channel.call(remote, "release"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._transfer(pull, now, f"{remote.host}:{remote.port}", release)

    def release_unpulled(self, request_id: str, now: float) -> None:
        """A D request that needed no pull (full local hit) still frees P's blocks (vLLM notifies P)."""
        remote = self._remote.pop(request_id, None)
        if remote is None:
            return
        source = self.fabric.source(remote.engine_id)
        if source is not None:
            source.release_lease(remote.remote_request_id, now)
        elif remote.host and remote.port and not self._closing:  # no new side-channel call once stopping
            task = asyncio.create_task(self._side_channel.call(remote, "release"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ generation
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        try:
            req = await self._run_steps(completion_steps(body, self.tokenizer, self.limits))
        except ApiError:
            self._release_rejected(body)
            raise
        return await self._generate(request, req)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        try:
            req = await self._run_steps(chat_steps(body, self.tokenizer, self.limits))
        except ApiError:
            self._release_rejected(body)
            raise
        return await self._generate(request, req)

    def _release_rejected(self, body: object) -> None:
        """A D leg rejected before the engine still frees P's pinned blocks (vLLM's rejection cleanup)."""
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return
        engine_id, rrid = params.get("remote_engine_id"), params.get("remote_request_id")
        host, port = params.get("remote_host"), params.get("remote_port")
        if not isinstance(engine_id, str) or not isinstance(rrid, str):
            return
        remote = KvRemote(
            engine_id=engine_id,
            remote_request_id=rrid,
            host=host if isinstance(host, str) else None,
            port=port if isinstance(port, int) and not isinstance(port, bool) else None,
        )
        key = f"rejected-{rrid}"
        self._remote[key] = remote
        self.release_unpulled(key, self.driver.now())

    def _ids(self, request: web.Request, req: GenerationRequest) -> tuple[str, str]:
        base = request.headers.get("X-Request-Id") or req.request_id or uuid.uuid4().hex
        if req.kind == "completion":
            response_id = f"cmpl-{base}"
            return response_id, f"{response_id}-0-{secrets.token_hex(4)}"
        response_id = f"chatcmpl-{base}"
        return response_id, f"{response_id}-{secrets.token_hex(4)}"

    async def _generate(self, request: web.Request, req: GenerationRequest) -> web.StreamResponse:
        response_id, internal_id = self._ids(request, req)
        span_data = RequestSpanData(request.headers) if self._tracer is not None else None
        kv = req.kv_transfer
        remote_decode = kv is not None and kv.do_remote_decode
        remote_prefill = kv is not None and kv.do_remote_prefill and not remote_decode
        bidirectional = self.settings.bidirectional_kv_xfer
        # A P leg carrying a decode worker's params (the next turn, docs/vllm-protocol.md 3.4).
        from_decoder = (
            bidirectional
            and kv is not None
            and remote_decode
            and bool(kv.remote_block_ids)
            and kv.remote_engine_id is not None
            and kv.remote_request_id is not None
            and (kv.remote_num_tokens or 0) > 0
        )
        sampled = sample_output(
            req.prompt_ids,
            seed=req.seed,
            max_tokens=1 if remote_decode else req.max_tokens,
            min_tokens=0 if remote_decode else req.min_tokens,
            ignore_eos=req.ignore_eos,
            settings=self.settings.sampler,
            tokenizer=self.tokenizer,
            explicit_limit=req.max_tokens_given,
        )
        engine_request = EngineRequest(
            request_id=internal_id,
            n_prompt=len(req.prompt_ids),
            content=GeneratedBlocks(req.prompt_ids, sampled, self._block_size, hasher=self._hasher),
            max_tokens=sampled.length,
            ignore_eos=sampled.finish_reason == "length",
            eos_at=sampled.length if sampled.finish_reason == "stop" else None,
            remote_decode=remote_decode,
            remote_prefill=remote_prefill,
            remote_prefix_tokens=(kv.remote_num_tokens or 0) if from_decoder and kv is not None else 0,
            kv_ttl_s=self.settings.decoder_kv_blocks_ttl_s if bidirectional and remote_prefill else None,
        )
        if (remote_prefill or from_decoder) and kv is not None:
            self._remote[internal_id] = KvRemote(
                engine_id=kv.remote_engine_id or "",
                remote_request_id=kv.remote_request_id or "",
                host=kv.remote_host,
                port=kv.remote_port,
                expires_at=kv.remote_blocks_expiry_time if from_decoder else None,
            )
        driver = self.driver
        handle = JobHandle(request_id=internal_id, submitted_at=driver.now())
        driver.submit(engine_request, handle)
        renderer = ResponseRenderer(req, response_id=response_id, created=int(time.time()))
        run = GenerationRun(
            worker=self,
            req=req,
            renderer=renderer,
            handle=handle,
            output=sampled,
            internal_id=internal_id,
        )
        try:
            if req.stream:
                return await run.stream(request)
            return await run.full()
        finally:
            if driver.engine.has_request(internal_id) and not handle.kv_pinned:
                driver.abort(internal_id)
            self._remote.pop(internal_id, None)
            if self._tracer is not None and span_data is not None:
                export_request_span(
                    self._tracer,
                    span_data,
                    request_id=response_id,
                    handle=handle,
                    now=driver.now(),
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=run.produced,
                    max_tokens=req.max_tokens,
                )

    def kv_params_for(
        self, internal_id: str, handle: JobHandle, req: GenerationRequest
    ) -> dict[str, Any] | None:
        """The `kv_transfer_params` of a finished request whose blocks are pinned: P's (docs/vllm-protocol.md
        1.3), or in bidirectional mode D's (3.4: the roles swapped, with the blocks' expiry time)."""
        if not handle.kv_pinned:
            return None
        p_leg = req.kv_transfer is not None and req.kv_transfer.do_remote_decode
        now = self.driver.now()
        if len(self._pinned) >= 256:  # forget leases the engine already expired (never read)
            for rid in [r for r in self._pinned if not self.engine.lease_alive(r, now)]:
                del self._pinned[rid]
        self._pinned[internal_id] = _Pinned(pinned_at=now)
        return {
            "do_remote_prefill": p_leg,
            "do_remote_decode": not p_leg,
            "remote_block_ids": [self.engine.remote_block_ids(internal_id)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": internal_id,
            "remote_host": self.settings.host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            # Tokens whose KV is computed: the prompt (P), plus all output tokens but the last (D).
            "remote_num_tokens": len(req.prompt_ids)
            + (0 if p_leg else self.engine.num_output_tokens(internal_id) - 1),
            # On the worker's monotonic clock, like vLLM's perf_counter() deadline.
            "remote_blocks_expiry_time": None if p_leg else self.engine.lease_expires_at(internal_id),
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": handle.cached_tokens,
        }

    def finish_metrics(self, req: GenerationRequest, handle: JobHandle, produced: int, reason: str) -> None:
        now = self.driver.now()
        first = handle.first_token_at if handle.first_token_at is not None else now
        scheduled = handle.scheduled_at if handle.scheduled_at is not None else first
        ttft = max(0.0, first - handle.submitted_at)
        self.metrics.on_finished(
            FinishedRequest(
                finished_reason=reason,
                prompt_tokens=len(req.prompt_ids),
                generation_tokens=produced,
                max_tokens=req.max_tokens,
                queue_s=max(0.0, scheduled - handle.submitted_at),
                ttft_s=ttft,
                prefill_s=max(0.0, first - scheduled),
                decode_s=max(0.0, now - first),
                e2e_s=max(0.0, now - handle.submitted_at),
                preemptions=handle.preemptions,
            )
        )
