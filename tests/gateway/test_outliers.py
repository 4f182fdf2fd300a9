"""Passive outlier detection (gateway/outliers.py), the retry budget (gateway/retry_budget.py) and their
window (gateway/window_counts.py): pure state machines driven with explicit times; and the pool's use
of them (pool.py rule 8) on an injected clock."""

from __future__ import annotations

import pytest

from gateway.outliers import Ejection, Held, OutlierDetector, OutlierSettings, Restoration
from gateway.plan import PlanRequest, plan
from gateway.pool import WorkerPool, WorkerSpec
from gateway.retry_budget import RetryBudget, RetryBudgetSettings
from gateway.routing import Decision
from gateway.sessions import Session
from gateway.settings import Settings, SettingsError
from gateway.window_counts import WindowCounts

S = OutlierSettings(
    consecutive_errors=5, error_rate=0.5, min_requests=10, window_s=30, base_ejection_s=10, max_ejection_s=40
)


def _fail(d: OutlierDetector, n: int, now: float, worker: str = "D0") -> list[Ejection | Held | None]:
    return [d.failure(worker, now, may_eject=True) for _ in range(n)]


def test_consecutive_errors_eject_and_a_success_resets_the_count() -> None:
    d = OutlierDetector(S)
    assert _fail(d, 4, 1.0) == [None] * 4
    assert d.success("D0", 1.0) is None
    assert _fail(d, 4, 2.0) == [None] * 4  # the count started again
    assert d.failure("D0", 2.0, may_eject=True) == Ejection("D0", "consecutive_errors", 10.0)
    assert d.is_ejected("D0")
    assert not d.admits("D0", 2.0)
    assert d.any_ejected


def test_an_error_share_over_the_window_ejects_a_worker_that_never_fails_five_in_a_row() -> None:
    d = OutlierDetector(S)
    events = []
    for i in range(12):  # fail, succeed, fail, ...: never 2 errors in a row
        events.append(d.failure("D0", float(i), may_eject=True) if i % 2 == 0 else d.success("D0", float(i)))
    # The 11th request is the first failure with >= 10 requests in the window: 6 errors of 11.
    assert events[:10] == [None] * 10
    assert events[10] == Ejection("D0", "error_rate", 10.0)


def test_errors_older_than_the_window_are_forgotten() -> None:
    d = OutlierDetector(S)
    for i in range(9):  # 9 requests, 4 errors, then 40 s of nothing
        d.failure("D0", float(i), may_eject=True) if i % 2 == 0 else d.success("D0", float(i))
    assert d.failure("D0", 50.0, may_eject=True) is None  # 1 request in the window now
    assert d.describe("D0", 50.0)["window_requests"] == 1


def test_half_open_admits_one_probe_whose_success_restores_the_worker() -> None:
    d = OutlierDetector(S)
    _fail(d, 5, 0.0)
    assert d.success("D0", 5.0) is None  # a request sent before the ejection: ignored
    assert d.failure("D0", 6.0, may_eject=True) is None  # likewise
    assert not d.admits("D0", 9.9)
    assert d.admits("D0", 10.0)  # half-open
    assert d.describe("D0", 10.0)["state"] == "half_open"
    d.claim("D0", 10.0)
    assert not d.admits("D0", 11.0)  # the probe is in flight: one at a time
    assert d.success("D0", 12.0) == Restoration("D0", 12.0)
    assert not d.is_ejected("D0")
    assert d.admits("D0", 12.0)
    assert not d.any_ejected
    assert d.describe("D0", 12.0)["state"] == "in_rotation"


def test_a_failed_probe_re_ejects_with_the_backoff_doubled_up_to_the_cap() -> None:
    d = OutlierDetector(S)
    assert _fail(d, 5, 0.0)[-1] == Ejection("D0", "consecutive_errors", 10.0)
    now = 0.0
    for backoff in (20.0, 40.0, 40.0):
        now = now + 1000.0
        d.claim("D0", now)
        assert d.failure("D0", now, may_eject=True) == Ejection("D0", "probe_failed", backoff)
        assert not d.admits("D0", now + backoff - 0.1)
        assert d.admits("D0", now + backoff)


