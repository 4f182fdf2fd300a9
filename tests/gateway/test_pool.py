"""The worker pool: registration, heartbeat expiry, health, least-loaded choice (injected clock)."""

from __future__ import annotations

import pytest

from gateway.errors import BadRequestError, NoWorkerError
from gateway.pool import Load, PoolView, WorkerPool, WorkerSpec, WorkerView, redact_url
from gateway.probe import load_from_metrics


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


STATIC = (WorkerSpec("P0", "prefill", "http://p0:1"), WorkerSpec("D0", "decode", "http://d0:1"))


def test_registered_workers_expire_without_heartbeats_static_ones_never() -> None:
    clock = FakeClock()
    pool = WorkerPool(STATIC, heartbeat_expiry_s=30, clock=clock)
    assert pool.register(WorkerSpec("D1", "decode", "http://d1:1")) is True
    clock.now = 20
    assert pool.register(WorkerSpec("D1", "decode", "http://d1:1")) is False  # heartbeat
    clock.now = 45
    assert pool.expire() == []
    clock.now = 51
    assert pool.expire() == ["D1"]
    assert [s.id for s in pool.specs()] == ["P0", "D0"]


def test_static_workers_cannot_be_overridden_or_removed_by_registration() -> None:
    pool = WorkerPool(STATIC, heartbeat_expiry_s=30, clock=FakeClock())
    with pytest.raises(BadRequestError, match="statically"):
        pool.register(WorkerSpec("D0", "decode", "http://evil:1"))
    assert pool.deregister("D0") is False
    assert pool.deregister("nope") is False


@pytest.mark.parametrize(
    ("wid", "role", "url"),
    [("", "decode", "http://x:1"), ("D", "gpu", "http://x:1"), ("D", "decode", "file:///etc/passwd")],
)
def test_bad_worker_specs_are_rejected(wid: str, role: str, url: str) -> None:
    with pytest.raises(BadRequestError):
        WorkerSpec(wid, role, url)  # type: ignore[arg-type]


def test_failed_workers_leave_the_view_until_healthy_again() -> None:
    pool = WorkerPool(STATIC, heartbeat_expiry_s=30, clock=FakeClock())
    pool.mark_failed("D0")
    assert pool.view().get("D0") is None
    with pytest.raises(NoWorkerError, match="decode"):
        pool.view().least_loaded("decode")
    pool.set_health("D0", True)
    assert pool.view().least_loaded("decode").id == "D0"


def test_least_loaded_uses_scraped_load_inflight_then_turn_taking() -> None:
    def view(*workers: WorkerView) -> PoolView:
        return PoolView(workers)

    busy = WorkerView("D0", "decode", "u", Load(running=5))
    idle = WorkerView("D1", "decode", "u", Load(running=1))
    assert view(busy, idle).least_loaded("decode").id == "D1"
    crowded = WorkerView("D1", "decode", "u", Load(running=1), inflight=9)
    assert view(busy, crowded).least_loaded("decode").id == "D0"
    full = WorkerView("D0", "decode", "u", Load(running=1, kv_usage=0.9))
    assert view(full, idle).least_loaded("decode").id == "D1"

    pool = WorkerPool(
        [WorkerSpec("D0", "decode", "http://a:1"), WorkerSpec("D1", "decode", "http://b:1")],
        heartbeat_expiry_s=30,
        clock=FakeClock(),
    )
    picks = []
    for _ in range(4):
        chosen = pool.view().least_loaded("decode").id
        pool.note_pick(chosen)
        picks.append(chosen)
    assert picks == ["D0", "D1", "D0", "D1"]


def test_inflight_accounting() -> None:
    pool = WorkerPool(STATIC, heartbeat_expiry_s=30, clock=FakeClock())
    pool.acquire("D0")
    pool.acquire("D0")
    pool.release("D0")
    assert pool.view().get("D0").inflight == 1  # type: ignore[union-attr]
    pool.release("D0")
    pool.release("D0")
    assert pool.view().get("D0").inflight == 0  # type: ignore[union-attr]


