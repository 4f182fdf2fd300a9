"""The admission policy (ppd/admission.py) with explicit times: priority order, fair share among
tenants, the queue bound with displacement, the wait bound, Retry-After."""

from __future__ import annotations

import collections

import pytest

from ppd.admission import (
    AdmissionQueue,
    AdmissionSettings,
    Admitted,
    Priority,
    Queued,
    Shed,
    TenantSettings,
    parse_priority,
)


def _queue(**kw: object) -> AdmissionQueue:
    return AdmissionQueue(AdmissionSettings(enabled=True, **kw))  # type: ignore[arg-type]


def _offer(
    q: AdmissionQueue, now: float, priority: Priority = "normal", tenant: str = "a", limit: int = 1
) -> int:
    return q.offer(now, priority=priority, tenant=tenant, limit=limit).outcome.ticket


def test_admits_up_to_the_limit_then_queues() -> None:
    q = _queue()
    first = q.offer(0.0, priority="normal", tenant="a", limit=2).outcome
    second = q.offer(0.0, priority="normal", tenant="a", limit=2).outcome
    third = q.offer(0.0, priority="normal", tenant="a", limit=2).outcome
    assert isinstance(first, Admitted)
    assert isinstance(second, Admitted)
    assert isinstance(third, Queued)
    assert third.deadline == 10.0
    assert q.inflight == 2
    assert q.depth() == 1
    [admitted] = q.release(1.5, limit=2)
    assert admitted.ticket == third.ticket
    assert admitted.waited_s == 1.5
    assert q.inflight == 2
    assert q.depth() == 0


def test_no_limit_admits_everything() -> None:
    q = _queue()
    assert all(
        isinstance(q.offer(0.0, priority="low", tenant="a", limit=None).outcome, Admitted) for _ in range(100)
    )


def test_higher_classes_go_first_and_arrivals_do_not_jump_the_queue() -> None:
    q = _queue()
    _offer(q, 0.0)  # in flight
    low = _offer(q, 0.1, "low")
    normal = _offer(q, 0.2, "normal")
    high = _offer(q, 0.3, "high")
    order = [a.ticket for _ in range(3) for a in q.release(1.0, limit=1)]
    assert order == [high, normal, low]
    # Room, but a queued request of the same class waits: the newcomer queues behind it.
    q2 = _queue()
    _offer(q2, 0.0)
    waiting = _offer(q2, 0.1)
    assert isinstance(q2.offer(0.2, priority="normal", tenant="b", limit=2).outcome, Queued)
    assert [a.ticket for a in q2.refill(0.3, limit=2)] == [waiting]
    # A higher class is admitted at once when there is room, lower ones waiting or not.
    assert isinstance(q2.offer(0.4, priority="high", tenant="c", limit=3).outcome, Admitted)


def test_tenants_of_one_class_share_by_weight_whatever_their_queue_length() -> None:
    q = _queue(max_queue=1000, tenants={"big": TenantSettings(weight=3)})
    _offer(q, 0.0, tenant="x")
    tenant_of = {}
    for i in range(200):  # a flood from one tenant, a trickle from two others
        tenant_of[_offer(q, 0.0, tenant="flood")] = "flood"
        if i < 40:
            tenant_of[_offer(q, 0.0, tenant="small")] = "small"
            tenant_of[_offer(q, 0.0, tenant="big")] = "big"
    served = collections.Counter(tenant_of[a.ticket] for _ in range(50) for a in q.release(1.0, limit=1))
    assert served == {"big": 30, "flood": 10, "small": 10}


def test_first_come_first_served_within_a_tenant() -> None:
    q = _queue()
    _offer(q, 0.0)
    tickets = [_offer(q, 0.1 * i) for i in range(5)]
    assert [a.ticket for _ in range(5) for a in q.release(1.0, limit=1)] == tickets


def test_a_full_queue_sheds_the_newcomer_with_retry_after() -> None:
    q = _queue(max_queue=2)
    _offer(q, 0.0)
    _offer(q, 0.0)
    _offer(q, 0.0)
    offer = q.offer(0.5, priority="normal", tenant="a", limit=1)
    assert isinstance(offer.outcome, Shed)
    assert offer.displaced is None
    assert offer.outcome.reason == "queue_full"
    assert offer.outcome.waited_s == 0.0
    # Nothing finished yet: the class's wait bound (10 s).
    assert offer.outcome.retry_after_s == 10
    assert q.depth() == 2


def test_a_higher_class_displaces_the_newest_lower_one() -> None:
    q = _queue(max_queue=2)
    _offer(q, 0.0)
    older = _offer(q, 0.1, "low")
    newer = _offer(q, 0.2, "low")
    offer = q.offer(0.3, priority="high", tenant="b", limit=1)
    assert isinstance(offer.outcome, Queued)
    assert offer.displaced is not None
    assert offer.displaced.ticket == newer
    assert offer.displaced.reason == "displaced"
    assert offer.displaced.priority == "low"
    assert q.cancel(older)
    assert not q.cancel(newer)


