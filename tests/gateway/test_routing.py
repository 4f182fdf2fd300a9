"""Routing modes: parsing and the decisions made without the DecisionService."""

from __future__ import annotations

import pytest

from gateway.routing import Decision, Mode, parse_mode, static_decision


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("pd", Mode("pd")),
        (" LOCAL ", Mode("local")),
        ("ppd", Mode("ppd")),
        ("replica", Mode("replica")),
        ("fraction:0.25", Mode("fraction", 0.25)),
        ("fraction:1", Mode("fraction", 1.0)),
    ],
)
def test_parse_mode(text: str, mode: Mode) -> None:
    assert parse_mode(text) == mode


@pytest.mark.parametrize("text", ["", "fast", "fraction:", "fraction:x", "fraction:1.5", "fraction:-0.1"])
def test_parse_mode_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"mode|fraction"):
        parse_mode(text)


def test_mode_prints_back() -> None:
    assert str(Mode("fraction", 0.5)) == "fraction:0.5"
    assert str(Mode("ppd")) == "ppd"


@pytest.mark.parametrize(
    ("mode", "turn", "expected"),
    [
        ("pd", 1, Decision("pd", "turn_one")),
        ("local", 1, Decision("pd", "turn_one")),
        ("ppd", 1, Decision("pd", "turn_one")),
        ("pd", 2, Decision("pd", "mode_pd")),
        ("local", 3, Decision("local", "mode_local")),
        ("replica", 1, Decision("replica", "mode_replica")),
        ("replica", 5, Decision("replica", "mode_replica")),
        ("ppd", 2, None),
        ("fraction:0", 2, Decision("pd", "mode_fraction")),
        ("fraction:1", 2, Decision("local", "mode_fraction")),
    ],
)
def test_static_decision(mode: str, turn: int, expected: Decision | None) -> None:
    assert static_decision(parse_mode(mode), turn=turn, session_id="abc") == expected


def test_fraction_is_a_stable_share_per_conversation() -> None:
    mode = parse_mode("fraction:0.3")
    paths = {}
    for i in range(2000):
        d = static_decision(mode, turn=2, session_id=f"s{i}")
        assert d is not None
        paths[i] = d.path
        again = static_decision(mode, turn=7, session_id=f"s{i}")
        assert again is not None
        assert again.path == d.path
    share = sum(p == "local" for p in paths.values()) / len(paths)
    assert 0.25 < share < 0.35
