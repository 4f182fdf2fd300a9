"""ppd-bench-routers at test size: it runs end to end, prints every target's figures, writes the JSON and
stops every process it started. Nothing here asserts speed."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from bench_routers.cli import main
from bench_routers.figures import TARGETS, TargetTotals, level_figures, ratio
from bench_routers.load import Batch
from tests.support.ci import running_in_ci

pytestmark = [pytest.mark.bench, pytest.mark.integration]

LEVEL_KEYS = {"streams", "targets", "ours_over_sglang"}
TARGET_KEYS = {
    "requests",
    "errors",
    "first_error",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "added_ttft_p50_ms",
    "added_ttft_p99_ms",
    "e2e_p50_ms",
    "router_cpu_s_per_1k",
    "worker_cpu_s_per_1k",
    "wall_s",
}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True  # exited and reaped (a zombie would still answer)
    return False


def _require_sglang_router() -> None:
    """Skip without the peer installed (the `bench` extra); under CI, fail instead (`dev` includes it)."""
    if importlib.util.find_spec("sglang_router") is not None:
        return
    message = "sglang-router is not installed: pip install -e '.[bench]'"
    if running_in_ci():
        pytest.fail(f"{message} (CI installs the dev extra, which includes it)", pytrace=False)
    pytest.skip(message)


def test_a_small_run_prints_every_target_and_writes_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _require_sglang_router()
    out = tmp_path / "figures.json"
    code = main(
        ["--streams", "1", "4", "--requests", "4", "--rounds", "2", "--max-tokens", "4", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    for streams in (1, 4):
        assert f"{streams} concurrent streams" in text
    for name in TARGETS:
        assert sum(line.strip().startswith(name + " ") for line in text.splitlines()) == 2, text
    assert text.count("ours/SGLang: added TTFT p50") == 2

    figures = json.loads(out.read_text())
    assert {"benchmark", "date", "machine", "settings", "processes", "levels"} <= set(figures)
    assert figures["settings"]["sglang_router"] == "0.3.2"
    assert [level["streams"] for level in figures["levels"]] == [1, 4]
    for level in figures["levels"]:
        assert set(level) == LEVEL_KEYS
        assert set(level["targets"]) == set(TARGETS)
        for name, target in level["targets"].items():
            assert set(target) == TARGET_KEYS
            assert target["errors"] == 0
            assert target["requests"] >= 4
            assert target["ttft_p50_ms"] is not None
            assert (target["router_cpu_s_per_1k"] is None) == (name == "direct")
        assert set(level["ours_over_sglang"]) == {
            "added_ttft_p50_ms",
            "added_ttft_p99_ms",
            "router_cpu_s_per_1k",
        }
    # Every process it started is stopped before it returns.
    assert all(_gone(pid) for pid in figures["processes"].values()), figures["processes"]


def test_help_names_the_command_and_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--streams",
        "--requests",
        "--rounds",
        "--json",
        "--worker-url",
        "--connection-per-request",
    ):
        assert option in text


def test_figures_subtract_the_direct_path_and_ratios_never_divide_by_zero() -> None:
    totals = {name: TargetTotals() for name in TARGETS}
    totals["direct"].add(Batch([0.010] * 3, [0.1] * 3), router_cpu_s=None, worker_cpu_s=0.3, wall_s=1.0)
    totals["gateway"].add(Batch([0.012] * 3, [0.1] * 3), router_cpu_s=0.006, worker_cpu_s=0.3, wall_s=1.0)
    totals["sglang"].add(
        Batch([0.011] * 2, [0.1] * 2, 1, "HTTP 500"), router_cpu_s=0.003, worker_cpu_s=0.3, wall_s=1.0
    )
    level = level_figures(16, totals)
    gateway, sglang = level["targets"]["gateway"], level["targets"]["sglang"]
    assert gateway["added_ttft_p50_ms"] == pytest.approx(2.0)
    assert sglang["added_ttft_p50_ms"] == pytest.approx(1.0)
    assert (sglang["requests"], sglang["errors"], sglang["first_error"]) == (3, 1, "HTTP 500")
    assert gateway["router_cpu_s_per_1k"] == pytest.approx(2.0)
    assert sglang["router_cpu_s_per_1k"] == pytest.approx(1.0)
    assert level["ours_over_sglang"]["added_ttft_p50_ms"] == pytest.approx(2.0)
    assert [ratio(1.0, 0.0), ratio(1.0, -0.5), ratio(-0.9, 1.0), ratio(None, 1.0)] == [None] * 4
