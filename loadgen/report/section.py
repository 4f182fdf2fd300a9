"""Small shared pieces of the experiment sections (``bidir``, ``drift``, ``slo``): their command line's
common options, Markdown tables, means, PNGs.

matplotlib is imported only when a PNG is drawn (object API, no pyplot global state).
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadgen.arguments import at_least
from ppd.slo import p99 as slo_p99

__all__ = [
    "add_experiment_parser",
    "md_table",
    "mean",
    "ms",
    "p99",
    "print_section",
    "progress_printer",
    "save_png",
]


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


def add_experiment_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str,
    shape: str,
    seed: int,
) -> argparse.ArgumentParser:
    """A ``ppd-bench`` experiment subcommand with the options every experiment has: ``--out``, ``--shape``,
    ``--seed`` and ``--no-progress``; the caller adds its own."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.add_argument("--out", type=Path, required=True, help="folder for the section, figures and records")
    parser.add_argument("--shape", default=shape, help=f"deployment shape (default {shape})")
    parser.add_argument(
        "--seed", type=at_least(0), default=seed, help=f"seed of the arrivals (default {seed})"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    return parser


def print_section(name: str, path: Path, goals: Sequence[Sequence[str]] = ()) -> None:
    """What an experiment command prints when it is done: where its section is, then its goal rows."""
    print(f"{name} section: {path}")
    for row in goals:
        print("| " + " | ".join(row) + " |")
