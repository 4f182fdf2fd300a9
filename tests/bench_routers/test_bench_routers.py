"""ppd-bench-routers at test size: it runs end to end with all five targets (direct, the standalone
gateway, Envoy with the picker on envoy.yaml and on envoy-gie.yaml, SGLang's router), both turns,
prints every target's figures, writes the JSON and the PNG, counts every process of a router, and stops
every process it started. Nothing here asserts speed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_routers.cli import main
from bench_routers.cpu import processes_cpu_seconds, tree_cpu_seconds
from bench_routers.figures import TargetTotals, cell_figures, ratio, summary
from bench_routers.load import Batch, Result
from bench_routers.targets import TARGETS
from tests.support.ci import running_in_ci
from tests.support.polling import wait_until

pytestmark = [pytest.mark.bench, pytest.mark.integration]

TARGET_KEYS = {
    "requests",
    "errors",
    "first_error",
    "paths",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "added_ttft_p50_ms",
    "added_ttft_p99_ms",
    "e2e_p50_ms",
    "chunks",
    "router_cpu_s",
    "router_cpu_s_per_1k",
    "router_cpu_s_per_1k_by_process",
    "worker_cpu_s_per_1k",
    "chunks_per_router_cpu_s",
    "data_plane_cpu_s",
    "data_plane_chunks_per_cpu_s",
    "wall_s",
}
ROUTER_PROCESSES = {
    "gateway": {"gateway"},
    "envoy": {"envoy", "picker"},
    "envoy-gie": {"envoy", "picker"},
    "sglang": {"sglang"},
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


def test_a_small_run_measures_every_router_on_both_turns_and_writes_the_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _require_sglang_router()
    out, png = tmp_path / "figures.json", tmp_path / "figures.png"
    argv = ["--streams", "1", "3", "--max-tokens", "1", "4", "--requests", "3", "--rounds", "1"]
    code = main([*argv, "--envoy-gie", "--json", str(out), "--png", str(png), "--no-progress"])
    text = capsys.readouterr().out
    assert code == 0, text
    for length in (1, 4):
        for streams in (1, 3):
            assert f"{length}-token answers, {streams} concurrent streams" in text
    # Per cell: five targets on Turn 2, four on Turn 1 (SGLang's Turn 1 is not vLLM P/D).
    for name, rows in (("direct", 8), ("gateway", 8), ("envoy", 8), ("envoy-gie", 8), ("sglang", 4)):
        assert sum(line.strip().startswith(name + " ") for line in text.splitlines()) == rows, text
    assert "Envoy's own CPU (envoy): relayed chunks per CPU-second" in text
    assert "Envoy's own CPU (envoy-gie): relayed chunks per CPU-second" in text
    assert "envoy/gateway" in text

    figures = json.loads(out.read_text())
    assert {"benchmark", "date", "machine", "settings", "processes", "cells", "summary"} <= set(figures)
    assert figures["settings"]["sglang_router"] == "0.3.2"
    assert [(c["max_tokens"], c["streams"]) for c in figures["cells"]] == [(1, 1), (1, 3), (4, 1), (4, 3)]
    # Every process of every router is named, and its CPU is counted by process.
    assert {name: set(pids) for name, pids in figures["processes"].items() if name != "workers"} == (
        ROUTER_PROCESSES
    )
    for cell in figures["cells"]:
        assert set(cell["turns"]["pd"]["targets"]) == {"direct", "gateway", "envoy", "envoy-gie"}
        assert set(cell["turns"]["local"]["targets"]) == set(TARGETS)
        for turn, figs in cell["turns"].items():
            direct_chunks = figs["targets"]["direct"]["chunks"]
            for name, target in figs["targets"].items():
                assert set(target) == TARGET_KEYS
                assert target["errors"] == 0, target["first_error"]
                assert target["requests"] >= 3
                assert target["ttft_p50_ms"] is not None
                # The same answers came through every target: one chunk per token, the role's and [DONE].
                assert target["chunks"] == direct_chunks == target["requests"] * (cell["max_tokens"] + 2)
                if name == "direct":
                    assert target["router_cpu_s_per_1k"] is None
                    continue
                by_process = target["router_cpu_s_per_1k_by_process"]
                assert set(by_process) == ROUTER_PROCESSES[name]
                assert target["router_cpu_s_per_1k"] == pytest.approx(sum(by_process.values()), abs=0.01)
                assert (target["data_plane_cpu_s"] is None) == (name not in ("envoy", "envoy-gie"))
                if name != "sglang":  # our routers say which path each turn took
                    assert target["paths"] == {turn: target["requests"]}
        assert set(cell["turns"]["pd"]["ratios"]) == {"envoy_over_gateway", "envoy-gie_over_envoy"}
        assert set(cell["turns"]["local"]["ratios"]) == {
            "envoy_over_gateway",
            "envoy-gie_over_envoy",
            "gateway_over_sglang",
            "envoy_over_sglang",
        }
    totals = figures["summary"]
    assert set(totals["router_cpu_s_per_1k"]) == {"1", "4"}
    assert set(totals["router_cpu_s_per_1k"]["4"]["local"]) == {"gateway", "envoy", "envoy-gie", "sglang"}
    assert {name: set(by_length) for name, by_length in totals["data_plane_chunks_per_cpu_s"].items()} == {
        "envoy": {"1", "4"},
        "envoy-gie": {"1", "4"},
    }
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every process it started is stopped before it returns.
    pids = [figures["processes"]["workers"]]
    pids += [
        pid for name, by_role in figures["processes"].items() if name != "workers" for pid in by_role.values()
    ]
    assert all(_gone(pid) for pid in pids), figures["processes"]


def test_help_names_the_command_and_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--streams",
        "--max-tokens",
        "--requests",
        "--rounds",
        "--timeout",
        "--ready-timeout",
        "--prefill-url",
        "--decode-url",
        "--connection-per-request",
        "--json",
        "--png",
        "--no-progress",
        "--envoy-gie",
    ):
        assert option in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-url", "http://127.0.0.1:8100"], "go together"),
        (
            ["--prefill-url", "http://prefill:8100", "--decode-url", "http://127.0.0.1:8200"],
            "addressed by name",
        ),
    ],
)
def test_workers_the_run_cannot_use_are_refused_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _require_sglang_router()
    assert main(argv) == 2
    assert message in capsys.readouterr().err


#: A real process that burns `argv[1]` seconds of CPU, then waits on its stdin (closed to end it).
BURN = (
    "import sys, time\n"
    "end = time.process_time() + float(sys.argv[1])\n"
    "while time.process_time() < end: pass\n"
    "sys.stdin.read()\n"
)
#: A parent that starts BURN as its child and waits for it, burning nothing itself.
PARENT = (
    "import subprocess, sys\n"
    "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], stdin=sys.stdin).wait()\n"
)


def _burner(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", BURN, str(seconds)], stdin=subprocess.PIPE)


def _end(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_routers_cpu_counts_every_one_of_its_processes() -> None:
    procs = {"envoy": _burner(0.3), "picker": _burner(0.3)}
    try:
        pids = {role: p.pid for role, p in procs.items()}
        wait_until(
            lambda: all(tree_cpu_seconds(pid) >= 0.3 for pid in pids.values()),
            deadline_s=60,
            what="both processes to burn their CPU",
        )
        by_role = processes_cpu_seconds(pids)
        assert set(by_role) == {"envoy", "picker"}
        assert all(seconds >= 0.3 for seconds in by_role.values())
    finally:
        for p in procs.values():
            _end(p)


def test_a_process_tree_counts_its_live_children() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, BURN, "0.5"], stdin=subprocess.PIPE)
    try:
        # The parent itself burns only its start-up (well under 0.5 s): the rest is its child's.
        wait_until(
            lambda: tree_cpu_seconds(parent.pid) >= 0.5, deadline_s=60, what="the child's CPU in the tree"
        )
    finally:
        _end(parent)


def _totals(ttft_s: float, n: int, cpu_s: dict[str, float], chunks_each: int = 6) -> TargetTotals:
    batch = Batch()
    for _ in range(n):
        batch.add(Result(ttft_s, 0.1, "x", chunks_each, ""))
    totals = TargetTotals()
    totals.add(batch, cpu_s=cpu_s, worker_cpu_s=0.3, wall_s=1.0)
    return totals


def test_figures_subtract_the_direct_path_add_every_process_and_never_divide_by_zero() -> None:
    local = {
        "direct": _totals(0.010, 3, {}),
        "gateway": _totals(0.012, 3, {"gateway": 0.006}),
        "envoy": _totals(0.013, 3, {"envoy": 0.003, "picker": 0.006}),
        "sglang": _totals(0.011, 2, {"sglang": 0.003}),
    }
    local["sglang"].batch.fail("HTTP 500")
    pd = {name: local[name] for name in ("direct", "gateway", "envoy")}
    cell = cell_figures(32, 16, {"pd": pd, "local": local}, {"envoy": "envoy"})
    targets = cell["turns"]["local"]["targets"]
    assert targets["gateway"]["added_ttft_p50_ms"] == pytest.approx(2.0)
    assert targets["envoy"]["added_ttft_p50_ms"] == pytest.approx(3.0)
    assert (targets["sglang"]["requests"], targets["sglang"]["errors"]) == (3, 1)
    assert targets["envoy"]["router_cpu_s_per_1k"] == pytest.approx(3.0)  # (0.003 + 0.006) / 3 * 1000
    assert targets["envoy"]["router_cpu_s_per_1k_by_process"] == {"envoy": 1.0, "picker": 2.0}
    assert targets["envoy"]["data_plane_chunks_per_cpu_s"] == 6000  # 18 chunks / 0.003 s
    assert targets["gateway"]["data_plane_chunks_per_cpu_s"] is None
    assert cell["turns"]["local"]["ratios"]["envoy_over_gateway"]["router_cpu_s_per_1k"] == pytest.approx(1.5)
    assert set(cell["turns"]["pd"]["targets"]) == {"direct", "gateway", "envoy"}
    totals = summary([cell])
    assert totals["router_cpu_s_per_1k"]["32"]["local"]["envoy"] == pytest.approx(3.0)
    assert totals["envoy_over_gateway_cpu"]["32"]["pd"] == pytest.approx(1.5)
    assert totals["data_plane_chunks_per_cpu_s"] == {"envoy": {"32": 6000}}  # both turns: 36 chunks / 0.006 s
    assert [ratio(1.0, 0.0), ratio(1.0, -0.5), ratio(-0.9, 1.0), ratio(None, 1.0)] == [None] * 4
