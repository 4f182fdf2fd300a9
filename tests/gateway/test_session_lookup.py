"""Finding a chat session without the answer (issue 25 item 2): a turn is also remembered under the
content key of what it was sent, and a request finds the longest stored prefix of its history that
ends right before an assistant message, one store call for every candidate."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from gateway.session_lookup import find_session, remember_turn
from gateway.sessions import InMemorySessionStore, KeyChain, Session, content_key, split_history

M = "m"
D_PARAMS = '{"do_remote_decode":true}'


def u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


class CountingStore(InMemorySessionStore):
    """The in-memory store, counting the calls a lookup makes."""

    def __init__(self) -> None:
        super().__init__(ttl_s=60.0, max_entries=1000, clock=lambda: 0.0)
        self.calls: list[tuple[str, int]] = []

    async def get(self, key: str) -> Session | None:
        self.calls.append(("get", 1))
        return await super().get(key)

    async def get_many(self, keys: Sequence[str]) -> list[Session | None]:
        self.calls.append(("get_many", len(keys)))
        return await super().get_many(keys)


def _turn(
    session_id: str, sent: list[dict[str, Any]], *, turns: int = 1, answer: str | None = None
) -> Session:
    """The state after a turn that was sent `sent`; `answer`: the text returned, when the front door
    saw it (None: a front door that never reads the answer, as the Envoy picker will not)."""
    chain = KeyChain(M).extend(sent)
    answer_key = chain.fork().add(a(answer)).key() if answer is not None else ""
    return Session(session_id, worker="D0", turns=turns - 1).after_turn(
        worker="D0",
        prompt_tokens=10,
        completion_tokens=2,
        history_key=chain.key(),
        history_messages=len(sent),
        answer_key=answer_key,
        decode_kv_params=D_PARAMS,
        decode_kv_expires_at=99.0,
    )


async def _find(store: Any, messages: list[dict[str, Any]], *, explicit: str | None = None, **kw: Any) -> Any:
    return await find_session(
        store, explicit=explicit, endpoint="chat", model=M, messages=messages, new_id=lambda: "new", **kw
    )


async def test_a_follow_up_finds_a_turn_remembered_without_its_answer() -> None:
    """A front door that never saw the answer (the picker) remembers the turn under what it was sent;
    the follow-up, whatever the answer's text, continues it, but never on the stored D params."""
    store = CountingStore()
    sent = [u("hi")]
    await remember_turn(store, _turn("s1", sent), explicit_id=None)
    assert await store.get(content_key(M, [*sent, a("hello")])) is None  # no answer-keyed entry
    match = await _find(store, [*sent, a("hello"), u("more")])
    assert (match.session_id, match.turn, match.history_end, match.lookup) == ("s1", 2, 2, "exact")
    assert match.session.decode_kv_params == ""  # the answer is not known to be the one returned


async def test_a_turn_whose_answer_is_known_is_found_without_the_answer_keyed_entry() -> None:
    """The gateway saw the answer: the entry under the sent key carries the answer's key, so the
    follow-up that carries that answer is found (with its D params) even when the answer-keyed entry
    is gone, and one that carries another answer is not this conversation."""
    store = CountingStore()
    sent = [u("hi")]
    await store.put_many([content_key(M, sent).replace("c:", "s:", 1)], _turn("s1", sent, answer="hello"))
    found = await _find(store, [*sent, a("hello"), u("more")])
    assert (found.session_id, found.turn, found.lookup) == ("s1", 2, "exact")
    assert found.session.decode_kv_params == D_PARAMS
    other = await _find(store, [*sent, a("never said"), u("more")])
    assert (other.session, other.turn, other.lookup) == (None, 1, "miss")


async def test_the_longest_stored_prefix_wins() -> None:
    store = CountingStore()
    one = [u("q1")]
    two = [*one, a("r1"), u("q2")]
    three = [*two, a("r2"), u("q3")]
    await remember_turn(store, _turn("s1", one, answer="r1"), explicit_id=None)
    await remember_turn(store, _turn("s1", two, turns=2, answer="r2"), explicit_id=None)
    # The third answer was never seen here (another front door, or the client's own): the longest
    # state known is turn 2's, and everything after it is new input for ψ.
    request = [*three, a("r3 from elsewhere"), u("q4")]
    match = await _find(store, request)
    assert (match.session_id, match.turn, match.history_end, match.lookup) == ("s1", 3, 4, "prefix")
    assert match.new_messages_from == 4
    assert store.calls == [("get_many", 6)]  # both keys of each of the three candidates, one call
    # The whole history known: the longest candidate.
    exact = await _find(store, [*two, a("r2"), u("q3")])
    assert (exact.turn, exact.history_end, exact.lookup) == (3, 4, "exact")


