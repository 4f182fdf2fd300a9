"""Exploration in the virtual-time cluster (ClusterConfig.explore): the gateway's policy (ppd/explore.py)
over the decision service's verdicts, its bounds, and records unchanged at epsilon = 0."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from decision_service.route import Query, Reason, Verdict
from decision_service.table import Figure, Table, encode_table
from ppd.explore import ExploreSettings
from ppd.records import Record
from simulator.core.cluster import ClusterConfig, simulate
from simulator.core.profile import Profile
from simulator.core.routing import TableRouter
from simulator.core.topology import Topology
from simulator.core.workload import Conversation, synthetic_conversations
from tests.support.tables import synthetic_spec, with_header

UNCAPPED = 1e9


class Recording(TableRouter):
    """A TableRouter that keeps each turn's verdict, by (conversation id, turn)."""

    def __init__(self, table: Table) -> None:
        super().__init__(table)
        self.seen: dict[tuple[str, int], Verdict | None] = {}

    def verdict(self, conversation_id: str, query: Query) -> Verdict | None:
        v = super().verdict(conversation_id, query)
        self.seen[(conversation_id, query.turn)] = v
        return v

    def reason(self, record: dict[str, Any]) -> Reason:
        v = self.seen[(record["conversation_id"], record["turn"])]
        assert v is not None
        return v.reason


def _table(**header: Any) -> Table:
    return Table.from_bytes(encode_table(with_header(synthetic_spec(), **header)))


def _run(
    profile: Profile,
    convs: list[Conversation],
    router: TableRouter,
    explore: ExploreSettings | None,
    qps: float = 4.0,
) -> list[dict[str, Any]]:
    cfg = ClusterConfig(topology=Topology.parse("1P3D"), mode="ppd", target_qps=qps, explore=explore)
    return simulate(profile, cfg, convs, router=router).records


def _lines(records: list[dict[str, Any]]) -> bytes:
    return b"".join(Record.from_dict(r).to_json().encode() + b"\n" for r in records)


@pytest.fixture(scope="module")
def convs() -> list[Conversation]:
    return synthetic_conversations("large_mid_paste", qps=4, duration_s=6, seed=9)


def test_epsilon_zero_gives_the_records_of_no_exploration_byte_for_byte(
    profile: Profile, convs: list[Conversation]
) -> None:
    table = _table()
    plain = _run(profile, convs, TableRouter(table), None)
    for settings in (ExploreSettings(), ExploreSettings(epsilon=0.0, seed=5, max_per_worker_per_s=UNCAPPED)):
        off = _run(profile, convs, TableRouter(table), settings)
        assert json.dumps(off) == json.dumps(plain)
        assert _lines(off) == _lines(plain)


def test_explored_turns_take_the_other_path_and_say_so(profile: Profile, convs: list[Conversation]) -> None:
    router = Recording(_table())
    eps = 0.3
    records = _run(
        profile, convs, router, ExploreSettings(epsilon=eps, seed=1, max_per_worker_per_s=UNCAPPED)
    )
    for r in records:
        Record.from_dict(r)  # every record is valid in the schema, optional fields included
    later = [r for r in records if r["turn"] >= 2]
    explored = [r for r in later if r.get("explored")]
    assert explored
    assert 0.1 < len(explored) / len(later) < 0.5
    for r in later:
        v = router.seen[(r["conversation_id"], r["turn"])]
        assert v is not None
        assert v.alternative_allowed  # every cell here allows both paths
        chosen = "local" if v.local else "pd"
        if r.get("explored"):
            assert r["path"] != chosen
            assert r["propensity"] == eps
        else:
            assert r["path"] == chosen
            assert r["propensity"] == pytest.approx(1 - eps)
    assert not any("explored" in r for r in records if r["turn"] == 1)
    # The same seed draws the same requests; another seed others.
    again = _run(
        profile,
        convs,
        Recording(_table()),
        ExploreSettings(epsilon=eps, seed=1, max_per_worker_per_s=UNCAPPED),
    )
    assert again == records
    other = _run(
        profile,
        convs,
        Recording(_table()),
        ExploreSettings(epsilon=eps, seed=2, max_per_worker_per_s=UNCAPPED),
    )
    assert [r.get("explored") for r in other] != [r.get("explored") for r in records]


def test_never_into_a_path_whose_cell_fails_the_slo(profile: Profile, convs: list[Conversation]) -> None:
    spec = synthetic_spec()
    fig = spec.figures.copy()
    fig[..., Figure.PD_SUCCESS] = 0.5  # PD missed the SLO everywhere: every measured cell is forced LOCAL
    table = Table.from_bytes(encode_table(dataclasses.replace(spec, figures=fig)))
    router = Recording(table)
    records = _run(profile, convs, router, ExploreSettings(epsilon=1.0, max_per_worker_per_s=UNCAPPED))
    later = [r for r in records if r["turn"] >= 2]
    assert later
    assert {router.reason(r) for r in later} == {Reason.PD_FAILED_IN_CELL}
    assert {r["path"] for r in later} == {"local"}
    assert not any("explored" in r for r in records)


def test_never_while_the_decode_load_guard_is_active(profile: Profile) -> None:
    convs = synthetic_conversations("large_mid_paste", qps=8, duration_s=5, seed=9)
    router = Recording(_table(max_decode_running=2, max_prefill_queue_depth=None))
    records = _run(
        profile, convs, router, ExploreSettings(epsilon=1.0, max_per_worker_per_s=UNCAPPED), qps=8.0
    )
    later = [r for r in records if r["turn"] >= 2]
    guarded = [r for r in later if router.reason(r) is Reason.LIVE_SIGNAL]
    assert guarded  # the guard fired ...
    assert all(r["path"] == "pd" and "explored" not in r for r in guarded)  # ... and nothing explored then
    free = [r for r in later if r not in guarded]
    assert free
    assert all(r["explored"] for r in free)  # epsilon 1 explores every other turn


def test_the_cap_per_decode_worker_and_second_holds_in_virtual_time(profile: Profile) -> None:
    convs = synthetic_conversations("large_mid_paste", qps=8, duration_s=8, seed=3)
    rate = 0.5
    router = Recording(_table())
    records = _run(profile, convs, router, ExploreSettings(epsilon=1.0, max_per_worker_per_s=rate), qps=8.0)
    later = [r for r in records if r["turn"] >= 2]
    explored = [r for r in later if r.get("explored")]
    assert explored
    assert len(explored) < len(later) / 2  # epsilon 1, yet most turns were capped
    starts = sorted(r["start_time"] for r in explored)
    span = starts[-1] - starts[0]
    assert len(explored) <= 3 * (1 + rate * span)  # three decode workers, one bucket each
    capped = [r for r in later if not r.get("explored")]
    assert all("propensity" not in r for r in capped)  # capped: not eligible, propensity 1


def test_exploration_needs_a_router_that_gives_verdicts(profile: Profile, convs: list[Conversation]) -> None:
    class PathOnly:
        def local(self, conversation_id: str, query: Query) -> bool:
            return True

    cfg = ClusterConfig(topology=Topology.parse("1P3D"), mode="ppd", explore=ExploreSettings(epsilon=0.1))
    with pytest.raises(ValueError, match="verdicts"):
        simulate(profile, cfg, convs, router=PathOnly())
    # Other modes ignore the setting.
    pd = simulate(profile, dataclasses.replace(cfg, mode="pd"), convs).records
    assert {r["path"] for r in pd} == {"pd"}
