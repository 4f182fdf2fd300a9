"""The sans-I/O SSE parser: any split of the bytes yields the same events (property test)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sse import SSEEvent, SSEParser, encode_data, encode_event


def _feed_all(chunks: list[bytes]) -> tuple[list[SSEEvent], SSEParser]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.end())
    return events, parser


def test_vllm_stream() -> None:
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    events, parser = _feed_all([stream])
    assert [e.data for e in events] == ['{"a": 1}', '{"b": 2}', "[DONE]"]
    assert not parser.pending


def test_fields_comments_and_line_endings() -> None:
    stream = b": keep-alive\r\nevent: note\r\nid: 7\r\nretry: 100\r\ndata: one\rdata:two\n\n"
    events, _ = _feed_all([stream])
    assert events == [SSEEvent("one\ntwo", "note", "7", 100)]


def test_blank_lines_without_fields_dispatch_nothing() -> None:
    assert _feed_all([b"\n\n\r\n"])[0] == []


def test_pending_reports_a_truncated_event() -> None:
    events, parser = _feed_all([b"data: {}\n\ndata: {partial"])
    assert len(events) == 1
    assert parser.pending
    _, parser2 = _feed_all([b"data: x\n"])
    assert parser2.pending


def test_encoders_round_trip() -> None:
    assert encode_data("[DONE]") == b"data: [DONE]\n\n"
    event = SSEEvent("a\nb", "e", "1", 5)
    assert _feed_all([encode_event(event)])[0] == [event]
    assert _feed_all([encode_data("x\ny")])[0] == [SSEEvent("x\ny")]


_payload = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=20)
# No per-example deadline: the parser's speed is not what these tests check, and on a busy machine the
# default 200 ms deadline fails an example that is merely slow.
_no_deadline = settings(deadline=None)


@_no_deadline
@given(
    st.lists(_payload, max_size=8),
    st.lists(st.integers(0, 400), max_size=10),
    st.sampled_from(["\n", "\r\n", "\r"]),
)
def test_any_split_gives_the_same_events(payloads: list[str], cuts: list[int], eol: str) -> None:
    stream = "".join(f"data: {p}{eol}{eol}" for p in payloads).encode()
    whole, _ = _feed_all([stream])
    bounds = sorted({min(c, len(stream)) for c in cuts})
    pieces = [stream[i:j] for i, j in zip([0, *bounds], [*bounds, len(stream)], strict=True)]
    split, parser = _feed_all(pieces)
    assert split == whole == [SSEEvent(p) for p in payloads]
    assert not parser.pending


@_no_deadline
@given(
    st.lists(_payload, max_size=6), st.lists(st.integers(0, 300), max_size=8), st.sampled_from(["\n", "\r\n"])
)
def test_raw_bytes_are_exactly_the_completed_events(payloads: list[str], cuts: list[int], eol: str) -> None:
    stream = "".join(f": c{eol}data: {p}{eol}{eol}" for p in payloads).encode()
    bounds = sorted({min(c, len(stream)) for c in cuts})
    parser = SSEParser()
    raw = b""
    events: list[SSEEvent] = []
    for i, j in zip([0, *bounds], [*bounds, len(stream)], strict=True):
        got, piece = parser.feed_raw(stream[i:j])
        events += got
        raw += piece
        # Whatever was passed on so far is a whole number of events.
        assert SSEParser().feed(raw) == events
    assert raw == stream
