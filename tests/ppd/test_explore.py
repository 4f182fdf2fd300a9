"""The exploration policy (ppd/explore.py): the seeded draw, the three bounds on harm, the propensity."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppd.explore import Exploration, ExplorationPolicy, ExploreSettings, explore_draw

KEYS = [f"c{i}#2" for i in range(2000)]


def _decide(policy: ExplorationPolicy, key: str, **changes: object) -> Exploration:
    args: dict[str, object] = {
        "request_key": key,
        "chosen_local": True,
        "alternative_allowed": True,
        "worker": "D0",
        "now": 0.0,
        "guard_active": False,
    }
    args.update(changes)
    return policy.decide(**args)  # type: ignore[arg-type]


def _uncapped(epsilon: float, seed: int = 0) -> ExplorationPolicy:
    return ExplorationPolicy(ExploreSettings(epsilon=epsilon, seed=seed, max_per_worker_per_s=1e9))


def test_epsilon_zero_never_explores_and_answers_propensity_one() -> None:
    policy = ExplorationPolicy(ExploreSettings())
    for i, key in enumerate(KEYS[:200]):
        chosen = i % 2 == 0
        e = _decide(policy, key, chosen_local=chosen, now=float(i))
        assert e == Exploration(explored=False, local=chosen, propensity=1.0)


def test_the_share_explored_is_epsilon_and_the_path_flips() -> None:
    policy = _uncapped(0.1)
    answers = [_decide(policy, key, chosen_local=False) for key in KEYS]
    explored = [e for e in answers if e.explored]
    assert 0.07 < len(explored) / len(KEYS) < 0.13
    assert all(e.local and e.propensity == 0.1 for e in explored)
    assert all(not e.local and math.isclose(e.propensity, 0.9) for e in answers if not e.explored)


@given(st.permutations(KEYS[:60]), st.integers(min_value=0, max_value=2**32))
def test_the_draw_is_seeded_per_request_and_independent_of_order(keys: list[str], seed: int) -> None:
    first = {k: _decide(_uncapped(0.5, seed), k) for k in KEYS[:60]}
    policy = _uncapped(0.5, seed)
    assert {k: _decide(policy, k) for k in keys} == first


def test_another_seed_draws_another_set() -> None:
    a = {k for k in KEYS if explore_draw(1, k) < 0.2}
    b = {k for k in KEYS if explore_draw(2, k) < 0.2}
    assert a != b
    assert all(0.0 <= explore_draw(7, k) < 1.0 for k in KEYS)


def test_never_into_a_path_that_fails_the_cells_slo() -> None:
    policy = _uncapped(1.0)
    e = _decide(policy, "c1#2", alternative_allowed=False)
    assert e == Exploration(explored=False, local=True, propensity=1.0)
    assert _decide(policy, "c1#2").explored  # the same request, alternative allowed: epsilon 1 explores


def test_never_while_a_live_signal_guard_is_active() -> None:
    policy = _uncapped(1.0)
    e = _decide(policy, "c1#2", chosen_local=False, guard_active=True)
    assert e == Exploration(explored=False, local=False, propensity=1.0)


def test_the_cap_per_worker_and_second() -> None:
    policy = ExplorationPolicy(ExploreSettings(epsilon=1.0, max_per_worker_per_s=2.0))
    # 10 requests in the same instant on D0: the bucket holds 2.
    same_instant = [_decide(policy, f"a{i}#2", now=5.0) for i in range(10)]
    assert sum(e.explored for e in same_instant) == 2
    capped = same_instant[-1]
    assert capped == Exploration(explored=False, local=True, propensity=1.0)  # not eligible: prob 1
    # Another worker has its own bucket.
    assert _decide(policy, "b#2", worker="D1", now=5.0).explored
    # Half a second later one token is back on D0, and only one.
    later = [_decide(policy, f"c{i}#2", now=5.5) for i in range(5)]
    assert sum(e.explored for e in later) == 1
    # Over a long run the rate holds: 100 s at 50 requests/s on one worker explore about 200 times.
    policy = ExplorationPolicy(ExploreSettings(epsilon=1.0, max_per_worker_per_s=2.0))
    n = sum(_decide(policy, f"r{i}#2", now=i / 50).explored for i in range(5000))
    assert 199 <= n <= 202


def test_a_cap_below_one_per_second_spaces_explorations_and_zero_stops_them() -> None:
    policy = ExplorationPolicy(ExploreSettings(epsilon=1.0, max_per_worker_per_s=0.25))
    times = [float(t) for t in range(20)]
    explored_at = [t for t in times if _decide(policy, f"k{t}#2", now=t).explored]
    assert explored_at == [0.0, 4.0, 8.0, 12.0, 16.0]
    never = ExplorationPolicy(ExploreSettings(epsilon=1.0, max_per_worker_per_s=0.0))
    assert not any(_decide(never, k, now=float(i)).explored for i, k in enumerate(KEYS[:50]))


def test_time_running_back_does_not_refill() -> None:
    policy = ExplorationPolicy(ExploreSettings(epsilon=1.0, max_per_worker_per_s=1.0))
    assert _decide(policy, "a#2", now=10.0).explored
    assert not _decide(policy, "b#2", now=3.0).explored
    assert not _decide(policy, "c#2", now=10.5).explored
    assert _decide(policy, "d#2", now=11.0).explored


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"epsilon": -0.1}, "epsilon must be within 0..1"),
        ({"epsilon": 1.5}, "epsilon must be within 0..1"),
        ({"epsilon": math.nan}, "epsilon must be within 0..1"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"max_per_worker_per_s": -1.0}, "max_per_worker_per_s must be"),
        ({"max_per_worker_per_s": math.inf}, "max_per_worker_per_s must be"),
    ],
)
def test_bad_settings_are_refused(changes: dict[str, float], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        ExploreSettings(**changes)  # type: ignore[arg-type]
