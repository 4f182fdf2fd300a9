"""The report's section "Prefix-aware placement": prefix against least-loaded placement of P (and of
the Turn-1 D) on the virtual-time cluster (ppd/placement.py, the gateway's rule), on the same arrivals.

``ppd-bench report --run`` runs it (``run_placement``) after the reproduction's sweeps: per shape and
QPS level, ShareGPT multi-turn conversations in mode ``pd`` (every Turn 2+ goes through P, so every one
is a leg placement places), then each shared-prefix workload of ``placement_shared_workloads`` (groups
of conversations behind one long system prompt), once per placement, with common random numbers. It
writes one JSON file, ``<records>/placement/placement.json``; ``ppd-bench report`` renders it when it
is there (``placement_section``: the goals, a table per shape, ``placement.png`` and
``placement_shared.png``).

ShareGPT figures per point, Turn 2+ only: prompt tokens P computed (the prompt less what P's prefix cache
held, ``ClusterResult.prefill_cached``) against the whole prompts, mean and P99 TTFT, success, and how
many legs the prefix moved away from the least-loaded P. Goals: on 2P2D and 3P1D, P's tokens at most
0.5x and mean TTFT at most 0.7x least-loaded's at every level; on 1P3D within 2% (one P: nothing to
choose).

Shared-prefix figures per point, Turn 1 only (the turn that carries the shared prompt): the same, plus
how busy P was: its utilisation, the seconds P's engines spent stepping (``ClusterResult.busy_s``) over
P workers x seconds of arrivals (above 100% when P's backlog outlives the arrivals). P is *busy* at a
level when least loaded's P utilisation is at least 50%: from there a request's wait in P's queue is
as long as half its prefill or longer (M/D/1: wait = rho / (2(1 - rho)) x service), so the prefill
placement saves is paid again in queueing. Goals: on 2P2D and 3P1D, Turn 1 mean TTFT at most 0.6x
least-loaded's at every busy level; on 1P3D within 2% (one P).
"""

from __future__ import annotations

import dataclasses
import itertools
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
    "SharedPrefixPoint",
    "placement_file",
    "placement_runs",
    "placement_section",
    "read_points",
    "read_shared_points",
    "run_placement",
]

PLACEMENT_FILE: Final = Path("placement") / "placement.json"
_POLICIES: Final[tuple[Placement, ...]] = ("least_loaded", "prefix")
_GOAL_TOKENS: Final = 0.5
_GOAL_TTFT: Final = 0.7
_NOISE: Final = 0.02
_MULTI_P: Final = ("2P2D", "3P1D")
_GOAL_TURN1_TTFT: Final = 0.6
#: Least loaded's P utilisation from which P counts as busy (see the module docstring).
_BUSY: Final = 0.5


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


@dataclass(frozen=True, slots=True)
class SharedPrefixPoint:
    """One shared-prefix run's Turn 1 figures, and how busy its P workers were."""

    workload: str
    shape: str
    qps: float
    placement: str
    turns: int  # Turn 1 requests that succeeded
    prefill_tokens: int  # prompt tokens P computed for them
    prompt_tokens: int  # their whole prompts
    ttft_mean_ms: float | None
    ttft_p99_ms: float | None
    success: float  # of every request of the run
    moved: int  # Turn 1 requests with a leg (P or D) the resident prefix moved
    p_utilisation: float  # P's stepping seconds / (P workers x seconds of arrivals)


def placement_file(records: Path) -> Path | None:
    """The placement figures under a records folder, if ``--run`` wrote them."""
    path = records / PLACEMENT_FILE
    return path if path.exists() else None


def placement_runs(settings: ReproduceSettings) -> int:
    """How many runs ``run_placement`` makes (its ``on_point`` calls)."""
    workloads = 1 + len(settings.placement_shared_workloads)
    return workloads * len(settings.shapes) * len(settings.qps_levels) * len(_POLICIES)


def run_placement(
    settings: ReproduceSettings, records: Path, *, on_point: Callable[[], object] | None = None
) -> Path:
    """Both placements at every shape x QPS level of ``settings``, mode pd, on ShareGPT and on each
    shared-prefix workload of ``settings.placement_shared_workloads``; the JSON path."""
    lists = turn_lists(dataclasses.replace(settings, workload=SHAREGPT_WORKLOAD))
    points: list[PlacementPoint] = []
    shared: list[SharedPrefixPoint] = []
    grid = list(itertools.product(settings.shapes, settings.qps_levels, _POLICIES))
    for workload in (SHAREGPT_WORKLOAD, *settings.placement_shared_workloads):
        for shape, qps, policy in grid:
            is_sharegpt = workload == SHAREGPT_WORKLOAD
            result = simulate_cluster(
                lists,
                shape=shape,
                mode="pd",
                qps=qps,
                duration_s=settings.duration_s,
                workload=workload,
                seed=settings.seed,
                run_id=f"placement-{'' if is_sharegpt else workload + '-'}{shape}-{policy}-{qps:g}",
                profile=settings.profile,
                model=settings.model,
                placement=policy,
            )
            if is_sharegpt:
                points.append(PlacementPoint(shape, qps, policy, *_figures(result, turn1=False)))
            else:
                busy = _p_utilisation(result, settings.duration_s)
                shared.append(
                    SharedPrefixPoint(workload, shape, qps, policy, *_figures(result, turn1=True), busy)
                )
            if on_point is not None:
                on_point()
    path = records / PLACEMENT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    data = {
        "sharegpt": [dataclasses.asdict(p) for p in points],
        "shared_prefix": [dataclasses.asdict(p) for p in shared],
    }
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    tmp.replace(path)
    return path


