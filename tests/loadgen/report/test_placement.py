"""The report's section "Prefix-aware placement": both placements on the same arrivals, at CI size."""

from __future__ import annotations

from pathlib import Path

from loadgen.report.placement import (
    PLACEMENT_FILE,
    placement_file,
    placement_section,
    read_points,
    run_placement,
)
from loadgen.report.reproduce import ReproduceSettings

SETTINGS = ReproduceSettings(
    duration_s=6.0, shapes=("1P3D", "2P2D"), qps_levels=(8.0,), sharegpt_conversations=60, seed=1
)


def test_prefix_placement_computes_less_on_p_where_there_is_a_choice(tmp_path: Path) -> None:
    calls: list[int] = []
    path = run_placement(SETTINGS, tmp_path, on_point=lambda: calls.append(1))
    assert path == tmp_path / PLACEMENT_FILE == placement_file(tmp_path)
    assert len(calls) == 4  # two shapes x one level x two placements
    by = {(p.shape, p.placement): p for p in read_points(path)}
    one_least, one_prefix = by[("1P3D", "least_loaded")], by[("1P3D", "prefix")]
    assert (one_prefix.prefill_tokens, one_prefix.moved) == (one_least.prefill_tokens, 0)  # one P
    two_least, two_prefix = by[("2P2D", "least_loaded")], by[("2P2D", "prefix")]
    assert two_prefix.turns == two_least.turns > 0  # the same arrivals, all served
    assert two_prefix.prefill_tokens < two_least.prefill_tokens <= two_least.prompt_tokens
    assert two_prefix.moved > 0

    (tmp_path / "out").mkdir()
    lines = placement_section(path, tmp_path / "out", "caption")
    text = "\n".join(lines)
    assert "## Prefix-aware placement" in text
    assert "| 1P3D: within 2% of least loaded | PASS |" in text
    assert "2P2D: Turn 2+ P tokens <= 0.5x" in text
    assert "### 2P2D" in text
    assert (tmp_path / "out" / "placement.png").stat().st_size > 0


def test_no_figures_no_file(tmp_path: Path) -> None:
    assert placement_file(tmp_path) is None
