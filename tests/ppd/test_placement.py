"""The placement rule (ppd/placement.py): pure, shared by the gateway and the virtual-time cluster."""

from __future__ import annotations

import math

import pytest

from ppd.placement import LEAST_LOADED, Candidate, Placed, PlacementSettings, place, placement_order

PREFIX = PlacementSettings("prefix", max_imbalance=2.0)


def test_the_worker_holding_the_longest_prefix_wins_within_the_imbalance() -> None:
    cands = [Candidate("P0", 0, 0), Candidate("P1", 1, 12), Candidate("P2", 2, 30)]
    assert place(cands, PREFIX) == Placed(2, True, 30)


def test_least_loaded_policy_always_takes_the_first() -> None:
    cands = [Candidate("P0", 0, 0), Candidate("P1", 0, 50)]
    assert place(cands, LEAST_LOADED) == Placed(0, False, 0)


def test_a_worker_busier_than_the_imbalance_allows_is_passed_over() -> None:
    cands = [Candidate("P0", 1, 0), Candidate("P1", 2, 5), Candidate("P2", 4, 40)]
    # P2 holds more but is 3 requests busier than the least loaded (limit 2): P1, within it, wins.
    assert place(cands, PREFIX) == Placed(1, True, 5)
    only_far = [Candidate("P0", 1, 0), Candidate("P1", 9, 40)]
    assert place(only_far, PREFIX) == Placed(0, False, 0)


def test_a_tie_goes_to_the_less_loaded() -> None:
    cands = [Candidate("P0", 0, 7), Candidate("P1", 1, 7)]
    assert place(cands, PREFIX) == Placed(0, False, 7)
    cands = [Candidate("P0", 0, 0), Candidate("P1", 1, 7), Candidate("P2", 1, 7)]
    assert place(cands, PREFIX).index == 1


def test_unknown_residency_counts_as_nothing_and_all_unknown_is_least_loaded() -> None:
    assert place([Candidate("P0", 0, None), Candidate("P1", 0, None)], PREFIX) == Placed(0)
    # An unsynced worker is never guessed to hold the prefix: the synced one holding it wins.
    assert place([Candidate("P0", 0, None), Candidate("P1", 1, 3)], PREFIX) == Placed(1, True, 3)


def test_fewer_resident_blocks_than_min_blocks_stay_least_loaded() -> None:
    settings = PlacementSettings("prefix", max_imbalance=2.0, min_blocks=4)
    assert place([Candidate("P0", 0, 0), Candidate("P1", 0, 3)], settings) == Placed(0)
    assert place([Candidate("P0", 0, 0), Candidate("P1", 0, 4)], settings) == Placed(1, True, 4)


def test_one_candidate_and_none() -> None:
    assert place([Candidate("P0", 5, 9)], PREFIX) == Placed(0, False, 9)
    with pytest.raises(ValueError, match="at least one candidate"):
        place([], PREFIX)


def test_the_order_keeps_the_others_after_the_chosen_one() -> None:
    assert placement_order(4, Placed(2, True, 1)) == [2, 0, 1, 3]
    assert placement_order(3, Placed(0)) == [0, 1, 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "nearest"}, "placement must be one of prefix, least_loaded"),
        ({"max_imbalance": -1.0}, "placement_max_imbalance must be >= 0"),
        ({"max_imbalance": math.nan}, "placement_max_imbalance must be >= 0"),
        ({"min_blocks": 0}, "placement_min_blocks must be >= 1"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlacementSettings(**kwargs)  # type: ignore[arg-type]
