"""The shape advisor's pure part (loadgen/plan/recommend.py): figures from records, the mix, the score,
the winner per QPS level and overall under weights and under SLO targets, Table 2's winner shares."""

from __future__ import annotations

import pytest

from loadgen.plan.recommend import (
    Config,
    Figures,
    Objective,
    band_changes,
    combine,
    figures,
    recommend,
    score,
    winner_shares,
)
from tests.support.records import make_record

PD = Config("2P2D", "pd")
LOCAL = Config("1P3D", "local")
FAST_TTFT = Config("3P1D", "local")


def _fig(ttft: float, tpot: float, success: float = 1.0, slo: float | None = None) -> Figures:
    return Figures(
        sent=100,
        success=success,
        ttft1_ms=ttft,
        ttft2_ms=ttft,
        ttft_ms=ttft,
        tpot_ms=tpot,
        tpot2_ms=tpot,
        tokens_per_s=1000.0 / tpot,
        slo_attainment=slo,
    )


def test_figures_split_turns_count_failures_and_measure_slo_attainment() -> None:
    records = [
        make_record(turn=1, n_ctx=0, ttft_ms=200.0, tpot_ms=10.0, conversation_id="a"),
        make_record(turn=2, ttft_ms=50.0, tpot_ms=30.0, conversation_id="a", path="local"),
        make_record(turn=2, ttft_ms=150.0, tpot_ms=10.0, conversation_id="b"),
        make_record(turn=1, n_ctx=0, ok=False, conversation_id="c"),
    ]
    fig = figures(records, Objective(slo_ttft_ms=160.0, slo_tpot_ms=20.0))
    assert fig.sent == 4
    assert fig.success == 0.75
    assert (fig.ttft1_ms, fig.ttft2_ms) == (200.0, 100.0)
    assert fig.ttft_ms == pytest.approx(400 / 3)
    assert fig.tpot_ms == pytest.approx(50 / 3)
    assert fig.local_share == 0.5
    # Only the third meets both targets (the first's TTFT, the second's TPOT miss; the failure misses).
    assert fig.slo_attainment == 0.25
    assert figures(records, Objective()).slo_attainment is None  # no targets: no attainment


def test_the_mix_weighs_each_workload_by_its_share() -> None:
    mixed = combine([(3.0, _fig(100.0, 10.0)), (1.0, _fig(200.0, 30.0, success=0.5))])
    assert mixed.ttft_ms == pytest.approx(125.0)
    assert mixed.tpot_ms == pytest.approx(15.0)
    assert mixed.success == pytest.approx(0.875)
    assert mixed.sent == 200


def test_the_score_is_the_papers_s_on_relative_deltas_against_the_baseline() -> None:
    base = _fig(200.0, 10.0)
    assert score(base, base, Objective()) == 0.0
    # TTFT halved (+0.5), TPOT up 20% (-0.2 at w_tpot=1, -0.8 at w_tpot=4).
    assert score(_fig(100.0, 12.0), base, Objective()) == pytest.approx(0.3)
    assert score(_fig(100.0, 12.0), base, Objective(w_tpot=4.0)) == pytest.approx(-0.3)
    assert score(_fig(100.0, 12.0, slo=0.9), base, Objective(slo_ttft_ms=150.0)) == 0.9


def _table(**levels: dict[Config, Figures]) -> dict[Config, dict[float, Figures]]:
    out: dict[Config, dict[float, Figures]] = {}
    for key, per in levels.items():
        for c, f in per.items():
            out.setdefault(c, {})[float(key.removeprefix("q"))] = f
    return out


def test_weights_pick_the_winner_per_level_and_overall() -> None:
    # LOCAL: half the TTFT at +20% TPOT. FAST_TTFT: a third of the TTFT at +150% TPOT.
    table = _table(
        q1={PD: _fig(200.0, 10.0), LOCAL: _fig(100.0, 12.0), FAST_TTFT: _fig(66.0, 25.0)},
        q8={PD: _fig(400.0, 10.0), LOCAL: _fig(150.0, 12.0), FAST_TTFT: _fig(100.0, 25.0)},
    )
    rec = recommend(table, PD, Objective())
    assert [w.winner for w in rec.levels] == [LOCAL, LOCAL]
    assert rec.levels[0].score == pytest.approx(0.3)
    assert rec.overall == LOCAL
    assert rec.eligible_levels == 2
    # Caring only for TTFT (w_tpot tiny), the fastest first token wins.
    ttft_only = recommend(table, PD, Objective(w_ttft=1.0, w_tpot=0.01))
    assert ttft_only.overall == FAST_TTFT
    # Caring mostly for TPOT, classic P/D (the baseline, S = 0) wins.
    assert recommend(table, PD, Objective(w_tpot=10.0)).overall == PD


def test_a_config_below_the_success_floor_cannot_win() -> None:
    table = _table(
        q1={PD: _fig(200.0, 10.0), LOCAL: _fig(100.0, 10.0)},
        q16={PD: _fig(400.0, 10.0), LOCAL: _fig(100.0, 10.0, success=0.9)},
    )
    rec = recommend(table, PD, Objective())
    assert [w.winner for w in rec.levels] == [LOCAL, PD]
    assert rec.overall == PD  # the only config that holds the floor at every level
    lenient = recommend(table, PD, Objective(min_success=0.8))
    assert lenient.overall == LOCAL


