"""gateway/answer_observer.py: what the picker learns from an answer Envoy passes on, chunk by chunk
(each of its rules provoked, any split of the stream)."""

from __future__ import annotations

import json

import pytest

from gateway.answer_observer import AnswerObserver
from gateway.turn import TurnOutcome


def _event(content: str | None = None, **extra: object) -> bytes:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    return b"data: " + json.dumps({"id": "c1", "choices": choices, **extra}).encode() + b"\n\n"


ROLE = b'data: {"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
STREAM = [ROLE, _event("hel"), _event("lo"), _event(" there"), b"data: [DONE]\n\n"]


def _observer(*, stream: bool = True, max_body_bytes: int = 1 << 20) -> tuple[AnswerObserver, TurnOutcome]:
    outcome = TurnOutcome()
    observer = AnswerObserver(outcome, stream=stream, start=10.0, worker="D0", max_body_bytes=max_body_bytes)
    return observer, outcome


def test_a_stream_gives_ttft_the_last_token_and_the_answer_at_done() -> None:
    observer, outcome = _observer()
    got = [observer.feed(chunk, 11.0 + i) for i, chunk in enumerate(STREAM)]
    assert got[:-1] == [None] * 4  # complete only at [DONE] (rule 2)
    answer = got[-1]
    assert answer is not None
    assert (answer.text, answer.chunks, answer.usage) == ("hello there", 3, None)
    assert outcome.ttft == pytest.approx(2.0)  # the first content chunk (12.0), not the role chunk
    assert outcome.last_token == pytest.approx(14.0)
    assert outcome.error is None
    assert observer.complete
    assert observer.end() is None  # once


@pytest.mark.parametrize("size", [1, 3, 7, 50])
def test_any_split_of_the_stream_learns_the_same(size: int) -> None:
    raw = b"".join(STREAM[:-1]) + _event(None, usage={"prompt_tokens": 5, "completion_tokens": 3})
    raw += b"data: [DONE]\n\n"
    observer, outcome = _observer()
    answers = [observer.feed(raw[i : i + size], 20.0) for i in range(0, len(raw), size)]
    done = [a for a in answers if a is not None]
    assert len(done) == 1
    assert done[0].text == "hello there"
    assert done[0].usage is not None
    assert (done[0].usage.prompt_tokens, done[0].usage.completion_tokens) == (5, 3)
    assert outcome.ttft == pytest.approx(10.0)


def test_a_stream_cut_before_done_is_an_error_not_an_answer() -> None:
    observer, outcome = _observer()
    for chunk in STREAM[:3]:
        assert observer.feed(chunk, 11.0) is None
    assert observer.end() is None
    assert outcome.error == "worker D0 ended the stream before [DONE]"
    assert not observer.complete


def test_a_workers_error_event_is_the_turns_error() -> None:
    observer, outcome = _observer()
    observer.feed(ROLE, 11.0)
    observer.feed(b'data: {"error":{"message":"engine died","code":500}}\n\n', 12.0)
    assert observer.feed(b"data: [DONE]\n\n", 13.0) is None
    assert observer.end() is None
    assert outcome.error == "engine died"


def test_a_whole_answer_is_read_at_the_end_without_a_ttft() -> None:
    body = {
        "choices": [{"index": 0, "message": {"content": "whole"}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2},
    }
    raw = json.dumps(body).encode()
    observer, outcome = _observer(stream=False)
    assert observer.feed(raw[:10], 11.0) is None
    assert observer.feed(raw[10:], 12.0) is None
    answer = observer.end()
    assert answer is not None
    assert answer.text == "whole"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 2
    assert answer.chunks is None
    assert outcome.ttft is None  # rule 3, as the standalone's whole answers


@pytest.mark.parametrize(
    ("raw", "limit", "error"),
    [
        (b'{"choices": [', 1 << 20, "worker D0 sent a malformed answer"),
        (b"[1, 2]", 1 << 20, "worker D0 sent a malformed answer"),
        (b'{"choices": []}' + b" " * 100, 50, "worker D0's answer is over 50 bytes: not read"),
    ],
)
def test_a_whole_answer_malformed_or_too_long_is_an_error(raw: bytes, limit: int, error: str) -> None:
    observer, outcome = _observer(stream=False, max_body_bytes=limit)
    observer.feed(raw, 11.0)
    assert observer.end() is None
    assert outcome.error == error