def test_load_from_vllm_metrics_text() -> None:
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",reason="deferred"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_hits_total{engine="0"} 100.0
garbage line
vllm:num_requests_running{broken
"""
    assert load_from_metrics(text) == Load(running=5.0, waiting=4.0, kv_usage=0.5)
    assert load_from_metrics("vllm:num_requests_running 7\n") == Load(running=7.0)


def test_health_checks_need_consecutive_failures() -> None:
    pool = WorkerPool(STATIC, heartbeat_expiry_s=30, clock=FakeClock())
    pool.record_check("D0", False, unhealthy_after=2)
    assert pool.is_live("D0")
    pool.record_check("D0", True, unhealthy_after=2)
    pool.record_check("D0", False, unhealthy_after=2)
    assert pool.is_live("D0")
    pool.record_check("D0", False, unhealthy_after=2)
    assert not pool.is_live("D0")
    pool.record_check("D0", True, unhealthy_after=2)
    assert pool.is_live("D0")
    pool.record_check("nope", True)


def test_failed_checks_are_forgiven_while_requests_succeed() -> None:
    clock = FakeClock()
    pool = WorkerPool(STATIC, heartbeat_expiry_s=30, clock=clock)
    pool.note_success("D0")
    for _ in range(3):
        pool.record_check("D0", False, unhealthy_after=2, served_within_s=4.0)
    assert pool.is_live("D0")
    clock.now = 5.0  # no request answered for a while: the checks count again
    pool.record_check("D0", False, unhealthy_after=2, served_within_s=4.0)
    pool.record_check("D0", False, unhealthy_after=2, served_within_s=4.0)
    assert not pool.is_live("D0")


def test_max_model_len_is_the_smallest_declared_and_forgotten_with_its_worker() -> None:
    clock = FakeClock()
    pool = WorkerPool(STATIC, heartbeat_expiry_s=30, clock=clock)
    assert pool.max_model_len("m") is None
    assert pool.needs_models("P0")
    pool.set_models("P0", {"m": 8192, "other": 100})
    pool.register(WorkerSpec("D1", "decode", "http://d1:1"))
    pool.set_models("D1", {"m": 4096})
    assert not pool.needs_models("D1")
    assert (pool.max_model_len("m"), pool.max_model_len("other"), pool.max_model_len("x")) == (
        4096,
        100,
        None,
    )
    pool.register(WorkerSpec("D1", "decode", "http://d1:2"))  # moved: its card is read again
    assert pool.needs_models("D1")
    assert pool.max_model_len("m") == 8192
    pool.set_models("D1", {"m": 2048})
    assert pool.deregister("D1")
    assert pool.max_model_len("m") == 8192
    pool.set_models("P0", None)
    assert pool.max_model_len("m") is None


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://u:p@h:1/x", "http://***@h:1/x"),
        ("http://h:1/a@b", "http://h:1/a@b"),
        ("https://token@h", "https://***@h"),
        ("u:p@h:1", "***@h:1"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_view_without_a_worker_is_the_same_snapshot_less_that_worker() -> None:
    from gateway.pool import PoolView, WorkerView

    view = PoolView((WorkerView("D0", "decode", "http://d0"), WorkerView("D1", "decode", "http://d1")))
    less = view.without("D0")
    assert [w.id for w in less.workers] == ["D1"]
    assert [w.id for w in view.workers] == ["D0", "D1"]  # the snapshot itself is unchanged


def test_a_view_narrowed_within_a_subset_keeps_other_roles_and_names_its_scope() -> None:
    """Rule 7: only the named roles are narrowed; an empty role says where it looked, also after
    `without`."""
    view = PoolView(
        (
            WorkerView("P0", "prefill", "http://p0"),
            WorkerView("D0", "decode", "http://d0"),
            WorkerView("D1", "decode", "http://d1"),
        )
    )
    narrowed = view.within({"D1"}, roles=("decode", "replica"), scope="the hint")
    assert [w.id for w in narrowed.workers] == ["P0", "D1"]
    assert narrowed.least_loaded("decode").id == "D1"
    with pytest.raises(NoWorkerError, match=r"^no live decode worker in the hint$"):
        narrowed.without("D1").least_loaded("decode")
    with pytest.raises(NoWorkerError, match=r"^no live decode worker in the pool$"):
        view.within(set(), roles=("decode", "replica"), scope="").least_loaded("decode")
