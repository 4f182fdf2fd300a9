"""The report's section "Prefix-aware placement": both placements on the same arrivals, at CI size."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from loadgen.report.placement import (
    PLACEMENT_FILE,
    placement_file,
    placement_runs,
    placement_section,
    read_points,
    read_shared_points,
    run_placement,
)
from loadgen.report.reproduce import ReproduceSettings

SETTINGS = ReproduceSettings(
    duration_s=6.0,
    shapes=("1P3D", "2P2D"),
    qps_levels=(8.0,),
    sharegpt_conversations=60,
    seed=1,
    placement_shared_workloads=(),
)
#: Many prompts, each reused by a few conversations: least loaded often sends a conversation to the P
#: that does not hold its group's prompt (seeded: the same arrivals every run).
SHARED = "shared2048_16x4_small_small_bal"


def test_prefix_placement_computes_less_on_p_where_there_is_a_choice(tmp_path: Path) -> None:
    calls: list[int] = []
    path = run_placement(SETTINGS, tmp_path, on_point=lambda: calls.append(1))
    assert path == tmp_path / PLACEMENT_FILE == placement_file(tmp_path)
    assert len(calls) == placement_runs(SETTINGS) == 4  # two shapes x one level x two placements
    by = {(p.shape, p.placement): p for p in read_points(path)}
    one_least, one_prefix = by[("1P3D", "least_loaded")], by[("1P3D", "prefix")]
    assert (one_prefix.prefill_tokens, one_prefix.moved) == (one_least.prefill_tokens, 0)  # one P
    two_least, two_prefix = by[("2P2D", "least_loaded")], by[("2P2D", "prefix")]
    assert two_prefix.turns == two_least.turns > 0  # the same arrivals, all served
    assert two_prefix.prefill_tokens < two_least.prefill_tokens <= two_least.prompt_tokens
    assert two_prefix.moved > 0
    assert read_shared_points(path) == []

    (tmp_path / "out").mkdir()
    lines = placement_section(path, tmp_path / "out", "caption")
    text = "\n".join(lines)
    assert "## Prefix-aware placement" in text
    assert "| 1P3D: within 2% of least loaded | PASS |" in text
    assert "2P2D: Turn 2+ P tokens <= 0.5x" in text
    assert "### 2P2D" in text
    assert "Shared-prefix" not in text  # no shared-prefix runs, no such part
    assert (tmp_path / "out" / "placement.png").stat().st_size > 0


def test_prefix_placement_computes_less_of_turn_one_on_a_shared_prefix_workload(tmp_path: Path) -> None:
    settings = dataclasses.replace(
        SETTINGS, shapes=("2P2D",), qps_levels=(4.0, 12.0), placement_shared_workloads=(SHARED,)
    )
    calls: list[int] = []
    path = run_placement(settings, tmp_path, on_point=lambda: calls.append(1))
    assert len(calls) == placement_runs(settings) == 8  # (ShareGPT + one) x one shape x two levels x two
    shared = read_shared_points(path)
    assert {(p.workload, p.shape, p.qps) for p in shared} == {(SHARED, "2P2D", 4.0), (SHARED, "2P2D", 12.0)}
    by = {(p.qps, p.placement): p for p in shared}
    least, prefix = by[(12.0, "least_loaded")], by[(12.0, "prefix")]
    assert prefix.turns == least.turns > 0  # the same arrivals, every Turn 1 served
    prompt = 2048 + 128  # the shared prompt, then small's Turn 1 input
    assert least.prompt_tokens == prefix.prompt_tokens == prompt * least.turns
    # Prefix placement sends a conversation to the P holding its group's prompt; least loaded
    # recomputes the prompt wherever the less loaded P has not seen the group yet.
    assert prefix.prefill_tokens < least.prefill_tokens < least.prompt_tokens
    assert prefix.moved > 0
    assert least.moved == 0
    assert 0.0 < prefix.p_utilisation < least.p_utilisation  # less computed, less time stepping

    (tmp_path / "out").mkdir()
    text = "\n".join(placement_section(path, tmp_path / "out", "caption"))
    assert "### Shared-prefix family: Turn 1" in text
    assert f"#### {SHARED}, 2P2D" in text
    assert "2P2D: shared-prefix Turn 1 mean TTFT <= 0.6x where P is busy" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 4 |", "| 12 |"))]
    assert len(rows) == 4  # ShareGPT's and the shared-prefix table's two levels
    assert (tmp_path / "out" / "placement_shared.png").stat().st_size > 0


def test_a_file_written_before_the_shared_prefix_family_still_renders(tmp_path: Path) -> None:
    path = run_placement(SETTINGS, tmp_path)
    raw = json.loads(path.read_text("utf-8"))
    path.write_text(json.dumps(raw["sharegpt"]), encoding="utf-8")  # the old form: a list of points
    assert len(read_points(path)) == 4
    assert read_shared_points(path) == []
    (tmp_path / "out").mkdir()
    assert "### 2P2D" in "\n".join(placement_section(path, tmp_path / "out", "caption"))


def test_no_figures_no_file(tmp_path: Path) -> None:
    assert placement_file(tmp_path) is None
