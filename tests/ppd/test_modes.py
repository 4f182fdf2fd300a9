"""The routing-mode grammar and the one `fraction:<x>` split (ppd/modes.py), and that the gateway and
the simulator, which both use it, put the same conversations local."""

from __future__ import annotations

import pytest

from gateway.routing import static_decision
from ppd.modes import NAMED_MODES, Mode, ModeError, fraction_goes_local, parse_mode, unit_interval
from simulator.core.cluster import ClusterConfig, simulate
from simulator.core.profile import load_profile
from simulator.core.topology import Topology
from simulator.core.workload import synthetic_conversations


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("pd", Mode("pd")),
        ("local", Mode("local")),
        ("ppd", Mode("ppd")),
        ("replica", Mode("replica")),
        ("bidir", Mode("bidir")),
        ("fraction:0.25", Mode("fraction", 0.25)),
        ("fraction:1", Mode("fraction", 1.0)),
        ("fraction:0", Mode("fraction", 0.0)),
    ],
)
def test_parse_mode(text: str, mode: Mode) -> None:
    assert parse_mode(text) == mode
    assert parse_mode(text, loose=True) == mode


def test_loose_parsing_ignores_case_and_surrounding_spaces_strict_does_not() -> None:
    assert parse_mode(" LOCAL ", loose=True) == Mode("local")
    assert parse_mode("Fraction:0.5", loose=True) == Mode("fraction", 0.5)
    with pytest.raises(ModeError, match="is not one of"):
        parse_mode(" LOCAL ")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "is not one of"),
        ("fast", "is not one of"),
        ("xpd", "routing mode 'xpd' is not one of"),
        ("fraction:", "fraction is not a number"),
        ("fraction:x", "fraction is not a number"),
        ("fraction:nan", r"fraction must lie in \[0, 1\]"),
        ("fraction:1.5", r"fraction must lie in \[0, 1\]"),
        ("fraction:-0.1", r"fraction must lie in \[0, 1\]"),
    ],
)
def test_parse_mode_rejects(text: str, why: str) -> None:
    with pytest.raises(ModeError, match=why):
        parse_mode(text)
    assert issubclass(ModeError, ValueError)


def test_mode_prints_back() -> None:
    assert str(Mode("fraction", 0.5)) == "fraction:0.5"
    assert str(Mode("ppd")) == "ppd"
    for name in NAMED_MODES:
        assert str(parse_mode(name)) == name


@pytest.mark.parametrize(
    ("mode", "share"),
    [("pd", 0.0), ("local", 1.0), ("bidir", 0.0), ("ppd", None), ("replica", None), ("fraction:0.5", 0.5)],
)
def test_local_share(mode: str, share: float | None) -> None:
    assert parse_mode(mode).local_share == share


def test_the_split_is_blake2b_of_the_conversation_id() -> None:
    # Pinned: the gateway's behaviour since it shipped; the simulator follows it.
    assert unit_interval("") == int("e4a6a0577479b2b4", 16) / 2.0**64
    assert all(0.0 <= unit_interval(f"c{i}") < 1.0 for i in range(100))
    share = sum(fraction_goes_local(f"s{i}", 0.3) for i in range(2000)) / 2000
    assert 0.25 < share < 0.35
    assert not any(fraction_goes_local(f"s{i}", 0.0) for i in range(100))
    assert all(fraction_goes_local(f"s{i}", 1.0) for i in range(100))


def test_the_gateway_and_the_simulator_send_the_same_conversations_local() -> None:
    convs = synthetic_conversations("small_big_paste", qps=4, duration_s=10, seed=8)
    config = ClusterConfig(topology=Topology.parse("1P3D"), mode="fraction:0.5")
    records = simulate(load_profile(), config, convs).records
    simulated = {str(r["conversation_id"]): r["path"] for r in records if r["turn"] == 2 and r["ok"]}
    assert {"local", "pd"} <= set(simulated.values())
    mode = parse_mode("fraction:0.5")
    for conversation_id, path in simulated.items():
        decision = static_decision(mode, turn=2, session_id=conversation_id)
        assert decision is not None
        assert decision.path == path, conversation_id
