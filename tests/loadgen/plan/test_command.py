"""``ppd-bench plan`` end to end on tiny grids (loadgen/plan/command.py, runner.py, render.py): the report
and its PNGs, determinism across seeds and process counts, the request log as a workload, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.cli import build_parser, main
from loadgen.plan.runner import REQUEST_LOG_WORKLOAD, log_component, splits
from table_builder.records import read_records, write_records
from tests.support.records import make_record

TINY = ["--workloads", "small_tiny,large_huge_paste=2", "--qps", "1,8", "--duration", "2", "--no-progress"]


def _plan(out: Path, *extra: str) -> dict[str, object]:
    assert main(["plan", "--gpus", "4", "--out", str(out), *TINY, *extra]) == 0
    doc: dict[str, object] = json.loads((out / "plan.json").read_text())
    return doc


def test_four_gpus_write_the_report_with_every_split_and_a_recommendation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _plan(tmp_path / "plan", "--jobs", "1")
    text = (tmp_path / "plan" / "report.md").read_text()
    for shape in ("1P3D", "2P2D", "3P1D"):
        for mode in ("pd", "local", "ppd"):
            assert f"| {shape} {mode} | 8 |" in text
    assert "## Recommendation" in text
    assert f"**{doc['recommendation']}**" in text
    assert "Baseline: 2P2D pd." in text
    assert "## Held against the paper" in text
    assert "| Replica |" in text
    assert "| 1P3D | " in text  # Table 1's row
    for png in ("plan.png", "plan_score.png"):
        assert (tmp_path / "plan" / png).read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert f"recommended: {doc['recommendation']}" in out
    assert "wall time:" in out


def test_the_same_seed_gives_the_same_figures_whatever_the_process_count(tmp_path: Path) -> None:
    one = _plan(tmp_path / "one", "--jobs", "1")
    two = _plan(tmp_path / "two", "--jobs", "2")
    assert one == two
    other = _plan(tmp_path / "other", "--jobs", "1", "--seed", "7")
    assert other["figures"] != one["figures"]  # the seed moves the arrivals


def test_slo_targets_and_weights_are_the_rule_the_report_states(tmp_path: Path) -> None:
    doc = _plan(tmp_path / "slo", "--jobs", "1", "--slo-ttft-ms", "100")
    assert str(doc["rule"]).startswith("SLO attainment")
    assert "| SLO attainment |" in (tmp_path / "slo" / "report.md").read_text()


def test_two_gpus_without_a_table_run_pd_and_local_and_say_so(tmp_path: Path) -> None:
    out = tmp_path / "two"
    argv = ["plan", "--gpus", "2", "--workloads", "small_mid_paste", "--qps", "2", "--duration", "2"]
    assert main([*argv, "--jobs", "1", "--no-progress", "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "1P1D: no table for 1P1D/llama-3.1-8b in tables, so pd and local only." in text
    assert "| 1P1D local | 2 |" in text
    assert "1P1D ppd" not in text
    assert "Baseline: 1P1D pd." in text


def test_a_request_log_joins_the_mix_as_its_conversations_turn_sizes(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    write_records(
        log,
        [
            make_record(conversation_id="a", turn=1, n_ctx=0, n_in=300, n_out=40, mode="ppd", target_qps=0.0),
            make_record(
                conversation_id="a", turn=2, n_in=50, n_out=20, n_ctx=340, mode="ppd", target_qps=0.0
            ),
            make_record(conversation_id="b", turn=2, n_in=10, n_out=5, n_ctx=100),  # no Turn 1: left out
        ],
    )
    comp = log_component(read_records([log]), 1.0)
    assert (comp.name, comp.lists) == (REQUEST_LOG_WORKLOAD, (((300, 40), (50, 20)),))
    out = tmp_path / "plan"
    argv = ["plan", "--gpus", "2", "--workloads", "small_tiny", "--request-log", str(log), "--qps", "2"]
    assert main([*argv, "--duration", "2", "--jobs", "1", "--no-progress", "--out", str(out)]) == 0
    assert "request-log 50%" in (out / "report.md").read_text()
    alone = ["plan", "--gpus", "2", "--request-log", str(log), "--qps", "2", "--duration", "2"]
    assert main([*alone, "--jobs", "1", "--no-progress", "--out", str(tmp_path / "alone")]) == 0
    assert "mix request-log 100%;" in (tmp_path / "alone" / "report.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "0"], "needs at least 2 GPUs (one prefill and one decode worker), got 0"),
        (["--gpus", "1"], "needs at least 2 GPUs"),
        (["--gpus", "4", "--workloads", "medium_tiny"], "unknown synthetic workload 'medium_tiny'"),
        (["--gpus", "4", "--qps", "0,4"], "give e.g. 1,4,8 or 'all'"),
        (["--gpus", "4", "--qps", "fast"], "give e.g. 1,4,8 or 'all'"),
        (["--gpus", "4", "--modes", "bidir"], "is not a P/D mode"),
        (["--gpus", "4", "--request-log", "/nonexistent/requests.jsonl"], "cannot read /nonexistent"),
        (["--gpus", "4", "--profile", "/nonexistent/profile.json"], "give a shipped profile name"),
    ],
)
def test_bad_input_is_a_usage_error_that_says_what_to_fix(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["plan", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_request_log_that_is_not_ours_or_has_no_conversation_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n")
    later_only = tmp_path / "later.jsonl"
    write_records(later_only, [make_record()])  # a Turn-2 line only
    for path, message in (
        (garbage, "is not a request log of ours"),
        (later_only, "no conversation that starts"),
    ):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(
                ["plan", "--gpus", "2", "--out", str(tmp_path), "--request-log", str(path)]
            )
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_a_baseline_that_is_not_run_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--gpus", "2", "--baseline", "2P2D:pd", "--out", str(tmp_path), *TINY]) == 2
    assert "--baseline 2P2D:pd is not one of the configs run (1P1D:pd, 1P1D:local)" in capsys.readouterr().err
    # 1P1D has no shipped table, so it runs no ppd to score against.
    assert main(["plan", "--gpus", "2", "--baseline", "1P1D:ppd", "--out", str(tmp_path), *TINY]) == 2
    assert "--baseline 1P1D:ppd is not one of the configs run" in capsys.readouterr().err


def test_splits_have_at_least_one_of_each() -> None:
    assert splits(4) == ["1P3D", "2P2D", "3P1D"]
    assert splits(3, replica=True) == ["1P2D", "2P1D", "3R"]
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        splits(1)


def test_plan_has_help_that_names_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["plan", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--gpus", "--workloads", "--request-log", "--qps", "--w-tpot", "--slo-ttft-ms", "--jobs"):
        assert flag in text
