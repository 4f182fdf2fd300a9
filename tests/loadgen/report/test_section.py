"""The experiment sections' shared pieces: Markdown tables, mean, nearest-rank P99, milliseconds, and the
options and output every experiment command (bidir, drift, slo) has."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.cli import build_parser
from loadgen.report.section import md_table, mean, ms, p99, print_section

EXPERIMENTS = ("bidir", "drift", "slo")


def test_md_table_mean_p99_and_ms() -> None:
    assert md_table(["a", "b"], [["1", "2"]]) == ["| a | b |", "|---|---|", "| 1 | 2 |", ""]
    assert mean([]) is None
    assert mean([1.0, 2.0]) == 1.5
    assert p99([]) is None
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0
    assert p99([5.0]) == 5.0
    assert ms(None) == "-"
    assert ms(1.234) == "1.2"


@pytest.mark.parametrize("command", EXPERIMENTS)
def test_every_experiment_takes_the_common_options(command: str, tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [command, "--out", str(tmp_path), "--shape", "2P2D", "--seed", "7", "--no-progress"]
    )
    assert (args.out, args.shape, args.seed, args.no_progress) == (tmp_path, "2P2D", 7, True)
    defaults = build_parser().parse_args([command, "--out", str(tmp_path)])
    assert defaults.no_progress is False
    assert defaults.seed >= 0


@pytest.mark.parametrize("command", EXPERIMENTS)
@pytest.mark.parametrize(
    "missing_or_bad", [[], ["--out", "x", "--seed", "-1"], ["--out", "x", "--seed", "a"]]
)
def test_an_experiment_without_out_or_with_a_bad_seed_is_refused(
    command: str, missing_or_bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, *missing_or_bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert ("--out" in err) if not missing_or_bad else ("--seed" in err)


def test_print_section_says_where_and_prints_the_goal_rows(capsys: pytest.CaptureFixture[str]) -> None:
    print_section("slo", Path("out") / "slo-section", [("goal", "met"), ("p99", "12.0")])
    assert capsys.readouterr().out.splitlines() == [
        "slo section: out/slo-section",
        "| goal | met |",
        "| p99 | 12.0 |",
    ]
    print_section("bidir", Path("bidir-section"))
    assert capsys.readouterr().out == "bidir section: bidir-section\n"
