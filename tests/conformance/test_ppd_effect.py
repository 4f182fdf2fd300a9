"""Items 2 and 4 of the real-vLLM issue, small, on the session's cluster (both engines, no new start):
``ppd-vllm ppd-effect`` attached to a decision service and a gateway on the cluster's workers, then
``ppd-bench sim-vs-real`` on its folder, then both report sections.

Figures are never asserted (the machine is shared); only that the pipeline produces them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.report.real_vllm import real_vllm_section
from loadgen.report.sim_vs_real import sim_vs_real_section, simulate_runs
from table_builder.records import read_records
from tests.conformance.workers import Cluster
from tests.gateway.processes import Process, start
from tests.support.gateway_config import worker_tables
from vllm_harness.ppd_effect import Attach, EffectSettings, run_effect

pytestmark = pytest.mark.integration

MODEL_LABEL = "tiny-llama-cpu"


@pytest.fixture
def stack(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[Process, Process, Path]]:
    if cluster.engine == "external":
        pytest.skip("needs the cluster's model profile")
    tables = tmp_path / "served-tables"
    tables.mkdir()
    decision = start(
        ["decision_service", "serve", "--tables", str(tables), "--port", "0", "--metrics-port", "0",
         "--reload-interval", "0.2"],
        tmp_path, "decision",
    )  # fmt: skip
    topology = _topology(cluster)
    lines = ['mode = "ppd"', "allow_mode_header = true", "", "[decision]"]  # pd and local runs ask
    lines += [f'address = "127.0.0.1:{decision.ready["grpc"]}"']
    lines += [f'table_key = "{topology}/{MODEL_LABEL}"', ""]
    lines += [*worker_tables(cluster.workers), ""]
    config = tmp_path / "gateway.toml"
    config.write_text("\n".join(lines))
    gateway = start(["gateway", "serve", "--config", str(config), "--port", "0"], tmp_path, "gateway")
    yield decision, gateway, tables
    assert gateway.stop() == 0, gateway.stderr()[-2000:]
    assert decision.stop() == 0, decision.stderr()[-2000:]


def _topology(cluster: Cluster) -> str:
    roles = [w["role"] for w in cluster.workers]
    return f"{roles.count('prefill')}P{roles.count('decode')}D"


def test_pd_local_ppd_then_the_simulator_on_the_same_arrivals(
    cluster: Cluster, stack: tuple[Process, Process, Path], tmp_path: Path
) -> None:
    decision, gateway, tables = stack
    out = tmp_path / "effect"
    settings = EffectSettings(
        out=out, topology=_topology(cluster), engine=cluster.engine, seed=2, duration_s=4.0,
        fractions=(0.5, 1.0), capacity_qps=1.0, max_output_tokens=8, max_context_tokens=600, turns=2,
        conversations=20,
        model_label=MODEL_LABEL,
        attach=Attach(f"http://127.0.0.1:{gateway.ready['http']}", int(decision.ready["grpc"]), tables),
    )  # fmt: skip
    manifest = run_effect(settings, say=lambda line: None)
    assert sorted((r.level, r.mode) for r in manifest.runs) == sorted(
        (level, mode) for level in ("L1", "L2") for mode in ("pd", "local", "ppd")
    )
    for run in manifest.runs:
        assert read_records([out / "runs" / f"{run.run_id}.jsonl"]), run.run_id
    assert list(tables.glob("*.ppdt")), "the table built from the pd and local runs is served"
    section = real_vllm_section(out, tmp_path / "report")
    assert sum(line.startswith("| L") for line in section) == 6 + 2  # 2 levels x 3 modes, 2 verdicts
    profile, link = (
        ("tiny-llama-cpu", "measured") if cluster.engine == "vllm-cpu" else ("llama-3.1-8b-h100", "nvlink")
    )
    simulated = simulate_runs(out, profile, link)
    assert set(simulated) == {r.run_id for r in manifest.runs}
    comparison = sim_vs_real_section(out, tmp_path / "report")
    assert any(line.startswith("Within +-25%:") for line in comparison)
    assert (tmp_path / "report" / "sim_vs_real.png").exists()
