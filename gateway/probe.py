"""Keeps the worker pool honest: active /health checks, load scraped from /metrics, heartbeat expiry,
and each worker's served models with their `max_model_len` from /v1/models.

Runs as one background task per gateway; each round probes all workers concurrently, so one slow
worker delays nobody else's check by more than the probe timeout. /v1/models is read once per worker
(again after it was down: it may have restarted with another model length).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from gateway.errors import UpstreamError
from gateway.metrics import GatewayMetrics
from gateway.pool import Load, WorkerPool, WorkerSpec
from gateway.ports import Upstream
from gateway.settings import PoolSettings
from gateway.types import Role

__all__ = ["PoolMonitor", "load_from_metrics", "models_from_cards"]

log = logging.getLogger(__name__)
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV = "vllm:kv_cache_usage_perc"
_ROLES: tuple[Role, ...] = ("prefill", "decode", "replica")


def load_from_metrics(text: str) -> Load:
    """Running and waiting summed over engines (DP ranks), KV usage the highest of them."""
    running = waiting = kv = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name not in (_RUNNING, _WAITING, _KV):
            continue
        try:
            value = float(line.rsplit("}", 1)[-1].split()[0] if "}" in line else line.split()[1])
        except (IndexError, ValueError):
            continue
        if name == _RUNNING:
            running += value
        elif name == _WAITING:
            waiting += value
        else:
            kv = max(kv, value)
    return Load(running, waiting, kv)


def models_from_cards(body: bytes) -> dict[str, int]:
    """Model id -> max_model_len from a /v1/models answer (vLLM's ModelCard); cards without one skipped."""
    try:
        cards = json.loads(body).get("data")
    except (ValueError, AttributeError):
        return {}
    models: dict[str, int] = {}
    for card in cards if isinstance(cards, list) else ():
        if not isinstance(card, dict):
            continue
        model, length = card.get("id"), card.get("max_model_len")
        if isinstance(model, str) and isinstance(length, int) and not isinstance(length, bool) and length > 0:
            models[model] = length
    return models


class PoolMonitor:
    def __init__(
        self,
        pool: WorkerPool,
        upstream: Upstream,
        settings: PoolSettings,
        metrics: GatewayMetrics,
        *,
        on_gone: Callable[[str], None] | None = None,
    ) -> None:
        """``on_gone`` is told each registered worker that missed its heartbeats (KV tracking ends)."""
        self._on_gone = on_gone
        self._pool = pool
        self._upstream = upstream
        self._s = settings
        self._metrics = metrics

    async def run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self._s.health_interval_s)

    async def check_once(self) -> None:
        for gone in self._pool.expire():
            log.warning("worker %s missed its heartbeats; removed from the pool", gone)
            if self._on_gone is not None:
                self._on_gone(gone)
        specs = self._pool.specs()
        await asyncio.gather(*(self._check(spec) for spec in specs))
        self.publish()

    def publish(self) -> None:
        for role in _ROLES:
            total = self._pool.count(role, live=False)
            live = self._pool.count(role, live=True)
            self._metrics.workers.labels(role, "live").set(live)
            self._metrics.workers.labels(role, "down").set(total - live)

    async def _check(self, spec: WorkerSpec) -> None:
        try:
            reply = await self._upstream.get(spec.url + "/health")
            healthy = reply.status == 200
        except UpstreamError:
            healthy = False
        was = self._pool.is_live(spec.id)
        self._pool.record_check(
            spec.id,
            healthy,
            unhealthy_after=self._s.unhealthy_after,
            served_within_s=self._s.health_interval_s * self._s.unhealthy_after,
        )
        healthy = self._pool.is_live(spec.id)
        if was != healthy:
            log.warning("worker %s (%s) is now %s", spec.id, spec.url, "up" if healthy else "down")
        if not healthy:
            if not self._pool.needs_models(spec.id):
                self._pool.set_models(spec.id, None)
            return
        if self._pool.needs_models(spec.id):
            await self._read_models(spec)
        if not self._s.scrape_metrics:
            return
        try:
            reply = await self._upstream.get(spec.url + "/metrics")
        except UpstreamError:
            return
        if reply.status == 200:
            self._pool.set_load(spec.id, load_from_metrics(reply.body.decode("utf-8", errors="replace")))

    async def _read_models(self, spec: WorkerSpec) -> None:
        try:
            reply = await self._upstream.get(spec.url + "/v1/models")
        except UpstreamError:
            return  # read again next round
        self._pool.set_models(spec.id, models_from_cards(reply.body) if reply.status == 200 else {})
