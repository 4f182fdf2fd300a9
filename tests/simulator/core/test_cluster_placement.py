"""Placement in the virtual-time cluster (ClusterConfig.placement, ppd/placement.py): P's prefix cache
is modelled (a P holding the history prefills only the rest), prefix placement finds that P, and one
P (1P3D) or least_loaded gives the records of before."""

from __future__ import annotations

from ppd.placement import LEAST_LOADED, PlacementSettings
from simulator.core.cluster import ClusterConfig, ClusterResult, simulate
from simulator.core.profile import Profile
from simulator.core.topology import Topology
from simulator.core.workload import Conversation, sharegpt_like, turn_list_conversations

# Any P holding the history is taken, however busy: every Turn 2+ must land on its P.
ANY_LOAD = PlacementSettings("prefix", max_imbalance=1e9)


def _convs(qps: float = 6.0) -> list[Conversation]:
    return turn_list_conversations(sharegpt_like(40, turns=3, seed=3), qps, 8.0, seed=1)


def _run(
    profile: Profile, shape: str, placement: PlacementSettings, convs: list[Conversation]
) -> ClusterResult:
    config = ClusterConfig(topology=Topology.parse(shape), mode="pd", target_qps=6.0, placement=placement)
    return simulate(profile, config, convs)


def _cached_turn_two_plus(result: ClusterResult) -> dict[str, int]:
    return {rid: n for rid, n in result.prefill_cached.items() if not rid.endswith("#1")}


def test_a_turn_goes_to_the_p_holding_its_history_and_prefills_only_the_rest(profile: Profile) -> None:
    convs = _convs()
    result = _run(profile, "2P2D", ANY_LOAD, convs)
    bs = profile.scheduler.block_size
    by_rid = {f"{r['conversation_id']}#{r['turn']}": r for r in result.records}
    later = [r for r in result.records if r["turn"] > 1 and r["ok"]]
    assert later
    for r in later:
        rid = f"{r['conversation_id']}#{r['turn']}"
        prev = by_rid[f"{r['conversation_id']}#{r['turn'] - 1}"]
        # The previous turn's prompt (whole blocks) sits in its P's prefix cache; its answer does not
        # (it was generated on D): P computes the answer's tokens and the new input only.
        assert result.prefill_cached[rid] == (prev["n_ctx"] + prev["n_in"]) // bs * bs, rid
    assert result.placed_by_prefix  # some turns left the least-loaded P for the one holding them


def test_least_loaded_misses_the_history_that_prefix_placement_reuses(profile: Profile) -> None:
    convs = _convs()
    least = _cached_turn_two_plus(_run(profile, "2P2D", LEAST_LOADED, convs))
    prefix = _cached_turn_two_plus(_run(profile, "2P2D", PlacementSettings("prefix"), convs))
    assert least.keys() == prefix.keys()
    assert any(n == 0 for n in least.values())  # least loaded sent some turns to a P holding nothing
    assert sum(prefix.values()) > sum(least.values())


def test_one_prefill_worker_or_least_loaded_gives_the_records_of_before(profile: Profile) -> None:
    convs = _convs()
    default = simulate(
        profile, ClusterConfig(topology=Topology.parse("2P2D"), mode="pd", target_qps=6.0), convs
    )
    assert _run(profile, "2P2D", LEAST_LOADED, convs).records == default.records
    assert _run(profile, "1P3D", PlacementSettings("prefix"), convs).records == (
        _run(profile, "1P3D", LEAST_LOADED, convs).records
    )


def test_busy_seconds_per_engine_fall_with_the_prefill_placement_saves(profile: Profile) -> None:
    convs = _convs()
    least = _run(profile, "2P2D", LEAST_LOADED, convs)
    prefix = _run(profile, "2P2D", ANY_LOAD, convs)
    for result in (least, prefix):
        assert result.busy_s.keys() == {"P0", "P1", "D0", "D1"}
        assert all(0.0 < busy <= result.end_time for busy in result.busy_s.values())

    def p_busy(result: ClusterResult) -> float:
        return result.busy_s["P0"] + result.busy_s["P1"]

    assert sum(prefix.prefill_cached.values()) > sum(least.prefill_cached.values())
    assert p_busy(prefix) < p_busy(least)  # fewer prompt tokens computed: less time stepping
