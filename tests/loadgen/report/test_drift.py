"""``ppd-bench drift``: the stale and oracle arms end to end at CI size, the closed loop's refresh
mechanics and figures with a stand-in refresh, and the closed loop with exploration (``ppd.explore``)
and the real refresh (``table_builder.refresh``)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from decision_service.table import Table
from loadgen.cli import main
from loadgen.report.drift import run_drift
from loadgen.report.drift_arms import (
    ArmRun,
    DriftSettings,
    RefreshLoop,
    TableSwap,
    cluster_config,
    decision_match,
    post_drift_events,
    run_arm,
    traffic_cells,
)
from loadgen.report.drift_section import ArmFigures, DriftFigures, figures, goals
from loadgen.report.traffic import mix_conversations
from table_builder.aggregate import CellKey
from table_builder.records import read_records
from tests.support.tables import decided_everywhere

ROOT = Path(__file__).resolve().parents[3]
STALE = ROOT / "tables" / "3P1D__llama-3.1-8b.ppdt"

# CI size: 40 s of arrivals, the drift at 15 s, oracle points of 5 s (about 10 s of CPU in all).
CI = DriftSettings(duration_s=40.0, drift=("15:decode=2",), oracle_duration_s=5.0, stale_table=STALE)


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("drift")
    lines: list[str] = []
    fig, path = run_drift(
        DriftSettings(**{**_fields(CI), "arms": ("stale", "oracle")}), out, progress=lines.append
    )
    assert path == out / "drift.md"
    assert any(line.startswith("oracle sweep 8/8") for line in lines)
    return out, fig


def _fields(settings: DriftSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in DriftSettings.__dataclass_fields__}


def test_stale_and_oracle_arms_end_to_end(ci_run: tuple[Path, Any]) -> None:
    out, fig = ci_run
    stale, oracle = fig.arm("stale"), fig.arm("oracle")
    # Decode workers twice as slow make the huge paste's append-prefills cost more TPOT than they save
    # TTFT: the oracle (built on the drifted cluster) sends them to P, the stale table keeps them local.
    assert fig.stale_match == pytest.approx(0.75, abs=0.05)
    assert stale.match_final == fig.stale_match
    assert oracle.match_final == 1.0
    assert stale.local_share_post == 1.0
    assert oracle.local_share_post is not None
    assert oracle.local_share_post < 0.8
    assert oracle.tpot_post_ms < stale.tpot_post_ms
    # Same arrivals and the same table until the drift: the arms agree before it.
    assert oracle.ttft_pre_ms == stale.ttft_pre_ms
    assert fig.arm("closed") is None
    text = (out / "drift.md").read_text("utf-8")
    assert "## Drift: stale table vs closed loop vs oracle" in text
    assert "| stale |" in text
    assert "| oracle |" in text
    assert (out / "drift.png").stat().st_size > 10_000
    assert json.loads((out / "drift.json").read_text("utf-8"))["stale_match"] == fig.stale_match
    records = read_records([out / "records" / "stale.jsonl"])
    assert {r.mode for r in records} == {"ppd"}
    assert {r.run_id for r in records} == {"drift-stale"}


def test_the_oracle_table_measures_only_the_cells_the_mix_visits(ci_run: tuple[Path, Any]) -> None:
    out, _ = ci_run
    table = Table.open(out / "oracle-sweep" / "3P1D__llama-3.1-8b.ppdt")
    nc, nw, nq = table.header.axes.shape
    measured = {(c, w, q) for c in range(nc) for w in range(nw) for q in range(nq) if table.measured(c, w, q)}
    conversations = mix_conversations(CI.workloads, CI.qps, CI.duration_s, CI.seed)
    visited = traffic_cells(table, conversations, CI.qps, 0.0)
    assert measured == {(k.context, k.workload, k.qps) for k in visited}
    assert len(measured) == 4
    assert json.loads((out / "oracle-sweep" / "sweep.json").read_text("utf-8"))["settings"]["drift"] == [
        "0:decode=2"
    ]


def test_decision_match_weighs_cells_by_traffic() -> None:
    stale = Table.open(STALE)
    pd, local = decided_everywhere(stale, local=False), decided_everywhere(stale, local=True)
    cells = Counter({CellKey(0, 8, 4): 3, CellKey(1, 5, 4): 1})
    assert decision_match(pd, local, cells) == 0.0
    assert decision_match(local, local, cells) == 1.0
    assert decision_match(stale, local, cells) == 1.0  # the shipped 3P1D table is local there
    assert decision_match(pd, local, Counter()) == 1.0


def test_refresh_loop_swaps_tables_in_virtual_time_and_the_figures_count_the_requests() -> None:
    """A stand-in refresh that returns the oracle table once its evidence holds post-drift records:
    the loop's mechanics (when it refreshes, what it reads, the swap) and the convergence figures."""
    from simulator.core.cluster import simulate
    from simulator.core.profile import load_profile
    from simulator.core.routing import TableRouter

    settings = DriftSettings(**{**_fields(CI), "refresh_every": 50, "window": 80})
    stale = Table.open(STALE)
    oracle = decided_everywhere(stale, local=False)
    seen: list[int] = []

    def refresh(base: Table, records: Any) -> Table:
        assert base is stale
        seen.append(len(records))
        return oracle if max(r.start_time for r in records) >= settings.drift_at else base

    conversations = mix_conversations(settings.workloads, settings.qps, settings.duration_s, settings.seed)
    router = TableRouter(stale)
    loop = RefreshLoop(router, stale, refresh, every=50, window=80)
    records = simulate(load_profile(), cluster_config(settings, "x"), conversations, router, loop).records
    assert seen[:2] == [50, 80]
    assert set(seen[1:]) == {80}
    assert [s.finished for s in loop.swaps] == [50 * (i + 1) for i in range(len(loop.swaps))]
    cells = traffic_cells(stale, conversations, settings.qps, settings.drift_at)
    stale_run = run_arm("stale", settings, conversations, stale)
    fig = figures([stale_run, ArmRun("closed", records, loop.swaps)], stale, oracle, cells, settings.drift_at)
    first = next(s for s in loop.swaps if s.table is oracle)
    assert fig.converged_at == first.at
    assert fig.requests_to_converge == sum(
        1 for r in records if settings.drift_at <= r["start_time"] < first.at
    )
    assert fig.requests_to_converge > 0
    assert fig.stayed is True
    closed = fig.arm("closed")
    assert closed is not None
    assert closed.match_final == 1.0
    assert fig.stale_match == 0.0
    after = [r for r in records if r["turn"] == 2 and r["start_time"] > first.at + 1.0]
    assert after
    assert {r["path"] for r in after} == {"pd"}
    assert fig.exploration_cost_ms == 0.0  # no exploration, the same table before the drift
    with pytest.raises(ValueError, match="refresh_every"):
        RefreshLoop(router, stale, refresh, every=0)


