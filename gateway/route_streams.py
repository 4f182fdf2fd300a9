"""The gateway's RouteStreams: a small pool of long-lived streams on the decision channel, requests
spread over them, each answered first-in-first-out on the stream it was written to.

Why a pool (docs/performance/services.md, "The decision transport, side by side"): a stream is one
call, so gRPC's `round_robin` (or Envoy) places it on one backend for its whole life, where unary
calls are spread one by one. `stream_pool_size` holds one stream per address the target names or
resolves to at start-up (`decision.streams = 0`; a positive value is taken as it is), and
round_robin puts each new stream on the next ready backend. Requests take the streams in turn.
- Every stream is retired after `decision.stream_max_age_s` on the injected clock, and at once once
  a request on it timed out: it takes no new requests, is half-closed (its waiters are still
  answered) and the next request opens its successor, which round_robin places on the next backend.
  So streams opened while only one backend was ready, or before a scale-up, spread again, and a
  stream stuck behind a slow answer or a frozen backend does not hold up the requests after it.
- A stream that ends (its backend went away, a proxy reset it, the service ended it) leaves its slot
  at once; the next request on the slot opens a new one, with no pause (as a unary call would be
  tried). Its unanswered requests get a `StreamEnd`, which the caller may retry once on a new stream.
- A stream that ends with the service's no-table status (UNAVAILABLE with trailing metadata
  `ppd-unavailable: no-table`, ppd/decision/v1/status.py) is an answer, not a break: `not_serving`,
  never retried, exactly as for a unary call.
- Only when opening itself keeps failing (`FAILED_OPENS_BEFORE_BACKOFF` streams in a row ended before
  their first answer) does the pool pause opening, `BACKOFF_FIRST_S` doubling up to `BACKOFF_MAX_S`;
  `paused()` tells the caller to make unary calls meanwhile, so the service's return is seen by the
  next request. The first answer on a stream ends the backoff.
A request never touches a call from its own task: it queues itself on the stream, whose one writer
task writes (a cancelled write would cancel the call for every request on it), and waits for its
answer, matched first-in-first-out by the stream's reader task.
Talks gRPC only; every time comes from the injected clock.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from gateway.types import Clock
from ppd.decision.v1 import decision_pb2, decision_pb2_grpc
from ppd.decision.v1.status import UNAVAILABLE_CAUSE_KEY, UNAVAILABLE_NO_TABLE

__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "FAILED_OPENS_BEFORE_BACKOFF",
    "RouteStreams",
    "StreamEnd",
    "no_table",
    "reopen_delays",
    "stream_pool_size",
]

log = logging.getLogger(__name__)
FAILED_OPENS_BEFORE_BACKOFF = 3
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 2.0

_Call = grpc.aio.StreamStreamCall[decision_pb2.RouteRequest, decision_pb2.RouteResponse]
_Waiter = asyncio.Future["decision_pb2.RouteResponse | StreamEnd"]


def reopen_delays(first_s: float, most_s: float) -> Iterator[float]:
    """Pauses before successive re-opens: first_s, doubling, never above most_s."""
    delay = first_s
    while True:
        yield min(delay, most_s)
        delay = min(delay * 2.0, most_s)


def no_table(exc: grpc.aio.AioRpcError) -> bool:
    """Whether an UNAVAILABLE carries the service's no-table cause (read from trailing metadata only)."""
    trailing = exc.trailing_metadata() or ()
    return any(key == UNAVAILABLE_CAUSE_KEY and value == UNAVAILABLE_NO_TABLE for key, value in trailing)


def stream_pool_size(target: str, lb_policy: str) -> int:
    """One stream per address `target` names (`ipv4:`/`ipv6:` lists) or resolves to now (a name,
    `dns:` included); 1 for `pick_first` (it uses one address), a unix socket or a name that does not
    resolve. Blocks on DNS: call it off the event loop."""
    if lb_policy == "pick_first":
        return 1
    scheme, _, rest = target.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return max(1, sum(1 for address in rest.split(",") if address))
    if scheme in ("unix", "unix-abstract", "vsock"):
        return 1
    name = target
    if scheme == "dns":  # dns:host:port, dns:///host:port, dns://authority/host:port
        name = rest.removeprefix("//")
        if "/" in name:
            name = name.split("/", 1)[1]
    host, port = name, "443"
    if name.startswith("["):
        host, _, tail = name[1:].partition("]")
        port = tail.removeprefix(":") or port
    elif name.count(":") == 1:
        host, port = name.split(":")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return 1
    return max(1, len({info[4][:2] for info in infos}))


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """Why a request written to a stream got no answer on it: the outcome the caller reports
    (`not_serving`, `unavailable`, `error`) and whether it may try once more on a new stream."""

    outcome: str
    retry: bool


_CLOSED_UNANSWERED = StreamEnd("unavailable", retry=True)  # the stream ended with OK, requests left
_CLIENT_CLOSED = StreamEnd("unavailable", retry=False)


def _end_of(exc: grpc.aio.AioRpcError) -> StreamEnd:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE and no_table(exc):
        return StreamEnd("not_serving", retry=False)
    return StreamEnd("unavailable" if code == grpc.StatusCode.UNAVAILABLE else "error", retry=True)


async def _write(stream: _Stream) -> None:
    """A stream's one writer: its requests in order, then (at None) the half-close."""
    call = stream.call
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        while (request := await stream.outbox.get()) is not None:
            await call.write(request)
        await call.done_writing()
    # Past a write that failed the call has ended: its reader answers every waiter with the end.