def test_a_probe_that_never_answers_frees_its_slot_after_one_backoff() -> None:
    d = OutlierDetector(S)
    _fail(d, 5, 0.0)
    d.claim("D0", 10.0)
    assert not d.admits("D0", 19.9)
    assert d.admits("D0", 20.0)


def test_the_doubling_starts_again_after_a_quiet_spell_of_max_ejection_s() -> None:
    d = OutlierDetector(S)
    _fail(d, 5, 0.0)
    d.claim("D0", 10.0)
    assert d.failure("D0", 10.0, may_eject=True) == Ejection("D0", "probe_failed", 20.0)
    assert d.success("D0", 30.0) == Restoration("D0", 30.0)
    assert _fail(d, 5, 31.0)[-1] == Ejection("D0", "consecutive_errors", 40.0)  # soon again: doubled
    assert d.success("D0", 71.0) is not None
    assert _fail(d, 5, 200.0)[-1] == Ejection("D0", "consecutive_errors", 10.0)  # quiet 129 s >= 40


def test_the_last_worker_is_held_not_ejected_and_asks_again_on_its_next_error() -> None:
    d = OutlierDetector(S)
    assert [d.failure("D0", 0.0, may_eject=False) for _ in range(6)][4:] == [
        Held("D0", "consecutive_errors"),
        Held("D0", "consecutive_errors"),
    ]
    assert not d.is_ejected("D0")
    assert d.admits("D0", 0.0)
    assert d.failure("D0", 1.0, may_eject=True) == Ejection("D0", "consecutive_errors", 10.0)


def test_a_failed_probe_of_the_last_worker_puts_it_back_in_rotation() -> None:
    d = OutlierDetector(S)
    _fail(d, 5, 0.0)
    assert d.failure("D0", 10.0, may_eject=False) == Held("D0", "probe_failed")
    assert not d.is_ejected("D0")
    assert not d.any_ejected


def test_off_nothing_is_ejected() -> None:
    d = OutlierDetector(OutlierSettings(enabled=False))
    assert _fail(d, 50, 0.0) == [None] * 50
    assert d.admits("D0", 0.0)


def test_a_forgotten_worker_leaves_no_ejection_behind() -> None:
    d = OutlierDetector(S)
    _fail(d, 5, 0.0)
    d.forget("D0")
    assert not d.any_ejected
    assert d.admits("D0", 1.0)


@pytest.mark.parametrize(
    ("section", "values", "match"),
    [
        ("outliers", {"consecutive_errors": 0}, "consecutive_errors"),
        ("outliers", {"error_rate": 1.5}, "error_rate"),
        ("outliers", {"base_ejection_s": 20.0, "max_ejection_s": 10.0}, "base_ejection_s"),
        ("retry_budget", {"ratio": -0.1}, "ratio"),
        ("retry_budget", {"window_s": 0}, "window_s"),
        ("retry_budget", {"share": 0.1}, "unknown setting 'share'"),
    ],
)
def test_bad_settings_are_refused_with_the_key_named(
    section: str, values: dict[str, float], match: str
) -> None:
    with pytest.raises(SettingsError, match=match):
        Settings.from_mapping({section: values})


def test_settings_default_on_and_read_from_toml() -> None:
    s = Settings.from_mapping({"outliers": {"consecutive_errors": 3}, "retry_budget": {"enabled": False}})
    assert s.outliers.enabled
    assert s.outliers.consecutive_errors == 3
    assert not s.retry_budget.enabled
    assert Settings().retry_budget.enabled


# ---------------------------------------------------------------- the window and the retry budget


def test_window_counts_slide_by_buckets() -> None:
    w = WindowCounts(10.0, buckets=10)
    w.add(0.5)
    w.add(0.5, marked=1)
    w.add(5.0, events=0, marked=1)
    assert w.totals(5.0) == (2, 2)
    assert w.totals(10.4) == (0, 1)  # the first second's slot left the window
    assert w.totals(16.0) == (0, 0)
    w.add(16.0)
    w.clear()
    assert w.totals(16.0) == (0, 0)


