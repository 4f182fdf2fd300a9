"""Admission control: at most a bounded number of requests in flight, the rest waiting in a bounded
queue by priority class and fairly among tenants, or shed with a time to retry. Pure: no clock, no
event loop, no logging (every call takes ``now``, seconds on a monotonic clock); shared by the
gateway (its request core drives it) and the virtual-time simulator (the overload experiment).

Rules:

1. In flight: a request is admitted at once while fewer than ``limit`` requests are in flight and no
   queued request of its class or a higher one waits (``limit`` None: no bound; the caller computes it
   from the settings and the live workers: ``AdmissionSettings.limit``). ``release`` ends one admitted
   request and admits queued ones while there is room; ``refill`` does the same when the limit grew.
2. Order: classes are strict: every queued ``high`` request goes before any ``normal`` one, every
   ``normal`` before any ``low``. Within a class, tenants take turns by smooth weighted round robin
   (each tenant's weight from the settings, default 1): under saturation a tenant of weight w gets
   w / (sum of the waiting tenants' weights) of the admissions of that class, whatever its queue
   length. Within a tenant, first come first served.
3. Queue bound: at most ``max_queue`` requests wait. A request that finds the queue full displaces
   the newest request of the tenant holding the most queue per weight in the lowest class below its
   own, or in its own class when that tenant holds more per weight than the newcomer's tenant would
   after joining (reason ``displaced`` for the one pushed out); otherwise it is shed itself
   (``queue_full``). So a high-priority request is never shed while lower ones wait, and one
   tenant's burst cannot keep another tenant out of the queue.
4. Wait bound: a queued request still waiting ``max_wait_<class>_s`` after it arrived is shed by
   ``expire`` (``wait_exceeded``); ``next_deadline`` says when the next one falls due.
5. Retry-After: a shed request is told to retry after the time the requests ahead of it (queued at
   its class or higher, itself included) take to drain at the rate requests finished over the last
   ``rate_window_s``; the class's wait bound while nothing finished; rounded up to whole seconds and
   kept within ``retry_after_min_s`` and ``retry_after_max_s``.
6. ``cancel``: a queued request whose client left is dropped without a trace (not counted as shed).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, get_args

__all__ = [
    "PRIORITIES",
    "AdmissionQueue",
    "AdmissionSettings",
    "Admitted",
    "Offer",
    "Priority",
    "Queued",
    "Shed",
    "ShedReason",
    "TenantSettings",
    "parse_priority",
]

Priority = Literal["high", "normal", "low"]
#: Highest first: the order classes are served in (rule 2).
PRIORITIES: Final[tuple[Priority, ...]] = get_args(Priority)
ShedReason = Literal["queue_full", "wait_exceeded", "displaced"]


def parse_priority(value: str) -> Priority:
    """``value`` as a priority class; ``ValueError`` naming the classes otherwise."""
    for p in PRIORITIES:
        if value == p:
            return p
    raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantSettings:
    """One tenant's default class, the highest class it may ask for per request, and its weight."""

    priority: Priority = "normal"
    max_priority: Priority = "high"
    weight: int = 1

    def __post_init__(self) -> None:
        parse_priority(self.priority)
        parse_priority(self.max_priority)
        if type(self.weight) is not int or not 1 <= self.weight <= 1000:
            raise ValueError(f"a tenant's weight must be an integer from 1 to 1000, got {self.weight!r}")

    def priority_for(self, asked: Priority | None) -> Priority:
        """The class of a request that asked for ``asked`` (None: the tenant's default), never above
        ``max_priority``."""
        chosen = self.priority if asked is None else asked
        return PRIORITIES[max(PRIORITIES.index(chosen), PRIORITIES.index(self.max_priority))]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionSettings:
    """[admission]: off by default. Raises ``ValueError`` naming a bad value."""

    # Admission control on: bound the requests in flight, queue and shed the rest (off: forward all).
    enabled: bool = False
    # Requests in flight through this front door at most (0: no bound of its own).
    max_inflight: int = 0
    # Requests in flight at most per live decode (or replica) worker (0: no bound of its own).
    max_inflight_per_worker: int = 0
    # Requests waiting for admission at most; more are shed with 429 (0: none waits).
    max_queue: int = 256
    # Seconds a high-priority request may wait in the queue before it is shed with 429.
    max_wait_high_s: float = 30.0
    # Seconds a normal-priority request may wait in the queue before it is shed with 429.
    max_wait_normal_s: float = 10.0
    # Seconds a low-priority request may wait in the queue before it is shed with 429.
    max_wait_low_s: float = 5.0
    # Class (high, normal, low) of a request from a tenant not listed in `tenants` without X-PPD-Priority.
    default_priority: str = "normal"
    # The highest class X-PPD-Priority may ask for, for a tenant not listed in `tenants`.
    header_max_priority: str = "high"
    # Per tenant id: "key:" + the first 16 hex digits of the SHA-256 of its bearer token, or
    # "tenant:" + its X-PPD-Tenant header: { priority = "high", max_priority = "high", weight = 1 }.
    tenants: Mapping[str, TenantSettings] = field(default_factory=dict)
    # The fewest Retry-After seconds a shed request is told (rule 5).
    retry_after_min_s: int = 1
    # The most Retry-After seconds a shed request is told (rule 5).
    retry_after_max_s: int = 60
    # Seconds over which the finishing rate behind Retry-After is measured.
    rate_window_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_inflight < 0 or self.max_inflight_per_worker < 0 or self.max_queue < 0:
            raise ValueError("admission.max_inflight, max_inflight_per_worker and max_queue must be >= 0")
        for p in PRIORITIES:
            if not 0.0 < self.max_wait(p) < math.inf:
                raise ValueError(f"admission.max_wait_{p}_s must be a positive number of seconds")
        parse_priority(self.default_priority)
        parse_priority(self.header_max_priority)
        if not 0 <= self.retry_after_min_s <= self.retry_after_max_s:
            raise ValueError("need 0 <= admission.retry_after_min_s <= admission.retry_after_max_s")
        if not 0.0 < self.rate_window_s < math.inf:
            raise ValueError("admission.rate_window_s must be a positive number of seconds")

    def max_wait(self, priority: Priority) -> float:
        return {"high": self.max_wait_high_s, "normal": self.max_wait_normal_s, "low": self.max_wait_low_s}[
            priority
        ]

    def tenant(self, tenant: str) -> TenantSettings:
        """A listed tenant's settings, else the defaults (``default_priority``, ``header_max_priority``)."""
        found = self.tenants.get(tenant)
        if found is not None:
            return found
        return TenantSettings(
            priority=parse_priority(self.default_priority),
            max_priority=parse_priority(self.header_max_priority),
        )

    def limit(self, workers: int) -> int | None:
        """Rule 1's bound with ``workers`` live destination workers: the smaller of the two bounds
        that are set (at least 1 once a per-worker bound is set: a pool with no live worker is the
        request path's 503, not a queue), None when neither is."""
        bounds = []
        if self.max_inflight:
            bounds.append(self.max_inflight)
        if self.max_inflight_per_worker:
            bounds.append(max(1, workers) * self.max_inflight_per_worker)
        return min(bounds) if bounds else None