def _figures(
    result: ClusterResult, *, turn1: bool
) -> tuple[int, int, int, float | None, float | None, float, int]:
    """Turn 1's figures (``turn1``) or Turn 2+'s, in the points' field order from ``turns`` to ``moved``."""
    records, cached, moved = result.records, result.prefill_cached, result.placed_by_prefix
    chosen = [r for r in records if (r["turn"] == 1) == turn1 and r["ok"]]
    prompts = [r["n_ctx"] + r["n_in"] for r in chosen]
    computed = [
        n - cached.get(f"{r['conversation_id']}#{r['turn']}", 0) for r, n in zip(chosen, prompts, strict=True)
    ]
    ttft = [float(r["ttft_ms"]) for r in chosen if r["ttft_ms"] is not None]
    success = sum(1 for r in records if r["ok"]) / len(records) if records else 1.0
    n_moved = sum(1 for rid in moved if rid.endswith("#1") == turn1)
    return len(chosen), sum(computed), sum(prompts), mean(ttft), p99(ttft), success, n_moved


def _p_utilisation(result: ClusterResult, duration_s: float) -> float:
    """P's stepping seconds over P workers x ``duration_s`` (0 without P workers)."""
    names = [name for name in result.engine_stats if name.startswith("P")]
    busy = math.fsum(result.busy_s.get(name, 0.0) for name in names)
    return busy / (len(names) * duration_s) if names and duration_s > 0 else 0.0


def _read(path: Path) -> dict[str, list[dict[str, Any]]]:
    raw = json.loads(path.read_text("utf-8"))
    return {"sharegpt": raw} if isinstance(raw, list) else raw  # a list: written before shared prefixes


def read_points(path: Path) -> list[PlacementPoint]:
    """The ShareGPT (Turn 2+) points of a placement file."""
    return [PlacementPoint(**raw) for raw in _read(path).get("sharegpt", [])]


def read_shared_points(path: Path) -> list[SharedPrefixPoint]:
    """The shared-prefix (Turn 1) points of a placement file (none in a file written before them)."""
    return [SharedPrefixPoint(**raw) for raw in _read(path).get("shared_prefix", [])]


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
        rows = [[f"{a.qps:g}", *_compared(a, b)] for a, b in levels]
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
    return lines + _shared_lines(read_shared_points(path), out, caption)


_SharedPairs = dict[str, dict[str, list[tuple[SharedPrefixPoint, SharedPrefixPoint]]]]


def _shared_pairs(points: Sequence[SharedPrefixPoint]) -> _SharedPairs:
    """Per workload and shape, (least_loaded, prefix) at each QPS level, in level order."""
    by = {(p.workload, p.shape, p.qps, p.placement): p for p in points}
    out: _SharedPairs = {}
    for workload, shape, qps in sorted({(p.workload, p.shape, p.qps) for p in points}):
        least, prefix = (
            by.get((workload, shape, qps, "least_loaded")),
            by.get((workload, shape, qps, "prefix")),
        )
        if least is not None and prefix is not None:
            out.setdefault(workload, {}).setdefault(shape, []).append((least, prefix))
    return out


def _compared(
    least: PlacementPoint | SharedPrefixPoint, prefix: PlacementPoint | SharedPrefixPoint
) -> list[str]:
    """One level's cells, least loaded against prefix: P's tokens, mean and P99 TTFT, moved, success."""
    a, b = least, prefix
    return [
        f"{a.prefill_tokens:,} / {a.prompt_tokens:,}",
        f"{b.prefill_tokens:,}",
        _x(_ratio(b.prefill_tokens, a.prefill_tokens)),
        f"{ms(a.ttft_mean_ms)} / {ms(b.ttft_mean_ms)}",
        _x(_ratio(b.ttft_mean_ms, a.ttft_mean_ms)),
        f"{ms(a.ttft_p99_ms)} / {ms(b.ttft_p99_ms)}",
        f"{b.moved} of {b.turns}",
        f"{a.success:.1%} / {b.success:.1%}",
    ]


def _busy(least: SharedPrefixPoint) -> bool:
    return least.p_utilisation >= _BUSY


