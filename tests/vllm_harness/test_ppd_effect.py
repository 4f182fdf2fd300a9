"""``ppd-vllm ppd-effect``: the capacity ramp, the load levels, and the whole pipeline on one stack."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadgen.report.real_vllm import MANIFEST_NAME, RealVllmManifest, real_vllm_section
from loadgen.report.sim_vs_real import sim_vs_real_section, simulate_runs
from table_builder.records import read_records
from vllm_harness.cli import main
from vllm_harness.ppd_effect import EffectSettings, capacity_from_ramp, levels, load_average, run_effect


def test_the_capacity_is_the_last_step_pd_still_serves() -> None:
    ramp = [(0.25, 1.0, 100.0), (0.5, 1.0, 150.0), (1.0, 0.97, 350.0), (2.0, 0.6, 900.0)]
    assert capacity_from_ramp(ramp, min_success=0.95, knee_factor=4.0) == 1.0


def test_a_ttft_knee_ends_the_ramp_even_when_everything_completes() -> None:
    ramp = [(0.25, 1.0, 100.0), (0.5, 1.0, 150.0), (1.0, 1.0, 450.0)]
    assert capacity_from_ramp(ramp, min_success=0.95, knee_factor=4.0) == 0.5


def test_no_capacity_when_even_the_first_step_fails() -> None:
    assert capacity_from_ramp([(0.25, 0.5, 100.0)], min_success=0.95, knee_factor=4.0) is None
    assert capacity_from_ramp([(0.25, None, None)], min_success=0.95, knee_factor=4.0) is None


@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(1.0, 1e4)), min_size=1, max_size=8))
def test_the_capacity_is_a_step_of_the_ramp_before_any_failure(steps: list[tuple[float, float]]) -> None:
    ramp = [(0.25 * 2**i, s, t) for i, (s, t) in enumerate(steps)]
    capacity = capacity_from_ramp(ramp, min_success=0.95, knee_factor=4.0)
    served = [q for q, s, _ in ramp if s >= 0.95]
    if capacity is None:
        assert ramp[0][1] < 0.95
    else:
        assert capacity in served
        assert all(s >= 0.95 for q, s, _ in ramp if q <= capacity)


def test_levels_are_rounded_fractions_in_order() -> None:
    assert levels(1.5, (1.0, 0.25, 0.5)) == (0.375, 0.75, 1.5)
    assert levels(1 / 3, (0.5, 0.5)) == (0.167,)


def test_the_load_average_reads_like_uptime() -> None:
    parts = load_average().split()
    assert len(parts) == 3
    assert all(float(p) >= 0 for p in parts)


def test_bad_fractions_are_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["ppd-effect", "--out", "x", "--fractions", "0.5,-1"])
    assert "need positive numbers" in capsys.readouterr().err


@pytest.mark.integration
def test_the_pipeline_runs_every_mode_on_one_stack_and_renders(tmp_path: Path) -> None:
    # Simulated workers behind the real ppd-up, decision service and gateway: the pipeline, not figures.
    out = tmp_path / "effect"
    settings = EffectSettings(
        out=out, engine="sim", seed=1, duration_s=3.0, fractions=(0.5, 1.0), probe_start_qps=1.0,
        probe_duration_s=3.0, probe_steps=2, max_output_tokens=8, max_context_tokens=600,
        conversations=40, ready_timeout_s=60.0,
    )  # fmt: skip
    said: list[str] = []
    manifest = run_effect(settings, say=said.append)
    assert RealVllmManifest.from_json((out / MANIFEST_NAME).read_text("utf-8")) == manifest
    assert manifest.capacity_measured
    assert [q for q, _, _ in manifest.probe][: len(manifest.probe)] == [1.0, 2.0][: len(manifest.probe)]
    qps = sorted({r.qps for r in manifest.runs})
    assert qps == list(levels(manifest.capacity_qps, (0.5, 1.0)))
    assert sorted((r.level, r.mode) for r in manifest.runs) == sorted(
        (f"L{i + 1}", m) for i in range(len(qps)) for m in ("pd", "local", "ppd")
    )
    by_mode: dict[str, list[str]] = {}
    for run in manifest.runs:
        records = read_records([out / "runs" / f"{run.run_id}.jsonl"])
        assert records, run.run_id
        assert {r.mode for r in records} == {run.mode}
        by_mode.setdefault(run.mode, []).extend(f"{r.conversation_id}" for r in records)
        later = [r.path for r in records if r.turn > 1 and r.ok]
        if run.mode in ("pd", "local") and later:
            assert set(later) == {run.mode}  # the gateway took the path the run asked for
    # Fresh conversation ids per run: no id is sent by two runs.
    ids = [cid.rsplit("-r", 1)[1] for cids in by_mode.values() for cid in set(cids)]
    assert len({(run.run_id) for run in manifest.runs}) == len(manifest.runs)
    assert len(set(ids)) == len(manifest.runs)
    assert "built by `ppd-table build`" in manifest.table
    assert list((out / "tables").glob("*.ppdt"))
    assert any(line.startswith("capacity:") for line in said)
    lines = real_vllm_section(out, tmp_path / "report")
    assert any("ppd vs pd" in line for line in lines)
    assert (tmp_path / "report" / "real_vllm.png").exists()
    assert sim_vs_real_section(out, tmp_path / "report") == []  # nothing simulated yet
    # Item 4 on the same folder: every run again on the virtual-time simulator, then the side by side.
    simulated = simulate_runs(out, "llama-3.1-8b-h100", link="nvlink")
    assert set(simulated) == {run.run_id for run in manifest.runs}
    for run in manifest.runs:
        real_ids = {
            r.conversation_id.rsplit("-r", 1)[0] for r in read_records([out / "runs" / f"{run.run_id}.jsonl"])
        }
        # The same conversations arrive: as many as the real run started.
        assert len({r.conversation_id for r in simulated[run.run_id]}) == len(real_ids)
    section = sim_vs_real_section(out, tmp_path / "report")
    assert section[0] == "## The simulator against real vLLM"
    assert any(line.startswith("Within +-25%:") for line in section)
    assert (tmp_path / "report" / "sim_vs_real.png").exists()


def test_attaching_needs_the_gateway_the_decision_port_and_the_tables(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["ppd-effect", "--out", "x", "--gateway", "http://127.0.0.1:1"]) == 2
    assert "go together" in capsys.readouterr().err
