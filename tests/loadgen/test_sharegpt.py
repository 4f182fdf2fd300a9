from __future__ import annotations

import io
import json
from typing import Any

import pytest

from loadgen.sharegpt import (
    ChatConversation,
    JsonArrayStream,
    SharegptLimits,
    chat_conversations,
    sharegpt_pool,
)
from loadgen.tokens import llama3_counter
from loadgen.workloads import WorkloadError


class Words:
    def count(self, text: str) -> int:
        return len(text.split())


def _item(conv_id: str, *turns: tuple[str, str]) -> dict[str, Any]:
    return {"id": conv_id, "conversations": [{"from": f, "value": v} for f, v in turns]}


def _sample(n: int) -> list[dict[str, Any]]:
    return [
        _item(
            f"c{i}",
            ("human", f"question {i} one"),
            ("gpt", "answer one two three"),
            ("human", "more"),
            ("gpt", "ok then"),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_a_truncated_array_keeps_every_complete_element(chunk: int) -> None:
    text = json.dumps(_sample(5), indent=2)
    cut = text[: text.rindex('"ok then"') - 3]  # inside the last object
    stream = JsonArrayStream(io.StringIO(cut), chunk_chars=chunk)
    items = list(stream)
    assert [i["id"] for i in items] == ["c0", "c1", "c2", "c3"]
    assert stream.truncated
    assert stream.dropped_chars > 0
    assert stream.elements == 4


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_a_complete_array_is_read_whole_even_with_numbers_across_chunks(chunk: int) -> None:
    stream = JsonArrayStream(io.StringIO(' [ 12345 , {"a": [1, 2]}, "x", 6.25e2 ]\n'), chunk_chars=chunk)
    assert list(stream) == [12345, {"a": [1, 2]}, "x", 625.0]
    assert not stream.truncated
    assert list(JsonArrayStream(io.StringIO("[]"))) == []


def test_cut_right_after_a_comma_or_before_any_element() -> None:
    stream = JsonArrayStream(io.StringIO('[{"a": 1},'))
    assert list(stream) == [{"a": 1}]
    assert stream.truncated
    assert stream.dropped_chars == 0
    empty = JsonArrayStream(io.StringIO("["))
    assert list(empty) == []
    assert empty.truncated


def test_not_an_array_or_garbage_between_elements_is_an_error() -> None:
    with pytest.raises(ValueError, match="not a JSON array"):
        list(JsonArrayStream(io.StringIO('{"a": 1}')))
    with pytest.raises(ValueError, match="expected ','"):
        list(JsonArrayStream(io.StringIO("[1 2]")))


def test_roles_parts_and_alternation_follow_vllms_converter() -> None:
    items = [
        _item("a_0", ("gpt", "hello first"), ("human", "q1"), ("chatgpt", "a1")),
        _item("a_1", ("user", "q2"), ("bard", "a2")),
        _item("b", ("human", "q1"), ("human", "again"), ("gpt", "a")),
        _item("c", ("human", "q1"), ("gpt", "a1"), ("human", "q2")),
        _item("d", ("human", "q1"), ("gpt", "  ")),
        {"no": "id"},
    ]
    convs = list(chat_conversations(items))
    assert convs == [
        ChatConversation("a", (("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"))),
        ChatConversation("c", (("user", "q1"), ("assistant", "a1"))),
    ]
    assert convs[0].pairs == 2


def test_pool_from_a_truncated_stream_sizes_turns_from_the_recorded_answers() -> None:
    text = json.dumps(_sample(6))
    pool = sharegpt_pool(Words(), seed=1, count=3, stream=io.StringIO(text[:-40]))
    assert len(pool.conversations) == 3
    conv = pool.conversation(0)
    assert conv.id.startswith("sharegpt-c")
    assert [(t.n_in, t.n_out) for t in conv.turns] == [(3, 4), (1, 2)]
    same = sharegpt_pool(Words(), seed=1, count=3, stream=io.StringIO(text[:-40]))
    assert [c.id for c in same.conversations] == [c.id for c in pool.conversations]


def test_pool_limits_cap_outputs_and_drop_conversations_over_the_context_budget() -> None:
    text = json.dumps(_sample(2))
    capped = sharegpt_pool(
        Words(), seed=0, count=1, limits=SharegptLimits(max_output_tokens=2), stream=io.StringIO(text)
    )
    assert capped.conversation(0).turns[0].n_out == 2
    with pytest.raises(WorkloadError, match="no ShareGPT conversation"):
        sharegpt_pool(
            Words(), seed=0, count=1, limits=SharegptLimits(max_context_tokens=8), stream=io.StringIO(text)
        )


def test_the_bundled_dataset_yields_seeded_multi_turn_conversations() -> None:
    counter = llama3_counter()
    pool = sharegpt_pool(counter, seed=11, count=20)
    assert len(pool.conversations) == 20
    for conv in pool.conversations:
        assert 2 <= len(conv.turns) <= 16
        assert all(t.n_in == counter.count(t.content) and 1 <= t.n_out <= 1024 for t in conv.turns)
        assert sum(t.n_in + t.n_out for t in conv.turns) <= 8192
    again = sharegpt_pool(counter, seed=11, count=20)
    assert again.conversations == pool.conversations
