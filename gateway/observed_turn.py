"""One turn the Envoy picker observes (picker.py rule 6), from the answer's response headers to its
end: the held turn (core.py rule 7) fed the answer's chunks through answer_observer.py, remembered
with its real answer and ended with its line. No transport: the picker hands over the status, the
bytes and the time each arrived (tests/gateway/test_picker_observe.py drives it through the picker).

Rule 1: a 200 with a body is observed; any other status is the turn's error (`worker D0 answered
503`), a 200 without a body too; either ends the turn with its line. When the body cannot reach the
picker (Envoy would ignore the override), the turn ends unobserved: no line.
Rule 2: the answer complete (answer_observer rule 2 or 3), the turn is remembered with it before the
chunk that completed it is answered (so before the client can see `[DONE]` and send its next turn),
and is delivered; the body's last chunk ends the turn.
Rule 2b (`strip`: D may answer with vLLM's bidirectional params, picker.py rule 9): each chunk is
answered with what the client gets instead (answer_observer rule 4: the standalone's bytes, without
`kv_transfer_params`), and the turn is remembered with D's params, so the next turn can take the
bidir path. Without `strip` the bytes go on as they came.
Rule 3: the ext_proc stream over with the turn still held: a turn not delivered lost its client
(`CLIENT_DISCONNECTED`, which the table refresh leaves out); a 200 whose body never came at all is
also logged as a warning (Envoy's `allow_mode_override` off?).
"""

from __future__ import annotations

import logging

from gateway.answer_observer import AnswerObserver
from gateway.core import ActiveTurn, RequestCore
from ppd.records import CLIENT_DISCONNECTED

__all__ = ["ObservedTurn"]

log = logging.getLogger(__name__)


class ObservedTurn:
    """Rules 1-3 for one held turn; `stream` as D was asked, `strip` as rule 2b."""

    __slots__ = ("_chunks", "_core", "_max", "_observer", "_stream", "_strip", "_t")

    def __init__(
        self, core: RequestCore, t: ActiveTurn, *, stream: bool, max_body_bytes: int, strip: bool = False
    ) -> None:
        self._core = core
        self._t = t
        self._stream = stream
        self._strip = strip
        self._max = max_body_bytes
        self._observer: AnswerObserver | None = None
        self._chunks = 0

    @property
    def strips(self) -> bool:
        """Rule 2b: the answer's bytes may be replaced (so its Content-Length cannot stand)."""
        return self._strip

    def headers(self, status: str, *, has_body: bool, body_comes: bool) -> bool:
        """Rule 1: True when the body is to be observed."""
        t = self._t
        worker = t.outcome.decode_worker
        if not body_comes:
            t.observed = False
            self._core.end(t)
            return False
        if status == "200" and has_body:
            self._observer = AnswerObserver(
                t.outcome,
                stream=self._stream,
                start=t.turn.start,
                worker=worker,
                max_body_bytes=self._max,
                strip=self._strip,
            )
            return True
        t.outcome.error = f"worker {worker} " + (f"answered {status}" if status != "200" else "sent no body")
        self._core.end(t)
        return False

    async def body(self, data: bytes, *, last: bool, at: float) -> bytes | None:
        """Rules 2 and 2b: one chunk of the answer, received at `at` (the gateway's timer); the bytes
        the client gets instead of `data` (None: `data` goes on as it came)."""
        observer = self._observer
        if observer is None:
            return None
        self._chunks += 1
        t = self._t
        outcome = t.outcome
        out, answer = observer.feed_through(data, at)
        if last:
            tail, end_answer = observer.end_through()
            out += tail
            answer = answer or end_answer
        if answer is not None:
            outcome.ok = True
            await self._core.remember(
                t.turn,
                outcome,
                answer.text,
                answer.usage,
                completion_chunks=answer.chunks,
                kv_params=answer.kv_params,
            )
            outcome.delivered = True  # the whole answer is Envoy's to pass on once this is answered
        if last:
            self._core.end(t)
        return out if self._strip else None

    @staticmethod
    def close_if(watch: ObservedTurn | None) -> None:
        if watch is not None:
            watch.close()

    def close(self) -> None:
        """Rule 3: the ext_proc stream is over."""
        t = self._t
        if not t.held:
            return
        if self._observer is not None and not self._chunks:
            log.warning(
                "request %s: no byte of its observed answer reached the picker (is Envoy's ext_proc "
                "allow_mode_override on, with this mode in allowed_override_modes?)",
                t.turn.request_id,
            )
        if not t.outcome.delivered:
            t.outcome.ok = False
            t.outcome.error = t.outcome.error or CLIENT_DISCONNECTED
        self._core.end(t)
