"""A PNG heatmap of a decision grid (``ppd-table show --png``). matplotlib is imported lazily.

Colour is the score S = w_ttft·ΔTTFT − w_tpot·ΔTPOT (blue: local wins, red: pd wins, clipped to ±1);
cells decided by a failed success SLO are drawn at the extreme of the winning side, cells without data
grey. A grid asked as a caller that can serve BIDIR (``Grid.bidir``) draws its BIDIR cells in a third
colour (green, by their S against PD, with a colour bar of their own). Each cell is labelled with the
grid's symbol.
"""

from __future__ import annotations

import os
from pathlib import Path

from table_builder.grid import BIDIR_LEGEND, LEGEND, Grid

__all__ = ["PlotsMissingError", "write_heatmap"]


class PlotsMissingError(RuntimeError):
    """matplotlib is not installed (it is the optional ``plots`` extra)."""


def write_heatmap(grid: Grid, path: str | os.PathLike[str]) -> Path:
    """Draw one panel per context class and save a PNG at ``path``."""
    try:
        import matplotlib as mpl

        mpl.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError as exc:
        raise PlotsMissingError(
            "--png needs matplotlib: pip install 'ppd-router[plots]' (or `make venv`)"
        ) from exc

    from decision_service.route import Reason

    axes = grid.axes
    nc = len(axes.context_classes)
    nw, nq = len(axes.workloads), len(axes.qps_levels)
    fig, panels = plt.subplots(
        1, nc, figsize=(1.0 + 0.62 * nq * nc, 0.5 * nw + 2.2), squeeze=False, layout="constrained"
    )
    cmap = mpl.colormaps["RdBu"].with_extremes(bad="#d9d9d9")
    bidir_cmap = mpl.colormaps["Greens"]
    image = bidir_image = None
    for c, ax in enumerate(panels[0]):
        values = np.full((nw, nq), np.nan)
        bidir = np.full((nw, nq), np.nan)
        for w in range(nw):
            for q in range(nq):
                cell = grid.cells[c][w][q]
                if cell is not None and cell.bidir:
                    # Forced (the others missed the SLO) at the extreme, else its S; never below the scale.
                    forced = cell.reason is Reason.PD_FAILED_IN_CELL and cell.score <= 0
                    bidir[w, q] = 1.0 if forced else max(0.2, min(1.0, cell.score))
                elif cell is not None and cell.reason is not Reason.DEFAULT:
                    if cell.reason in (Reason.PD_FAILED_IN_CELL, Reason.LOCAL_FAILED_IN_CELL):
                        values[w, q] = 1.0 if cell.local else -1.0
                    else:
                        values[w, q] = max(-1.0, min(1.0, cell.score))
                dark = abs(values[w, q]) > 0.6 or bidir[w, q] > 0.6
                label = "-" if cell is None else cell.symbol()
                ax.text(q, w, label, ha="center", va="center", fontsize=8, color="white" if dark else "black")
        image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=-1.0, vmax=1.0, aspect="auto")
        if grid.bidir:
            bidir_image = ax.imshow(
                np.ma.masked_invalid(bidir), cmap=bidir_cmap, vmin=0.0, vmax=1.0, aspect="auto"
            )
        ax.set_title(f"context {axes.context_classes[c]}")
        ax.set_xticks(range(nq), [f"{q:g}" for q in axes.qps_levels], fontsize=7)
        ax.set_xlabel("QPS")
        ax.set_yticks(range(nw), list(axes.workload_names()) if c == 0 else [""] * nw, fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=panels[0].tolist(), label="S (local wins > 0)", shrink=0.8)
    if bidir_image is not None:
        fig.colorbar(bidir_image, ax=panels[0].tolist(), label="S of bidir (green: bidir wins)", shrink=0.8)
    weights = grid.weights
    fig.suptitle(
        f"{grid.key}  v{grid.version}  w_ttft={weights.w_ttft:g} w_tpot={weights.w_tpot:g} "
        f"({grid.weights_label})",
        fontsize=9,
    )
    fig.supxlabel(LEGEND + ("\n" + BIDIR_LEGEND if grid.bidir else ""), fontsize=6)
    target = Path(path)
    fig.savefig(target, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return target
