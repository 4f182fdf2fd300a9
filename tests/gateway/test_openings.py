"""gateway/openings.py (pure): the marks Turn 1 prompts opening with the same first message share."""

from __future__ import annotations

import pytest

from gateway.openings import Openings


def test_a_first_message_seen_once_answers_its_prompts_marks() -> None:
    openings = Openings(4)
    assert openings.get("system-a") is None  # never seen: nothing to place by
    openings.learn("system-a", ((1, 11), (2, 12), (4, 14), (6, 16)))
    assert openings.get("system-a") == ((1, 11), (2, 12), (4, 14), (6, 16))


def test_later_prompts_keep_only_the_leading_marks_they_share() -> None:
    openings = Openings(4)
    openings.learn("s", ((1, 11), (2, 12), (4, 14), (8, 18), (10, 20)))
    openings.learn("s", ((1, 11), (2, 12), (4, 14), (8, 99), (9, 98)))  # blocks 5-8 differ
    assert openings.get("s") == ((1, 11), (2, 12), (4, 14))
    openings.learn("s", ((1, 11), (2, 12), (4, 14), (8, 18), (16, 30), (20, 31)))  # longer: no gain
    assert openings.get("s") == ((1, 11), (2, 12), (4, 14))
    openings.learn("s", ((1, 77),))  # shares nothing: known, with nothing to place by
    assert openings.get("s") == ()


def test_the_least_recently_used_first_message_is_forgotten_past_the_bound() -> None:
    openings = Openings(2)
    openings.learn("a", ((1, 1),))
    openings.learn("b", ((1, 2),))
    assert openings.get("a") == ((1, 1),)  # "a" is now the most recent
    openings.learn("c", ((1, 3),))
    assert (openings.get("a"), openings.get("b"), openings.get("c")) == (((1, 1),), None, ((1, 3),))
    assert len(openings) == 2


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_entries must be positive"):
        Openings(0)
