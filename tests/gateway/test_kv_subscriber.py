"""gateway/kv_subscriber.py against a broken KV event stream (issue 24, items 10-12): a real ZMQ
publisher and replay socket on 127.0.0.1 driven by the test, the real subscriber and residency.

The publisher is an XPUB (vLLM's is a PUB; the wire is the same) so the test knows when the
subscriber's subscription arrived instead of racing ZMQ's slow joiner. Every wait is a condition
polled with a generous deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import msgpack
import pytest
import zmq
import zmq.asyncio

from gateway.kv_subscriber import KvSubscriber
from gateway.metrics import GatewayMetrics
from gateway.residency import Residency
from ppd.kv_events import END_SEQ, BlockStored, EventBatch, KvEvent, encode_batch, encode_seq
from tests.support.metrics import sample
from tests.support.polling import eventually

# A batch whose event map is keyed by an array: msgpack raises TypeError (unhashable), not ValueError.
UNHASHABLE_KEY = msgpack.packb([0.0, [{(1, 2): 1}], 0])


def stored(*hashes: int) -> bytes:
    return encode_batch(EventBatch(0.0, (BlockStored(hashes, None, (), 16),), 0))


class Publisher:
    """vLLM's framing: ``(topic, seq, payload)`` live, and a ROUTER replay socket whose behaviour the
    test picks: ``answer`` (the history from the asked seq, then END_SEQ), ``silent`` (never answers),
    ``gated`` (the history as it was when asked, sent once ``release`` is set), ``endless`` (batches
    from seq 0 without an end marker, ``endless_bytes`` of them, then silence)."""

    def __init__(self, replay: str = "answer", *, endless_bytes: int = 0) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        self.mode = replay
        self.endless_bytes = endless_bytes
        self.history: list[tuple[int, bytes]] = []
        self.subscriptions = 0
        self.replays = 0
        self.release = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._serve()), loop.create_task(self._watch())]

    @property
    def endpoint(self) -> str:
        return self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str:
        return self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    async def send(self, seq: int, payload: bytes, *, live: bool = True, keep: bool = True) -> None:
        if keep:
            self.history.append((seq, payload))
        if live:
            await self.pub.send_multipart((b"", encode_seq(seq), payload))

    async def _watch(self) -> None:
        while True:
            if (await self.pub.recv())[:1] == b"\x01":
                self.subscriptions += 1

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            if self.mode == "silent":
                continue
            if self.mode == "endless":
                sent, seq = 0, 0
                while sent < self.endless_bytes:
                    payload = stored(*range(seq * 1000, seq * 1000 + 1000))
                    await self.router.send_multipart((client, b"", b"", encode_seq(seq), payload))
                    sent, seq = sent + len(payload), seq + 1
                continue
            snapshot = [(s, p) for s, p in self.history if s >= first]
            if self.mode == "gated":
                await self.release.wait()
            for seq, payload in snapshot:
                await self.router.send_multipart((client, b"", b"", encode_seq(seq), payload))
            await self.router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


@asynccontextmanager
async def following(
    pub: Publisher,
    *,
    replay: bool = True,
    residency: Residency | None = None,
    endpoint: str | None = None,
    **options: float,
) -> AsyncIterator[tuple[KvSubscriber, Residency, GatewayMetrics]]:
    residency = residency or Residency(["D0"], max_blocks=1_000_000)
    metrics = GatewayMetrics()
    sub = KvSubscriber(
        residency,
        {"D0": endpoint or pub.endpoint},
        {"D0": pub.replay_endpoint} if replay else {},
        metrics,
        **{"resync_interval_s": 0.05, **options},  # type: ignore[arg-type]
    )
    sub.start()
    try:
        yield sub, residency, metrics
    finally:
        await sub.close()


async def holds(check: Callable[[], bool], what: str) -> None:
    async def probe() -> bool:
        return check()

    await eventually(probe, what=what)


def errors(metrics: GatewayMetrics, kind: str, worker: str = "D0") -> float:
    return (
        sample(metrics.registry, "ppd_gateway_kv_event_errors_total", {"worker": worker, "kind": kind}) or 0.0
    )


def synced_gauge(metrics: GatewayMetrics, worker: str = "D0") -> float | None:
    return sample(metrics.registry, "ppd_gateway_kv_events_synced", {"worker": worker})


# ------------------------------------------------------------------ 10: a message that does not decode


async def test_a_batch_that_does_not_decode_is_a_bad_message_and_the_replay_repairs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.kv_subscriber")
    pub = Publisher()
    try:
        async with following(pub) as (_, residency, metrics):
            await holds(lambda: pub.subscriptions >= 1 and residency.synced("D0"), "subscribed and synced")
            await pub.send(0, stored(10))
            await holds(lambda: residency.resident_blocks("D0", [10]) == 1, "batch 0 applied")
            # Batch 1 reaches the gateway mangled (the replay keeps the good copy), five times over.
            await pub.send(1, stored(11), live=False)
            for _ in range(5):
                await pub.send(1, UNHASHABLE_KEY, keep=False)
            await holds(lambda: errors(metrics, "bad_message") == 5, "five bad messages counted")
            await pub.send(2, stored(12))
            await holds(
                lambda: residency.resident_blocks("D0", [10, 11, 12]) == 3 and synced_gauge(metrics) == 1,
                "resynced from the replay and following the stream again",
            )
            await pub.send(3, stored(13))
            await holds(lambda: residency.resident_blocks("D0", [13]) == 1, "batch 3 applied")
    finally:
        await pub.close()
    bad = [r for r in caplog.records if "bad message" in r.getMessage()]
    assert len(bad) == 1, [r.getMessage() for r in bad]  # rate-limited: one line for five
    assert "unhashable" in bad[0].getMessage()


class FailsOnce(Residency):
    """A residency with a bug that strikes once: the subscriber's task dies while applying a batch."""

    def __init__(self) -> None:
        super().__init__(["D0"], max_blocks=100)
        self.armed = False

    def apply_events(self, worker: str, events: Sequence[KvEvent]) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("injected bug")
        super().apply_events(worker, events)


