"""Conversation sessions: what the gateway remembers between turns, and the keys that find it
(session_lookup.py applies these rules to a request and remembers a finished turn).

Rule 1 (content addressing): a chat history's content key is a strong hash (SHA-256, 128 bits kept)
of (model, its messages), computed message by message (`KeyChain`). After a turn completes, its state
is stored under the key of (the messages it was sent + the answer actually returned: the answer key,
`Session.answer_key`) and under the same hash of the messages it was sent alone (`sent_key`, rule 4).
A request finds its session by the longest stored prefix of its history that ends right before an
assistant message (session_lookup.py rule 2). So a follow-up finds its session; an edit or
regeneration of the last user turn finds the state *before* that turn (the same prefix); a fork from
an older turn finds that older state; a history whose latest turns were answered elsewhere finds the
latest state this gateway knows; and two conversations that merely start alike ("hi") never share a
session while the gateway saw their answers: one sent history answered two ways has two answer keys,
and a sent-key state is taken only for the answer it returned (or when it knows none, rule 4).
Rule 2 (explicit ids): an `X-Session-ID` header, or a `session_id` / `conversation_id` body field,
overrides the content key; the state under it is the latest turn of that conversation, but only for a
chat history that extends it: every session keeps the content key of the messages its last turn was sent
(and how many), and a request whose first that-many messages hash differently, or that has no answer
after them, does not continue it (session_lookup.history_extends; it is then a fork or a new
conversation). A completions prompt continues it only if it starts with what the last turn was sent and
answered: a text prompt with that prompt and the answer's text, a token-id prompt with that prompt's ids
(`prompt_extends`, over `prompt_fingerprint`); otherwise it is a new conversation. The gateway does not
see the answer's token ids, so a token-id continuation (and one of a session without a fingerprint)
never gets the session's stored D params (`decode_kv_params`, used by the bidir path): with them P
would compute the request's tokens on top of whatever KV those params name. Likewise a chat request
gets them only when the answer in its history is the one the gateway returned (the key of its history
up to that answer is the session's `answer_key`): someone who knows a session's id and its user
messages but not its answer is served without them (full PD), and so is every request continuing a
state whose answer the front door never saw.
Rule 3 (bounded memory): entries expire after an idle TTL and the store never holds more than
`max_entries` (least recently used goes first), whatever the traffic. A chat turn writes two entries
(three with an explicit id), so `max_entries` holds about half as many chat turns as entries.
Rule 4 (sessions without the answer, issue 25): a front door that never sees the answer (Envoy
streaming it, with the gateway's core as its endpoint picker) can compute `sent_key` of what it
sends, and nothing else; a state stored by it has no `answer_key`. Sent keys ("s:") live apart
from content keys ("c:"), whose history may end with the same messages. The trade-off: a client that
edits the assistant's answer continues such a state; the worker's KV then no longer matches the
text, which costs only performance (vLLM's prefix cache misses from the edit on), never correctness.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final, Protocol

from gateway.types import Clock

if TYPE_CHECKING:
    from hashlib import _Hash

__all__ = [
    "CONTENT_PREFIX",
    "MAX_OUTPUT_HISTORY",
    "SENT_PREFIX",
    "InMemorySessionStore",
    "KeyChain",
    "Session",
    "SessionStore",
    "content_key",
    "explicit_key",
    "is_chat_key",
    "prompt_extends",
    "prompt_fingerprint",
    "prompt_is_text",
    "sent_key",
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
    # The content key of every message the last turn was sent (chat), and how many there were: a request
    # continues this session only if its history starts with them (rule 2). Completions: the key of
    # the prefix the next prompt must start with (`prompt_fingerprint`) and its length. "" / 0: not known.
    history_key: str = ""
    history_messages: int = 0
    # Chat: the content key of the messages the last turn was sent + the answer it returned (rule 1's
    # answer key), so a history is known to carry that answer without another lookup (rule 2's D
    # params, rule 4); "" when the front door that served the turn never saw the answer.
    answer_key: str = ""
    # vLLM bidirectional mode (docs/vllm-protocol.md 3.4): the `kv_transfer_params` that `worker` returned
    # on the last turn's final chunk, as JSON text ("" when it returned none), and the wall-clock time
    # (seconds since the epoch, so replicas sharing a store agree) after which the gateway no longer
    # sends them to P. Single use: every turn replaces them with what its own D leg returned.
    decode_kv_params: str = ""
    decode_kv_expires_at: float = 0.0
    # The marks of the last prompt a P prefilled for this conversation (gateway/residency.py rule 5,
    # as `marks_text` writes them), from P's own answer; no P holds more of the conversation than
    # that prompt (P never computes an answer), so a later turn's P is placed by them without asking
    # a worker for the prompt's token ids. "" when no P leg said.
    prompt_marks: str = ""

    def mean_output(self) -> float | None:
        if not self.output_lengths:
            return None
        return sum(self.output_lengths) / len(self.output_lengths)

    def after_turn(
        self,
        *,
        worker: str,
        prompt_tokens: int,
        completion_tokens: int,
        history_key: str = "",
        history_messages: int = 0,
        answer_key: str = "",
        decode_kv_params: str = "",
        decode_kv_expires_at: float = 0.0,
        prompt_marks: str = "",
    ) -> Session:
        """The session after a turn; `prompt_marks` "" keeps the last P prompt's (a local turn's)."""
        outputs = (*self.output_lengths, completion_tokens)[-MAX_OUTPUT_HISTORY:]
        return replace(
            self,
            worker=worker,
            turns=self.turns + 1,
            context_tokens=prompt_tokens + completion_tokens,
            output_lengths=outputs,
            history_key=history_key,
            history_messages=history_messages,
            answer_key=answer_key,
            decode_kv_params=decode_kv_params,
            decode_kv_expires_at=decode_kv_expires_at,
            prompt_marks=prompt_marks or self.prompt_marks,
        )


class SessionStore(Protocol):
    """Where sessions live; in memory by default (InMemorySessionStore), or shared by several gateway
    replicas (redis_sessions.RedisSessionStore). Async because a shared store is a network call; a
    store never raises to the request path (a shared one falls back to local memory)."""

    async def get(self, key: str) -> Session | None: ...

    async def get_many(self, keys: Sequence[str]) -> list[Session | None]:
        """Each key's session (None: no entry), in one call (one round trip for a shared store)."""
        ...

    async def put(self, key: str, session: Session) -> None: ...

    async def put_many(self, keys: Sequence[str], session: Session) -> None:
        """The same session under every key, in one call."""
        ...

    async def expire(self) -> int:
        """Drop idle entries now; returns how many went."""
        ...

    def __len__(self) -> int:
        """Entries held (a shared store: as last seen)."""
        ...


