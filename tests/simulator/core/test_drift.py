"""Timed drift in the virtual-time cluster: the values, the text form, and what an event does to a run."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decision_service.route import Query
from simulator.core.cluster import ClusterConfig, simulate
from simulator.core.cost import CostModel
from simulator.core.drift import DriftError, DriftEvent, parse_drift, slowed
from simulator.core.link import Link, TransferMode
from simulator.core.profile import LinkSpec, Profile
from simulator.core.routing import TableRouter
from simulator.core.topology import Topology
from simulator.core.workload import Conversation, Turn, turn_list_conversations

MIX = [[(1024, 1024), (256, 64)], [(128, 128), (1024, 32)], [(4096, 1024), (64, 1024)]]


def cfg(mode: str, shape: str = "1P3D", **kw: Any) -> ClusterConfig:
    return ClusterConfig(topology=Topology.parse(shape), mode=mode, target_qps=8.0, **kw)


def digest(records: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(records).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- values


def test_parse_drift_reads_the_documented_form() -> None:
    assert parse_drift("60:link=0.1,decode=2") == DriftEvent(at_s=60.0, link=0.1, decode=2.0)
    assert parse_drift("0: prefill=1.5") == DriftEvent(at_s=0.0, prefill=1.5)
    assert parse_drift("60:link=0.1").describe() == "at 60 s: KV links x0.1 bandwidth"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("60", "expected AT:KEY=FACTOR"),
        ("60:", "expected AT:KEY=FACTOR"),
        ("60:speed=2", "unknown drift key"),
        ("60:link", "unknown drift key"),
        ("x:link=2", "not a number"),
        ("60:link=fast", "not a number"),
        ("60:link=2,link=3", "given twice"),
        ("-1:link=2", "time >= 0"),
        ("60:decode=0", "positive number"),
        ("60:decode=nan", "positive number"),
    ],
)
def test_parse_drift_refuses_what_cannot_happen(text: str, message: str) -> None:
    with pytest.raises(DriftError, match=message):
        parse_drift(text)


def test_an_event_must_change_something() -> None:
    with pytest.raises(DriftError, match="changes nothing"):
        DriftEvent(at_s=1.0)


@given(factor=st.floats(min_value=0.25, max_value=8.0))
@settings(max_examples=25, deadline=None)
def test_slowed_profile_prices_every_step_factor_times(factor: float) -> None:
    from simulator.core.profile import load_profile

    profile = load_profile()
    base, slow = CostModel(profile), CostModel(slowed(profile, factor))
    for chunks, decodes, kv in (((), 1, 500.0), (((512, 0),), 0, 0.0), (((64, 2048),), 40, 80_000.0)):
        a = base.step(num_decodes=decodes, chunks=chunks, num_sampled=decodes + 1, kv_read_tokens=kv)
        b = slow.step(num_decodes=decodes, chunks=chunks, num_sampled=decodes + 1, kv_read_tokens=kv)
        assert b == pytest.approx(factor * a, rel=1e-9)
    assert slowed(profile, 1.0) is profile


def test_link_set_bandwidth_slows_a_shared_flow_under_way() -> None:
    link = Link(LinkSpec("l", 100.0, 0.0), TransferMode.SHARED_LINK)
    link.start(0.0, 100)  # alone at 100 B/s: done at 1.0
    link.set_bandwidth(0.5, 10.0)  # 50 B moved, 50 B left at 10 B/s
    assert link.next_completion_at() == pytest.approx(5.5)
    with pytest.raises(ValueError, match="positive"):
        link.set_bandwidth(0.6, 0.0)


# ---------------------------------------------------------------- the cluster


def test_records_without_drift_are_the_bytes_of_the_simulator_before_drift(profile: Profile) -> None:
    """Digests of these records from the simulator as it was before drift existed (and an observer
    that only watches changes nothing). If the simulator's model changes on purpose, the shipped
    tables change too (tests/table_builder/test_shipped_tables.py); update these with them."""
    convs = turn_list_conversations(MIX, 8.0, 20.0, workload="mix", seed=3)
    seen: list[dict[str, Any]] = []

    class Watch:
        def finished(self, record: dict[str, Any], now: float) -> None:
            assert now >= record["start_time"]
            seen.append(record)

    got = {}
    for mode in ("pd", "local", "ppd"):
        router = TableRouter.open("tables/1P3D__llama-3.1-8b.ppdt") if mode == "ppd" else None
        records = simulate(profile, cfg(mode), convs, router, Watch()).records
        got[mode] = digest(records)
        assert sorted(seen, key=lambda r: (r["start_time"], r["conversation_id"], r["turn"])) == records
        seen.clear()
    assert got == {"pd": "ddb30635eddfc5ce", "local": "26f37f71d05ac24a", "ppd": "4bc98902c0d8dd6c"}


@given(at=st.floats(min_value=2.0, max_value=18.0), link=st.sampled_from([0.1, 0.5, 3.0]))
@settings(max_examples=8, deadline=None)
def test_requests_finished_before_the_drift_are_untouched(at: float, link: float) -> None:
    from simulator.core.profile import load_profile

    profile = load_profile()
    convs = turn_list_conversations(MIX, 8.0, 20.0, workload="mix", seed=3)
    event = DriftEvent(at_s=at, link=link, decode=2.0)
    for mode in ("pd", "local"):
        before = simulate(profile, cfg(mode), convs).records
        after = simulate(profile, cfg(mode, drift=(event,)), convs).records
        done_early = [
            r for r in before if r["e2e_ms"] is not None and r["start_time"] + r["e2e_ms"] / 1e3 < at
        ]
        assert done_early
        assert all(r in after for r in done_early)
        assert after != before


def test_a_slower_link_from_t_hurts_pd_turns_after_t_only(profile: Profile) -> None:
    convs = turn_list_conversations([[(4096, 64), (1024, 64)]], 2.0, 40.0, workload="x", seed=1)
    drift = (DriftEvent(at_s=20.0, link=0.01),)
    base = simulate(profile, cfg("pd"), convs).records
    slow = simulate(profile, cfg("pd", drift=drift), convs).records

    def ttft(records: list[dict[str, Any]], late: bool) -> float:
        xs = [
            float(r["ttft_ms"])
            for r in records
            if r["turn"] == 2 and (r["start_time"] > 20.0 if late else r["start_time"] < 19.0)
        ]
        return sum(xs) / len(xs)

    assert ttft(slow, late=False) == ttft(base, late=False)
    # 5,120 tokens x 128 KiB at 1.49 GB/s: about 0.45 s per transfer instead of 4.5 ms.
    assert ttft(slow, late=True) > ttft(base, late=True) + 300.0
    local_base = simulate(profile, cfg("local"), convs).records
    local_slow = simulate(profile, cfg("local", drift=drift), convs).records
    # Turn 1 still takes PD (later Turn 2 starts), but a local Turn 2 moves no KV: its TTFT stays.
    assert ttft(local_slow, late=True) == pytest.approx(ttft(local_base, late=True), rel=0.1)


def test_slower_decode_workers_take_twice_as_long_per_step_from_t(profile: Profile) -> None:
    """One long answer alone on its decode worker: the steps after the drift take twice as long."""
    conv = [Conversation("c", "x", 0.0, (Turn(64, 2000),))]
    base = simulate(profile, cfg("pd", "1P1D"), conv).records[0]
    at = 5.0
    slow = simulate(profile, cfg("pd", "1P1D", drift=(DriftEvent(at_s=at, decode=2.0),)), conv).records[0]
    assert slow["ttft_ms"] == base["ttft_ms"]
    end_base, end_slow = base["e2e_ms"] / 1e3, slow["e2e_ms"] / 1e3
    step = base["tpot_ms"] / 1e3 * 1.5  # the step in flight at the drift ends as planned
    assert end_slow == pytest.approx(at + 2 * (end_base - at), abs=step)


def test_slower_prefill_workers_slow_the_pd_path_only(profile: Profile) -> None:
    convs = turn_list_conversations([[(2048, 64), (2048, 64)]], 2.0, 20.0, workload="x", seed=4)
    drift = (DriftEvent(at_s=0.0, prefill=3.0),)
    for mode, slower in (("pd", True), ("local", False)):
        base = simulate(profile, cfg(mode), convs).records
        slow = simulate(profile, cfg(mode, drift=drift), convs).records
        b = sum(r["ttft_ms"] for r in base if r["turn"] == 2)
        s = sum(r["ttft_ms"] for r in slow if r["turn"] == 2)
        assert (s > 1.2 * b) is slower, mode
        # Turn 1 takes PD in both modes, so its prefill is slower in both.
        assert sum(r["ttft_ms"] for r in slow if r["turn"] == 1) > sum(
            r["ttft_ms"] for r in base if r["turn"] == 1
        )


def test_a_router_table_swapped_mid_run_routes_the_requests_after(profile: Profile) -> None:
    """The closed loop's hook: an observer swaps the router's table in virtual time."""
    from decision_service.table import Table
    from tests.support.tables import decided_everywhere

    local_table = Table.open("tables/1P3D__llama-3.1-8b.ppdt")
    router = TableRouter(local_table)
    swap_at = 10.0

    class Swap:
        def __init__(self) -> None:
            self.done = False

        def finished(self, record: dict[str, Any], now: float) -> None:
            if not self.done and now >= swap_at:
                router.use_table(decided_everywhere(local_table, local=False))
                self.done = True

    convs = turn_list_conversations(MIX, 4.0, 20.0, workload="mix", seed=5)
    records = simulate(profile, cfg("ppd"), convs, router, Swap()).records
    turn2 = [r for r in records if r["turn"] == 2]
    assert {r["path"] for r in turn2 if r["start_time"] < swap_at} == {"local"}
    assert {r["path"] for r in turn2 if r["start_time"] > swap_at + 1.0} == {"pd"}
    assert router.local("c", Query(turn=2, n_in=256, n_out=64, n_ctx=2048, qps=4.0)) is False