@dataclass(frozen=True, slots=True)
class Admitted:
    ticket: int
    priority: Priority
    waited_s: float


@dataclass(frozen=True, slots=True)
class Queued:
    ticket: int
    priority: Priority
    deadline: float


@dataclass(frozen=True, slots=True)
class Shed:
    ticket: int
    priority: Priority
    tenant: str
    reason: ShedReason
    retry_after_s: int
    waited_s: float


@dataclass(frozen=True, slots=True)
class Offer:
    """What became of an offered request, and the queued one it displaced (rule 3), if any."""

    outcome: Admitted | Queued | Shed
    displaced: Shed | None = None


@dataclass(slots=True)
class _Entry:
    ticket: int
    priority: Priority
    tenant: str
    arrived: float
    deadline: float


class _Class:
    """One priority class's queue: per tenant, tickets in arrival order (rule 2)."""

    __slots__ = ("by_tenant", "count", "current", "order", "size")

    def __init__(self) -> None:
        # Non-empty deques only, each starting and ending with a queued ticket (cancelled ones may
        # sit in the middle until they reach an end).
        self.by_tenant: dict[str, deque[int]] = {}
        self.count: dict[str, int] = {}  # queued tickets per tenant
        self.current: dict[str, int] = {}  # smooth weighted round robin's running scores
        self.order: deque[int] = deque()  # every ticket in arrival order (stale ones skipped): rule 4
        self.size = 0


