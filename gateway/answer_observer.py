"""What a front door that does not relay the answer learns from it as it passes (the Envoy picker's
observed turns, picker.py rule 6): fed D's answer body chunk by chunk as `(bytes, timestamp)`, it fills
the turn's TTFT and last-token time and says when the answer is complete, with its text, usage and
content-chunk count. Without I/O. By default it changes no byte (Envoy passes the answer on as it
came); one made with `strip` also says what the client gets instead (rule 4).

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
Rule 4 (`strip`: D may answer with vLLM's bidirectional `kv_transfer_params`, picker.py rule 9): the
client gets what the standalone gateway sends it, from the same code. Streamed: each chunk becomes the
relay's output (`StreamRelay.feed`: whole events only, an event carrying the params re-encoded without
them; a partial event waits for its end), the body's end adds what the relay still held. Whole: every
chunk is held back (the client gets nothing for it) and the body's end gives `relay.client_body`; a
body past `max_body_bytes` cannot be rewritten, so the held bytes go on as they came, and so does the
rest. The answer carries D's params (`Answer.kv_params`) for the session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.relay import StreamRelay, Usage, answer_from_body, client_body, kv_params_from_body
from gateway.turn import TurnOutcome

__all__ = ["Answer", "AnswerObserver"]


@dataclass(frozen=True, slots=True)
class Answer:
    """A complete answer: its text (choice 0), the worker's usage if it sent one, and (streamed) the
    content-carrying chunks counted (about one token each)."""

    text: str
    usage: Usage | None
    chunks: int | None
    # D's returned params (vLLM's bidirectional mode), kept with the session (rule 4); None: none.
    kv_params: dict[str, Any] | None = None


class AnswerObserver:
    """Rules 1-3 for one answer; `stream` as the request asked (the plan's D call)."""

    __slots__ = (
        "_complete",
        "_held",
        "_max",
        "_outcome",
        "_over",
        "_parts",
        "_relay",
        "_start",
        "_strip",
        "_worker",
    )

    def __init__(
        self,
        outcome: TurnOutcome,
        *,
        stream: bool,
        start: float,
        worker: str,
        max_body_bytes: int,
        strip: bool = False,
    ) -> None:
        self._outcome = outcome
        self._start = start
        self._worker = worker
        self._max = max_body_bytes
        self._strip = strip
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
        return self.feed_through(data, at)[1]

    def feed_through(self, data: bytes, at: float) -> tuple[bytes, Answer | None]:
        """`feed`, with the bytes the client gets for this chunk: `data` itself unless `strip`
        (rule 4)."""
        relay = self._relay
        if relay is None:
            return self._hold(data), None
        out, content = relay.feed(data)
        out = out if self._strip else data
        if self._over:
            return out, None
        if content:
            self._outcome.content_at(at, self._start)
        if relay.error is not None:
            return out, self._failed(relay.error)
        return out, self._done() if relay.done else None

    def end(self) -> Answer | None:
        """The body ended: a whole answer (rule 3), or a stream's last held event; None when the
        answer was already complete or is not (then `outcome.error` says why)."""
        return self.end_through()[1]

    def end_through(self) -> tuple[bytes, Answer | None]:
        """`end`, with the bytes the client still gets at the body's end (rule 4; none unless `strip`)."""
        relay = self._relay
        if relay is None:
            return self._whole()
        tail = relay.end()
        tail = tail if self._strip else b""
        if self._over:
            return tail, None
        if relay.error is not None:
            return tail, self._failed(relay.error)
        if relay.done:
            return tail, self._done()
        return tail, self._failed(f"worker {self._worker} ended the stream before [DONE]")

    def _failed(self, error: str) -> Answer | None:
        """No answer: `error` says why (the turn's error)."""
        self._over = True
        self._outcome.error = error
        return None

    def _done(self) -> Answer:
        relay = self._relay
        assert relay is not None
        self._over = self._complete = True
        return Answer(relay.answer, relay.usage, relay.chunks, relay.kv_params)

    def _hold(self, data: bytes) -> bytes:
        """A whole answer's chunk held (rule 3); what the client gets for it now (rule 4)."""
        self._held += len(data)
        if self._held <= self._max:
            self._parts.append(data)
            return b"" if self._strip else data
        held = b"".join(self._parts)  # empty once past the limit: then the bytes go on as they come
        self._parts.clear()
        return held + data if self._strip else data

    def _whole(self) -> tuple[bytes, Answer | None]:
        if self._over:
            return b"", None
        if self._held > self._max:
            return b"", self._failed(f"worker {self._worker}'s answer is over {self._max} bytes: not read")
        raw = b"".join(self._parts)
        self._parts.clear()
        body: Any
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            return raw if self._strip else b"", self._failed(f"worker {self._worker} sent a malformed answer")
        self._over = self._complete = True
        text, usage = answer_from_body(body)
        return client_body(raw, body) if self._strip else b"", Answer(
            text, usage, None, kv_params_from_body(body)
        )