def test_closed_loop_arm_with_exploration_and_refresh(tmp_path: Path) -> None:
    settings = DriftSettings(**{**_fields(CI), "duration_s": 60.0, "refresh_every": 50, "min_samples": 5})
    fig, _ = run_drift(settings, tmp_path)
    closed = fig.arm("closed")
    assert closed is not None
    assert closed.explored is not None
    assert closed.explored > 0
    assert fig.closed_matches
    records = read_records([tmp_path / "records" / "closed.jsonl"])
    assert {r.path for r in records if r.turn == 2} == {"pd", "local"}


def test_every_refresh_merges_into_the_offline_base_and_replace_drifted_reaches_it() -> None:
    """The closed loop's tables come from the stale table each time (never from the previous refresh:
    the records would count twice), with refresh rule 7 when asked."""
    settings = DriftSettings(**{**_fields(CI), "duration_s": 30.0, "refresh_every": 100})
    stale = Table.open(STALE)
    conversations = mix_conversations(settings.workloads, settings.qps, settings.duration_s, settings.seed)
    for replace in (False, True):
        run = run_arm("closed", dataclasses.replace(settings, replace_drifted=replace), conversations, stale)
        assert len(run.swaps) >= 2
        for swap in run.swaps:
            provenance = swap.table.header.provenance
            assert provenance["base"]["version"] == stale.version
            assert provenance.get("replace_drifted", False) is replace


def test_the_decision_goal_needs_the_match_to_hold_not_a_final_table_that_matches_by_chance() -> None:
    closed = ArmFigures(
        name="closed", ttft_pre_ms=1.0, ttft_post_ms=1.0, tpot_pre_ms=1.0, tpot_post_ms=1.0,
        success_post=1.0, local_share_post=1.0, explored=3, match_final=1.0,
    )  # fmt: skip
    fell_back = DriftFigures(
        drift_at=10.0, arms=(closed,), closed_matches=((5.0, 1, 0.75), (12.0, 2, 1.0), (14.0, 3, 0.75),
        (16.0, 4, 1.0)), stale_match=0.75, converged_at=12.0, requests_to_converge=7, stayed=False,
        closed_ttft_ms=1.0, oracle_ttft_ms=1.0, exploration_cost_ms=0.0,
    )  # fmt: skip
    _, match, converge, _ = goals(fell_back)
    assert match[1] == "FAIL"
    assert match[2].startswith("2 of 3 refreshes after the drift; final table 100%")
    assert converge[1] == "FAIL"
    assert "fell below again later" in converge[2]
    held = dataclasses.replace(fell_back, closed_matches=fell_back.closed_matches[:2], stayed=True)
    assert [row[1] for row in goals(held)[1:3]] == ["PASS", "PASS"]


