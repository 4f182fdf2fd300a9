"""The ZMQ edge of KV residency tracking: one SUB socket per worker feeding gateway/residency.py.

Per worker (``[kv_events]`` in the settings): connect a SUB socket to its publisher, then, when a
replay endpoint is configured, ask it for everything from seq 0 (a full resync); then apply the live
batches in order. A gap, an undecodable message or a lost connection makes the worker unsynced
(residency answers None: the gateway falls back to its belief) and starts a new full resync, at most
one per ``resync_interval_s``. Without a replay endpoint a worker becomes synced only when its
publisher (re)starts at seq 0. Logs one line per transition, never per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.metrics import GatewayMetrics
from gateway.residency import Applied, Residency
from ppd.kv_events import END_SEQ, EventBatch, KvEventError, decode_batch, decode_seq, encode_seq

__all__ = ["KvSubscriber"]

_log = logging.getLogger(__name__)


class KvSubscriber:
    """Runs one task per worker; ``close`` stops them and the sockets."""

    def __init__(
        self,
        residency: Residency,
        endpoints: dict[str, str],
        replay_endpoints: dict[str, str],
        metrics: GatewayMetrics,
        *,
        replay_timeout_s: float = 5.0,
        resync_interval_s: float = 1.0,
        max_resync_interval_s: float = 60.0,
    ) -> None:
        self._residency = residency
        self._endpoints = endpoints
        self._replay = replay_endpoints
        self._metrics = metrics
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._resync_interval_s = resync_interval_s
        self._max_resync_interval_s = max_resync_interval_s
        self._ctx = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for worker, endpoint in self._endpoints.items():
            self._publish(worker)
            self._tasks.append(
                asyncio.create_task(self._follow(worker, endpoint), name=f"kv-events-{worker}")
            )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.term()

    def _publish(self, worker: str) -> None:
        self._metrics.kv_tracked_blocks.labels(worker).set(self._residency.tracked_blocks(worker))
        self._metrics.kv_events_synced.labels(worker).set(1 if self._residency.synced(worker) else 0)

    async def _follow(self, worker: str, endpoint: str) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        need_resync = worker in self._replay
        was_synced = False
        interval = self._resync_interval_s  # doubles while the replay cannot resync (its buffer rolled over)
        try:
            while True:
                if need_resync:
                    need_resync = not await self._resync(worker)
                    interval = (
                        min(2 * interval, self._max_resync_interval_s)
                        if need_resync
                        else self._resync_interval_s
                    )
                ready = dict(await poller.poll(interval * 1000 if need_resync else None))
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_DISCONNECTED and self._residency.synced(worker):
                        self._lost(worker, "connection lost")
                    elif event["event"] == zmq.EVENT_CONNECTED and not self._residency.synced(worker):
                        need_resync = worker in self._replay
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if not self._receive(worker, frames):
                        need_resync = worker in self._replay
                synced = self._residency.synced(worker)
                if synced != was_synced:
                    _log.info("kv events of %s: %s", worker, "synced" if synced else "unsynced")
                    was_synced = synced
                self._publish(worker)
        finally:
            monitor.close(linger=0)
            sub.close(linger=0)

    def _receive(self, worker: str, frames: list[bytes]) -> bool:
        """Apply one live message; False when the worker needs a resync."""
        try:
            if len(frames) != 3:
                raise KvEventError(f"expected 3 frames, got {len(frames)}")
            seq, batch = decode_seq(frames[1]), decode_batch(frames[2])
        except KvEventError as exc:
            if self._residency.synced(worker):
                self._lost(worker, f"bad message ({exc})")
            return False
        self._metrics.kv_events.labels(worker).inc(len(batch.events))
        applied = self._residency.apply(worker, seq, batch)
        if applied is Applied.GAP:
            self._metrics.kv_event_gaps.labels(worker).inc()
            return False
        return applied is not Applied.UNSYNCED

    def _lost(self, worker: str, why: str) -> None:
        self._metrics.kv_event_gaps.labels(worker).inc()
        self._residency.lost(worker)
        _log.warning("kv events of %s: %s; routing on belief until a full resync", worker, why)

    async def _resync(self, worker: str) -> bool:
        """Everything the worker's replay buffer holds from seq 0; True when it rebuilt the state."""
        endpoint = self._replay.get(worker)
        if endpoint is None:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        batches: list[tuple[int, EventBatch]] = []
        try:
            await sock.send_multipart((b"", encode_seq(0)))
            while True:
                if not await sock.poll(self._replay_timeout_ms):
                    return False
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    return False
                _, _topic, seq, payload = frames
                if seq == END_SEQ:
                    break
                batches.append((decode_seq(seq), decode_batch(payload)))
        except KvEventError:
            return False
        finally:
            sock.close(linger=0)
        return self._residency.resync(worker, batches)
