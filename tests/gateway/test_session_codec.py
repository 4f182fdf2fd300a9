"""Sessions as bytes from their dataclass fields: any Session round-trips, a field added later flows
through untouched code, other versions and malformed entries are refused."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.session_codec import VERSION, CodecError, DataclassCodec
from gateway.sessions import Session

_text = st.text(max_size=20)
_sessions = st.builds(
    Session,
    id=_text,
    worker=st.none() | _text,
    turns=st.integers(0, 10**6),
    context_tokens=st.integers(0, 10**9),
    output_lengths=st.lists(st.integers(0, 10**6), max_size=8).map(tuple),
    history_key=_text,
    history_messages=st.integers(0, 1000),
)


@given(_sessions)
def test_every_session_round_trips(session: Session) -> None:
    codec = DataclassCodec(Session)
    assert codec.decode(codec.encode(session)) == session


def test_the_encoding_is_the_fields_under_a_version_tag() -> None:
    data = json.loads(DataclassCodec(Session).encode(Session("s", worker="D0", output_lengths=(3, 4))))
    assert data["v"] == VERSION
    assert data["f"]["output_lengths"] == [3, 4]
    assert set(data["f"]) == {f.name for f in dataclasses.fields(Session)}


@dataclass(frozen=True, slots=True)
class _Later:
    """A Session of a later day: fields another change added, of the kinds such fields have."""

    id: str
    worker: str | None = None
    resident_tokens: int = 0
    blocks: tuple[str, ...] = ()
    kv_share: float | None = None
    pair: tuple[int, str] = (0, "")
    tags: dict[str, list[int]] = field(default_factory=dict)


def test_fields_added_later_travel_without_a_change_here() -> None:
    codec = DataclassCodec(_Later)
    value = _Later("s", "D1", 512, ("a", "b"), 0.5, (3, "x"), {"k": [1, 2]})
    assert codec.decode(codec.encode(value)) == value


def test_replicas_of_two_versions_share_entries() -> None:
    """An older replica ignores fields it does not know; a newer one fills missing fields with defaults."""
    new, old = DataclassCodec(_Later), DataclassCodec(Session)
    assert old.decode(new.encode(_Later("s", "D1", resident_tokens=9))) == Session("s", worker="D1")
    assert new.decode(old.encode(Session("s", worker="D2", turns=3))) == _Later("s", "D2")


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff",
        b"[]",
        b'{"v": 2, "f": {"id": "s"}}',
        b'{"v": 1}',
        b'{"v": 1, "f": {}}',  # the id is required
        b'{"v": 1, "f": {"id": 5}}',
        b'{"v": 1, "f": {"id": "s", "turns": "3"}}',
        b'{"v": 1, "f": {"id": "s", "turns": true}}',
        b'{"v": 1, "f": {"id": "s", "output_lengths": 3}}',
        b'{"v": 1, "f": {"id": "s", "output_lengths": ["x"]}}',
    ],
)
def test_anything_else_is_a_codec_error(raw: bytes) -> None:
    with pytest.raises(CodecError):
        DataclassCodec(Session).decode(raw)


def test_a_field_that_cannot_be_stored_is_refused_at_start_up() -> None:
    @dataclass
    class Odd:
        id: str
        when: set[int] = field(default_factory=set)

    with pytest.raises(TypeError, match=r"Odd\.when"):
        DataclassCodec(Odd)