def _shared_goals(pairs: _SharedPairs) -> list[list[str]]:
    per_shape: dict[str, list[tuple[str, SharedPrefixPoint, SharedPrefixPoint]]] = {}
    for workload, shapes in pairs.items():
        for shape, levels in shapes.items():
            per_shape.setdefault(shape, []).extend((workload, a, b) for a, b in levels)
    rows: list[list[str]] = []
    for shape in sorted(per_shape):
        runs = per_shape[shape]
        if shape in _MULTI_P:
            busy = [(w, a, _ratio(b.ttft_mean_ms, a.ttft_mean_ms)) for w, a, b in runs if _busy(a)]
            known = [(r, w, a.qps) for w, a, r in busy if r is not None]
            worst = max(known, default=None)
            measured = "P never busy" if not busy else f"worst {_x(worst[0] if worst else None)}"
            if worst is not None:
                measured += f" ({worst[1]}, QPS {worst[2]:g}); busy at {len(busy)} of {len(runs)} points"
            goal = f"{shape}: shared-prefix Turn 1 mean TTFT <= {_GOAL_TURN1_TTFT}x where P is busy"
            rows.append([goal, _mark(worst[0] if worst else None, _GOAL_TURN1_TTFT), measured])
        else:
            ratios = [_ratio(b.ttft_mean_ms, a.ttft_mean_ms) for _, a, b in runs]
            spread = max((abs(r - 1.0) for r in ratios if r is not None), default=None)
            goal = f"{shape}: shared-prefix Turn 1 mean TTFT within {_NOISE:.0%} of least loaded"
            rows.append([goal, _mark(spread, _NOISE), f"largest change {_pct(spread)}"])
    return rows


def _shared_lines(points: Sequence[SharedPrefixPoint], out: Path, caption: str) -> list[str]:
    pairs = _shared_pairs(points)
    if not pairs:
        return []
    lines = [
        "### Shared-prefix family: Turn 1",
        "",
        "The same comparison on conversations that open with their group's shared system prompt "
        "(`shared<L>_<G>x<C>_<turn1>_<class>`), Turn 1 only: the turn that carries the prompt. P busy: "
        "the share of the arrival window P's engines spent stepping, least loaded / prefix; P counts as "
        f"busy at a level when least loaded's is at least {_BUSY:.0%} (marked *busy*).",
        "",
        *md_table(["goal", "result", "measured"], _shared_goals(pairs)),
    ]
    header = ["QPS", "P busy, least / prefix", "Turn 1 P tokens, least loaded / prompts", "P tokens, prefix"]
    header += ["ratio", "mean TTFT ms, least / prefix", "ratio", "P99 TTFT ms", "moved", "success"]
    for workload, shapes in pairs.items():
        for shape, levels in shapes.items():
            rows = [
                [
                    f"{a.qps:g}",
                    f"{a.p_utilisation:.0%} / {b.p_utilisation:.0%}" + (" *busy*" if _busy(a) else ""),
                    *_compared(a, b),
                ]
                for a, b in levels
            ]
            lines += [f"#### {workload}, {shape}", "", *md_table(header, rows)]
    name = "placement_shared.png"
    shapes_seen = sorted({shape for shapes in pairs.values() for shape in shapes})
    save_png(
        out / name,
        "Prefix placement against least loaded, shared-prefix family (Turn 1, pd)",
        caption,
        _shared_drawer(pairs, shapes_seen),
        panels=len(shapes_seen),
    )
    return [*lines, f"![Prefix placement against least loaded, shared-prefix Turn 1]({name})", ""]


def _shared_drawer(pairs: _SharedPairs, shapes: Sequence[str]) -> Callable[[Any], None]:
    def draw(axes: Any) -> None:
        for ax, shape in zip(axes, shapes, strict=True):
            for workload, by_shape in pairs.items():
                levels = by_shape.get(shape, [])
                ratio = [_ratio(b.ttft_mean_ms, a.ttft_mean_ms) for a, b in levels]
                ys = [math.nan if r is None else r for r in ratio]
                line = ax.plot([a.qps for a, _ in levels], ys, label=workload)[0]
                busy = [(a.qps, y) for (a, _), y in zip(levels, ys, strict=True) if _busy(a)]
                ax.plot([q for q, _ in busy], [y for _, y in busy], "o", color=line.get_color())
            if shape in _MULTI_P:
                ax.axhline(
                    _GOAL_TURN1_TTFT, color="grey", linestyle="--", linewidth=1, label="goal where P busy"
                )
            else:
                ax.axhspan(
                    1 - _NOISE, 1 + _NOISE, color="grey", alpha=0.3, label=f"goal: within {_NOISE:.0%}"
                )
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_xlabel("QPS (conversations started per second)")
            ax.set_ylabel("Turn 1 mean TTFT, prefix / least loaded")
            ax.set_title(f"{shape} (dots: P busy)")
            ax.set_ylim(0, 1.15)
            ax.legend(fontsize=7)

    return draw


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