def test_one_tenants_burst_cannot_keep_another_out_of_the_queue() -> None:
    q = _queue(max_queue=4)
    _offer(q, 0.0)
    burst = [_offer(q, 0.1, tenant="flood") for _ in range(4)]
    offer = q.offer(0.2, priority="normal", tenant="other", limit=1)
    assert isinstance(offer.outcome, Queued)
    assert offer.displaced is not None
    assert offer.displaced.ticket == burst[-1]
    # The flooding tenant itself finds the queue full: it is shed, not its own older requests.
    again = q.offer(0.3, priority="normal", tenant="flood", limit=1)
    assert isinstance(again.outcome, Shed)
    assert again.displaced is None


def test_zero_queue_sheds_at_once() -> None:
    q = _queue(max_queue=0)
    _offer(q, 0.0)
    outcome = q.offer(0.0, priority="high", tenant="a", limit=1).outcome
    assert isinstance(outcome, Shed)
    assert outcome.reason == "queue_full"


def test_the_wait_bound_of_each_class() -> None:
    q = _queue(max_wait_high_s=3.0, max_wait_low_s=1.0)
    _offer(q, 0.0)
    low = _offer(q, 0.0, "low")
    high = _offer(q, 0.0, "high")
    assert q.next_deadline() == 1.0
    assert q.expire(0.99) == []
    [shed] = q.expire(1.0)
    assert (shed.ticket, shed.reason, shed.waited_s) == (low, "wait_exceeded", 1.0)
    assert q.next_deadline() == 3.0
    [shed] = q.expire(5.0)
    assert shed.ticket == high
    assert q.next_deadline() is None
    assert q.depth() == 0


def test_retry_after_follows_the_rate_requests_finish_at() -> None:
    q = _queue(max_queue=4, rate_window_s=10.0, retry_after_max_s=30)
    _offer(q, 0.0, limit=1)
    for t in range(20):  # 20 finished in the last 10 s: 2 a second
        q.release(float(t) / 2, limit=1)
        _offer(q, float(t) / 2)
        q.refill(float(t) / 2, limit=1)
    for _ in range(4):
        _offer(q, 9.9)
    outcome = q.offer(9.9, priority="normal", tenant="a", limit=1).outcome
    assert isinstance(outcome, Shed)
    assert outcome.retry_after_s == 3  # 5 ahead (itself included) at 2 a second, rounded up
    # Bounded: a tiny rate would say minutes; capped at retry_after_max_s.
    late = q.offer(1000.0, priority="normal", tenant="a", limit=1).outcome
    assert isinstance(late, Shed)
    assert late.retry_after_s == 10


def test_cancel_keeps_order_and_counts() -> None:
    q = _queue()
    _offer(q, 0.0)
    a, b, c = (_offer(q, 0.1) for _ in range(3))
    assert q.cancel(b)
    assert q.depth() == 2
    assert [x.ticket for _ in range(2) for x in q.release(1.0, limit=1)] == [a, c]
    assert q.release(2.0, limit=1) == []
    assert q.inflight == 0


def test_limit_from_settings() -> None:
    assert AdmissionSettings().limit(3) is None
    assert AdmissionSettings(max_inflight_per_worker=4).limit(3) == 12
    assert AdmissionSettings(max_inflight_per_worker=4).limit(0) == 4
    assert AdmissionSettings(max_inflight=10, max_inflight_per_worker=4).limit(3) == 10


def test_tenant_priorities_are_capped() -> None:
    s = AdmissionSettings(header_max_priority="normal", tenants={"gold": TenantSettings(priority="high")})
    assert s.tenant("gold").priority_for(None) == "high"
    assert s.tenant("anyone").priority_for("high") == "normal"
    assert s.tenant("anyone").priority_for("low") == "low"
    assert s.tenant("anyone").priority_for(None) == "normal"


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"max_queue": -1}, "max_queue"),
        ({"max_wait_low_s": 0.0}, "max_wait_low_s"),
        ({"default_priority": "urgent"}, "priority must be one of high, normal, low"),
        ({"retry_after_min_s": 5, "retry_after_max_s": 1}, "retry_after_min_s"),
    ],
)
def test_bad_settings_are_named(kw: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        AdmissionSettings(**kw)  # type: ignore[arg-type]


def test_bad_priority_and_weight() -> None:
    with pytest.raises(ValueError, match="urgent"):
        parse_priority("urgent")
    with pytest.raises(ValueError, match="weight"):
        TenantSettings(weight=0)
