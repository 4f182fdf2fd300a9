"""Small shared pieces of the experiment sections (``drift``, ``slo``): Markdown tables, means, PNGs.

matplotlib is imported only when a PNG is drawn (object API, no pyplot global state).
"""

from __future__ import annotations

import math
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ppd.slo import p99 as slo_p99

__all__ = ["md_table", "mean", "ms", "p99", "progress_printer", "save_png"]


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def p99(values: Sequence[float]) -> float | None:
    """The 99th percentile as the SLO controller computes it (``ppd.slo.p99``, nearest rank)."""
    return slo_p99(list(values)) if values else None


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def save_png(path: Path, title: str, caption: str, draw: Callable[[Any], None], *, panels: int = 1) -> Path:
    """Draw ``panels`` side-by-side axes with ``draw(axes)`` and save them with a title and caption."""
    from matplotlib.figure import Figure

    width = max(7.5, 5.5 * panels)
    fig = Figure(figsize=(width, 4.8), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    draw(axes)
    wrapped = "\n".join(textwrap.wrap(caption, width=int(width * 13)))
    fig.suptitle(f"{title}\n{wrapped}", fontsize=9)
    fig.savefig(path, dpi=110)
    return path


def progress_printer(quiet: bool) -> Callable[[str], None]:
    """Where an experiment's progress lines go: stderr, flushed, or nowhere with ``--no-progress``."""

    def say(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    return say
