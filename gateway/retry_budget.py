"""The retry budget: retries may add at most a set share to the requests the gateway serves, so a
failing cluster is not handed twice its load in retries. Pure: every call takes its time as an
argument (seconds, monotonic).

Rule 1: over the last `window_s` seconds (window_counts.py), a retry is allowed while the retries
already taken are fewer than `ratio` x the requests that arrived plus `min_per_s` x `window_s` (the
floor that lets low traffic retry at all; Linkerd's budget has the same two terms).
Rule 2: an allowed retry is counted at once; a refused one is not (it did not happen).
Rule 3: `enabled` false: every retry is allowed (and still counted).
What is a retry, where, and what a refused one answers is the request core's (core.py rule 9).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.window_counts import WindowCounts

__all__ = ["RetryBudget", "RetryBudgetSettings"]


@dataclass(frozen=True, slots=True)
class RetryBudgetSettings:
    """[retry_budget]: rule 1's share and floor; on by default at 20% plus 1 retry a second."""

    # Cap retries (off: every retry the request path wants is made).
    enabled: bool = True
    # Retries may be at most this share of the requests that arrived within window_s (plus the floor).
    ratio: float = 0.2
    # The floor: this many retries a second are allowed whatever the traffic (low traffic can retry).
    min_per_s: float = 1.0
    # The sliding window over which requests and retries are counted, in seconds.
    window_s: float = 10.0

    def validate(self) -> None:
        if not (0.0 <= self.ratio < float("inf") and 0.0 <= self.min_per_s < float("inf")):
            raise ValueError("retry_budget.ratio and retry_budget.min_per_s must be >= 0")
        if not 0.0 < self.window_s < float("inf"):
            raise ValueError("retry_budget.window_s must be a positive number of seconds")


class RetryBudget:
    def __init__(self, settings: RetryBudgetSettings) -> None:
        self._s = settings
        self._counts = WindowCounts(settings.window_s)

    def note_request(self, now: float) -> None:
        """A client request arrived (the retries' base)."""
        self._counts.add(now)

    def try_retry(self, now: float) -> bool:
        """Rules 1-3: whether one more retry may go now; counted when it may."""
        requests, retries = self._counts.totals(now)
        s = self._s
        if s.enabled and retries >= s.ratio * requests + s.min_per_s * s.window_s:
            return False
        self._counts.add(now, events=0, marked=1)
        return True
