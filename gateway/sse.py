"""Server-sent events without I/O: feed bytes in, get whole events out (h11's receive_data/next_event
idea), and encode events to bytes.

Rule 1: `SSEParser.feed` accepts any split of the stream (a chunk may end inside a line, inside a
`\\r\\n` pair or inside a multi-byte UTF-8 character) and yields the same events as one big feed.
Rule 2: an event is dispatched only at the blank line that ends it; `pending` tells whether a
stream stopped in the middle of one (a truncation the relay must report, not hide).
Line endings `\\n`, `\\r\\n` and `\\r` are all accepted, comments (`:` lines) are skipped, as in the
WHATWG event-stream grammar.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DONE", "SSEEvent", "SSEParser", "encode_data", "encode_event"]

DONE = "[DONE]"


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: str
    event: str | None = None
    id: str | None = None
    retry: int | None = None


class SSEParser:
    """Incremental parser; one per stream."""

    __slots__ = ("_buf", "_data", "_event", "_has_fields", "_id", "_raw", "_retry")

    def __init__(self) -> None:
        self._buf = b""
        self._raw = b""  # whole lines consumed since the last dispatched event
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._retry: int | None = None
        self._has_fields = False

    @property
    def idle(self) -> bool:
        """True between events: nothing held, so the next chunk starts a new event."""
        return not (self._buf or self._raw or self._has_fields)

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished event are held."""
        return bool(self._buf) or self._has_fields

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        return self.feed_raw(chunk)[0]

    def feed_raw(self, chunk: bytes) -> tuple[list[SSEEvent], bytes]:
        """The events completed by this chunk, and the exact bytes that made them up (for relays
        that pass a stream on unchanged, event by event)."""
        buf = self._buf + chunk if self._buf else chunk
        events: list[SSEEvent] = []
        cut = -1
        start = 0
        n = len(buf)
        while start < n:
            nl = buf.find(b"\n", start)
            cr = buf.find(b"\r", start, nl if nl >= 0 else n)
            if cr >= 0:
                if cr + 1 == n:  # a lone \r at the end may be the first half of \r\n
                    break
                end, nxt = cr, cr + 2 if buf[cr + 1 : cr + 2] == b"\n" else cr + 1
            elif nl >= 0:
                end, nxt = nl, nl + 1
            else:
                break
            event = self._line(buf[start:end])
            if event is not None:
                events.append(event)
                cut = nxt
            start = nxt
        self._buf = buf[start:]
        if cut < 0:
            if start:
                self._raw += buf[:start]
            return events, b""
        raw = self._raw + buf[:cut] if self._raw else buf[:cut]
        self._raw = buf[cut:start]
        return events, raw

    def end(self) -> list[SSEEvent]:
        """The stream closed: a trailing lone `\r` was a line end after all."""
        if self._buf.endswith(b"\r"):
            return self.feed(b"\n")
        return []

    def end_raw(self) -> tuple[list[SSEEvent], bytes]:
        if self._buf.endswith(b"\r"):
            return self.feed_raw(b"\n")
        return [], b""

    def _line(self, raw: bytes) -> SSEEvent | None:
        if not raw:
            if not self._has_fields:
                return None
            event = SSEEvent("\n".join(self._data), self._event, self._id, self._retry)
            self._data = []
            self._event = None
            self._retry = None
            self._has_fields = False
            return event
        line = raw.decode("utf-8", errors="replace")
        if line[0] == ":":
            return None
        name, sep, value = line.partition(":")
        if sep and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._has_fields = True
        elif name == "event":
            self._event = value
            self._has_fields = True
        elif name == "id":
            if "\x00" not in value:
                self._id = value
                self._has_fields = True
        elif name == "retry" and value.isdigit():
            self._retry = int(value)
            self._has_fields = True
        return None


def encode_data(data: str) -> bytes:
    """`data: <data>\\n\\n`, the only form vLLM emits."""
    if "\n" in data or "\r" in data:
        return encode_event(SSEEvent(data))
    return b"data: " + data.encode("utf-8") + b"\n\n"


def encode_event(event: SSEEvent) -> bytes:
    parts: list[str] = []
    if event.event is not None:
        parts.append(f"event: {event.event}\n")
    if event.id is not None:
        parts.append(f"id: {event.id}\n")
    if event.retry is not None:
        parts.append(f"retry: {event.retry}\n")
    for line in event.data.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        parts.append(f"data: {line}\n")
    parts.append("\n")
    return "".join(parts).encode("utf-8")
