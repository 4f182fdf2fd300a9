"""Two counts over a sliding window of fixed buckets: events, and the share of them that were marked
(errors among a worker's requests, retries among the gateway's requests; psi.QpsMeter counts events
only). Pure: every call takes its time as an argument (seconds, monotonic); memory and work per call
are O(buckets), never O(events).

Rule 1: the window is `buckets` slots of `window_s / buckets` seconds each; a slot older than the
window is cleared when time reaches it again, so what is counted is at most one slot's width older
than `window_s`.
"""

from __future__ import annotations

__all__ = ["WindowCounts"]

# A slot number no time reaches (times near 0 give slots near 0, and negative ones in the window).
_NEVER = -(1 << 62)


class WindowCounts:
    __slots__ = ("_events", "_marked", "_slots", "_width")

    def __init__(self, window_s: float, *, buckets: int = 10) -> None:
        if not window_s > 0 or buckets <= 0:
            raise ValueError("window_s and buckets must be positive")
        self._width = window_s / buckets
        self._events = [0] * buckets
        self._marked = [0] * buckets
        self._slots = [_NEVER] * buckets

    def add(self, now: float, *, events: int = 1, marked: int = 0) -> None:
        """`events` events and `marked` marks at `now` (a mark need not come with an event: a retry
        is marked against the requests it is counted among)."""
        slot = int(now / self._width)
        i = slot % len(self._slots)
        if self._slots[i] != slot:
            self._slots[i] = slot
            self._events[i] = self._marked[i] = 0
        self._events[i] += events
        self._marked[i] += marked

    def totals(self, now: float) -> tuple[int, int]:
        """(events, marked) in the window that ends at `now`."""
        oldest = int(now / self._width) - len(self._slots) + 1
        events = marked = 0
        for i, slot in enumerate(self._slots):
            if slot >= oldest:
                events += self._events[i]
                marked += self._marked[i]
        return events, marked

    def clear(self) -> None:
        self._slots = [_NEVER] * len(self._slots)
