"""Draws docs/images/architecture.png: the parts of the router and a request's path (dev tooling).

Rules: 1. one picture, drawn from the boxes and arrows below, so a change of the parts is a change
here and a rerun (`python tools/docs/draw_architecture.py`); 2. matplotlib's Agg backend only (no
display), the `plots` extra; 3. nothing in the product imports this file.
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "docs" / "images" / "architecture.png"

# (x, y, width, height, title, body, colour): the parts.
BOXES: tuple[tuple[float, float, float, float, str, str, str], ...] = (
    (0.2, 3.0, 1.9, 1.4, "Client", "OpenAI API\n(curl, openai)", "#eeeeee"),
    (
        3.0,
        2.7,
        3.0,
        2.0,
        "Gateway",
        "ppd-gateway serve, or Envoy +\nppd-gateway picker\nsessions, ψ, plan",
        "#d8e8f8",
    ),
    (3.0, 5.6, 3.0, 1.3, "DecisionService", "ppd-decision\nRoute(ψ) → PD | LOCAL | BIDIR", "#fde9c8"),
    (7.4, 5.6, 2.2, 1.3, "tables/", "*.ppdt, hot reload", "#fde9c8"),
    (10.2, 5.6, 2.4, 1.3, "ppd-table", "sweep, build, refresh\n(offline)", "#f3f3f3"),
    (7.4, 3.3, 2.6, 1.4, "Prefill worker P", "vLLM (or ppd-sim)", "#dff0d8"),
    (7.4, 0.6, 2.6, 1.6, "Decode worker D", "vLLM (or ppd-sim)\nholds the conversation's KV", "#dff0d8"),
    (10.6, 2.7, 2.0, 1.3, "request log", "JSONL records", "#f3f3f3"),
)

# (start, end, label, colour, label position): the arrows.
ARROWS: tuple[tuple[tuple[float, float], tuple[float, float], str, str, tuple[float, float]], ...] = (
    ((2.1, 3.9), (3.0, 3.9), "1 request", "#333333", (2.05, 4.05)),
    ((4.2, 4.7), (4.2, 5.6), "2 Route(ψ)", "#b36b00", (3.3, 5.1)),
    ((6.0, 4.1), (7.4, 4.1), "3a PD: prefill\nthe history", "#1f5fa8", (6.05, 4.25)),
    ((8.7, 3.3), (8.7, 2.2), "KV (NIXL)", "#1f5fa8", (8.8, 2.45)),
    ((5.4, 2.7), (7.4, 1.6), "3b LOCAL: append-prefill\nthe new tokens on D", "#2b8a3e", (6.2, 2.3)),
    ((7.4, 0.9), (3.6, 2.7), "answer tokens", "#555555", (3.9, 1.5)),
    ((3.0, 3.4), (2.1, 3.4), "4 answer\n(SSE)", "#555555", (2.1, 2.55)),
    ((10.2, 6.25), (9.6, 6.25), "", "#555555", (0, 0)),
    ((7.4, 6.25), (6.0, 6.25), "", "#555555", (0, 0)),
    ((6.0, 3.0), (10.6, 3.2), "one line per request", "#888888", (8.9, 2.8)),
    ((11.6, 4.0), (11.4, 5.6), "refresh", "#888888", (11.6, 4.7)),
)


def draw(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = plt.subplots(figsize=(12.8, 7.2), dpi=100)
    ax.set_xlim(0, 12.8)
    ax.set_ylim(0, 7.2)
    ax.axis("off")
    for x, y, w, h, title, body, colour in BOXES:
        ax.add_patch(
            FancyBboxPatch(
                (x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc=colour, ec="#555555"
            )
        )
        ax.text(x + w / 2, y + h - 0.3, title, ha="center", va="center", fontsize=12, weight="bold")
        ax.text(x + w / 2, y + (h - 0.45) / 2, body, ha="center", va="center", fontsize=9.5)
    for start, end, label, colour, at in ARROWS:
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, color=colour, lw=1.6))
        if label:
            ax.text(at[0], at[1], label, fontsize=9, color=colour)
    ax.text(
        0.2,
        0.25,
        "Turn 1 always takes 3a. Turn 2+: the table's cell for ψ (turn, new tokens, context, expected "
        "output, QPS) picks 3a or 3b.",
        fontsize=9,
        color="#333333",
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else OUT
    draw(out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
