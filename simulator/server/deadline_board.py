"""The pending step deadlines of the real-time drivers that share one event loop.

One process hosts a whole cluster on one loop, and its decode workers step on independent clocks: a
driver's synchronous work (a delivery pass, rendering the next step's chunks) delays any other driver
whose deadline falls inside it. Drivers post their next deadline here while they wait for it, and a
driver doing long synchronous work asks `due` between slices of it and yields one loop turn when
another driver's deadline has come, so that driver wakes within about one slice of its deadline
instead of after the whole pass.

Invariants:
- Rule 1: a driver posts its deadline only while it waits for it (`post` before the wait, `clear` at
  wake-up or cancellation); a driver that asks `due` is past its own wait, so two drivers never wait
  for each other (no livelock).
- Rule 2: one board per event loop, created by whoever creates the drivers of that loop (the worker
  group) and passed in; there is no module-level board. All calls happen on that loop: no locks.
"""

from __future__ import annotations

__all__ = ["DeadlineBoard"]


class DeadlineBoard:
    """Every waiting driver's next deadline (the drivers' clock, seconds)."""

    __slots__ = ("_deadlines", "_earliest")

    def __init__(self) -> None:
        self._deadlines: dict[object, float] = {}  # driver -> deadline
        self._earliest = float("inf")

    def post(self, owner: object, deadline: float) -> None:
        self._deadlines[owner] = deadline
        self._earliest = min(self._deadlines.values())

    def clear(self, owner: object) -> None:
        if self._deadlines.pop(owner, None) is not None:
            self._earliest = min(self._deadlines.values(), default=float("inf"))

    def due(self, owner: object, at: float) -> bool:
        """True when a driver other than `owner` waits for a deadline at or before `at`."""
        if self._earliest > at:
            return False
        return any(key is not owner and deadline <= at for key, deadline in self._deadlines.items())

    @property
    def waiting(self) -> int:
        return len(self._deadlines)
