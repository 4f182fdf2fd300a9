"""``ppd-bench bidir`` (loadgen/report/bidir.py): the per-cell figures, the score and picks of the two-way
and three-way tables, the winners, and the section built by one command at a small size."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.cli import main
from loadgen.report.bidir import BidirSettings, Cell, ModeFigures, cell_of, pick, render, score, winners
from tests.support.records import make_record

SETTINGS = BidirSettings()


def _cell(workload: str = "large_mid_paste", qps: float = 8.0, **modes: tuple[float, float, float]) -> Cell:
    return Cell(workload, qps, "nvlink", {m: ModeFigures(t, p, s, 10) for m, (t, p, s) in modes.items()})


def test_a_cells_figures_are_over_turn_two_and_count_failures() -> None:
    records = [
        make_record(turn=1, n_ctx=0, ttft_ms=999.0),
        make_record(ttft_ms=100.0, tpot_ms=10.0),
        make_record(ttft_ms=300.0, tpot_ms=20.0),
        make_record(ok=False, ttft_ms=None, tpot_ms=None, e2e_ms=None, error="timeout"),
    ]
    cell = cell_of("small_mid_paste", 2.0, "nvlink", {"pd": records})
    assert cell.modes["pd"] == ModeFigures(200.0, 15.0, 2 / 3, 2)
    assert (cell.context, cell.turn2, cell.band) == ("small", "mid_paste", "low")


def test_the_three_way_table_picks_bidir_only_where_it_scores_best() -> None:
    # local saves the most TTFT but costs TPOT; bidir saves less TTFT at PD's TPOT.
    cell = _cell(pd=(200.0, 10.0, 1.0), local=(50.0, 200.0, 1.0), bidir=(120.0, 10.0, 1.0))
    assert score(cell, "pd", SETTINGS) == 0.0
    assert score(cell, "local", SETTINGS) == pytest.approx(150 / 200 - 190 / 10)  # relative deltas
    assert score(cell, "bidir", SETTINGS) == pytest.approx(80 / 200)
    assert pick(cell, ("pd", "local"), SETTINGS) == "pd"
    assert pick(cell, ("pd", "local", "bidir"), SETTINGS) == "bidir"
    failing = _cell(pd=(200.0, 10.0, 1.0), local=(50.0, 10.0, 1.0), bidir=(10.0, 10.0, 0.5))
    assert score(failing, "bidir", SETTINGS) is None  # below min_success: never picked
    assert pick(failing, ("pd", "local", "bidir"), SETTINGS) == "local"
    assert pick(_cell(pd=(200.0, 10.0, 1.0)), ("pd", "local", "bidir"), SETTINGS) == "pd"


def test_winners_count_cells_per_class_with_the_margin_over_the_runner_up() -> None:
    cells = [
        _cell("large_mid_paste", pd=(200.0, 10.0, 1.0), local=(50.0, 20.0, 1.0), bidir=(100.0, 10.0, 1.0)),
        _cell("small_mid_paste", pd=(100.0, 10.0, 1.0), local=(80.0, 20.0, 1.0), bidir=(40.0, 12.0, 1.0)),
        _cell("small_tiny", pd=(100.0, 10.0, 1.0)),  # a mode missing: no winner
    ]
    ttft = winners(cells, "ttft_ms", lambda c: c.context)
    assert ttft["large"]["local"] == (1, 50.0)
    assert ttft["small"]["bidir"] == (1, 50.0)
    assert ttft["small"]["pd"] == (0, None)
    tpot = winners(cells, "tpot_ms", lambda c: "all")
    # A tie goes to the mode listed first (pd) with a 0% margin; the median of 0% and 2/12 is half of it.
    assert tpot["all"]["pd"] == (2, pytest.approx(100 * 2 / 12 / 2, rel=1e-9))


def test_the_section_says_where_three_way_beats_two_way() -> None:
    wins = _cell(pd=(200.0, 10.0, 1.0), local=(50.0, 200.0, 1.0), bidir=(120.0, 10.0, 1.0))
    text = "\n".join(render([wins], SETTINGS))
    assert "picks bidir in 1 of 1 cells (mean S gain 0.40 over the two-way pick)" in text
    same = _cell(pd=(200.0, 10.0, 1.0), local=(50.0, 10.0, 1.0), bidir=(120.0, 10.0, 1.0))
    assert "never picks bidir" in "\n".join(render([same], SETTINGS))


def test_one_command_builds_the_section_on_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "bidir"
    argv = [
        "bidir",
        "--out",
        str(out),
        "--workloads",
        "large_mid_paste",
        "--qps",
        "2,16",
        "--links",
        "nvlink",
    ]
    assert main([*argv, "--duration", "2", "--no-progress"]) == 0
    text = (out / "bidir.md").read_text()
    assert "### Per-metric winners (the paper's Table 3, three ways)" in text
    assert "| nvlink | low |" in text
    assert "| nvlink | high |" in text
    assert sorted(p.name for p in (out / "records" / "nvlink").iterdir()) == [
        "bidir", "local", "pd", "ppd2-routed", "ppd3-routed",
    ]  # fmt: skip
    assert (
        out / "tables" / "nvlink.ppdt"
    ).is_file()  # the table the routed arms used (built from the static runs)
    assert "ppd3 routed (vs pd)" in text
    assert (out / "bidir.json").is_file()