class _Stream:
    """One open RouteStream: its call, its requests not yet written (`outbox`, in order; None asks the
    writer to half-close), those not yet answered (`waiters`, the same order), its reader and writer
    tasks, how it ended (None while open), and whether a request on it timed out (stale)."""

    __slots__ = (
        "answered", "call", "end", "opened_at", "outbox", "reader", "retired", "slot", "stale", "waiters",
        "writer",
    )  # fmt: skip

    def __init__(self, call: _Call, slot: int, opened_at: float) -> None:
        self.call = call
        self.slot = slot
        self.opened_at = opened_at
        self.outbox: asyncio.Queue[decision_pb2.RouteRequest | None] = asyncio.Queue()
        self.waiters: collections.deque[_Waiter] = collections.deque()
        self.reader: asyncio.Task[None] | None = None
        self.writer: asyncio.Task[None] | None = None
        self.end: StreamEnd | None = None
        self.answered = False
        self.retired = False
        self.stale = False


class RouteStreams:
    """`size` RouteStreams over one stub, opened on first use; see the module docstring."""

    def __init__(
        self,
        stub: decision_pb2_grpc.DecisionServiceAsyncStub,
        size: int,
        *,
        max_age_s: float,
        clock: Clock,
    ) -> None:
        self._stub = stub
        self._clock = clock
        self._max_age_s = max_age_s
        self._slots: list[_Stream | None] = [None] * max(1, size)
        self._streams: set[_Stream] = set()  # every stream whose reader still runs (retired ones too)
        self._turn = 0
        self._failed_opens = 0
        self._delays = reopen_delays(BACKOFF_FIRST_S, BACKOFF_MAX_S)
        self._paused_until = float("-inf")
        self._closing = False

    @property
    def size(self) -> int:
        return len(self._slots)

    def paused(self) -> bool:
        """True while opening streams backs off (FAILED_OPENS_BEFORE_BACKOFF failed opens in a row)."""
        return self._clock() < self._paused_until

    async def send(self, request: decision_pb2.RouteRequest) -> decision_pb2.RouteResponse | StreamEnd:
        """Queues `request` on the next stream and waits for its answer, or for the stream's end.
        No deadline of its own: the caller bounds it (a late answer resolves a future nobody awaits).
        The request's task never touches the call: grpc.aio cancels a call whose write is cancelled,
        which would end the stream for every request on it and raise CancelledError in the next one
        to write (read as its client leaving). The stream's writer task writes instead."""
        slot = self._turn
        self._turn = (slot + 1) % len(self._slots)
        stream = self._current(slot)
        waiter: _Waiter = asyncio.get_running_loop().create_future()
        stream.waiters.append(waiter)  # no await between these two: answers stay in request order
        stream.outbox.put_nowait(request)
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            # Its deadline passed (or its client left): the stream may be stuck behind a slow answer
            # or a frozen backend, where a unary call would start afresh. It takes no new requests.
            stream.stale = True
            raise

    def _current(self, slot: int) -> _Stream:
        stream = self._slots[slot]
        if stream is not None and stream.end is None:
            if not stream.stale and self._clock() - stream.opened_at < self._max_age_s:
                return stream
            # Retired: no new requests; its writer half-closes it after the requests it holds, so the
            # service answers those and ends it (a frozen backend holds up only that stream).
            self._slots[slot] = None
            stream.retired = True
            stream.outbox.put_nowait(None)
        call: _Call = self._stub.RouteStream()
        stream = _Stream(call, slot, self._clock())
        stream.reader = asyncio.create_task(self._read(stream), name=f"route-stream-{slot}-read")
        stream.writer = asyncio.create_task(_write(stream), name=f"route-stream-{slot}-write")
        self._slots[slot] = stream
        self._streams.add(stream)
        return stream

    async def _read(self, stream: _Stream) -> None:
        end = _CLOSED_UNANSWERED
        try:
            async for response in stream.call:
                if not stream.answered:
                    stream.answered = True
                    self._opened()
                waiter = stream.waiters.popleft() if stream.waiters else None
                if waiter is not None and not waiter.done():
                    waiter.set_result(response)
        except grpc.aio.AioRpcError as exc:
            end = _end_of(exc)
        except asyncio.CancelledError:
            end = _CLIENT_CLOSED
            raise
        except Exception:  # not gRPC's own failure: one line per stream, its requests may retry
            log.exception("RouteStream reader failed")
            end = StreamEnd("error", retry=True)
        finally:
            stream.end = end
            stream.outbox.put_nowait(None)  # its writer, if waiting for a request, ends too
            self._streams.discard(stream)
            if self._slots[stream.slot] is stream:
                self._slots[stream.slot] = None
            if not (stream.answered or stream.retired or self._closing or end.outcome == "not_serving"):
                self._failed_open()
            waiters, stream.waiters = stream.waiters, collections.deque()
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(end)

    def _opened(self) -> None:
        if self._failed_opens:
            self._failed_opens = 0
            self._delays = reopen_delays(BACKOFF_FIRST_S, BACKOFF_MAX_S)
            self._paused_until = float("-inf")

    def _failed_open(self) -> None:
        self._failed_opens += 1
        if self._failed_opens >= FAILED_OPENS_BEFORE_BACKOFF:
            self._paused_until = self._clock() + next(self._delays)

    async def close(self) -> None:
        self._closing = True
        streams = list(self._streams)
        for stream in streams:
            stream.call.cancel()
        for stream in streams:
            for task in (stream.reader, stream.writer):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
