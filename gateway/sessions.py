"""Conversation sessions: what the gateway remembers between turns, and how a request finds it.

Rule 1 (content addressing): a chat request's session key is a strong hash of (model, the messages up
to and including the last assistant message). After a turn completes, the key of (all messages + the
answer actually returned) points at the new state of the same session. So a follow-up finds its
session; an edit or regeneration of the last user turn finds the state *before* that turn (the same
prefix); a fork from an older turn finds that older state; and two conversations that merely start
alike ("hi") never share a key until their histories are identical.
Rule 2 (explicit ids): an `X-Session-ID` header, or a `session_id` / `conversation_id` body field,
overrides the content key; the state under it is the latest turn of that conversation.
Rule 3 (bounded memory): entries expire after an idle TTL and the store never holds more than
`max_entries` (least recently used goes first), whatever the traffic.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gateway.types import Clock

__all__ = [
    "MAX_OUTPUT_HISTORY",
    "InMemorySessionStore",
    "Session",
    "SessionStore",
    "canonical_message",
    "content_key",
    "explicit_key",
    "split_history",
]

MAX_OUTPUT_HISTORY = 8
_MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id")


@dataclass(frozen=True, slots=True)
class Session:
    """The state of a conversation after its last completed turn."""

    id: str
    # The D (or R) worker that produced the last answer and so holds the conversation's KV.
    worker: str | None = None
    turns: int = 0
    # Tokens in the conversation so far (the last turn's prompt + completion, from `usage`).
    context_tokens: int = 0
    # Output lengths of the most recent turns, oldest first.
    output_lengths: tuple[int, ...] = field(default=())

    def mean_output(self) -> float | None:
        if not self.output_lengths:
            return None
        return sum(self.output_lengths) / len(self.output_lengths)

    def after_turn(self, *, worker: str, prompt_tokens: int, completion_tokens: int) -> Session:
        outputs = (*self.output_lengths, completion_tokens)[-MAX_OUTPUT_HISTORY:]
        return replace(
            self,
            worker=worker,
            turns=self.turns + 1,
            context_tokens=prompt_tokens + completion_tokens,
            output_lengths=outputs,
        )


class SessionStore(Protocol):
    """Where sessions live; in memory by default, a shared store for several gateway replicas."""

    def get(self, key: str) -> Session | None: ...

    def put(self, key: str, session: Session) -> None: ...

    def expire(self) -> int:
        """Drop idle entries now; returns how many went."""
        ...

    def __len__(self) -> int: ...


class _Entry:
    __slots__ = ("last_used", "session")

    def __init__(self, session: Session, last_used: float) -> None:
        self.session = session
        self.last_used = last_used


class InMemorySessionStore:
    """LRU-ordered dict with an idle TTL. Not thread-safe: one event loop owns it."""

    def __init__(self, *, ttl_s: float, max_entries: int, clock: Clock) -> None:
        if ttl_s <= 0 or max_entries <= 0:
            raise ValueError("ttl_s and max_entries must be positive")
        self._ttl = ttl_s
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Session | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = self._clock()
        if now - entry.last_used > self._ttl:
            del self._entries[key]
            self.expired += 1
            return None
        entry.last_used = now
        self._entries.move_to_end(key)
        return entry.session

    def put(self, key: str, session: Session) -> None:
        now = self._clock()
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = _Entry(session, now)
            if len(self._entries) > self._max:
                self._entries.popitem(last=False)
                self.evicted += 1
        else:
            entry.session = session
            entry.last_used = now
            self._entries.move_to_end(key)

    def expire(self) -> int:
        deadline = self._clock() - self._ttl
        dropped = 0
        entries = self._entries
        while entries:
            key, entry = next(iter(entries.items()))
            if entry.last_used >= deadline:
                break
            del entries[key]
            dropped += 1
        self.expired += dropped
        return dropped


def split_history(messages: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(index after the last assistant message, count of assistant messages before it).

    `messages[:i]` is the history whose key finds the session; `messages[i:]` is the new turn."""
    last = 0
    assistants = 0
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            last = i + 1
            assistants += 1
    return last, assistants


def canonical_message(message: Mapping[str, Any]) -> list[Any]:
    """The parts of a message that define the conversation, independent of how a client serialises
    it (text parts joined, None/empty optional fields dropped, key order irrelevant)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, Mapping)]
        if all(isinstance(p, Mapping) and p.get("type") == "text" for p in content) and all(
            isinstance(t, str) for t in texts
        ):
            content = "".join(t for t in texts if isinstance(t, str))
    if content is None:
        content = ""
    extra = {k: message[k] for k in _MESSAGE_FIELDS if message.get(k)}
    return [message.get("role"), content, extra] if extra else [message.get("role"), content]


def content_key(model: str, messages: Sequence[Mapping[str, Any]]) -> str:
    payload = json.dumps(
        [model, [canonical_message(m) for m in messages]],
        ensure_ascii=False,
        separators=(",", ":"),
        sort_keys=True,
    )
    return "c:" + hashlib.blake2b(payload.encode("utf-8"), digest_size=16).hexdigest()


def explicit_key(session_id: str) -> str:
    return "x:" + hashlib.blake2b(session_id.encode("utf-8"), digest_size=16).hexdigest()
