"""Sessions as bytes from their dataclass fields: any Session round-trips, a field added later flows
through untouched code, other versions and malformed entries are refused."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.session_codec import VERSION, Bounds, CodecError, DataclassCodec, session_codec
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


def _fields(**fields: object) -> bytes:
    return json.dumps({"v": 1, "f": {"id": "s", **fields}}).encode()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (_fields(turns=-1), "field"),
        (_fields(history_messages=-7), "field"),
        (_fields(turns=2**31 - 1), "field"),  # turn = turns + 1 would overflow the RouteRequest's int32
        (_fields(turns=2**70), "field"),
        (_fields(output_lengths=[10**400]), "not_json"),  # orjson reads no number past a double
        (_fields(output_lengths=[2**40]), "field"),
        (b'{"v": 1, "f": {"id": "s", "decode_kv_expires_at": NaN}}', "not_json"),
        (b'{"v": 1, "f": {"id": "s", "decode_kv_expires_at": 1e400}}', "not_json"),
        (_fields(decode_kv_expires_at=1e300), "field"),
        (b'{"v": 1, "f": {"id": "s", "x": ' + b"[" * 17 + b"]" * 17 + b"}}", "too_deep"),
        (b'{"v": 1, "f": {"id": "s", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}}", "not_json"),
        (_fields(history_key="k" * (1 << 20)), "too_large"),
        (b'{"v": 2, "f": {"id": "s"}}', "version"),
    ],
)
def test_every_value_is_bounded(raw: bytes, reason: str) -> None:
    with pytest.raises(CodecError) as info:
        DataclassCodec(Session).decode(raw)
    assert info.value.reason == reason
    assert len(str(info.value)) < 300  # nothing of the entry quoted at length


def test_values_at_the_bounds_decode() -> None:
    codec = DataclassCodec(Session, bounds=Bounds(max_bytes=4096, max_depth=3, max_int=10, max_float=5.0))
    assert codec.decode(_fields(turns=10, output_lengths=[0, 10], decode_kv_expires_at=-5)) == Session(
        "s", turns=10, output_lengths=(0, 10), decode_kv_expires_at=-5.0
    )
    with pytest.raises(CodecError):
        codec.decode(_fields(turns=11))
    with pytest.raises(CodecError):
        codec.decode(_fields(decode_kv_expires_at=5.5))


@pytest.mark.parametrize(
    "fields",
    [
        {"id": "s1\r\nX-Evil: 1"},
        {"id": "x" * 1_000_000},
        {"id": "two words"},
        {"id": ""},
        {"worker": "D0\r\n"},
        {"worker": "w" * 129},
        {"decode_kv_params": "[" * 40 + "]" * 40},
        {"decode_kv_params": "[1]"},
        {"decode_kv_params": "{not json"},
        {"prompt_marks": "1:12,1:13"},
        {"prompt_marks": "2:12,1:13"},
        {"prompt_marks": "1:0x12"},
        {"prompt_marks": f"1:{2**64}"},
        {"prompt_marks": "1:" + "1" * 21},
        {"prompt_marks": "1:12,"},
        {"prompt_marks": "1 : 12"},
        {"prompt_marks": ",".join(f"{i + 1}:7" for i in range(65))},
    ],
)
def test_a_sessions_ids_and_params_are_what_the_gateway_accepts(fields: dict[str, object]) -> None:
    codec = session_codec(max_id_length=256)
    with pytest.raises(CodecError) as info:
        codec.decode(_fields(**fields))
    assert info.value.reason == "field"


_client_ids = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=64)


@given(_sessions, _client_ids)
def test_sessions_the_gateway_writes_round_trip_through_its_checks(session: Session, session_id: str) -> None:
    codec = session_codec(max_id_length=16)
    session = dataclasses.replace(
        session,
        id=session_id,
        worker="D-0.a:b_c",
        decode_kv_params='{"do_remote_decode": true}',
        prompt_marks="1:-9223372036854775808,2:18446744073709551615,3:0",
    )
    assert codec.decode(codec.encode(session)) == session


def test_the_gateways_own_ids_pass_a_small_id_limit() -> None:
    """A generated session id is 32 hex digits; a limit on client ids below that does not refuse it."""
    codec = session_codec(max_id_length=8)
    session = Session("0123456789abcdef0123456789abcdef", turns=2)
    assert codec.decode(codec.encode(session)) == session