async def test_a_subscriber_task_that_dies_is_restarted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.kv_subscriber")
    pub = Publisher()
    residency = FailsOnce()
    try:
        async with following(pub, residency=residency) as (_, _, metrics):
            await holds(lambda: pub.subscriptions >= 1 and residency.synced("D0"), "subscribed and synced")
            await pub.send(0, stored(1))
            await holds(lambda: residency.resident_blocks("D0", [1]) == 1, "batch 0 applied")
            residency.armed = True
            await pub.send(1, stored(2))
            await holds(lambda: errors(metrics, "subscriber_restart") == 1, "the restart counted")
            await holds(
                lambda: residency.resident_blocks("D0", [1, 2]) == 2 and synced_gauge(metrics) == 1,
                "the restarted task resynced (batch 1 from the replay)",
            )
            await pub.send(2, stored(3))
            await holds(lambda: residency.resident_blocks("D0", [3]) == 1, "following again")
    finally:
        await pub.close()
    restarts = [r for r in caplog.records if "restarting" in r.getMessage()]
    assert len(restarts) == 1
    assert restarts[0].exc_info is not None
    assert "injected bug" in str(restarts[0].exc_info[1])


async def test_a_worker_whose_task_keeps_dying_is_unsynced_and_retried_with_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.kv_subscriber")
    pub = Publisher()
    try:
        # Not a ZMQ endpoint: connecting raises, every time.
        async with following(pub, endpoint="not-an-endpoint") as (_, residency, metrics):
            await holds(lambda: errors(metrics, "subscriber_restart") >= 3, "three restarts")
            assert synced_gauge(metrics) == 0
            assert residency.resident_blocks("D0", [1]) is None
    finally:
        await pub.close()
    restarts = [r.getMessage() for r in caplog.records if "restarting" in r.getMessage()]
    assert len(restarts) >= 3
    assert ["0.05 s" in restarts[0], "0.1 s" in restarts[1], "0.2 s" in restarts[2]] == [True] * 3