class AdmissionQueue:
    """Rules 1-6 for one front door. Not thread-safe: one event loop (or one simulation) drives it."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self._s = settings
        self._classes: dict[Priority, _Class] = {p: _Class() for p in PRIORITIES}
        self._entries: dict[int, _Entry] = {}
        self._next_ticket = 0
        self._inflight = 0
        self._finished: deque[float] = deque()

    # ------------------------------------------------------------------ state

    @property
    def inflight(self) -> int:
        return self._inflight

    def depth(self, priority: Priority | None = None) -> int:
        """Requests waiting, in one class or in all."""
        if priority is None:
            return len(self._entries)
        return self._classes[priority].size

    def next_deadline(self) -> float | None:
        """Rule 4: when the next queued request's wait bound falls due (None: nothing queued)."""
        due: float | None = None
        for c in self._classes.values():
            while c.order and c.order[0] not in self._entries:
                c.order.popleft()
            if c.order:
                d = self._entries[c.order[0]].deadline
                due = d if due is None else min(due, d)
        return due

    # ------------------------------------------------------------------ the calls

    def offer(self, now: float, *, priority: Priority, tenant: str, limit: int | None) -> Offer:
        """A request arrives: admitted, queued or shed (rules 1 and 3)."""
        ticket = self._next_ticket
        self._next_ticket += 1
        if self._room(limit) and not any(self._classes[p].size for p in PRIORITIES[: _rank(priority) + 1]):
            self._inflight += 1
            return Offer(Admitted(ticket, priority, 0.0))
        displaced: Shed | None = None
        if len(self._entries) >= self._s.max_queue:
            victim = self._victim(priority, tenant) if self._s.max_queue else None
            if victim is None:
                return Offer(self._shed(_Entry(ticket, priority, tenant, now, now), "queue_full", now))
            self._remove(victim)
            displaced = self._shed(victim, "displaced", now)
        entry = _Entry(ticket, priority, tenant, now, now + self._s.max_wait(priority))
        self._entries[ticket] = entry
        c = self._classes[priority]
        c.by_tenant.setdefault(tenant, deque()).append(ticket)
        c.current.setdefault(tenant, 0)
        c.count[tenant] = c.count.get(tenant, 0) + 1
        c.order.append(ticket)
        c.size += 1
        return Offer(Queued(ticket, priority, entry.deadline), displaced)

    def release(self, now: float, *, limit: int | None) -> list[Admitted]:
        """One admitted request ended (served or failed): queued ones admitted into the room."""
        self._inflight = max(0, self._inflight - 1)
        self._finished.append(now)
        return self.refill(now, limit=limit)

    def refill(self, now: float, *, limit: int | None) -> list[Admitted]:
        """Queued requests admitted while there is room (rule 1), in rule 2's order."""
        admitted = []
        while self._entries and self._room(limit):
            entry = self._next()
            self._remove(entry)
            self._inflight += 1
            admitted.append(Admitted(entry.ticket, entry.priority, now - entry.arrived))
        return admitted

    def expire(self, now: float) -> list[Shed]:
        """Rule 4: the queued requests past their wait bound, shed."""
        shed = []
        for c in self._classes.values():
            while c.order:
                entry = self._entries.get(c.order[0])
                if entry is None:
                    c.order.popleft()
                    continue
                if entry.deadline > now:
                    break
                self._remove(entry)
                shed.append(self._shed(entry, "wait_exceeded", now))
        return shed

    def cancel(self, ticket: int) -> bool:
        """Rule 6: a queued request leaves; False when it is not queued (admitted or shed already)."""
        entry = self._entries.get(ticket)
        if entry is None:
            return False
        self._remove(entry)
        return True

    # ------------------------------------------------------------------ internals

    def _room(self, limit: int | None) -> bool:
        return limit is None or self._inflight < limit

    def _weight(self, tenant: str) -> int:
        listed = self._s.tenants.get(tenant)
        return 1 if listed is None else listed.weight

    def _next(self) -> _Entry:
        """Rule 2: the highest class's next tenant by smooth weighted round robin, its oldest ticket."""
        c = next(self._classes[p] for p in PRIORITIES if self._classes[p].size)
        total, best, best_score = 0, "", -math.inf
        for tenant in c.by_tenant:
            w = self._weight(tenant)
            total += w
            c.current[tenant] += w
            if c.current[tenant] > best_score:
                best, best_score = tenant, c.current[tenant]
        c.current[best] -= total
        return self._entries[c.by_tenant[best][0]]

    def _victim(self, priority: Priority, tenant: str) -> _Entry | None:
        """Rule 3: the queued request a newcomer of (``priority``, ``tenant``) displaces, if any."""
        for p in reversed(PRIORITIES[_rank(priority) :]):
            c = self._classes[p]
            if not c.size:
                continue
            hog, share = max(
                ((t, n / self._weight(t)) for t, n in c.count.items()),
                key=lambda ts: ts[1],
            )
            if p == priority:
                mine = (c.count.get(tenant, 0) + 1) / self._weight(tenant)
                if hog == tenant or share <= mine:
                    return None
            return self._entries[c.by_tenant[hog][-1]]
        return None

    def _remove(self, entry: _Entry) -> None:
        del self._entries[entry.ticket]
        c = self._classes[entry.priority]
        c.size -= 1
        c.count[entry.tenant] -= 1
        tickets = c.by_tenant[entry.tenant]
        while tickets and tickets[0] not in self._entries:
            tickets.popleft()
        while tickets and tickets[-1] not in self._entries:
            tickets.pop()
        if not tickets:  # an idle tenant starts its next turn afresh (smooth WRR)
            del c.by_tenant[entry.tenant], c.current[entry.tenant], c.count[entry.tenant]

    def _shed(self, entry: _Entry, reason: ShedReason, now: float) -> Shed:
        """Rule 5's Retry-After for a request shed now."""
        s = self._s
        while self._finished and self._finished[0] <= now - s.rate_window_s:
            self._finished.popleft()
        ahead = 1 + sum(self._classes[p].size for p in PRIORITIES[: _rank(entry.priority) + 1])
        rate = len(self._finished) / s.rate_window_s
        seconds = ahead / rate if rate > 0 else s.max_wait(entry.priority)
        retry = min(s.retry_after_max_s, max(s.retry_after_min_s, math.ceil(seconds)))
        return Shed(entry.ticket, entry.priority, entry.tenant, reason, retry, now - entry.arrived)


def _rank(priority: Priority) -> int:
    return PRIORITIES.index(priority)
