"""``ppd-bench report``: the reproduction report (Markdown + PNG plots) from benchmark records.

Reads every ``*.jsonl`` under ``--records`` and the optional ``manifest.json`` there (which engine and
seed produced the records, and which run ids belong to the w_tpot and link sweeps; see
``comparison.Manifest``). Writes ``report.md`` and one PNG per figure into ``--out``. Every plot
carries a caption saying what was run and with which seed. matplotlib is imported only here, lazily.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from loadgen.report.comparison import (
    MANIFEST_NAME,
    MODE_ORDER,
    Acceptance,
    Manifest,
    Point,
    SweepPoint,
    acceptance,
    band_changes,
    bandwidth_points,
    failure_rates,
    paper_wtpot_experiments,
    pareto,
    points,
    winners,
    wtpot_points,
)
from loadgen.report.paper import BANDS, HIGH_QPS, PAPER_FIGURE6_LOCAL, PAPER_TABLE1, PAPER_TABLE5
from loadgen.report.placement import placement_section
from loadgen.report.real_vllm import real_vllm_section
from loadgen.report.section import md_table, ms
from loadgen.report.sim_vs_real import sim_vs_real_section
from table_builder.records import Record, read_records

__all__ = ["REPORT_NAME", "ReportInputs", "load_inputs", "write_report"]

logger = logging.getLogger(__name__)

REPORT_NAME: Final = "report.md"
_COLOURS: Final = {"pd": "tab:blue", "local": "tab:orange", "ppd": "tab:green", "replica": "tab:gray"}


@dataclass(frozen=True, slots=True)
class ReportInputs:
    records: Sequence[Record]
    manifest: Manifest
    files: Sequence[Path]


def load_inputs(folder: Path) -> ReportInputs:
    """All records under ``folder`` (sorted file order) and its manifest (defaults when absent)."""
    files = sorted(folder.rglob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no *.jsonl records under {folder}")
    manifest_path = folder / MANIFEST_NAME
    manifest = Manifest.from_json(manifest_path.read_text("utf-8")) if manifest_path.exists() else Manifest()
    return ReportInputs(records=read_records(files), manifest=manifest, files=files)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _rate(value: float) -> str:
    """A failure rate, with one decimal near the ends, so 0.4% never reads as 0% nor 99.6% as 100%."""
    return f"{100 * value:.1f}%" if 0 < value < 0.1 or 0.9 < value < 1 else f"{100 * value:.0f}%"


def _provenance(inputs: ReportInputs) -> str:
    m = inputs.manifest
    workloads = sorted({r.workload for r in inputs.records})
    seed = "unrecorded" if m.seed is None else str(m.seed)
    return f"{m.engine}, seed {seed}; workloads: {', '.join(workloads)}; {len(inputs.records)} requests"


class _Plots:
    """Writes PNGs with matplotlib's object API (no pyplot global state)."""

    def __init__(self, out: Path, caption: str) -> None:
        from matplotlib.figure import Figure

        self._figure = Figure
        self._out = out
        self._caption = caption

    def save(self, name: str, title: str, draw: Callable[[Any], None], *, panels: int = 1) -> str:
        width = max(7.5, 5.0 * panels)
        fig = self._figure(figsize=(width, 4.6), layout="constrained")
        axes = fig.subplots(1, panels, squeeze=False)[0]
        draw(axes)
        caption = "\n".join(textwrap.wrap(self._caption, width=int(width * 16)))
        fig.suptitle(f"{title}\n{caption}", fontsize=9)
        fig.savefig(self._out / name, dpi=110)
        return name