class _Entry:
    __slots__ = ("last_used", "session")

    def __init__(self, session: Session, last_used: float) -> None:
        self.session = session
        self.last_used = last_used


class InMemorySessionStore:
    """LRU-ordered dict with an idle TTL. Not thread-safe: one event loop owns it. The `*_now` methods
    are the same operations for synchronous callers (the shared store's degraded mode, benchmarks)."""

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

    async def get(self, key: str) -> Session | None:
        return self.get_now(key)

    async def get_many(self, keys: Sequence[str]) -> list[Session | None]:
        return [self.get_now(key) for key in keys]

    async def put(self, key: str, session: Session) -> None:
        self.put_now(key, session)

    async def put_many(self, keys: Sequence[str], session: Session) -> None:
        for key in keys:
            self.put_now(key, session)

    async def expire(self) -> int:
        return self.expire_now()

    def get_now(self, key: str) -> Session | None:
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

    def put_now(self, key: str, session: Session) -> None:
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

    def items(self) -> list[tuple[str, Session]]:
        """Every entry held, least recently used first (idle ones too, until a sweep drops them)."""
        return [(key, entry.session) for key, entry in self._entries.items()]

    def expire_now(self) -> int:
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


class KeyChain:
    """A conversation's content key, computed message by message: the key of a history and, after one
    more pass over the new messages and the answer, the key of the next turn, without hashing the
    history twice.

    Each message feeds length-prefixed fields (role, content text, optional fields as canonical JSON),
    so no two different conversations feed the same bytes, and serialisation details (key order, text
    parts vs a string, null or empty optional fields) do not matter. Lone surrogates are hashed as
    they are instead of failing."""

    __slots__ = ("_h",)

    def __init__(self, model: str, *, _h: _Hash | None = None) -> None:
        if _h is not None:
            self._h = _h
            return
        # SHA-256 (hardware-accelerated on current CPUs: ~2 GB/s here, 2.5x BLAKE2b), cut to 128 bits.
        self._h = hashlib.sha256()
        pieces: list[bytes] = []
        _field(pieces, model)
        self._h.update(b"".join(pieces))

    def add(self, message: Mapping[str, Any]) -> KeyChain:
        return self.extend((message,))

    def extend(self, messages: Sequence[Mapping[str, Any]]) -> KeyChain:
        # One update per call: OpenSSL's per-update cost is larger than hashing a few KB.
        pieces: list[bytes] = []
        for message in messages:
            extra = {k: message[k] for k in _MESSAGE_FIELDS if message.get(k)}
            _field(pieces, str(message.get("role")))
            _field(pieces, _content_text(message.get("content")))
            _field(pieces, _canonical_json(extra) if extra else "")
        self._h.update(b"".join(pieces))
        return self

    def extend_marking(
        self, messages: Sequence[Mapping[str, Any]], marks: Iterable[int]
    ) -> dict[int, tuple[str, str]]:
        """Feeds `messages` like `extend`, and for each index i in `marks` (within them) returns the key
        just before `messages[i]` and the key just after it: one pass, each message hashed once."""
        keys: dict[int, tuple[str, str]] = {}
        start = 0
        for i in sorted({m for m in marks if 0 <= m < len(messages)}):
            before = self.extend(messages[start:i]).key()
            keys[i] = (before, self.add(messages[i]).key())
            start = i + 1
        self.extend(messages[start:])
        return keys

    def fork(self) -> KeyChain:
        return KeyChain("", _h=self._h.copy())

    def key(self) -> str:
        return CONTENT_PREFIX + self._h.hexdigest()[:32]


