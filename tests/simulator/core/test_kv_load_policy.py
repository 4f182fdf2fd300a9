"""The `--kv-load-failure-policy` SPEC of `ppd-sim cluster` (pure parsing)."""

from __future__ import annotations

import pytest

from simulator.core.kv_load_policy import PolicySpecError, parse_policy_spec, parse_worker_ids
from simulator.core.worker_settings import WorkerSettings

WORKERS = ("P0", "D0", "D1")


def test_one_policy_for_every_worker() -> None:
    assert parse_policy_spec("recompute", WORKERS) == {
        "P0": "recompute",
        "D0": "recompute",
        "D1": "recompute",
    }
    assert parse_policy_spec(" fail ", WORKERS) == {"P0": "fail", "D0": "fail", "D1": "fail"}


def test_chosen_workers_and_the_others_keep_the_default() -> None:
    assert parse_policy_spec("D1=recompute", WORKERS) == {"P0": "fail", "D0": "fail", "D1": "recompute"}
    assert parse_policy_spec("D0=recompute, P0=recompute,D1=fail", WORKERS) == {
        "P0": "recompute",
        "D0": "recompute",
        "D1": "fail",
    }
    assert parse_policy_spec("D1=fail", WORKERS, default="recompute")["D0"] == "recompute"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("retry", "unknown policy 'retry' (choose fail, recompute)"),
        ("Recompute", "unknown policy 'Recompute'"),
        ("D1=retry", "unknown policy 'retry'"),
        ("D1=", "unknown policy ''"),
        ("D7=recompute", "no worker 'D7' (workers: P0, D0, D1)"),
        ("D1=recompute,D1=fail", "worker 'D1' given twice"),
        ("D1=recompute,,", "'' is not ID=POLICY"),
        ("D1=recompute,recompute", "'recompute' is not ID=POLICY"),
        ("=recompute", "'=recompute' is not ID=POLICY"),
        ("", "expected POLICY or ID=POLICY"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(PolicySpecError, match="bad kv_load_failure_policy") as info:
        parse_policy_spec(spec, WORKERS)
    assert message in str(info.value)


def test_worker_settings_refuse_an_unknown_policy() -> None:
    assert WorkerSettings(worker_id="D0", role="decode").kv_load_failure_policy == "fail"
    with pytest.raises(ValueError, match="kv_load_failure_policy must be one of fail, recompute"):
        WorkerSettings(worker_id="D0", role="decode", kv_load_failure_policy="retry")  # type: ignore[arg-type]


def test_a_worker_list_names_known_workers_once() -> None:
    assert parse_worker_ids("", WORKERS) == frozenset()
    assert parse_worker_ids(" P0, D1 ", WORKERS) == frozenset({"P0", "D1"})
    assert parse_worker_ids(" all ", WORKERS) == frozenset(WORKERS)
    with pytest.raises(PolicySpecError, match="no worker 'all'"):
        parse_worker_ids("all,P0", WORKERS)
    with pytest.raises(PolicySpecError, match="no worker 'D7'"):
        parse_worker_ids("D7", WORKERS)
    with pytest.raises(PolicySpecError, match="given twice"):
        parse_worker_ids("D1,D1", WORKERS)
    with pytest.raises(PolicySpecError, match="no worker ''"):
        parse_worker_ids("D1,,", WORKERS)