def _by_shape(pts: Sequence[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in pts:
        out.setdefault(p.shape, []).append(p)
    return out


def _modes(pts: Sequence[Point]) -> list[str]:
    seen = {p.mode for p in pts}
    return [m for m in MODE_ORDER if m in seen] + sorted(seen - set(MODE_ORDER))


def _section_table1(pts: Sequence[Point], plots: _Plots) -> list[str]:
    lines = ["## Turn 2+ TTFT by mode across QPS (paper Table 1)", ""]
    if not pts:
        return [*lines, "No QPS-sweep records.", ""]
    shapes = _by_shape(pts)
    for shape, group in shapes.items():
        modes = _modes(group)
        qps_levels = sorted({p.qps for p in group})
        by = {(p.mode, p.qps): p for p in group}
        rows = [
            [f"{q:g}", *[ms(by[(m, q)].ttft2_mean_ms) if (m, q) in by else "-" for m in modes]]
            for q in qps_levels
        ]
        lines += [f"### {shape}: mean Turn 2+ TTFT (ms)", "", *md_table(["QPS", *modes], rows)]
        bands = [
            [m, *[_pct(band_changes(group, shape, m)[name]) for name, _, _ in BANDS]]
            for m in modes
            if m != "pd"
        ]
        if bands and shape in PAPER_TABLE1:
            bands.append(["paper, x=1 (Table 1)", *[_pct(v) for v in PAPER_TABLE1[shape]]])
        if bands:
            header = ["vs PD", *[f"{name} ({lo:g}-{hi:g})" for name, lo, hi in BANDS]]
            lines += [f"{shape}: change in mean Turn 2+ TTFT versus PD (negative = better)", ""]
            lines += md_table(header, bands)

    def draw(axes: Any) -> None:
        for ax, (shape, group) in zip(axes, shapes.items(), strict=True):
            for mode in _modes(group):
                xs = [
                    (p.qps, p.ttft2_mean_ms) for p in group if p.mode == mode and p.ttft2_mean_ms is not None
                ]
                if xs:
                    ax.plot(*zip(*xs, strict=True), marker="o", label=mode, color=_COLOURS.get(mode))
            ax.set_title(shape)
            ax.set_xlabel("target QPS")
            ax.set_ylabel("mean Turn 2+ TTFT (ms)")
            ax.legend(loc="upper left", fontsize=7)  # never "best": it warns when slow

    name = plots.save("table1_ttft_by_qps.png", "Turn 2+ TTFT by mode across QPS", draw, panels=len(shapes))
    return [*lines, f"![Turn 2+ TTFT by mode across QPS]({name})", ""]


def _section_pareto(pts: Sequence[Point], plots: _Plots) -> list[str]:
    lines = ["## P99 TTFT vs tokens/s (paper Figure 1)", ""]
    usable = [p for p in pts if p.tokens_per_s is not None and p.ttft_p99_ms is not None]
    if not usable:
        return [*lines, "No QPS-sweep records.", ""]
    shapes = _by_shape(usable)
    rows = []
    for shape, group in shapes.items():
        for q in sorted({p.qps for p in group}):
            front = pareto([p for p in group if p.qps == q])
            rows += [[shape, f"{q:g}", p.mode, f"{p.tokens_per_s:.0f}", ms(p.ttft_p99_ms)] for p in front]
    lines += ["Pareto-optimal modes per shape and QPS (higher tokens/s, lower P99 TTFT):", ""]
    lines += md_table(["shape", "QPS", "mode", "tokens/s", "P99 TTFT (ms)"], rows)

    def draw(axes: Any) -> None:
        for ax, (shape, group) in zip(axes, shapes.items(), strict=True):
            for mode in _modes(group):
                mine = [p for p in group if p.mode == mode]
                ax.scatter(
                    [p.tokens_per_s for p in mine],
                    [p.ttft_p99_ms for p in mine],
                    label=mode,
                    color=_COLOURS.get(mode),
                )
                for p in mine:
                    ax.annotate(f"{p.qps:g}", (p.tokens_per_s, p.ttft_p99_ms), fontsize=6)
            ax.set_title(f"{shape} (labels: QPS)")
            ax.set_xlabel("output tokens/s")
            ax.set_ylabel("P99 TTFT (ms)")
            ax.legend(loc="upper left", fontsize=7)  # never "best": it warns when slow

    name = plots.save("figure1_pareto.png", "P99 TTFT vs tokens/s", draw, panels=len(shapes))
    return [*lines, f"![P99 TTFT vs tokens/s]({name})", ""]


def _section_failures(pts: Sequence[Point]) -> list[str]:
    lines = ["## Failure rates at high QPS (paper Table 5)", ""]
    rates = failure_rates(pts)
    if not rates:
        return [*lines, f"No records at QPS {HIGH_QPS[0]:g} or above.", ""]
    levels = sorted({q for r in rates.values() for q in r})
    rows = [
        [f"{shape} ({mode})", *[_rate(r[q]) if q in r else "-" for q in levels]]
        for (shape, mode), r in rates.items()
    ]
    lines += md_table(["config", *[f"QPS={q:g}" for q in levels]], rows)
    paper = [
        [f"{shape} ({mode})", *[f"{100 * v:.0f}%" for v in values]]
        for (shape, mode), values in PAPER_TABLE5.items()
    ]
    lines += ["The paper's Table 5 (real H100 runs), for comparison:", ""]
    return [*lines, *md_table(["config", *[f"QPS={q:g}" for q in HIGH_QPS]], paper)]


def _section_winners(pts: Sequence[Point]) -> list[str]:
    lines = ["## Per-metric winners: PD vs x=1 vs PPD (paper Table 3)", ""]
    w = winners(pts)
    if not w.test_points:
        return [*lines, "No (shape, QPS) point has all of pd, local and ppd.", ""]
    names = {"pd": "PD (x=0)", "local": "x=1", "ppd": "PPD"}
    n = w.test_points
    rows = [
        [names[m], f"{w.tpot_best[m]}/{n}", f"{w.ttft_best[m]}/{n}", f"{w.full_success[m]}/{n}"]
        for m in ("pd", "local", "ppd")
    ]
    lines += [f"Counted over {n} (shape, QPS) test points; ties count for every tied mode.", ""]
    return [*lines, *md_table(["mode", "TPOT best", "TTFT best", "SR = 100%"], rows)]


def _section_wtpot(sweep: Sequence[SweepPoint], plots: _Plots) -> list[str]:
    lines = ["## The w_tpot sweep and the share routed locally (paper Figure 6)", ""]
    if not sweep:
        return [*lines, "No w_tpot sweep in these records.", ""]
    rows = [
        [
            s.label,
            ms(s.point.ttft2_mean_ms),
            ms(s.point.tpot2_mean_ms),
            "-" if s.point.local_share is None else f"{100 * s.point.local_share:.0f}%",
        ]
        for s in sweep
    ]
    lines += md_table(["setting", "Turn 2+ TTFT (ms)", "Turn 2+ TPOT (ms)", "routed local"], rows)

    def draw(axes: Any) -> None:
        ax = axes[0]
        weighted = [s for s in sweep if s.value is not None]
        static = [s for s in sweep if s.value is None]
        ax.plot(
            [s.point.tpot2_mean_ms for s in weighted],
            [s.point.ttft2_mean_ms for s in weighted],
            marker="o",
            color="tab:green",
            label="ppd, w_tpot sweep",
        )
        for s in static:
            ax.scatter(
                [s.point.tpot2_mean_ms],
                [s.point.ttft2_mean_ms],
                color=_COLOURS.get(s.mode, "tab:gray"),
                marker="s",
                label=f"static {s.mode}",
                zorder=3,
            )
        spots: dict[tuple[float | None, float | None], list[SweepPoint]] = {}
        for s in weighted:  # settings that land on the same point share one label
            spots.setdefault((s.point.tpot2_mean_ms, s.point.ttft2_mean_ms), []).append(s)
        for i, (xy, group) in enumerate(spots.items()):
            share = group[0].point.local_share
            text = "w_tpot=" + ", ".join(f"{s.value:g}" for s in group)
            text += ": -" if share is None else f": {100 * share:.0f}% local"
            ax.annotate(text, xy, fontsize=7, xytext=(6, -10 if i % 2 else 4), textcoords="offset points")
        ax.set_xlabel("mean Turn 2+ TPOT (ms)")
        ax.set_ylabel("mean Turn 2+ TTFT (ms)")
        ax.legend(loc="upper right", fontsize=7)

    name = plots.save("figure6_wtpot.png", "w_tpot traces a TTFT/TPOT frontier", draw)
    return [*lines, f"![w_tpot sweep]({name})", ""]


def _vs(value: float | None, base: float | None) -> str:
    return "" if value is None or not base else f" ({100 * (value / base - 1):+.0f}%)"


def _section_paper_wtpot(sweeps: Sequence[tuple[float, Sequence[SweepPoint]]], plots: _Plots) -> list[str]:
    lines = ["## Figure 6 in the paper's setting: prefill-heavy conversations, 1P3D, QPS 8 and 16", ""]
    if not sweeps:
        return [*lines, "No w_tpot sweep in the paper's setting in these records.", ""]
    lines += [
        "The paper's operating points: static PD 0% local, w_tpot = 6: 20%, w_tpot = 3: 50%, "
        "w_tpot = 1: 95%. Turn 2+ figures; the change in brackets is against static PD at the same QPS.",
        "",
    ]
    for qps, sweep in sweeps:
        pd = next((s.point for s in sweep if s.value is None), None)
        pd_ttft = None if pd is None else pd.ttft2_mean_ms
        pd_tpot = None if pd is None else pd.tpot2_mean_ms
        rows = []
        for s in sweep:
            paper = 0.0 if s.value is None else PAPER_FIGURE6_LOCAL.get(s.value)
            rows.append(
                [
                    s.label,
                    ms(s.point.ttft2_mean_ms) + _vs(s.point.ttft2_mean_ms, pd_ttft),
                    ms(s.point.tpot2_mean_ms) + _vs(s.point.tpot2_mean_ms, pd_tpot),
                    "-" if s.point.local_share is None else f"{100 * s.point.local_share:.0f}%",
                    "" if paper is None else f"{100 * paper:.0f}%",
                ]
            )
        lines += [f"QPS {qps:g}:", ""]
        lines += md_table(
            ["setting", "Turn 2+ TTFT (ms)", "Turn 2+ TPOT (ms)", "routed local", "paper"], rows
        )

    def draw(axes: Any) -> None:
        share, frontier = axes
        for qps, sweep in sweeps:
            weighted = [s for s in sweep if s.value is not None and s.point.local_share is not None]
            share.plot(
                [s.value for s in weighted],
                [100 * (s.point.local_share or 0.0) for s in weighted],
                marker="o",
                label=f"simulated, QPS {qps:g}",
            )
            frontier.plot(
                [s.point.tpot2_mean_ms for s in sweep],
                [s.point.ttft2_mean_ms for s in sweep],
                marker="o",
                label=f"QPS {qps:g} (static PD, then w_tpot up)",
            )
        share.scatter(
            list(PAPER_FIGURE6_LOCAL),
            [100 * v for v in PAPER_FIGURE6_LOCAL.values()],
            marker="x",
            color="black",
            s=60,
            label="paper",
            zorder=3,
        )
        share.set_xscale("log")
        share.set_xlabel("w_tpot")
        share.set_ylabel("Turn 2+ routed locally (%)")
        share.legend(fontsize=7)
        frontier.set_xlabel("mean Turn 2+ TPOT (ms)")
        frontier.set_ylabel("mean Turn 2+ TTFT (ms)")
        frontier.legend(fontsize=7)

    name = plots.save("figure6_paper_setting.png", "w_tpot in the paper's setting", draw, panels=2)
    return [*lines, f"![w_tpot in the paper's setting]({name})", ""]


def _section_links(sweep: Sequence[SweepPoint], plots: _Plots) -> list[str]:
    lines = ["## Turn 2+ TTFT across link bandwidths (paper Figure 5)", ""]
    if not sweep:
        return [*lines, "No link-bandwidth sweep in these records.", ""]
    rows = [
        [s.mode, s.label, ms(s.point.ttft2_mean_ms), ms(s.point.tpot2_mean_ms), ms(s.point.e2e_mean_ms)]
        for s in sweep
    ]
    lines += md_table(["mode", "link", "Turn 2+ TTFT (ms)", "Turn 2+ TPOT (ms)", "E2E (ms)"], rows)

    def draw(axes: Any) -> None:
        ax = axes[0]
        for mode in _modes([s.point for s in sweep]):
            mine = [s for s in sweep if s.mode == mode and s.value is not None]
            ax.plot(
                [s.value for s in mine],
                [s.point.ttft2_mean_ms for s in mine],
                marker="o",
                label=mode,
                color=_COLOURS.get(mode),
            )
        ax.set_xscale("log")
        ax.invert_xaxis()
        ax.set_xlabel("link bandwidth (GB/s, slower to the right)")
        ax.set_ylabel("mean Turn 2+ TTFT (ms)")
        ax.legend(loc="upper left", fontsize=7)  # never "best": it warns when slow

    name = plots.save("figure5_links.png", "Turn 2+ TTFT across link bandwidths", draw)
    return [*lines, f"![link sweep]({name})", ""]


def _section_acceptance(result: Acceptance, shape: str) -> list[str]:
    marks = {True: "PASS", False: "FAIL", None: "n/a"}
    rows = [[c.name, marks[c.passed], c.detail] for c in result.checks]
    return [f"## Acceptance figures ({shape})", "", *md_table(["check", "result", "measured"], rows)]


def write_report(
    inputs: ReportInputs,
    out: Path,
    *,
    shape: str = "1P3D",
    real_vllm: Path | None = None,
    placement: Path | None = None,
) -> Path:
    """Write ``report.md`` and its PNGs into ``out``; returns the report's path. ``placement``: the
    figures ``run_placement`` wrote (the section "Prefix-aware placement")."""
    out.mkdir(parents=True, exist_ok=True)
    caption = _provenance(inputs)
    plots = _Plots(out, caption)
    pts = points(inputs.records, inputs.manifest)
    wt = wtpot_points(inputs.records, inputs.manifest)
    links = bandwidth_points(inputs.records, inputs.manifest)
    folders = ", ".join(sorted({f.parent.name for f in inputs.files}))
    lines = [
        "# PPD reproduction report",
        "",
        f"What was run: {caption}.",
        f"Records: {len(inputs.files)} JSONL files in {folders}.",
    ]
    if inputs.manifest.notes:
        lines.append(inputs.manifest.notes)
    lines.append("")
    lines += _section_acceptance(acceptance(pts, wt, links, shape), shape)
    lines += _section_table1(pts, plots)
    lines += _section_pareto(pts, plots)
    lines += _section_failures(pts)
    lines += _section_winners(pts)
    lines += _section_wtpot(wt, plots)
    paper_sweeps = [
        (qps, wtpot_points(inputs.records, inputs.manifest, name))
        for qps, name in paper_wtpot_experiments(inputs.manifest)
    ]
    lines += _section_paper_wtpot(paper_sweeps, plots)
    lines += _section_links(links, plots)
    if placement is not None:
        lines += placement_section(placement, out, caption)
    if real_vllm is not None:
        lines += real_vllm_section(real_vllm, out)
        lines += sim_vs_real_section(real_vllm, out)
    path = out / REPORT_NAME
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