# ------------------------------------------------------------------ 11: a replay that never answers


async def test_a_replay_that_never_answers_does_not_hold_up_the_live_stream() -> None:
    pub = Publisher("silent")
    try:
        async with following(pub, replay_timeout_s=3600.0) as (_, residency, metrics):
            await holds(lambda: pub.subscriptions >= 1 and pub.replays >= 1, "subscribed, replay asked")
            assert not residency.synced("D0")
            assert synced_gauge(metrics) == 0
            # A fresh publisher: its stream from seq 0 is complete without the replay.
            for seq in range(16):
                await pub.send(seq, stored(100 + seq))
            await holds(
                lambda: residency.resident_blocks("D0", [100 + s for s in range(16)]) == 16,
                "all 16 live batches applied while the replay is still unanswered",
            )
            assert synced_gauge(metrics) == 1
    finally:
        await pub.close()


async def test_live_batches_are_buffered_while_a_replay_is_pending_and_applied_after_it() -> None:
    pub = Publisher("gated")
    for seq in range(5):  # published before the gateway came
        await pub.send(seq, stored(seq), live=False)
    try:
        async with following(pub, replay_timeout_s=3600.0) as (sub, residency, metrics):
            await holds(lambda: pub.subscriptions >= 1 and pub.replays >= 1, "subscribed, replay asked")
            for seq in range(5, 10):
                await pub.send(seq, stored(seq))
            await holds(lambda: sub.stats("D0").buffered_batches == 5, "5 live batches received meanwhile")
            # Nothing is known while the replay is pending: no worker looks evicted.
            assert residency.resident_blocks("D0", [0]) is None
            assert synced_gauge(metrics) == 0
            pub.release.set()  # the replay sends 0..4, as it was when asked
            await holds(
                lambda: residency.resident_blocks("D0", list(range(10))) == 10 and synced_gauge(metrics) == 1,
                "the replay, then the buffered live batches, applied in order",
            )
            assert sub.stats("D0").buffered_batches == 0
            await pub.send(10, stored(10))
            await holds(lambda: residency.resident_blocks("D0", [10]) == 1, "following live")
    finally:
        await pub.close()


async def test_the_worker_is_synced_only_once_the_replay_and_the_held_batches_are_all_applied() -> None:
    pub = Publisher("gated")
    await pub.send(0, stored(0), live=False)
    big = 5000  # events per held batch: applied in several slices, the event loop runs between them
    expected = [0]
    stale: list[int] = []

    async def watch(residency: Residency) -> None:
        while True:
            if residency.synced("D0") and residency.resident_blocks("D0", expected) != len(expected):
                stale.append(residency.tracked_blocks("D0"))
            await asyncio.sleep(0)

    try:
        async with following(pub, replay_timeout_s=3600.0) as (sub, residency, _):
            await holds(lambda: pub.subscriptions >= 1 and pub.replays >= 1, "subscribed, replay asked")
            for seq in range(1, 5):
                hashes = range(seq * big, seq * big + big)
                batch = EventBatch(0.0, tuple(BlockStored((h,), None, (), 16) for h in hashes), 0)
                await pub.send(seq, encode_batch(batch))
                expected.extend(hashes)
            await holds(lambda: sub.stats("D0").buffered_batches == 4, "4 live batches held")
            watcher = asyncio.get_running_loop().create_task(watch(residency))
            try:
                pub.release.set()
                await holds(lambda: residency.synced("D0"), "synced")
                assert residency.resident_blocks("D0", expected) == len(expected)
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
    finally:
        await pub.close()
    assert not stale, f"synced while {len(stale)} looks saw only part of the held batches"


