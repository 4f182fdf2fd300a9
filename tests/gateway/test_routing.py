"""The decisions made without the DecisionService (the mode grammar: tests/ppd/test_modes.py)."""

from __future__ import annotations

import pytest

from gateway.routing import Decision, static_decision
from ppd.modes import parse_mode


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
        ("bidir", 1, Decision("pd", "turn_one")),
        ("bidir", 2, Decision("bidir", "mode_bidir")),
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