async def test_the_lookup_is_bounded_to_the_latest_candidates() -> None:
    store = CountingStore()
    history: list[dict[str, Any]] = [u("q0")]
    await remember_turn(store, _turn("s1", list(history), answer="r0"), explicit_id=None)
    for t in range(1, 6):
        history += [a(f"unseen {t}"), u(f"q{t}")]
    history[1] = a("r0")  # the first answer is the one returned; the rest were never seen
    assert split_history(history)[1] == 5
    far = await _find(store, history, max_candidates=4)
    assert (far.session, far.lookup) == (None, "miss")
    assert store.calls[-1] == ("get_many", 8)
    near = await _find(store, history, max_candidates=5)
    assert (near.session_id, near.turn, near.history_end, near.lookup) == ("s1", 2, 2, "prefix")
    assert store.calls[-1] == ("get_many", 10)


async def test_a_first_turn_looks_nothing_up() -> None:
    store = CountingStore()
    match = await _find(store, [{"role": "system", "content": "s"}, u("hi")])
    assert (match.session, match.turn, match.lookup) == (None, 1, "")
    assert store.calls == []


def test_key_chain_marks_every_candidate_in_one_pass() -> None:
    history = [u("a"), a("b"), u("c"), a("d"), u("e")]
    chain = KeyChain(M)
    marks = chain.extend_marking(history, (3, 1))
    assert marks == {
        1: (content_key(M, history[:1]), content_key(M, history[:2])),
        3: (content_key(M, history[:3]), content_key(M, history[:4])),
    }
    assert chain.key() == content_key(M, history)


def test_key_chain_hashes_each_message_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidate keys cost one pass: every byte any hash object (copies included) is fed, counted,
    is the same for 50 candidates as for none (never a prefix hashed again per candidate)."""
    import hashlib

    fed: list[int] = []
    real_sha256 = hashlib.sha256

    class Spy:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def update(self, data: bytes) -> None:
            fed.append(len(data))
            self.inner.update(data)

        def copy(self) -> Spy:
            return Spy(self.inner.copy())

        def hexdigest(self) -> str:
            return str(self.inner.hexdigest())

    monkeypatch.setattr(hashlib, "sha256", lambda *args: Spy(real_sha256(*args)))
    history = [m for i in range(50) for m in (u("x" * 100 + str(i)), a("y" * 100 + str(i)))]
    KeyChain(M).extend_marking(history, range(1, 100, 2))
    marking = sum(fed)
    fed.clear()
    KeyChain(M).extend(history)
    assert marking == sum(fed) > 100 * 100


@pytest.mark.parametrize("answer", ["hello", None])
async def test_a_named_session_gets_its_d_params_only_with_the_answer_returned(answer: str | None) -> None:
    """Rule 2 for D params without a second lookup: the session carries the key of (what it was sent +
    the answer returned); a history with another answer, or an entry whose answer is unknown, is
    served without them."""
    store = CountingStore()
    sent = [u("my plan")]
    await remember_turn(store, _turn("s1", sent, answer=answer), explicit_id="s1")
    real = await _find(store, [*sent, a("hello"), u("go on")], explicit="s1")
    guessed = await _find(store, [*sent, a("a guess"), u("go on")], explicit="s1")
    assert (real.turn, real.reset, guessed.turn, guessed.reset) == (2, "", 2, "")
    assert real.session.decode_kv_params == (D_PARAMS if answer is not None else "")
    assert guessed.session.decode_kv_params == ""
    assert store.calls == [("get", 1), ("get", 1)]  # the id's entry alone: no second lookup


async def test_a_fork_of_a_named_session_finds_the_longest_known_state() -> None:
    store = CountingStore()
    one = [u("q1")]
    two = [*one, a("r1"), u("q2")]
    await remember_turn(store, _turn("s1", one, answer="r1"), explicit_id="s1")
    await remember_turn(store, _turn("s1", two, turns=2, answer="r2"), explicit_id="s1")
    edited = await _find(store, [*one, a("r1"), u("q2, edited")], explicit="s1")
    assert (edited.turn, edited.reset, edited.history_end, edited.lookup) == (2, "fork", 2, "exact")
    assert edited.session.decode_kv_params == D_PARAMS
    unknown = await _find(store, [u("other"), a("x"), u("y")], explicit="s1")
    assert (unknown.session, unknown.turn, unknown.reset, unknown.lookup) == (None, 1, "new_history", "miss")


async def test_histories_that_share_what_was_sent_keep_their_own_sessions() -> None:
    """Why a turn keeps its answer-keyed entry too: one sent history answered two ways (two
    conversations that start alike, or a regeneration) has one sent key but two answer keys, and each
    follow-up continues its own state."""
    store = CountingStore()
    sent = [u("hi")]
    await remember_turn(store, _turn("first", sent, answer="Hello!"), explicit_id=None)
    await remember_turn(store, _turn("second", sent, answer="Hey."), explicit_id=None)  # last writer
    for answer, session_id in (("Hello!", "first"), ("Hey.", "second")):
        match = await _find(store, [*sent, a(answer), u("more")])
        assert (match.session_id, match.turn, match.lookup) == (session_id, 2, "exact")
        assert match.session.decode_kv_params == D_PARAMS
