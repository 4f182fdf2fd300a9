"""Which session a request continues, and where a finished turn is remembered (sessions.py's rules
applied to one request; sessions.py owns the keys, the Session and the stores).

Rule 1 (remembering a turn, `remember_turn`): a chat turn's state goes under the content key of the
messages it was sent (`sessions.sent_key`: what any front door can compute, the Envoy picker of issue
25 included, which never sees the answer) and, when the answer is known, under the key of those
messages + the answer (the answer key, `Session.answer_key`), in one store call; plus the session's
explicit id when one was named. Two entries per chat turn, by choice: one sent history can be answered
several ways (a regeneration; two conversations that start alike), and only the answer keys keep
each of those histories apart. One entry under the sent key alone would hold only the last answer,
so a follow-up of the other would be lost.
Rule 2 (finding a chat session by content, `find_session`): the candidates are the prefixes of the
request's history that end right before an assistant message (`messages[:i]`, `messages[i]` an
answer), the latest `max_candidates` of them (`sessions.prefix_candidates`), keyed in one pass over
the messages (`KeyChain.extend_marking`) and looked up in one store call (one Redis round trip). The
longest candidate with a state wins: its answer key (that exact history), else its sent key holding
a state whose answer key is this history's (the answer-keyed entry evicted) or that knows no answer
(a front door that never saw it). A sent-key state with another answer is another conversation that
started alike (or this one with an edited answer): not this history, the next shorter candidate is
tried. So two conversations that merely start alike still never share a session while the gateway
saw their answers. The trade-off, for states whose answer is unknown: a client that edits the
assistant's answer continues the session; the worker's KV then no longer matches the text, which
costs only performance (vLLM's prefix cache misses from the edit on), never correctness. A state found
at a shorter candidate (`lookup` "prefix", vs "exact" for the whole history) is continued with every
message after its answer as new input (ψ); a history with no candidate looks nothing up.
Rule 3 (explicit ids): a named session is continued only by a history that extends what its last
turn was sent (`history_extends`); one that does not is a fork from the state rule 2 finds, else a
new conversation (`reset`). Its D params (bidir) are used only when the answer in the history is the
one the gateway returned: the key of the history up to that answer equals `Session.answer_key`,
computed in the same pass (no second lookup). An entry without an answer key (a front door that never
saw the answer, or a replica of the previous version during a rolling upgrade) is continued without
them (full PD for that turn). Completions: sessions.py rule 2, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

from gateway.sessions import (
    KeyChain,
    Session,
    SessionStore,
    explicit_key,
    is_chat_key,
    prompt_extends,
    prompt_is_text,
    sent_key,
    split_history,
)
from gateway.settings import SessionSettings
from gateway.types import Endpoint

__all__ = ["Lookup", "SessionMatch", "find_session", "history_extends", "remember_turn"]

#: How a chat request's content lookup went ("": none was made: no history, or a named session).
Lookup = Literal["exact", "prefix", "miss", ""]
_CANDIDATES: Final = SessionSettings().prefix_candidates
# Index -> (key of the messages before it, key of the messages up to and including it).
_Marks = Mapping[int, tuple[str, str]]


@dataclass(frozen=True, slots=True)
class SessionMatch:
    """Which session a request continues, and what it adds."""

    # The session id the client named (header or body); None when none was named.
    explicit_id: str | None
    # The session this request continues; None for a new conversation (turn 1).
    session: Session | None
    session_id: str
    turn: int
    # Index of the first message this turn adds (chat): after the last assistant message, or after the
    # answer of the state found when that is an earlier one (rule 2); the messages before it are history.
    history_end: int
    # The content-key chain over every message of the request (chat only): + the answer = next key.
    chain: KeyChain | None
    # Why a named session was not continued ("fork", "new_history"); "" when it was (or none was named).
    reset: str
    # How the content lookup went (rule 2), for ppd_gateway_session_lookups_total.
    lookup: Lookup = ""

    @property
    def new_messages_from(self) -> int:
        """The index of the first message ψ counts: the whole request for a new conversation."""
        return self.history_end if self.session is not None else 0


def history_extends(
    session: Session, marks: _Marks, messages: Sequence[Mapping[str, Any]], upto: int
) -> bool | None:
    """Whether the request's history `messages[:upto]` continues what `session` was last sent: it
    starts with those messages (same content key: `marks` must hold the index after them) and an
    answer follows them. None: the session keeps no fingerprint (an older entry); a completions turn's
    never matches a chat history (`prompt_fingerprint`)."""
    n = session.history_messages
    if not n or not session.history_key:
        return None
    if n >= upto or messages[n].get("role") != "assistant":
        return False
    return marks[n][0] == session.history_key


def _answers(messages: Sequence[Mapping[str, Any]], upto: int, most: int) -> list[int]:
    """The indices of the latest `most` assistant messages before `upto`, latest first."""
    found: list[int] = []
    for i in range(upto - 1, -1, -1):
        if len(found) == most:
            break
        if messages[i].get("role") == "assistant":
            found.append(i)
    return found


def _without_params(session: Session) -> Session:
    return replace(session, decode_kv_params="", decode_kv_expires_at=0.0)


async def _longest_known(
    store: SessionStore, marks: _Marks, candidates: Sequence[int]
) -> tuple[Session | None, int, Lookup]:
    """Rule 2: (the state, the index after its answer, exact|prefix) of the longest candidate with
    one; (None, 0, miss) when none has."""
    keys: list[str] = []
    for i in candidates:
        keys += [marks[i][1], sent_key(marks[i][0])]
    found = await store.get_many(keys)
    for j, i in enumerate(candidates):
        by_answer, by_sent = found[2 * j], found[2 * j + 1]
        if by_answer is not None:
            session = by_answer
        elif by_sent is not None and by_sent.answer_key == marks[i][1]:
            session = by_sent
        elif by_sent is not None and not by_sent.answer_key:
            session = _without_params(by_sent)  # the answer is not known to be the one returned
        else:
            continue
        return session, i + 1, "exact" if j == 0 else "prefix"
    return None, 0, "miss"


async def find_session(
    store: SessionStore,
    *,
    explicit: str | None,
    endpoint: Endpoint,
    model: str,
    messages: Sequence[Mapping[str, Any]],
    new_id: Callable[[], str],
    prompt: Any = None,
    max_candidates: int = _CANDIDATES,
) -> SessionMatch:
    """Rules 2 and 3 for one request (`prompt`: a completions request's)."""
    history_end = split_history(messages)[0] if messages else 0
    session: Session | None = None
    chain: KeyChain | None = None
    reset = ""
    lookup: Lookup = ""
    if explicit:
        session = await store.get(explicit_key(explicit))
    if endpoint == "chat":
        chain = KeyChain(model)
        candidates = _answers(messages, history_end, max_candidates)
        n = session.history_messages if session is not None else 0
        fed = history_end
        marks = chain.extend_marking(messages[:fed], [*candidates, n] if n else candidates)
        if session is not None:
            extends = history_extends(session, marks, messages, history_end)
            if extends is False:
                found: Session | None = None
                if candidates:
                    found, end, lookup = await _longest_known(store, marks, candidates)
                    history_end = end or history_end
                session = replace(found, id=explicit or session.id) if found is not None else None
                reset = "fork" if found is not None else "new_history"
            elif session.decode_kv_params and not (extends and marks[n][1] == session.answer_key):
                session = _without_params(session)
        elif not explicit and candidates:
            session, end, lookup = await _longest_known(store, marks, candidates)
            history_end = end or history_end
        chain.extend(messages[fed:])
    elif session is not None:
        extends = prompt_extends(session, model, prompt)
        if extends is False:
            session, reset = None, "new_history"
        elif extends is None or not prompt_is_text(prompt):
            session = _without_params(session)
    return SessionMatch(
        explicit_id=explicit,
        session=session,
        session_id=session.id if session is not None else (explicit or new_id()),
        turn=session.turns + 1 if session is not None else 1,
        history_end=history_end,
        chain=chain,
        reset=reset,
        lookup=lookup,
    )


async def remember_turn(store: SessionStore, session: Session, *, explicit_id: str | None) -> None:
    """Rule 1: `session` (the state after a turn) under every key that finds it, in one store call.
    A front door that never sees the answer passes a session without `answer_key`."""
    keys = [explicit_key(explicit_id)] if explicit_id else []
    if is_chat_key(session.history_key):
        keys.append(sent_key(session.history_key))
        if session.answer_key:
            keys.append(session.answer_key)
    if keys:
        await store.put_many(keys, session)