async def test_live_batches_past_the_buffer_cap_abandon_the_pending_replay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.kv_subscriber")
    pub = Publisher("gated")
    cap = 4 * len(stored(*range(1000)))
    try:
        async with following(pub, replay_timeout_s=3600.0, max_pending_bytes=cap) as (
            sub,
            residency,
            metrics,
        ):
            await holds(lambda: pub.subscriptions >= 1 and pub.replays >= 1, "subscribed, replay asked")
            for seq in range(1, 30):  # joined late: seq 0 was missed, the replay is needed
                await pub.send(seq, stored(*range(seq * 1000, seq * 1000 + 1000)))
            await holds(lambda: errors(metrics, "buffer_over_cap") >= 1, "the buffer cap reached")
            assert sub.stats("D0").peak_buffered_bytes <= cap
            assert not residency.synced("D0")
    finally:
        await pub.close()
    assert any("max_pending_bytes" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ 12: bounded bytes


async def test_a_replay_without_an_end_marker_is_abandoned_at_its_byte_cap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.kv_subscriber")
    cap = 1 << 20
    pub = Publisher("endless", endless_bytes=4 * cap)
    try:
        async with following(pub, replay_timeout_s=3600.0, max_replay_bytes=cap) as (sub, residency, metrics):
            await holds(lambda: errors(metrics, "replay_over_cap") >= 1, "the replay given up at its cap")
            stats = sub.stats("D0")
            assert cap < stats.peak_replay_bytes <= cap + len(stored(*range(1000)))
            assert stats.peak_buffered_bytes == 0  # the replay is applied as it streams, not held
            assert not residency.synced("D0")
            assert synced_gauge(metrics) == 0
    finally:
        await pub.close()
    assert any("max_replay_bytes" in r.getMessage() for r in caplog.records)


async def test_a_message_over_max_message_bytes_resets_the_connection_and_the_subscriber_recovers() -> None:
    pub = Publisher()
    limit = 64 * 1024
    huge = stored(*range(1 << 20, (1 << 20) + 20_000))
    assert len(huge) > limit
    try:
        async with following(pub, max_message_bytes=limit, replay_timeout_s=0.5) as (_, residency, metrics):
            await holds(lambda: pub.subscriptions >= 1 and residency.synced("D0"), "subscribed and synced")
            await pub.send(0, stored(1))
            await holds(lambda: residency.resident_blocks("D0", [1]) == 1, "batch 0 applied")
            subscribed = pub.subscriptions
            await pub.send(1, huge)  # over the limit: ZMQ drops the connection
            await holds(lambda: errors(metrics, "connection_lost") >= 1, "the reset counted")
            await holds(lambda: not residency.synced("D0"), "unsynced")
            # Its replay holds the huge batch too, so only a publisher restart (seq 0 again) can resync.
            await holds(lambda: pub.subscriptions > subscribed, "the subscriber reconnected")
            pub.history.clear()
            await pub.send(0, stored(7))
            await holds(
                lambda: residency.resident_blocks("D0", [7]) == 1 and synced_gauge(metrics) == 1,
                "synced again on the restarted stream",
            )
    finally:
        await pub.close()


async def test_a_large_batch_is_applied_in_slices_between_which_the_event_loop_runs() -> None:
    pub = Publisher()
    n = 20_000  # 2 MB, under max_message_bytes
    seen: set[int] = set()

    async def watch(residency: Residency) -> None:
        while True:
            seen.add(residency.tracked_blocks("D0"))
            await asyncio.sleep(0)

    try:
        async with following(pub) as (_, residency, _):
            await holds(lambda: pub.subscriptions >= 1 and residency.synced("D0"), "subscribed and synced")
            watcher = asyncio.get_running_loop().create_task(watch(residency))
            try:
                batch = EventBatch(0.0, tuple(BlockStored((h,), None, (), 16) for h in range(n)), 0)
                await pub.send(0, encode_batch(batch))
                await holds(lambda: residency.tracked_blocks("D0") == n, "the large batch applied")
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
    finally:
        await pub.close()
    assert any(0 < k < n for k in seen), "the event loop never ran while the batch was being applied"
