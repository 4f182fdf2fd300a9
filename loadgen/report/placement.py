"""The report's section "Prefix-aware placement": prefix against least-loaded placement of P (and of
the Turn-1 D) on the virtual-time cluster (ppd/placement.py, the gateway's rule), on the same arrivals.

``ppd-bench report --run`` runs it (``run_placement``) after the reproduction's sweeps: per shape and
QPS level, ShareGPT multi-turn conversations in mode ``pd`` (every Turn 2+ goes through P, so every one
is a leg placement places), once per placement, with common random numbers. It writes one JSON file,
``<records>/placement/placement.json``; ``ppd-bench report`` renders it when it is there
(``placement_section``: a table per shape, the goals, ``placement.png``).

Figures per point, Turn 2+ only: prompt tokens P computed (the prompt less what P's prefix cache held,
``ClusterResult.prefill_cached``) against the whole prompts, mean and P99 TTFT, success, and how many
legs the prefix moved away from the least-loaded P. Goals: on 2P2D and 3P1D, P's tokens at most 0.5x
and mean TTFT at most 0.7x least-loaded's at every level; on 1P3D within 2% (one P: nothing to choose).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from loadgen.report.reproduce import ReproduceSettings, simulate_cluster, turn_lists
from loadgen.report.section import md_table, mean, ms, p99, save_png
from loadgen.sharegpt import SHAREGPT_WORKLOAD
from ppd.placement import Placement

if TYPE_CHECKING:
    from simulator.core.cluster import ClusterResult

__all__ = [
    "PLACEMENT_FILE",
    "PlacementPoint",
    "placement_file",
    "placement_section",
    "read_points",
    "run_placement",
]

PLACEMENT_FILE: Final = Path("placement") / "placement.json"
_POLICIES: Final[tuple[Placement, ...]] = ("least_loaded", "prefix")
_GOAL_TOKENS: Final = 0.5
_GOAL_TTFT: Final = 0.7
_NOISE: Final = 0.02
_MULTI_P: Final = ("2P2D", "3P1D")


@dataclass(frozen=True, slots=True)
class PlacementPoint:
    """One run's Turn 2+ figures."""

    shape: str
    qps: float
    placement: str
    turns: int  # Turn 2+ requests that succeeded
    prefill_tokens: int  # prompt tokens P computed for them
    prompt_tokens: int  # their whole prompts
    ttft_mean_ms: float | None
    ttft_p99_ms: float | None
    success: float  # of every request of the run
    moved: int  # legs the resident prefix moved away from the least-loaded worker


def placement_file(records: Path) -> Path | None:
    """The placement figures under a records folder, if ``--run`` wrote them."""
    path = records / PLACEMENT_FILE
    return path if path.exists() else None


def run_placement(
    settings: ReproduceSettings, records: Path, *, on_point: Callable[[], object] | None = None
) -> Path:
    """Both placements at every shape x QPS level of ``settings`` on ShareGPT, mode pd; the JSON path."""
    lists = turn_lists(dataclasses.replace(settings, workload=SHAREGPT_WORKLOAD))
    points: list[PlacementPoint] = []
    for shape in settings.shapes:
        for qps in settings.qps_levels:
            for policy in _POLICIES:
                result = simulate_cluster(
                    lists,
                    shape=shape,
                    mode="pd",
                    qps=qps,
                    duration_s=settings.duration_s,
                    workload=SHAREGPT_WORKLOAD,
                    seed=settings.seed,
                    run_id=f"placement-{shape}-{policy}-{qps:g}",
                    profile=settings.profile,
                    model=settings.model,
                    placement=policy,
                )
                points.append(_point(shape, qps, policy, result))
                if on_point is not None:
                    on_point()
    path = records / PLACEMENT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([dataclasses.asdict(p) for p in points], indent=1), encoding="utf-8")
    tmp.replace(path)
    return path


def _point(shape: str, qps: float, policy: str, result: ClusterResult) -> PlacementPoint:
    records, cached, moved = result.records, result.prefill_cached, result.placed_by_prefix
    later = [r for r in records if r["turn"] > 1 and r["ok"]]
    prompts = [r["n_ctx"] + r["n_in"] for r in later]
    computed = [
        n - cached.get(f"{r['conversation_id']}#{r['turn']}", 0) for r, n in zip(later, prompts, strict=True)
    ]
    ttft = [float(r["ttft_ms"]) for r in later if r["ttft_ms"] is not None]
    return PlacementPoint(
        shape=shape,
        qps=qps,
        placement=policy,
        turns=len(later),
        prefill_tokens=sum(computed),
        prompt_tokens=sum(prompts),
        ttft_mean_ms=mean(ttft),
        ttft_p99_ms=p99(ttft),
        success=sum(1 for r in records if r["ok"]) / len(records) if records else 1.0,
        moved=sum(1 for rid in moved if not rid.endswith("#1")),
    )


