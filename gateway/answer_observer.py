"""What a front door that does not relay the answer learns from it as it passes (the Envoy picker's
observed turns, picker.py rule 6): fed D's answer body chunk by chunk as `(bytes, timestamp)`, it fills
the turn's TTFT and last-token time and says when the answer is complete, with its text, usage and
content-chunk count. Without I/O; it never changes a byte (Envoy passes the answer on as it came).

Rule 1: a streamed answer is read by the standalone gateway's relay (relay.StreamRelay, which takes
any split of the stream), so both front doors learn the same from the same bytes: content chunks of
choice 0, `usage`, a worker's error event, `[DONE]`. The time a content chunk arrived feeds
`TurnOutcome.content_at`, as the standalone's relay loop does.
Rule 2: a streamed answer is complete at `[DONE]` (`feed` returns it then, once: the caller remembers
the turn before that chunk goes on, so the client's next turn finds it), unless a worker's error event
came first (`outcome.error`). A stream whose body ends without `[DONE]` was cut: `outcome.error` says so.
Rule 3: a whole (non-streamed) answer is complete when its body ends (`end` returns it): JSON read by
`relay.answer_from_body`; no TTFT (the standalone records none either). Its bytes are held until then,
at most `max_body_bytes` of them: a longer or malformed body is an error, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.relay import StreamRelay, Usage, answer_from_body
from gateway.turn import TurnOutcome

__all__ = ["Answer", "AnswerObserver"]


@dataclass(frozen=True, slots=True)
class Answer:
    """A complete answer: its text (choice 0), the worker's usage if it sent one, and (streamed) the
    content-carrying chunks counted (about one token each)."""

    text: str
    usage: Usage | None
    chunks: int | None


class AnswerObserver:
    """Rules 1-3 for one answer; `stream` as the request asked (the plan's D call)."""

    __slots__ = ("_complete", "_held", "_max", "_outcome", "_over", "_parts", "_relay", "_start", "_worker")

    def __init__(
        self, outcome: TurnOutcome, *, stream: bool, start: float, worker: str, max_body_bytes: int
    ) -> None:
        self._outcome = outcome
        self._start = start
        self._worker = worker
        self._max = max_body_bytes
        self._relay = StreamRelay(strip_usage=False) if stream else None
        self._parts: list[bytes] = []
        self._held = 0
        self._complete = False
        self._over = False  # complete or failed: nothing more to learn

    @property
    def complete(self) -> bool:
        return self._complete

    def feed(self, data: bytes, at: float) -> Answer | None:
        """One chunk of the body, received at `at` (the gateway's timer); the answer when this chunk
        completed it (rule 2)."""
        relay = self._relay
        if relay is None:
            self._hold(data)
            return None
        if self._over:
            return None
        _, content = relay.feed(data)
        if content:
            self._outcome.content_at(at, self._start)
        if relay.error is not None:
            return self._failed(relay.error)
        return self._done() if relay.done else None

    def end(self) -> Answer | None:
        """The body ended: a whole answer (rule 3), or a stream's last held event; None when the
        answer was already complete or is not (then `outcome.error` says why)."""
        relay = self._relay
        if relay is None:
            return self._whole()
        if self._over:
            return None
        relay.end()
        if relay.error is not None:
            return self._failed(relay.error)
        if relay.done:
            return self._done()
        return self._failed(f"worker {self._worker} ended the stream before [DONE]")

    def _failed(self, error: str) -> Answer | None:
        """No answer: `error` says why (the turn's error)."""
        self._over = True
        self._outcome.error = error
        return None

    def _done(self) -> Answer:
        relay = self._relay
        assert relay is not None
        self._over = self._complete = True
        return Answer(relay.answer, relay.usage, relay.chunks)

    def _hold(self, data: bytes) -> None:
        self._held += len(data)
        if self._held <= self._max:
            self._parts.append(data)
        else:
            self._parts.clear()

    def _whole(self) -> Answer | None:
        if self._over:
            return None
        if self._held > self._max:
            return self._failed(f"worker {self._worker}'s answer is over {self._max} bytes: not read")
        body: Any
        try:
            body = orjson.loads(b"".join(self._parts))
        except orjson.JSONDecodeError:
            body = None
        self._parts.clear()
        if not isinstance(body, dict):
            return self._failed(f"worker {self._worker} sent a malformed answer")
        self._over = self._complete = True
        text, usage = answer_from_body(body)
        return Answer(text, usage, None)