def test_convergence_is_the_settling_time_not_a_passing_match() -> None:
    # The loop matches once after the drift (t=12), falls back (t=14), then matches from t=16 on: it
    # converged at 16, and the requests counted run from the drift to 16.
    stale = Table.open(STALE)
    oracle = decided_everywhere(stale, local=False)
    records = [
        {"turn": 2, "ok": True, "path": "local", "ttft_ms": 1.0, "tpot_ms": 1.0, "start_time": float(t)}
        for t in range(20)
    ]

    def fig(tables: list[tuple[float, Table]]) -> DriftFigures:
        swaps = [TableSwap(at, k, table) for k, (at, table) in enumerate(tables)]
        cells = Counter({CellKey(0, 0, 0): 1})
        return figures([ArmRun("closed", records, swaps)], stale, oracle, cells, 10.0)

    settles = fig([(5.0, stale), (12.0, oracle), (14.0, stale), (16.0, oracle), (18.0, oracle)])
    assert (settles.converged_at, settles.requests_to_converge, settles.stayed) == (16.0, 6, True)
    falls = fig([(5.0, stale), (12.0, oracle), (14.0, stale)])
    assert (falls.converged_at, falls.requests_to_converge, falls.stayed) == (12.0, 2, False)
    never = fig([(5.0, stale), (12.0, stale)])
    assert (never.converged_at, never.requests_to_converge, never.stayed) == (None, None, None)


def test_cli_help_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["drift", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "--refresh-every" in help_text
    assert "--replace-drifted" in help_text
    for bad in (["--drift", "10:speed=2"], ["--workloads", "nope"], ["--arms", "stale,best"]):
        with pytest.raises(SystemExit) as exc:
            main(["drift", "--out", "x", *bad])
        assert exc.value.code == 2
    assert "unknown drift key" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--epsilon", "1.5", "from 0 to 1"),
        ("--epsilon", "-0.1", "from 0 to 1"),
        ("--epsilon", "nan", "from 0 to 1"),
        ("--confidence", "1", "between 0 and 1"),
        ("--confidence", "0", "between 0 and 1"),
        ("--refresh-every", "0", "integer >= 1"),
        ("--min-samples", "0", "integer >= 1"),
        ("--window", "-1", "integer >= 0"),
        ("--window", "1.5", "integer >= 0"),
        ("--explore-seed", "-1", "integer >= 0"),
        ("--seed", "-3", "integer >= 0"),
    ],
)
def test_cli_range_checks_the_closed_loops_flags(
    flag: str, value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A bad value is a usage error naming the flag (exit 2), never a traceback from deep in a run.
    with pytest.raises(SystemExit) as exc:
        main(["drift", "--out", str(tmp_path), "--arms", "stale", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err, err
    assert message in err, err
    assert not any(tmp_path.iterdir())


def test_cli_refuses_a_drift_after_the_run(tmp_path: Path) -> None:
    assert main(["drift", "--out", str(tmp_path), "--duration", "10", "--drift", "20:link=0.1"]) == 2
    assert not any(tmp_path.iterdir())


def test_cli_runs_the_stale_arm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["drift", "--out", str(tmp_path), "--duration", "12", "--drift", "5:decode=2", "--arms", "stale"]
    assert main([*args, "--stale-table", str(STALE), "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "drift section:" in out.out
    assert out.err == ""
    assert next(r.run_id for r in read_records([tmp_path / "records" / "stale.jsonl"])) == "drift-stale"
    assert not (tmp_path / "oracle-sweep").exists()


def test_the_oracle_measures_the_cluster_after_every_event_in_time_order() -> None:
    # Text order would put "100:..." before "50:..."; the later event must be applied last.
    assert post_drift_events(("50:decode=2", "100:decode=4")) == ("0:decode=2", "0:decode=4")
    assert post_drift_events(("100:decode=4", "50:decode=2")) == ("0:decode=2", "0:decode=4")
    assert post_drift_events(("10:link=0.123456789",)) == ("0:link=0.123456789",)  # no rounding
