"""Content-addressed session keys and the bounded in-memory store (injected clock, no sleeping)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gateway.session_lookup import history_extends
from gateway.sessions import (
    MAX_OUTPUT_HISTORY,
    InMemorySessionStore,
    KeyChain,
    Session,
    content_key,
    explicit_key,
    split_history,
)

M = "llama"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([u("hi")], (0, 0)),
        ([{"role": "system", "content": "s"}, u("hi")], (0, 0)),
        ([u("hi"), a("yo"), u("more")], (2, 1)),
        ([u("hi"), a("yo"), u("more"), a("ok"), u("x"), u("y")], (4, 2)),
        ([u("hi"), a("yo")], (2, 1)),
    ],
)
def test_split_history(messages: list[dict[str, Any]], expected: tuple[int, int]) -> None:
    assert split_history(messages) == expected


def test_follow_up_finds_the_key_written_after_the_previous_turn() -> None:
    after_turn_1 = content_key(M, [u("hi"), a("hello!")])
    turn_2 = [u("hi"), a("hello!"), u("tell me more")]
    end, _ = split_history(turn_2)
    assert content_key(M, turn_2[:end]) == after_turn_1


def test_edit_and_regeneration_find_the_state_before_the_turn() -> None:
    turn_2 = [u("hi"), a("hello!"), u("tell me more")]
    edited = [u("hi"), a("hello!"), u("tell me less")]
    assert content_key(M, turn_2[:2]) == content_key(M, edited[: split_history(edited)[0]])


def test_conversations_that_start_alike_do_not_share_a_key() -> None:
    assert content_key(M, [u("hi"), a("Hello!")]) != content_key(M, [u("hi"), a("Hey.")])
    assert content_key(M, [u("hi"), a("x")]) != content_key("other-model", [u("hi"), a("x")])
    assert content_key(M, [u("hi"), a("x")]) != content_key(M, [{"role": "system", "content": "hi"}, a("x")])


@pytest.mark.parametrize(
    "variant",
    [
        {"role": "assistant", "content": "yo"},
        {"content": "yo", "role": "assistant"},
        {"role": "assistant", "content": [{"type": "text", "text": "y"}, {"type": "text", "text": "o"}]},
        {"role": "assistant", "content": "yo", "tool_calls": None, "refusal": None, "annotations": []},
    ],
)
def test_key_ignores_how_a_client_serialises_a_message(variant: dict[str, Any]) -> None:
    assert content_key(M, [u("hi"), variant]) == content_key(M, [u("hi"), a("yo")])


def test_tool_calls_are_part_of_the_key() -> None:
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f"}}]}
    assert content_key(M, [u("hi"), call]) != content_key(M, [u("hi"), a("")])


def test_explicit_keys_live_apart_from_content_keys() -> None:
    assert explicit_key("abc") != explicit_key("abd")
    assert explicit_key("abc").startswith("x:")
    assert content_key(M, []).startswith("c:")


def test_session_after_turn_tracks_context_and_bounded_history() -> None:
    s = Session("s")
    for i in range(MAX_OUTPUT_HISTORY + 3):
        s = s.after_turn(worker="D1", prompt_tokens=100 + i, completion_tokens=i)
    assert s.turns == MAX_OUTPUT_HISTORY + 3
    assert s.worker == "D1"
    assert s.context_tokens == 100 + 2 * (MAX_OUTPUT_HISTORY + 2)
    assert len(s.output_lengths) == MAX_OUTPUT_HISTORY
    assert s.output_lengths[-1] == MAX_OUTPUT_HISTORY + 2
    assert Session("x").mean_output() is None


def test_store_expires_idle_entries_lazily_and_in_sweeps() -> None:
    clock = FakeClock()
    store = InMemorySessionStore(ttl_s=60, max_entries=10, clock=clock)
    store.put_now("a", Session("a"))
    store.put_now("b", Session("b"))
    clock.now += 30
    assert store.get_now("a") is not None  # touching a renews it
    clock.now += 31
    assert store.get_now("b") is None
    assert store.get_now("a") is not None
    clock.now += 61
    assert store.expire_now() == 1
    assert len(store) == 0


def test_store_evicts_least_recently_used_at_the_bound() -> None:
    clock = FakeClock()
    store = InMemorySessionStore(ttl_s=60, max_entries=3, clock=clock)
    for key in "abc":
        store.put_now(key, Session(key))
    store.get_now("a")
    store.put_now("d", Session("d"))
    assert store.get_now("b") is None
    assert {k for k in "acd" if store.get_now(k) is not None} == set("acd")
    assert len(store) == 3
    assert store.evicted == 1


def test_store_memory_stays_bounded_under_any_traffic() -> None:
    clock = FakeClock()
    store = InMemorySessionStore(ttl_s=5, max_entries=100, clock=clock)
    for i in range(10_000):
        clock.now += 0.001
        store.put_now(f"k{i}", Session(str(i)))
        assert len(store) <= 100
    clock.now += 10
    store.expire_now()
    assert len(store) == 0


def test_store_rejects_non_positive_bounds() -> None:
    with pytest.raises(ValueError, match="positive"):
        InMemorySessionStore(ttl_s=0, max_entries=1, clock=FakeClock())


def test_key_chain_extends_a_history_without_rehashing_it() -> None:
    history = [u("hi"), a("yo"), u("more")]
    chain = KeyChain(M).extend(history[:2])
    assert chain.key() == content_key(M, history[:2])
    chain.add(history[2])
    forked = chain.fork().add(a("answer"))
    assert forked.key() == content_key(M, [*history, a("answer")])
    assert chain.key() == content_key(M, history)  # the fork left the original alone


def test_lone_surrogates_and_non_text_parts_hash() -> None:
    assert content_key(M, [u("\ud800 broken")]) != content_key(M, [u("broken")])
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}
    text = {"role": "user", "content": '[{"image_url":{"url":"data:x"},"type":"image_url"}]'}
    assert content_key(M, [image]) != content_key(M, [text])


def test_field_boundaries_are_unambiguous() -> None:
    assert content_key(M, [u("ab"), u("c")]) != content_key(M, [u("a"), u("bc")])
    assert content_key("m1", [u("x")]) != content_key("m", [u("1x")])


def test_a_history_extends_a_session_only_through_what_it_was_sent() -> None:
    sent = [u("a"), a("one"), u("b")]
    session = Session("s", turns=2, history_key=content_key(M, sent), history_messages=len(sent))

    def check(messages: list[dict[str, Any]]) -> tuple[bool | None, str]:
        upto = split_history(messages)[0]
        chain = KeyChain(M)
        marks = chain.extend_marking(messages[:upto], [session.history_messages])
        verdict = history_extends(session, marks, messages, upto)
        assert chain.key() == content_key(M, messages[:upto])  # the history is fed exactly once
        return verdict, chain.key()

    assert check([*sent, a("two"), u("c")])[0] is True
    assert check([*sent, a("said otherwise"), u("c")])[0] is True  # the answer's form is not compared
    assert check([*sent, a("two"), u("c"), a("three"), u("d")])[0] is True
    assert check([u("a")])[0] is False  # a new conversation under the same id
    assert check([u("a"), a("one"), u("b, edited")])[0] is False  # the last turn edited: a fork
    assert check([u("A"), a("one"), u("b"), a("two"), u("c")])[0] is False
    assert check([*sent, u("more"), a("two"), u("c")])[0] is False  # no answer right after what was sent
    unknown = Session("s", turns=2)
    assert history_extends(unknown, {}, [u("x")], 0) is None


async def test_find_session_continues_forks_or_starts_a_conversation() -> None:
    from gateway.session_lookup import find_session
    from gateway.sessions import InMemorySessionStore, KeyChain, explicit_key

    store = InMemorySessionStore(ttl_s=60.0, max_entries=100, clock=lambda: 0.0)
    ids = iter(["new1", "new2", "new3"])
    first = [{"role": "user", "content": "hi"}]
    fresh = await find_session(
        store, explicit=None, endpoint="chat", model="m", messages=first, new_id=lambda: next(ids)
    )
    assert (fresh.session, fresh.session_id, fresh.turn, fresh.reset) == (None, "new1", 1, "")
    assert fresh.new_messages_from == 0
    after = Session("new1").after_turn(
        worker="D0",
        prompt_tokens=5,
        completion_tokens=2,
        history_key=KeyChain("m").extend(first).key(),
        history_messages=1,
    )
    follow_up = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    await store.put(KeyChain("m").extend(follow_up[:2]).key(), after)
    await store.put(explicit_key("named"), after)
    found = await find_session(
        store, explicit=None, endpoint="chat", model="m", messages=follow_up, new_id=lambda: next(ids)
    )
    assert (found.session_id, found.turn, found.history_end, found.new_messages_from) == ("new1", 2, 2, 2)
    named = await find_session(
        store, explicit="named", endpoint="chat", model="m", messages=follow_up, new_id=lambda: next(ids)
    )
    assert (named.session_id, named.turn, named.reset) == ("new1", 2, "")
    other = [{"role": "user", "content": "a new story"}]
    reused = await find_session(
        store, explicit="named", endpoint="chat", model="m", messages=other, new_id=lambda: next(ids)
    )
    assert (reused.session, reused.session_id, reused.turn, reused.reset) == (None, "named", 1, "new_history")


@pytest.mark.parametrize(
    ("prompt", "continues", "keeps_d_params"),
    [
        ("Once upon a time there was more", True, True),  # prompt + answer + more
        ("Once upon a time", True, True),  # exactly the prompt and its answer
        (["Once upon a time there"], True, True),  # one prompt in a list
        ("Once", False, False),  # the prompt without the answer
        ("Once upon a dime there was", False, False),  # another answer
        ("Something else entirely", False, False),
        ([1, 2, 3], False, False),  # token ids after a text prompt
    ],
)
async def test_a_completions_prompt_continues_a_named_session_only_by_extending_it(
    prompt: Any, continues: bool, keeps_d_params: bool
) -> None:
    from gateway.session_lookup import find_session
    from gateway.sessions import InMemorySessionStore, prompt_fingerprint

    key, length = prompt_fingerprint("m", "Once", " upon a time")
    assert length == len("Once upon a time")
    last = Session("c1", worker="D0", turns=1).after_turn(
        worker="D0",
        prompt_tokens=1,
        completion_tokens=4,
        history_key=key,
        history_messages=length,
        decode_kv_params='{"do_remote_decode":true}',
        decode_kv_expires_at=99.0,
    )
    store = InMemorySessionStore(ttl_s=60.0, max_entries=100, clock=lambda: 0.0)
    await store.put(explicit_key("c1"), last)
    match = await find_session(
        store,
        explicit="c1",
        endpoint="completions",
        model="m",
        messages=(),
        new_id=lambda: "x",
        prompt=prompt,
    )
    assert (match.turn, match.reset) == ((3, "") if continues else (1, "new_history"))
    assert (match.session is not None and bool(match.session.decode_kv_params)) is keeps_d_params


async def test_token_id_and_unfingerprinted_completions_continue_without_ds_params() -> None:
    """The gateway cannot check a token-id prompt's answer part (it does not see the answer's ids),
    nor anything for an entry without a fingerprint: they continue, but never on the stored params."""
    from gateway.session_lookup import find_session
    from gateway.sessions import InMemorySessionStore, prompt_fingerprint

    key, length = prompt_fingerprint("m", [5, 6, 7], "ignored")
    assert length == 3
    held = Session(
        "ids", worker="D0", turns=1, decode_kv_params='{"do_remote_decode":true}', decode_kv_expires_at=99.0
    )
    store = InMemorySessionStore(ttl_s=60.0, max_entries=100, clock=lambda: 0.0)
    await store.put(explicit_key("ids"), replace(held, history_key=key, history_messages=3))
    await store.put(explicit_key("old"), replace(held, id="old"))
    for explicit, prompt, turn in (("ids", [5, 6, 7, 8, 9], 2), ("ids", [5, 6], 1), ("old", "anything", 2)):
        match = await find_session(
            store,
            explicit=explicit,
            endpoint="completions",
            model="m",
            messages=(),
            new_id=lambda: "x",
            prompt=prompt,
        )
        assert match.turn == turn, (explicit, prompt)
        assert match.session is None or match.session.decode_kv_params == ""


def test_a_turn_without_ps_token_ids_keeps_the_last_p_prompts_marks() -> None:
    marked = Session("s").after_turn(
        worker="D0", prompt_tokens=100, completion_tokens=10, prompt_marks="1:5,6:9"
    )
    assert marked.prompt_marks == "1:5,6:9"
    local = marked.after_turn(worker="D0", prompt_tokens=130, completion_tokens=10)  # no P leg
    assert local.prompt_marks == "1:5,6:9"
    again = local.after_turn(worker="D1", prompt_tokens=160, completion_tokens=10, prompt_marks="1:5,8:3")
    assert again.prompt_marks == "1:5,8:3"