def read_points(path: Path) -> list[PlacementPoint]:
    return [PlacementPoint(**raw) for raw in json.loads(path.read_text("utf-8"))]


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pairs(points: Sequence[PlacementPoint]) -> dict[str, list[tuple[PlacementPoint, PlacementPoint]]]:
    """Per shape, (least_loaded, prefix) at each QPS level, in level order."""
    by = {(p.shape, p.qps, p.placement): p for p in points}
    out: dict[str, list[tuple[PlacementPoint, PlacementPoint]]] = {}
    for shape, qps in sorted({(p.shape, p.qps) for p in points}, key=lambda k: (k[0], k[1])):
        least, prefix = by.get((shape, qps, "least_loaded")), by.get((shape, qps, "prefix"))
        if least is not None and prefix is not None:
            out.setdefault(shape, []).append((least, prefix))
    return out


def _goals(pairs: dict[str, list[tuple[PlacementPoint, PlacementPoint]]]) -> list[list[str]]:
    rows: list[list[str]] = []
    for shape, levels in pairs.items():
        tokens = [_ratio(b.prefill_tokens, a.prefill_tokens) for a, b in levels]
        ttft = [_ratio(b.ttft_mean_ms, a.ttft_mean_ms) for a, b in levels]
        worst_tokens = max((t for t in tokens if t is not None), default=None)
        worst_ttft = max((t for t in ttft if t is not None), default=None)
        if shape in _MULTI_P:
            rows.append(
                [
                    f"{shape}: Turn 2+ P tokens <= {_GOAL_TOKENS}x",
                    _mark(worst_tokens, _GOAL_TOKENS),
                    f"worst {_x(worst_tokens)}",
                ]
            )
            rows.append(
                [
                    f"{shape}: Turn 2+ mean TTFT <= {_GOAL_TTFT}x",
                    _mark(worst_ttft, _GOAL_TTFT),
                    f"worst {_x(worst_ttft)}",
                ]
            )
        else:
            spread = [abs(t - 1.0) for t in (*tokens, *ttft) if t is not None]
            worst = max(spread, default=None)
            rows.append(
                [
                    f"{shape}: within {_NOISE:.0%} of least loaded",
                    _mark(worst, _NOISE),
                    f"largest change {_pct(worst)}",
                ]
            )
    return rows


def _mark(value: float | None, limit: float) -> str:
    return "n/a" if value is None else ("PASS" if value <= limit else "FAIL")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def placement_section(path: Path, out: Path, caption: str) -> list[str]:
    """The section's Markdown lines, and ``placement.png`` in ``out``."""
    points = read_points(path)
    pairs = _pairs(points)
    lines = [
        "## Prefix-aware placement",
        "",
        'Prefix placement (the gateway\'s `[routing] placement = "prefix"`) against least loaded, on the '
        "same arrivals: ShareGPT conversations in mode pd, Turn 2+ only. P tokens: prompt tokens P "
        "computed (what its prefix cache did not hold) out of the whole prompts.",
        "",
        *md_table(["goal", "result", "measured"], _goals(pairs)),
    ]
    for shape, levels in pairs.items():
        rows = [
            [
                f"{a.qps:g}",
                f"{a.prefill_tokens:,} / {a.prompt_tokens:,}",
                f"{b.prefill_tokens:,}",
                _x(_ratio(b.prefill_tokens, a.prefill_tokens)),
                f"{ms(a.ttft_mean_ms)} / {ms(b.ttft_mean_ms)}",
                _x(_ratio(b.ttft_mean_ms, a.ttft_mean_ms)),
                f"{ms(a.ttft_p99_ms)} / {ms(b.ttft_p99_ms)}",
                f"{b.moved} of {b.turns}",
                f"{a.success:.1%} / {b.success:.1%}",
            ]
            for a, b in levels
        ]
        header = ["QPS", "P tokens, least loaded / prompts", "P tokens, prefix", "ratio"]
        header += ["mean TTFT ms, least / prefix", "ratio", "P99 TTFT ms", "moved", "success"]
        lines += [f"### {shape}", "", *md_table(header, rows)]
    if pairs:
        name = "placement.png"
        save_png(
            out / name,
            "Prefix placement against least loaded (Turn 2+, pd)",
            caption,
            _drawer(pairs),
            panels=2,
        )
        lines += [f"![Prefix placement against least loaded]({name})", ""]
    return lines


def _drawer(pairs: dict[str, list[tuple[PlacementPoint, PlacementPoint]]]) -> Callable[[Any], None]:
    def draw(axes: Any) -> None:
        for shape, levels in pairs.items():
            qps = [a.qps for a, _ in levels]
            tokens = [_ratio(b.prefill_tokens, a.prefill_tokens) for a, b in levels]
            ttft = [_ratio(b.ttft_mean_ms, a.ttft_mean_ms) for a, b in levels]
            axes[0].plot(qps, [math.nan if t is None else t for t in tokens], marker="o", label=shape)
            axes[1].plot(qps, [math.nan if t is None else t for t in ttft], marker="o", label=shape)
        for ax, title, goal in (
            (axes[0], "P tokens computed, Turn 2+", _GOAL_TOKENS),
            (axes[1], "mean TTFT, Turn 2+", _GOAL_TTFT),
        ):
            ax.axhline(goal, color="grey", linestyle="--", linewidth=1, label=f"goal {goal}x (2P2D, 3P1D)")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_xlabel("QPS (conversations started per second)")
            ax.set_ylabel("prefix / least loaded")
            ax.set_title(title)
            ax.set_ylim(0, 1.15)
            ax.legend(fontsize=8)

    return draw
