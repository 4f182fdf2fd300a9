"""Admission control on the event loop: the request core (core.py) passes each request through this
gate before it is served; the policy itself (what waits, in which order, what is shed) is the pure
`ppd.admission.AdmissionQueue`, shared with the virtual-time simulator.

Rule 1: `enter` returns a `Ticket` once the request is admitted (at once, or when a finished request
makes room), or raises `TooManyRequestsError` (429 with Retry-After, an OpenAI-style error on both
front doors) when it is shed: the queue is full, a higher-priority request displaced it, or it waited
past its class's bound.
Rule 2: every ticket is left exactly once (`leave`), served or failed; the in-flight bound is
`AdmissionSettings.limit` of the live decode and replica workers, read at every change, so the bound
follows the pool.
Rule 3: a client that leaves while queued is dropped from the queue (not counted as shed); one whose
admission raced its leaving leaves at once, so no slot is lost.
Rule 4: every shed is counted (`ppd_gateway_admission_shed_total{reason,priority}`) and its wait
observed (`ppd_gateway_admission_wait_seconds`, as every admission's); a WARNING line once a minute
at most names the last one's reason, class and tenant label (an API key only as its hash) and how
many were left out. The queue depth per class and the requests in flight are gauges.
Rule 5: the wait bounds are enforced by one loop timer set to the next deadline, and on every call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import TooManyRequestsError
from gateway.metrics import GatewayMetrics
from gateway.types import Clock
from ppd.admission import PRIORITIES, AdmissionQueue, AdmissionSettings, Admitted, Priority, Shed
from ppd.rate_limited_log import RateLimitedLog

__all__ = ["AdmissionGate", "Ticket"]

log = logging.getLogger(__name__)

_WHY = {
    "queue_full": "its queue is full",
    "displaced": "a higher-priority request took its place in the queue",
    "wait_exceeded": "it waited past its priority class's bound",
}


@dataclass(slots=True)
class Ticket:
    """One admitted request (rule 2): left once."""

    number: int
    priority: Priority
    left: bool = False


class AdmissionGate:
    def __init__(
        self,
        settings: AdmissionSettings,
        metrics: GatewayMetrics,
        *,
        clock: Clock,
        workers: Callable[[], int],
    ) -> None:
        self._s = settings
        self._queue = AdmissionQueue(settings)
        self._m = metrics
        self._clock = clock
        self._workers = workers
        self._waiting: dict[int, asyncio.Future[Admitted | Shed]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._shed_log = RateLimitedLog(log, clock=clock)
        self._gauges()

    async def enter(self, priority: Priority, tenant: str) -> Ticket:
        """Rule 1: wait for admission; TooManyRequestsError when shed."""
        now = self._clock()
        self._settle(now)
        offer = self._queue.offer(now, priority=priority, tenant=tenant, limit=self._limit())
        if offer.displaced is not None:
            self._resolve(offer.displaced)
        outcome = offer.outcome
        if isinstance(outcome, Admitted):
            self._admitted(outcome)
            self._gauges()
            return Ticket(outcome.ticket, priority)
        if isinstance(outcome, Shed):
            self._gauges()
            raise self._shed(outcome)
        future: asyncio.Future[Admitted | Shed] = asyncio.get_running_loop().create_future()
        self._waiting[outcome.ticket] = future
        self._arm(now)
        self._gauges()
        try:
            result = await future
        except asyncio.CancelledError:
            self._left_while_queued(outcome.ticket, future, priority)
            raise
        if isinstance(result, Shed):
            raise self._shed(result)
        return Ticket(result.ticket, priority)

    def leave(self, ticket: Ticket) -> None:
        """Rule 2: an admitted request ended; queued ones admitted into its room."""
        if ticket.left:
            return
        ticket.left = True
        now = self._clock()
        for admitted in self._queue.release(now, limit=self._limit()):
            self._resolve(admitted)
        self._settle(now)

    # ------------------------------------------------------------------ internals

    def _limit(self) -> int | None:
        return self._s.limit(self._workers())

    def _settle(self, now: float) -> None:
        """Rule 5 (and rule 2's bound following the pool): overdue requests shed, room filled."""
        for shed in self._queue.expire(now):
            self._resolve(shed)
        for admitted in self._queue.refill(now, limit=self._limit()):
            self._resolve(admitted)
        self._arm(now)
        self._gauges()

    def _resolve(self, result: Admitted | Shed) -> None:
        """A queued request's fate, handed to its waiting `enter` (counted there for a shed one)."""
        future = self._waiting.pop(result.ticket, None)
        if isinstance(result, Admitted):
            self._admitted(result)
        if future is not None and not future.done():
            future.set_result(result)
        elif isinstance(result, Admitted):  # nobody waits for it any more (rule 3)
            self.leave(Ticket(result.ticket, result.priority))

    def _left_while_queued(
        self, ticket: int, future: asyncio.Future[Admitted | Shed], priority: Priority
    ) -> None:
        """Rule 3."""
        self._waiting.pop(ticket, None)
        if future.done() and not future.cancelled():
            result = future.result()
            if isinstance(result, Admitted):
                self.leave(Ticket(ticket, priority))
        elif self._queue.cancel(ticket):
            self._settle(self._clock())

    def _admitted(self, admitted: Admitted) -> None:
        self._m.admission_wait.labels(admitted.priority, "admitted").observe(admitted.waited_s)

    def _shed(self, shed: Shed) -> TooManyRequestsError:
        """Rule 4: counted, observed, logged (rate-limited); the client's error."""
        self._m.admission_shed.labels(shed.reason, shed.priority).inc()
        self._m.admission_wait.labels(shed.priority, "shed").observe(shed.waited_s)
        self._shed_log.log(
            "admission control shed a request (%s, priority %s, tenant %s, %d in flight, %d queued)",
            shed.reason, shed.priority, shed.tenant, self._queue.inflight, self._queue.depth(),
        )  # fmt: skip
        return TooManyRequestsError(
            f"the gateway is at capacity and shed this {shed.priority}-priority request ({shed.reason}: "
            f"{_WHY[shed.reason]}); retry after {shed.retry_after_s} s",
            retry_after_s=shed.retry_after_s,
        )

    def _arm(self, now: float) -> None:
        """Rule 5: the timer at the next deadline (none while nothing waits)."""
        due = self._queue.next_deadline()
        if due == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, due
        if due is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, due - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self._settle(self._clock())

    def _gauges(self) -> None:
        for p in PRIORITIES:
            self._m.admission_queue_depth.labels(p).set(self._queue.depth(p))
        self._m.admission_inflight.set(self._queue.inflight)
