"""The virtual-time cluster's bidirectional path (simulator/core/cluster.py, mode ``bidir``): two
transfers per Turn 2+, P computes only what it neither holds nor pulls from D, D's pin expires."""

from __future__ import annotations

from pathlib import Path

import pytest

from decision_service.route import Query
from decision_service.table import Table, Weights, write_table
from ppd.catalog import parse_workload
from simulator.core.cluster import ClusterConfig, ClusterResult, LocalPolicy, simulate
from simulator.core.profile import Profile
from simulator.core.routing import TableRouter
from simulator.core.topology import Topology
from simulator.core.workload import Conversation, Turn, synthetic_conversations
from simulator.tools.sweep_engine import SimEngine
from table_builder.build import BuildOptions, build_from_records, default_header
from table_builder.records import read_records
from table_builder.sweep import SweepPlan, run_sweep


def _run(
    profile: Profile, mode: str, convs: list[Conversation], router: LocalPolicy | None = None, **kw: object
) -> ClusterResult:
    config = ClusterConfig(topology=Topology.parse("1P3D"), mode=mode, **{"target_qps": 4.0, **kw})  # type: ignore[arg-type]
    return simulate(profile, config, convs, router)


def _turn2_ttft(result: ClusterResult) -> float:
    values = [float(r["ttft_ms"]) for r in result.records if r["turn"] == 2 and r["ok"]]
    return sum(values) / len(values)


def test_bidir_turns_pull_the_history_from_d_and_land_between_local_and_pd(profile: Profile) -> None:
    convs = synthetic_conversations("large_mid_paste", qps=4, duration_s=20, seed=1)
    runs = {mode: _run(profile, mode, convs) for mode in ("pd", "local", "bidir")}
    bidir = runs["bidir"]
    assert {(r["turn"], r["path"], r["mode"]) for r in bidir.records} == {
        (1, "pd", "bidir"),
        (2, "bidir", "bidir"),
    }
    assert all(r["ok"] for r in bidir.records)
    # P appends after pulling the history from D: its prompts come partly from outside, as in vLLM's
    # prompt_tokens_by_source{source="external_kv_transfer"}; plain PD prefills take nothing from outside.
    assert bidir.engine_stats["P0"].prompt_tokens_external > 0
    assert runs["pd"].engine_stats["P0"].prompt_tokens_external == 0
    assert (
        bidir.engine_stats["P0"].prompt_tokens_local_compute
        < runs["pd"].engine_stats["P0"].prompt_tokens_local_compute
    )
    # Two transfers and an append: slower to the first token than local, faster than recomputing all.
    assert _turn2_ttft(runs["local"]) < _turn2_ttft(bidir) < _turn2_ttft(runs["pd"])


def test_the_read_or_the_ttl_ends_ds_pins(profile: Profile) -> None:
    convs = synthetic_conversations("large_mid_paste", qps=4, duration_s=10, seed=2)
    result = _run(profile, "bidir", convs, decoder_kv_blocks_ttl_s=5.0)
    # Every Turn 2 read its D's pin; the last turns' pins ran out; nothing stays pinned.
    assert sum(s.num_pinned for s in result.engine_stats.values()) == 0
    assert sum(s.num_kv_expired for name, s in result.engine_stats.items() if name.startswith("D")) > 0


def test_a_pin_expired_before_the_next_turn_fails_it(profile: Profile) -> None:
    conv = Conversation("c1", "w", start=0.0, turns=(Turn(1024, 512), Turn(256, 8)))
    result = _run(profile, "bidir", [conv], decoder_kv_blocks_ttl_s=1e-3, think_time_s=1.0)
    first, second = result.records
    assert (first["ok"], first["path"]) == (True, "pd")
    assert (second["ok"], second["path"], second["error"]) == (False, "bidir", "kv_lease_expired")


@pytest.mark.parametrize("fast_forward", [False, True])
def test_other_modes_keep_their_records(profile: Profile, fast_forward: bool) -> None:
    convs = synthetic_conversations("small_mid_bal", qps=4, duration_s=5, seed=3)
    a = _run(profile, "pd", convs, fast_forward=fast_forward).records
    b = _run(profile, "pd", convs, fast_forward=fast_forward, decoder_kv_blocks_ttl_s=1.0).records
    assert a == b  # the TTL is read in bidir mode only


def test_fast_forward_equals_step_by_step_on_the_bidir_path(profile: Profile) -> None:
    convs = synthetic_conversations("large_mid_paste", qps=6, duration_s=8, seed=4)
    a, b = (_run(profile, "bidir", convs, fast_forward=ff).records for ff in (False, True))
    assert [r["conversation_id"] for r in a] == [r["conversation_id"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert x["ttft_ms"] == pytest.approx(y["ttft_ms"], abs=1e-6)
        assert x["e2e_ms"] == pytest.approx(y["e2e_ms"], abs=1e-6)


def test_a_pull_below_the_recompute_threshold_is_computed_on_p_and_frees_ds_pin(profile: Profile) -> None:
    # P holds Turn 1's prompt; D's extra is Turn 1's 15 computed output tokens, below vLLM's 64.
    conv = Conversation("c1", "w", start=0.0, turns=(Turn(2048, 16), Turn(256, 8)))
    result = _run(profile, "bidir", [conv], decoder_kv_blocks_ttl_s=5.0)
    assert [(r["ok"], r["path"]) for r in result.records] == [(True, "pd"), (True, "bidir")]
    assert result.engine_stats["P0"].prompt_tokens_external == 0
    # Only Turn 2's own pin ran out: P's finish released Turn 1's.
    assert sum(s.num_kv_expired for s in result.engine_stats.values()) == 1


def _three_mode_table(tmp_path: Path) -> Table:
    """A 1P3D table with pd, local and bidir figures for large_mid_paste at 8 QPS (a tiny sim sweep)."""
    plan = SweepPlan(
        ("1P3D",), "llama-3.1-8b", ("pd", "local", "bidir"), (parse_workload("large_mid_paste"),), (8.0,)
    )
    files = run_sweep(plan, SimEngine(duration_s=4.0, seed=1), tmp_path)
    options = BuildOptions(header=default_header("1P3D", "llama-3.1-8b"), min_samples=1)
    result = build_from_records(read_records(files["1P3D"]), options)
    return Table.open(write_table(tmp_path / "t.ppdt", result.spec))


def test_ppd_routes_three_ways_only_when_the_caller_can_serve_bidir(profile: Profile, tmp_path: Path) -> None:
    table = _three_mode_table(tmp_path)
    try:
        convs = synthetic_conversations("large_mid_paste", qps=8, duration_s=4, seed=2)
        # TPOT weighs so much that local loses; bidir saves TTFT at PD's TPOT.
        router = TableRouter(table, Weights(1.0, 64.0))
        three = _run(profile, "ppd", convs, ppd_bidir=True, target_qps=8.0, router=router)
        two = _run(profile, "ppd", convs, target_qps=8.0, router=TableRouter(table, Weights(1.0, 64.0)))
    finally:
        table.close()
    assert {r["path"] for r in three.records if r["turn"] == 2} == {"bidir"}
    assert all(r["ok"] for r in three.records)
    assert {r["path"] for r in two.records if r["turn"] == 2} <= {"pd", "local"}  # never asked for bidir
    with pytest.raises(ValueError, match="ppd_bidir needs a router that gives verdicts"):
        _run(profile, "ppd", convs, ppd_bidir=True, router=_LocalOnly())


class _LocalOnly:
    def local(self, conversation_id: str, query: Query) -> bool:
        return True
