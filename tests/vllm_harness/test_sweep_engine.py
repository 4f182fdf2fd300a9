"""The ``vllm-cpu`` sweep engine: grid points on real vLLM workers through the whole local stack."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from decision_service.table import Table
from ppd.arrivals import poisson_arrivals
from ppd.catalog import parse_workload
from table_builder.cli import main
from table_builder.engines import EngineOptions, make_engine
from table_builder.records import read_records
from table_builder.sweep import GridPoint
from vllm_harness.spec import SERVED_MODEL, VLLM_CPU_VERSION
from vllm_harness.sweep_engine import VllmCpuEngine, _Stack


def _point(mode: str, qps: float = 1.0, workload: str = "small_mid_bal") -> GridPoint:
    return GridPoint("1P1D", "tiny-llama-cpu", mode, parse_workload(workload), qps)


def test_the_settings_name_the_engine_build_it_measures_on() -> None:
    engine = make_engine("vllm-cpu", EngineOptions(seed=4, duration_s=6.0))
    assert engine.name == "vllm-cpu"
    settings = engine.settings()
    assert settings["vllm"] == f"vllm-cpu {VLLM_CPU_VERSION}"
    assert settings["model"] == SERVED_MODEL
    assert (settings["seed"], settings["duration_s"]) == (4, 6.0)
    json.dumps(dict(settings))  # goes into the sweep manifest and the table's provenance


def test_pd_and_local_of_a_cell_see_the_same_traffic_and_cells_differ() -> None:
    engine = VllmCpuEngine(seed=1)
    assert engine.arrivals_seed(_point("pd")) == engine.arrivals_seed(_point("local"))
    assert engine.arrivals_seed(_point("pd", qps=2.0)) != engine.arrivals_seed(_point("pd"))
    assert engine.arrivals_seed(_point("pd", workload="large_mid_bal")) != engine.arrivals_seed(_point("pd"))
    engine.close()  # nothing started: nothing to stop


def test_points_on_real_workers_run_one_at_a_time(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    argv = ["sweep", "--engine", "vllm-cpu", "--shape", "1P1D", "--workloads", "small_mid_bal", "--qps", "1",
            "--jobs", "2", "--out", str(tmp_path / "sweep"), "--quiet"]  # fmt: skip
    assert main(argv) == 2
    assert "runs one point at a time" in caplog.text
    assert not (tmp_path / "sweep").exists()  # refused before any cluster or folder


def _seed_with_arrivals(duration_s: float, at_least: int) -> int:
    """The first sweep seed whose point (small_mid_bal at QPS 1) gets ``at_least`` conversations."""
    for seed in range(100):
        arrivals_seed = VllmCpuEngine(seed=seed).arrivals_seed(_point("pd"))
        if len(poisson_arrivals(random.Random(f"arrivals:{arrivals_seed}"), 1.0, duration_s)) >= at_least:
            return seed
    raise AssertionError("no seed below 100 gives the point enough arrivals")


@pytest.mark.integration
def test_a_sweep_on_real_vllm_measures_pd_and_local_and_builds_a_table(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    seed = _seed_with_arrivals(5.0, at_least=3)
    argv = ["sweep", "--engine", "vllm-cpu", "--shape", "1P1D", "--model", "tiny-llama-cpu",
            "--modes", "pd,local", "--workloads", "small_mid_bal", "--qps", "1", "--duration", "5",
            "--seed", str(seed), "--min-samples", "1", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    records = read_records(sorted((out / "records").rglob("*.jsonl")))
    assert {r.mode for r in records} == {"pd", "local"}
    assert {r.model for r in records} == {"tiny-llama-cpu"}
    assert all(r.ok or r.error for r in records)  # a failure says why
    for mode in ("pd", "local"):
        later = [r for r in records if r.mode == mode and r.turn == 2 and r.ok]
        assert later, f"no Turn 2 answered in the {mode} run"
        assert all(r.path == mode for r in later)  # the gateway took the path the run asked for
    tables = list(out.rglob("*.ppdt"))
    assert len(tables) == 1
    table = Table.open(tables[0])
    try:
        assert table.key == "1P1D/tiny-llama-cpu"
        assert "vllm-cpu" in json.dumps(table.header.provenance)
    finally:
        table.close()


def test_a_point_whose_stack_died_is_never_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # The stack "went away" during the point: its process has exited and its port refuses.
    dead = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, text=True)
    dead.wait()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed when the test runs the load
    engine = VllmCpuEngine(duration_s=2.0, seed=_seed_with_arrivals(2.0, at_least=1))
    engine._stack = _Stack("1P1D", dead, url)
    monkeypatch.setattr(VllmCpuEngine, "_stack_for", lambda self, shape: url)
    with pytest.raises(RuntimeError, match="stack exited during"):
        engine.run(_point("pd"))
    engine.close()
    assert dead.stdout is not None
    assert dead.stdout.closed