#: Rule 1's keys: content keys ("c:": a history up to and including an answer, and what a turn was
#: sent as `Session.history_key`), the same hash as the key of a turn's sent messages ("s:", rule 4).
CONTENT_PREFIX: Final = "c:"
SENT_PREFIX: Final = "s:"


def sent_key(history_key: str) -> str:
    """The store key of a chat turn's state under the content key of the messages it was sent (rule 4):
    apart from every answer key, whose history may end with the same messages."""
    return SENT_PREFIX + history_key.removeprefix(CONTENT_PREFIX)


def is_chat_key(history_key: str) -> bool:
    """Whether a session's `history_key` is a chat history's content key (not a completions prompt's)."""
    return history_key.startswith(CONTENT_PREFIX)


def _field(pieces: list[bytes], text: str) -> None:
    data = text.encode("utf-8", "surrogatepass")
    pieces.append(len(data).to_bytes(8, "little"))
    pieces.append(data)


def _canonical_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    # Images, audio, ...: the parts themselves, marked so they never equal a plain text.
    return "\x00json:" + _canonical_json(content)


def _prompt_units(prompt: Any) -> str | list[int] | None:
    """A completions prompt as its text or its token ids (one of either inside a list too); None for
    anything else."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    return None


def _prompt_key(model: str, units: str | list[int]) -> str:
    pieces: list[bytes] = []
    _field(pieces, model)
    if isinstance(units, str):
        _field(pieces, units)
        return "t:" + hashlib.sha256(b"".join(pieces)).hexdigest()[:32]
    _field(pieces, ",".join(map(str, units)))
    return "i:" + hashlib.sha256(b"".join(pieces)).hexdigest()[:32]


def prompt_fingerprint(model: str, prompt: Any, answer: str) -> tuple[str, int]:
    """Rule 2 for completions: (key, length) of what the next prompt of the session must start with:
    a text prompt followed by the answer's text (characters), or a token-id prompt's ids (the answer's
    ids are not known here); ("", 0) for a prompt of another form."""
    units = _prompt_units(prompt)
    if units is None:
        return "", 0
    if isinstance(units, str):
        units += answer
    return _prompt_key(model, units), len(units)


def prompt_is_text(prompt: Any) -> bool:
    """A completions prompt whose answer's text the gateway can check (not token ids)."""
    return isinstance(_prompt_units(prompt), str)


def prompt_extends(session: Session, model: str, prompt: Any) -> bool | None:
    """Whether a completions `prompt` continues `session` (rule 2): it starts with the fingerprinted
    prefix. None: the session keeps no fingerprint (an older entry)."""
    if not session.history_key:
        return None
    units = _prompt_units(prompt)
    n = session.history_messages
    if units is None or len(units) < n:
        return False
    return _prompt_key(model, units[:n]) == session.history_key


def content_key(model: str, messages: Sequence[Mapping[str, Any]]) -> str:
    return KeyChain(model).extend(messages).key()


def explicit_key(session_id: str) -> str:
    return "x:" + hashlib.blake2b(session_id.encode("utf-8"), digest_size=16).hexdigest()
