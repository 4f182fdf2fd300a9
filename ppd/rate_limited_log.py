"""One log line at most per interval for events anyone can cause at will (a client's malformed frame
or body, a corrupt shared entry, a publisher's bad message): the log stays readable whatever they
send. The next line says how many were left out meanwhile. Never a traceback. Used by the decision
service (bad gRPC frames) and the gateway (bad bodies, bad session entries, bad KV-event messages).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """At most one line per `interval_s` through `logger`, at `level`; the clock is injected."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = 60.0,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._level = level
        self._clock = clock
        self._next_at = float("-inf")
        self._left_out = 0

    @property
    def left_out(self) -> int:
        """Events not logged since the last line."""
        return self._left_out

    def log(self, message: str, *args: object) -> bool:
        """Log `message % args` unless a line went out less than `interval_s` ago; True when logged."""
        now = self._clock()
        if now < self._next_at:
            self._left_out += 1
            return False
        self._next_at = now + self._interval_s
        left_out, self._left_out = self._left_out, 0
        if left_out:
            message += f" ({left_out} more like it in the last {self._interval_s:g} s not logged)"
        self._logger.log(self._level, message, *args)
        return True
