"""`--png FILE`: the run's figures as one PNG (matplotlib's object API through loadgen's `save_png`,
imported only when a PNG is drawn).

Rule 1: three panels from the JSON figures alone (nothing measured here): Turn 1's and Turn 2's added
        TTFT p50 against the concurrency, a line per router and answer length; router CPU seconds per
        1,000 requests per answer length, a bar per router and turn.
Rule 2: the caption names the date, the workers and the load average, as the text output does, so a
        PNG taken out of context still says what it measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench_routers.figures import TURNS
from bench_routers.targets import TARGETS
from loadgen.report.section import save_png

__all__ = ["save_plot"]

_STYLES = ("-", "--", ":", "-.")
_TITLES = {"pd": "Turn 1 (pd): added TTFT p50, ms", "local": "Turn 2 (local): added TTFT p50, ms"}


def save_plot(figures: Mapping[str, Any], path: Path) -> Path:
    """Draw the run's figures (what `run` returned) into `path`."""
    cells = figures["cells"]
    levels = sorted({int(cell["streams"]) for cell in cells})
    lengths = sorted({int(cell["max_tokens"]) for cell in cells})

    def added(turn: str, name: str, length: int) -> list[float]:
        values = []
        for streams in levels:
            cell = next(c for c in cells if c["streams"] == streams and c["max_tokens"] == length)
            target = cell["turns"].get(turn, {}).get("targets", {}).get(name)
            value = None if target is None else target["added_ttft_p50_ms"]
            values.append(float("nan") if value is None else float(value))
        return values

    def draw(axes: Any) -> None:
        for ax, turn in zip(axes[:2], TURNS, strict=True):
            for color, name in enumerate(TARGETS[1:]):
                for style, length in enumerate(lengths):
                    values = added(turn, name, length)
                    if all(math.isnan(v) for v in values):  # NaN everywhere: not measured on this turn
                        continue
                    ax.plot(
                        levels, values, color=f"C{color}", linestyle=_STYLES[style % len(_STYLES)],
                        marker="o", label=f"{name}, {length} tok",
                    )  # fmt: skip
            ax.set_xscale("log")
            ax.minorticks_off()
            ax.set_xticks(levels, [str(x) for x in levels])
            ax.set_xlabel("concurrent streams")
            ax.set_title(_TITLES[turn], fontsize=9)
            ax.axhline(0, color="grey", linewidth=0.5)
            ax.legend(fontsize=6)
        per_1k = figures["summary"]["router_cpu_s_per_1k"]
        bars = [
            (name, turn)
            for turn in TURNS
            for name in TARGETS[1:]
            if any(name in per_1k[x][turn] for x in per_1k)
        ]
        width = 0.8 / len(bars)
        ax = axes[2]
        for i, (name, turn) in enumerate(bars):
            xs = [j + i * width for j in range(len(lengths))]
            ys = [per_1k[str(length)][turn].get(name) or 0.0 for length in lengths]
            shade = f"C{TARGETS[1:].index(name)}"  # as in the line panels; Turn 1 hatched
            ax.bar(xs, ys, width, color=shade, hatch="//" if turn == "pd" else "", label=f"{name}, {turn}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [f"{x} tok" for x in lengths])
        ax.set_title("router CPU s per 1,000 requests (all its processes)", fontsize=9)
        ax.legend(fontsize=6)

    machine = figures["machine"]
    caption = (
        f"ppd-bench-routers {figures['date']}: workers {figures['settings']['workers']}, "
        f"sglang-router {figures['settings']['sglang_router']}, {machine['cpus']} CPUs, load average "
        f"{machine['loadavg_start'][0]} at the start, {machine['loadavg_end'][0]} at the end. "
        "Added TTFT = router minus direct, same cell, same run."
    )
    return save_png(
        path, "Routers side by side: standalone gateway, Envoy + picker, SGLang", caption, draw, panels=3
    )