def test_when_no_config_holds_the_floor_the_most_successful_is_flagged() -> None:
    table = _table(q20={PD: _fig(400.0, 10.0, success=0.5), LOCAL: _fig(100.0, 10.0, success=0.7)})
    (level,) = recommend(table, PD, Objective()).levels
    assert (level.winner, level.eligible) == (LOCAL, False)


def test_slo_targets_rank_by_attainment_and_break_ties_on_ttft() -> None:
    slo = Objective(slo_ttft_ms=150.0)
    table = _table(
        q4={
            PD: _fig(200.0, 10.0, slo=0.6),
            LOCAL: _fig(100.0, 30.0, slo=0.9),
            FAST_TTFT: _fig(90.0, 40, slo=0.8),
        }
    )
    rec = recommend(table, PD, slo)
    assert rec.overall == LOCAL
    assert rec.levels[0].runner_up == FAST_TTFT
    tie = _table(q4={PD: _fig(200.0, 10.0, slo=0.9), LOCAL: _fig(100.0, 30.0, slo=0.9)})
    assert recommend(tie, PD, slo).overall == LOCAL  # same attainment, lower TTFT


def test_winner_shares_count_cells_per_category_and_table1_changes_per_band() -> None:
    pd1, local1, replica = Config("1P3D", "pd"), Config("1P3D", "local"), Config("4R", "replica")
    ppd1, frac = Config("1P3D", "ppd"), Config("1P3D", "fraction:0.5")
    cells = {
        ("a", 1.0): {pd1: _fig(200.0, 10.0), local1: _fig(80.0, 12.0), replica: _fig(50.0, 20.0)},
        ("b", 1.0): {pd1: _fig(200.0, 10.0), local1: _fig(100.0, 9.0), frac: _fig(150.0, 8.0)},
        ("a", 16.0): {
            pd1: _fig(300.0, 10.0),
            local1: _fig(150.0, 12.0),
            replica: _fig(10.0, 1.0, success=0.5),  # fails too often to count
            ppd1: _fig(100.0, 5.0),
        },
    }
    shares = winner_shares(cells, 0.95, with_ppd=False)
    assert shares["ttft"]["Replica"] == pytest.approx(1 / 3)
    assert shares["ttft"]["x=1 (local)"] == pytest.approx(2 / 3)
    assert shares["tpot"]["0<x<1 (fraction)"] == pytest.approx(1 / 3)
    assert shares["tpot"]["x=0 (pd)"] == pytest.approx(2 / 3)
    assert shares["throughput"]["x=0 (pd)"] == pytest.approx(2 / 3)  # throughput ~ 1/TPOT here
    with_ppd = winner_shares(cells, 0.95, with_ppd=True)
    assert with_ppd["ttft"]["PPD"] == pytest.approx(1 / 3)
    assert with_ppd["ttft"]["x=1 (local)"] == pytest.approx(1 / 3)
    bands = band_changes(cells)
    assert bands["1P3D"]["low"] == pytest.approx(((80 / 200 - 1) + (100 / 200 - 1)) / 2)
    assert bands["1P3D"]["high"] == pytest.approx(150 / 300 - 1)
    assert "medium" not in bands["1P3D"]


def test_an_exact_tie_shares_the_cells_win_instead_of_going_to_the_first_listed() -> None:
    same = _fig(100.0, 10.0)
    cells = {
        ("a", 1.0): {Config("1P3D", "local"): same, Config("1P3D", "pd"): same, Config("4R", "replica"): same}
    }
    shares = winner_shares(cells, 0.95, with_ppd=False)
    for cat in ("Replica", "x=0 (pd)", "x=1 (local)"):
        assert shares["tpot"][cat] == pytest.approx(1 / 3)


def test_a_near_tie_shares_the_win_only_when_asked() -> None:
    cells = {
        ("a", 1.0): {Config("1P3D", "pd"): _fig(100.0, 10.0), Config("4R", "replica"): _fig(100.0, 9.95)}
    }
    exact = winner_shares(cells, 0.95, with_ppd=False)
    assert (exact["tpot"]["Replica"], exact["tpot"]["x=0 (pd)"]) == (1.0, 0.0)
    near = winner_shares(cells, 0.95, with_ppd=False, tie_within=0.01)
    assert (near["tpot"]["Replica"], near["tpot"]["x=0 (pd)"]) == (0.5, 0.5)


def test_a_tie_with_a_static_mode_goes_to_ppd() -> None:
    ppd = Config("1P3D", "ppd")
    table = _table(q1={PD: _fig(200.0, 10.0), LOCAL: _fig(100.0, 10.0), ppd: _fig(100.0, 10.0)})
    rec = recommend(table, PD, Objective())
    assert (rec.levels[0].winner, rec.levels[0].runner_up, rec.overall) == (ppd, LOCAL, ppd)


def test_a_level_where_the_baseline_completed_nothing_scores_against_the_first_config_with_figures() -> None:
    dead = Figures(sent=10, success=0.0, ttft1_ms=None, ttft2_ms=None, ttft_ms=None, tpot_ms=None,
                   tpot2_ms=None, tokens_per_s=None)  # fmt: skip
    table = {LOCAL: {20.0: _fig(100.0, 10.0)}, PD: {20.0: dead}, FAST_TTFT: {20.0: _fig(50.0, 10.0)}}
    rec = recommend(table, PD, Objective())
    assert rec.scores[LOCAL][20.0] == 0.0
    assert rec.scores[FAST_TTFT][20.0] == pytest.approx(0.5)
    assert rec.scores[PD][20.0] is None
    assert rec.levels[0].winner == FAST_TTFT
