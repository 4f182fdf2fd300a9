"""The ZMQ edge of KV residency tracking: one SUB socket per worker feeding gateway/residency.py.

Per worker (``[kv_events]`` in the settings), one task (restarted with a doubling pause, logged, if
it ever dies; the worker is unsynced meanwhile) owns a SUB socket on the worker's publisher and,
while the worker is not synced and a replay endpoint is configured, one full resync in flight: a
DEALER that asked the replay socket for everything from seq 0. The live stream is never held up by
it: both sockets are polled together.

- A replay is applied as it streams (residency.begin_resync / apply_events / end_resync), never held
  whole: it must start at seq 0 without a gap, deliver at most ``max_replay_bytes`` and send
  something every ``replay_timeout_s``, else it is given up (the worker stays unsynced, counted and
  logged) and asked again after ``resync_interval_s``, doubling up to ``max_resync_interval_s``.
- Live batches that arrive meanwhile are decoded (validated), kept as bytes (at most
  ``max_pending_bytes``, else the replay is given up) and applied in order after the end marker:
  duplicates of replayed batches are ignored, a gap means another resync. A live batch with seq 0
  while a replay is pending is a restarted publisher: its stream is complete, the replay is dropped.
- Every message that cannot be decoded or validated (whatever the decoder raised) is a bad message:
  counted, logged at most once a minute per worker (with how many were left out), and treated as a
  lost batch (unsynced until a full resync).
- Frames over ``max_message_bytes`` (ZMQ_MAXMSGSIZE) make ZMQ drop the connection; libzmq does not
  reconnect after that protocol error, so every lost connection is re-made here (counted; unsynced).
- A batch's events are applied in slices of ``_SLICE``, yielding to the event loop between them.

While a worker is not synced, residency answers None for it (the gateway routes on its belief, as
without events); the synced gauge follows residency. Workers registered through the admin API that
name their publisher are followed from then on (``follow``: a heartbeat with the same endpoints changes
nothing) until they leave (``unfollow``: the task is cancelled, the residency and the worker's metric
series dropped); the static ones are followed for the process' life. Logs one line per transition
or failure, never per message. It stays one module (about 490 lines): the live socket, the replay
and the batches held between them are one state machine per worker, owned by one task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.metrics import GatewayMetrics
from gateway.residency import Applied, Residency
from gateway.settings import KvEventSettings
from ppd.kv_events import END_SEQ, EventBatch, KvEvent, KvEventError, decode_batch, decode_seq, encode_seq
from ppd.rate_limited_log import RateLimitedLog

__all__ = ["KvSubscriber", "StreamStats"]

_log = logging.getLogger(__name__)
_SLICE = 2048  # events applied between two yields to the event loop
_BAD_LOG_INTERVAL_S = 60.0  # at most one "bad message" line per worker this often
_DETAIL_CHARS = 200


@dataclass(slots=True)
class StreamStats:
    """What the subscriber holds and has held for one worker (its own buffers, not the process')."""

    buffered_batches: int = 0  # live batches held while a replay is pending
    buffered_bytes: int = 0
    peak_buffered_bytes: int = 0
    replay_bytes: int = 0  # bytes the pending (or last) replay delivered; applied as they came
    peak_replay_bytes: int = 0
    bad_messages: int = 0


@dataclass(slots=True)
class _Replay:
    sock: zmq.asyncio.Socket
    deadline: float  # given up when nothing arrives before it
    next_seq: int = 0


@dataclass(slots=True)
class _Stream:
    """One worker's stream state; only its own task touches it."""

    worker: str
    endpoint: str
    replay_endpoint: str | None
    interval: float  # the pause before the next replay after a failed one (doubles)
    stats: StreamStats = field(default_factory=StreamStats)
    buffer: deque[tuple[int, bytes]] = field(default_factory=deque)
    replay: _Replay | None = None
    next_resync_at: float = 0.0
    was_synced: bool = False
    ever_synced: bool = False  # during the current run of its task (resets the restart backoff)
    bad_log: RateLimitedLog | None = None  # at most one "bad message" line per worker a minute

    def clear_buffer(self) -> None:
        self.buffer.clear()
        self.stats.buffered_batches = self.stats.buffered_bytes = 0


class KvSubscriber:
    """Runs one supervised task per worker; ``close`` stops them and the sockets."""

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
        max_message_bytes: int = 4 << 20,
        max_replay_bytes: int = 256 << 20,
        max_pending_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._residency = residency
        self._metrics = metrics
        self._replay_timeout_s = replay_timeout_s
        self._resync_interval_s = resync_interval_s
        self._max_resync_interval_s = max_resync_interval_s
        self._max_message_bytes = max_message_bytes
        self._max_replay_bytes = max_replay_bytes
        self._max_pending_bytes = max_pending_bytes
        self._clock = clock
        self._streams = {
            worker: _Stream(worker, endpoint, replay_endpoints.get(worker), resync_interval_s)
            for worker, endpoint in endpoints.items()
        }
        self._static = frozenset(endpoints)
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ending: set[asyncio.Task[None]] = set()  # tasks of workers that left, until they stop
        self._started = False

    @classmethod
    def from_settings(
        cls, residency: Residency, kv: KvEventSettings, metrics: GatewayMetrics
    ) -> KvSubscriber:
        return cls(
            residency,
            kv.endpoints,
            kv.replay_endpoints,
            metrics,
            replay_timeout_s=kv.replay_timeout_s,
            max_message_bytes=kv.max_message_bytes,
            max_replay_bytes=kv.max_replay_bytes,
            max_pending_bytes=kv.max_pending_bytes,
        )

    def stats(self, worker: str) -> StreamStats:
        return self._streams[worker].stats

    def start(self) -> None:
        self._started = True
        for stream in self._streams.values():
            self._launch(stream)

    def _launch(self, stream: _Stream) -> None:
        self._publish(stream.worker)
        self._tasks[stream.worker] = asyncio.create_task(
            self._supervise(stream), name=f"kv-events-{stream.worker}"
        )

    def follow(self, worker: str, endpoint: str, replay_endpoint: str | None) -> None:
        """A registered worker's publisher (residency.py rule 4)."""
        current = self._streams.get(worker)
        if current is not None and (current.endpoint, current.replay_endpoint) == (endpoint, replay_endpoint):
            return
        if worker in self._static:
            return  # the settings name its publisher; a registration does not move it
        self.unfollow(worker)
        self._residency.track(worker)
        stream = _Stream(worker, endpoint, replay_endpoint, self._resync_interval_s)
        self._streams[worker] = stream
        _log.info("kv events of %s: following %s", worker, endpoint)
        if self._started:
            self._launch(stream)

    def unfollow(self, worker: str) -> None:
        """A registered worker left the pool (residency.py rule 4)."""
        if worker in self._static or self._streams.pop(worker, None) is None:
            return
        task = self._tasks.pop(worker, None)
        if task is not None:
            task.cancel()
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)
        self._residency.untrack(worker)
        for gauge in (self._metrics.kv_tracked_blocks, self._metrics.kv_events_synced):
            with contextlib.suppress(KeyError):
                gauge.remove(worker)
        _log.info("kv events of %s: no longer followed (the worker left)", worker)

    def followed(self) -> list[str]:
        return list(self._streams)

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._ending]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.term()

    # ------------------------------------------------------------------ the task and its restarts

    async def _supervise(self, s: _Stream) -> None:
        pause = self._resync_interval_s
        while True:
            s.ever_synced = False
            try:
                await self._follow(s)
            except Exception:  # a bug or a broken socket: never a silent death (cancellation passes)
                if s.ever_synced:
                    pause = self._resync_interval_s
                self._error(s, "subscriber_restart")
                self._residency.lost(s.worker)
                s.was_synced = False
                self._publish(s.worker)
                _log.exception(
                    "kv events of %s: the subscriber failed; restarting it in %.3g s (routing on belief)",
                    s.worker,
                    pause,
                )
                await asyncio.sleep(pause)
                pause = min(2 * pause, self._max_resync_interval_s)

    async def _follow(self, s: _Stream) -> None:
        sub = self._ctx.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sub.connect(s.endpoint)
            s.next_resync_at = self._clock()
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            polled: _Replay | None = None  # the replay whose socket the poller watches
            while True:
                self._maybe_start_replay(s)
                replay = s.replay
                if polled is not replay:
                    if polled is not None:
                        poller.unregister(polled.sock)  # closed already: only forgotten here
                    if replay is not None:
                        poller.register(replay.sock, zmq.POLLIN)
                    polled = replay
                ready = dict(await poller.poll(self._poll_timeout_ms(s)))
                if monitor in ready:
                    self._connection_event(s, sub, await monitor.recv_multipart())
                if sub in ready:
                    await self._live(s, await sub.recv_multipart())
                if replay is not None and replay is s.replay and replay.sock in ready:
                    await self._replayed(s, replay, await replay.sock.recv_multipart())
                if s.replay is not None and self._clock() >= s.replay.deadline:
                    self._give_up(
                        s, "replay_timeout", f"the replay sent nothing for {self._replay_timeout_s:g} s"
                    )
                self._transition(s)
        finally:
            self._drop_replay(s)
            s.clear_buffer()
            if monitor is not None:
                monitor.close(linger=0)
            sub.close(linger=0)

    def _poll_timeout_ms(self, s: _Stream) -> float | None:
        if s.replay is not None:
            at = s.replay.deadline
        elif self._wants_replay(s):
            at = s.next_resync_at
        else:
            return None
        return max(0.0, (at - self._clock()) * 1000)

    def _transition(self, s: _Stream) -> None:
        synced = self._residency.synced(s.worker)
        if synced != s.was_synced:
            _log.info("kv events of %s: %s", s.worker, "synced" if synced else "unsynced")
            s.was_synced = synced
        s.ever_synced = s.ever_synced or synced
        self._publish(s.worker)

    def _publish(self, worker: str) -> None:
        self._metrics.kv_tracked_blocks.labels(worker).set(self._residency.tracked_blocks(worker))
        self._metrics.kv_events_synced.labels(worker).set(1 if self._residency.synced(worker) else 0)

    def _error(self, s: _Stream, kind: str) -> None:
        self._metrics.kv_event_errors.labels(s.worker, kind).inc()

    # ------------------------------------------------------------------ the live stream

    def _connection_event(self, s: _Stream, sub: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self._error(s, "connection_lost")
            if self._residency.synced(s.worker):
                self._lost(s, "connection lost")
            # libzmq does not reconnect after a protocol error (a frame over max_message_bytes).
            with contextlib.suppress(zmq.ZMQError):
                sub.disconnect(s.endpoint)
            sub.connect(s.endpoint)
        elif event["event"] == zmq.EVENT_CONNECTED and not self._residency.synced(s.worker):
            s.next_resync_at = self._clock()  # a (re)started publisher: resync at once

    async def _live(self, s: _Stream, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise KvEventError(f"expected 3 frames, got {len(frames)}")
            seq, batch = decode_seq(frames[1]), decode_batch(frames[2])
        except Exception as exc:  # whatever the decoder raised
            self._bad(s, exc)
            return
        if s.replay is not None:
            if seq != 0:
                self._hold(s, seq, frames[2])
                return
            self._give_up(s, None, "its publisher restarted (seq 0): the live stream is complete")
        await self._apply(s, seq, batch)

    async def _apply(self, s: _Stream, seq: int, batch: EventBatch) -> None:
        applied = self._residency.admit(s.worker, seq)
        if applied is Applied.GAP:
            self._metrics.kv_event_gaps.labels(s.worker).inc()
        elif applied in (Applied.OK, Applied.RESTART):
            self._metrics.kv_events.labels(s.worker).inc(len(batch.events))
            await self._apply_events(s, batch.events)

    async def _apply_events(self, s: _Stream, events: Sequence[KvEvent]) -> None:
        for start in range(0, len(events), _SLICE):
            if start:
                await asyncio.sleep(0)
            self._residency.apply_events(s.worker, events[start : start + _SLICE])

    def _hold(self, s: _Stream, seq: int, payload: bytes) -> None:
        """A live batch that arrived while the replay is pending, for after it."""
        st = s.stats
        if st.buffered_bytes + len(payload) > self._max_pending_bytes:
            self._give_up(
                s,
                "buffer_over_cap",
                f"live batches held during the replay passed max_pending_bytes ({self._max_pending_bytes})",
            )
            return
        s.buffer.append((seq, payload))
        st.buffered_batches += 1
        st.buffered_bytes += len(payload)
        st.peak_buffered_bytes = max(st.peak_buffered_bytes, st.buffered_bytes)

    def _bad(self, s: _Stream, exc: Exception) -> None:
        """A message that does not decode: a lost batch, counted, logged at most once a minute."""
        s.stats.bad_messages += 1
        self._error(s, "bad_message")
        if self._residency.synced(s.worker):
            self._metrics.kv_event_gaps.labels(s.worker).inc()
            self._residency.lost(s.worker)
        if s.bad_log is None:
            s.bad_log = RateLimitedLog(_log, interval_s=_BAD_LOG_INTERVAL_S, clock=self._clock)
        detail = " ".join(str(exc).split())[:_DETAIL_CHARS]
        s.bad_log.log(
            "kv events of %s: bad message (%s: %s); routing on belief until a full resync",
            s.worker,
            type(exc).__name__,
            detail,
        )

    def _lost(self, s: _Stream, why: str) -> None:
        self._metrics.kv_event_gaps.labels(s.worker).inc()
        self._residency.lost(s.worker)
        _log.warning("kv events of %s: %s; routing on belief until a full resync", s.worker, why)

    # ------------------------------------------------------------------ the replay (full resync)

    def _wants_replay(self, s: _Stream) -> bool:
        return s.replay_endpoint is not None and not self._residency.synced(s.worker)

    def _maybe_start_replay(self, s: _Stream) -> None:
        if s.replay is not None or not self._wants_replay(s) or self._clock() < s.next_resync_at:
            return
        assert s.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        s.replay = _Replay(sock, self._clock() + self._replay_timeout_s)
        s.stats.replay_bytes = 0
        self._residency.begin_resync(s.worker)
        sock.connect(s.replay_endpoint)
        try:
            sock.send_multipart((b"", encode_seq(0)), flags=zmq.NOBLOCK)
        except zmq.Again:
            self._give_up(s, "replay_timeout", "the replay socket takes no request")

    async def _replayed(self, s: _Stream, replay: _Replay, frames: list[bytes]) -> None:
        st = s.stats
        try:
            if len(frames) != 4:
                raise KvEventError(f"a replay message has 4 frames, got {len(frames)}")
            if frames[2] == END_SEQ:
                await self._replay_done(s, replay)
                return
            st.replay_bytes += len(frames[3])
            st.peak_replay_bytes = max(st.peak_replay_bytes, st.replay_bytes)
            if st.replay_bytes > self._max_replay_bytes:
                self._give_up(
                    s,
                    "replay_over_cap",
                    f"the replay sent over max_replay_bytes ({self._max_replay_bytes}) without its end",
                )
                return
            seq = decode_seq(frames[2])
            if seq != replay.next_seq:
                self._give_up(
                    s,
                    "replay_incomplete",
                    f"the replay has seq {seq} where {replay.next_seq} was due (its buffer lost the start)",
                )
                return
            batch = decode_batch(frames[3])
        except Exception as exc:  # whatever the decoder raised
            self._bad(s, exc)
            self._give_up(s, "replay_incomplete", "the replay sent a bad message")
            return
        replay.next_seq += 1
        replay.deadline = self._clock() + self._replay_timeout_s
        await self._apply_events(s, batch.events)

    async def _replay_done(self, s: _Stream, replay: _Replay) -> None:
        """The end marker: the live batches held meanwhile continue the replay. The worker is synced
        once they are all applied (until then residency answers None, never a set that lags)."""
        self._drop_replay(s)
        held = list(s.buffer)
        s.clear_buffer()
        next_seq = replay.next_seq
        for seq, payload in held:
            if seq < next_seq:
                continue  # the replay had it
            try:
                if seq > next_seq:
                    raise KvEventError(f"the held live batches jump from seq {next_seq} to {seq}")
                batch = decode_batch(payload)
            except KvEventError as exc:
                self._metrics.kv_event_gaps.labels(s.worker).inc()
                self._residency.lost(s.worker)
                self._retry_later(s, None, f"after the replay, {exc}")
                return
            self._metrics.kv_events.labels(s.worker).inc(len(batch.events))
            await self._apply_events(s, batch.events)
            next_seq += 1
        self._residency.end_resync(s.worker, next_seq)
        s.interval = self._resync_interval_s
        s.next_resync_at = self._clock() + self._resync_interval_s  # at most one per interval

    def _give_up(self, s: _Stream, kind: str | None, why: str) -> None:
        """Drop the pending replay and what was held for it; unsynced. ``kind`` None: not a failure
        (the live stream made it unnecessary), else counted, logged, and retried after a pause."""
        if s.replay is None:
            return
        self._drop_replay(s)
        s.clear_buffer()
        self._residency.lost(s.worker)
        if kind is None:
            _log.info("kv events of %s: resync dropped, %s", s.worker, why)
            s.next_resync_at = self._clock()
            return
        self._retry_later(s, kind, why)

    def _retry_later(self, s: _Stream, kind: str | None, why: str) -> None:
        if kind is not None:
            self._error(s, kind)
        _log.warning(
            "kv events of %s: %s; resync given up (routing on belief), next in %.3g s",
            s.worker,
            why,
            s.interval,
        )
        s.next_resync_at = self._clock() + s.interval
        s.interval = min(2 * s.interval, self._max_resync_interval_s)

    def _drop_replay(self, s: _Stream) -> None:
        if s.replay is not None:
            s.replay.sock.close(linger=0)
            s.replay = None
