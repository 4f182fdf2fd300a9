"""Passive outlier detection: workers that keep failing real requests are ejected from rotation for a
while, then tried again with one probe request. Pure: every call takes its time as an argument
(seconds, monotonic); the pool (pool.py) owns one detector and feeds it what the request path saw.

Rule 1 (what counts): an error is a connection failure, a timeout before the first byte, or a 5xx
answer from the worker; a 4xx is the client's fault and counts as an answer (a success). What happens
after the first byte (a stream broken midway) is not counted here.
Rule 2 (when to eject): `consecutive_errors` errors in a row, or an error share of at least
`error_rate` over at least `min_requests` requests within the last `window_s` seconds
(window_counts.py). Reason `consecutive_errors` or `error_rate`.
Rule 3 (backoff): an ejection lasts `base_ejection_s`, doubled for each re-ejection, at most
`max_ejection_s`. The doubling starts again from the base once a restored worker has gone
`max_ejection_s` without being ejected.
Rule 4 (half-open): when its backoff is over, an ejected worker is admitted for one probe request
(the pool lets it be picked again; the first request sent to it claims the probe, and views taken
from then on leave it out; a request whose view was taken just before may still reach it). Its success
restores the worker (counts cleared); its failure re-ejects it with the doubled backoff (reason
`probe_failed`). A probe claimed but never answered (its client left) frees the slot for another after
one backoff. Outcomes of requests sent before the ejection, arriving while it lasts, change nothing.
Rule 5 (last worker): the caller says whether the worker may be ejected (`may_eject`: another live,
admitted worker of its role exists); when it may not, the failure is `Held` (not ejected, requests keep
going to it) and the worker stays in rotation with its counts, so the next error asks again.
Rule 6: `enabled` false: no worker is ever ejected (failures still counted, nothing returned).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.window_counts import WindowCounts

__all__ = ["Ejection", "Held", "OutlierDetector", "OutlierSettings", "Reason", "Restoration"]

Reason = Literal["consecutive_errors", "error_rate", "probe_failed"]


@dataclass(frozen=True, slots=True)
class OutlierSettings:
    """[outliers]: rules 2-4's thresholds; on by default with Envoy's outlier detection's defaults
    (5 errors in a row, base ejection 10 s doubled to at most 5 min)."""

    # Eject workers that fail requests (off: failures are only counted in the metrics).
    enabled: bool = True
    # Errors in a row (connection failures, timeouts before the first byte, 5xx) that eject a worker.
    consecutive_errors: int = 5
    # Or this share of errors among at least min_requests requests within the last window_s seconds.
    error_rate: float = 0.5
    # Fewer requests than this in the window: error_rate is not judged.
    min_requests: int = 10
    # The sliding window of error_rate, in seconds.
    window_s: float = 30.0
    # The first ejection's length; each re-ejection (a failed probe) doubles it.
    base_ejection_s: float = 10.0
    # The longest ejection; a worker restored this long without an ejection starts again at the base.
    max_ejection_s: float = 300.0

    def validate(self) -> None:
        if self.consecutive_errors < 1 or self.min_requests < 1:
            raise ValueError("outliers.consecutive_errors and outliers.min_requests must be >= 1")
        if not 0.0 < self.error_rate <= 1.0:
            raise ValueError("outliers.error_rate must be in (0, 1]")
        if not (self.window_s > 0 and 0 < self.base_ejection_s <= self.max_ejection_s < float("inf")):
            raise ValueError(
                "need outliers.window_s > 0 and 0 < outliers.base_ejection_s <= outliers.max_ejection_s"
            )


@dataclass(frozen=True, slots=True)
class Ejection:
    """A worker left rotation for `backoff_s` seconds."""

    worker: str
    reason: Reason
    backoff_s: float


@dataclass(frozen=True, slots=True)
class Held:
    """Rule 5: a worker that met an ejection rule but is the last of its role: kept in rotation."""

    worker: str
    reason: Reason


@dataclass(frozen=True, slots=True)
class Restoration:
    """Rule 4: a probe succeeded; the worker is back after `ejected_s` seconds out."""

    worker: str
    ejected_s: float


class _Worker:
    __slots__ = ("consecutive", "ejected_at", "ejections", "probe_at", "restored_at", "until", "window")

    def __init__(self, window_s: float) -> None:
        self.consecutive = 0
        self.window = WindowCounts(window_s)
        self.ejections = 0  # rule 3's doubling count
        self.ejected_at: float | None = None  # None: in rotation
        self.until = 0.0
        self.probe_at: float | None = None
        self.restored_at = float("-inf")

    def backoff(self, s: OutlierSettings) -> float:
        return min(s.base_ejection_s * 2.0 ** max(self.ejections - 1, 0), s.max_ejection_s)


class OutlierDetector:
    """Rules 1-6 for every worker of one pool."""

    def __init__(self, settings: OutlierSettings) -> None:
        self._s = settings
        self._workers: dict[str, _Worker] = {}
        self._ejected = 0  # workers ejected now (half-open included): the view's fast path

    @property
    def settings(self) -> OutlierSettings:
        return self._s

    @property
    def any_ejected(self) -> bool:
        return self._ejected > 0

    def forget(self, worker: str) -> None:
        """The worker left the pool."""
        state = self._workers.pop(worker, None)
        if state is not None and state.ejected_at is not None:
            self._ejected -= 1

    def is_ejected(self, worker: str) -> bool:
        """Out of rotation (its backoff running, or half-open awaiting its probe's answer)."""
        state = self._workers.get(worker)
        return state is not None and state.ejected_at is not None

    def admits(self, worker: str, now: float) -> bool:
        """Whether the worker may be picked now: in rotation, or half-open with its probe slot free."""
        state = self._workers.get(worker)
        if state is None or state.ejected_at is None:
            return True
        if now < state.until:
            return False
        return state.probe_at is None or now - state.probe_at >= state.backoff(self._s)

    def claim(self, worker: str, now: float) -> None:
        """Rule 4: a request is being sent to the worker; when half-open, it is the probe."""
        state = self._workers.get(worker)
        if state is not None and state.ejected_at is not None and self.admits(worker, now):
            state.probe_at = now

    def success(self, worker: str, now: float) -> Restoration | None:
        """The worker answered (rule 1); a Restoration when that was its half-open probe."""
        state = self._state(worker)
        if state.ejected_at is None:
            state.consecutive = 0
            state.window.add(now)
            return None
        if now < state.until:
            return None  # rule 4: sent before the ejection
        out = Restoration(worker, now - state.ejected_at)
        self._restore(state, now)
        return out

    def failure(self, worker: str, now: float, *, may_eject: bool) -> Ejection | Held | None:
        """The worker failed a request (rule 1): an Ejection, a Held (rule 5), or None."""
        state = self._state(worker)
        if state.ejected_at is not None:
            if now < state.until:
                return None  # rule 4: sent before the ejection
            if not (self._s.enabled and may_eject):
                self._restore(state, now)
                state.consecutive = self._s.consecutive_errors
                return Held(worker, "probe_failed") if self._s.enabled else None
            state.ejections += 1
            return self._eject(state, worker, "probe_failed", now)
        state.consecutive += 1
        state.window.add(now, marked=1)
        reason = self._reason(state, now)
        if reason is None or not self._s.enabled:
            return None
        if not may_eject:
            return Held(worker, reason)
        if now - state.restored_at >= self._s.max_ejection_s:
            state.ejections = 0  # rule 3: a long quiet spell starts the doubling again
        state.ejections += 1
        self._ejected += 1
        return self._eject(state, worker, reason, now)

    def describe(self, worker: str, now: float) -> dict[str, object]:
        """The worker's state for `/admin/workers`: in_rotation, ejected or half_open."""
        state = self._workers.get(worker)
        if state is None:
            return {"state": "in_rotation", "consecutive_errors": 0}
        requests, errors = state.window.totals(now)
        out: dict[str, object] = {
            "state": "in_rotation",
            "consecutive_errors": state.consecutive,
            "window_requests": requests,
            "window_errors": errors,
            "ejections": state.ejections,
        }
        if state.ejected_at is not None:
            out["state"] = "ejected" if now < state.until else "half_open"
            out["ejected_for_s"] = round(now - state.ejected_at, 3)
            out["backoff_s"] = state.backoff(self._s)
            out["probe_in_s"] = round(max(state.until - now, 0.0), 3)
        return out

    # ------------------------------------------------------------------ internals

    def _state(self, worker: str) -> _Worker:
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = _Worker(self._s.window_s)
        return state

    def _reason(self, state: _Worker, now: float) -> Reason | None:
        if state.consecutive >= self._s.consecutive_errors:
            return "consecutive_errors"
        requests, errors = state.window.totals(now)
        if requests >= self._s.min_requests and errors >= self._s.error_rate * requests:
            return "error_rate"
        return None

    def _eject(self, state: _Worker, worker: str, reason: Reason, now: float) -> Ejection:
        backoff = state.backoff(self._s)
        if state.ejected_at is None:
            state.ejected_at = now
        state.until = now + backoff
        state.probe_at = None
        state.consecutive = 0
        state.window.clear()
        return Ejection(worker, reason, backoff)

    def _restore(self, state: _Worker, now: float) -> None:
        state.ejected_at = None
        state.probe_at = None
        state.consecutive = 0
        state.window.clear()
        state.restored_at = now
        self._ejected -= 1