def test_the_retry_budget_floor_lets_low_traffic_retry_and_caps_it() -> None:
    b = RetryBudget(RetryBudgetSettings(ratio=0.0, min_per_s=0.2, window_s=10.0))
    assert [b.try_retry(1.0) for _ in range(3)] == [True, True, False]
    assert b.try_retry(12.0)  # the window slid past the two retries


def test_the_retry_budget_grows_with_requests() -> None:
    b = RetryBudget(RetryBudgetSettings(ratio=0.2, min_per_s=0.0, window_s=10.0))
    assert not b.try_retry(0.0)
    for _ in range(10):
        b.note_request(0.0)
    assert [b.try_retry(0.0) for _ in range(3)] == [True, True, False]


def test_the_retry_budget_off_allows_every_retry() -> None:
    b = RetryBudget(RetryBudgetSettings(enabled=False, ratio=0.0, min_per_s=0.0))
    assert all(b.try_retry(0.0) for _ in range(100))


# ---------------------------------------------------------------- the pool (pool.py rule 8)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


WORKERS = (
    WorkerSpec("P0", "prefill", "http://p0:1"),
    WorkerSpec("D0", "decode", "http://d0:1"),
    WorkerSpec("D1", "decode", "http://d1:1"),
)


def _pool(clock: Clock) -> WorkerPool:
    return WorkerPool(WORKERS, heartbeat_expiry_s=30, clock=clock, outliers=S)


def _decodes(pool: WorkerPool) -> list[str]:
    return [w.id for w in pool.view().ranked("decode")]


def test_an_ejected_worker_leaves_the_view_until_its_probe() -> None:
    clock = Clock()
    pool = _pool(clock)
    events = [pool.note_failure("D1") for _ in range(5)]
    assert events[-1] == Ejection("D1", "consecutive_errors", 10.0)
    assert _decodes(pool) == ["D0"]
    assert pool.ejected("decode") == 1
    assert pool.ejected("prefill") == 0
    row = next(r for r in pool.describe() if r["id"] == "D1")
    assert row["outlier"] == {
        "state": "ejected",
        "consecutive_errors": 0,
        "window_requests": 0,
        "window_errors": 0,
        "ejections": 1,
        "ejected_for_s": 0.0,
        "backoff_s": 10.0,
        "probe_in_s": 10.0,
    }
    clock.now = 10.0
    assert sorted(_decodes(pool)) == ["D0", "D1"]  # half-open
    pool.acquire("D1")  # the probe
    assert _decodes(pool) == ["D0"]
    assert pool.note_success("D1") == Restoration("D1", 10.0)
    assert sorted(_decodes(pool)) == ["D0", "D1"]
    assert pool.ejected("decode") == 0


def test_the_last_live_worker_of_a_role_is_never_ejected() -> None:
    clock = Clock()
    pool = _pool(clock)
    assert [pool.note_failure("P0") for _ in range(5)][-1] == Held("P0", "consecutive_errors")
    assert [w.id for w in pool.view().ranked("prefill")] == ["P0"]
    pool.mark_failed("D0")  # D1 is the last live decode worker now
    assert [pool.note_failure("D1") for _ in range(5)][-1] == Held("D1", "consecutive_errors")
    assert _decodes(pool) == ["D1"]


def test_a_view_keeps_the_ejected_workers_of_a_role_the_others_left() -> None:
    clock = Clock()
    pool = _pool(clock)
    _ = [pool.note_failure("D1") for _ in range(5)]
    assert _decodes(pool) == ["D0"]
    pool.mark_failed("D0")  # after the ejection: D1 is all that is left
    assert _decodes(pool) == ["D1"]


def test_a_session_whose_decode_worker_is_ejected_goes_through_p_to_another_and_rebinds() -> None:
    pool = _pool(Clock())
    _ = [pool.note_failure("D1") for _ in range(5)]
    request = PlanRequest(endpoint="chat", body={"messages": []}, request_id="r1")
    p = plan(request, Session("s", worker="D1"), Decision("local", "table"), pool.view())
    assert (p.path, p.reason, p.rebound, p.decode.worker) == ("pd", "decode_gone", True, "D0")
