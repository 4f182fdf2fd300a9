"""The logger the HTTP server reports to: aiohttp logs every request that is not valid HTTP
(BadHttpMessage, LineTooLong, InvalidURLError, ...) at ERROR with a full traceback, so any client could
flood the log. Here such a record becomes one concise WARNING line (client address, error class, its
message with whitespace collapsed, cut short), at most one per `interval_s`; the next one says how many
were left out. Every other record (a real bug in a handler) passes untouched, traceback included.
`ppd.rate_limited_log.RateLimitedLog` is the same rule for the gateway's own lines about what a client
(or a corrupt shared entry) can cause at will: a JSON body nested too deep, an unreadable session entry.
"""

from __future__ import annotations

import logging
import time

from aiohttp.http_exceptions import HttpProcessingError

from gateway.types import Clock

__all__ = ["MalformedRequestFilter", "server_logger"]

_MESSAGE_CHARS = 160


class MalformedRequestFilter(logging.Filter):
    def __init__(self, *, interval_s: float = 60.0, clock: Clock = time.monotonic) -> None:
        super().__init__()
        self._interval = interval_s
        self._clock = clock
        self._last: float | None = None
        self._left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            self._left_out += 1
            return False
        self._last = now
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        detail = " ".join(str(exc.message).split())
        if len(detail) > _MESSAGE_CHARS:
            detail = detail[:_MESSAGE_CHARS] + "..."
        left_out = f" ({self._left_out} more since the last line)" if self._left_out else ""
        self._left_out = 0
        record.msg = "malformed HTTP request from %s answered 400: %s: %s%s"
        record.args = (remote, type(exc).__name__, detail, left_out)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        return True


def server_logger(parent: logging.Logger, *, interval_s: float = 60.0) -> logging.Logger:
    """A logger for aiohttp's server (`AppRunner(logger=...)`), named `<parent>.http`, that reports
    through `parent`'s handlers with `MalformedRequestFilter` on it. It is a fresh object, not the
    registered logger of that name, so no global logger is changed."""
    logger = logging.Logger(f"{parent.name}.http")
    logger.parent = parent
    logger.addFilter(MalformedRequestFilter(interval_s=interval_s))
    return logger
