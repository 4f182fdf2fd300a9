"""``ppd-bench slo``: fixed weights vs the SLO controller on a load ramp (issue 14, item 4).

One seeded mix of synthetic two-turn workloads (``loadgen.report.traffic``) climbs a load ramp (``step_s``
seconds at each QPS level) through the virtual-time cluster in mode ``ppd``, with the same arrivals for
every arm:

- ``fixed w_tpot=W``: the table routes every Turn 2+ request with fixed weights (w_ttft=1, w_tpot=W),
  one arm per W of ``fixed_w_tpot`` (the first is the table's usual 1; a large W trades TTFT for TPOT
  at every load);
- ``slo``: the gateway's SLO controller (``ppd.slo`` through ``ClusterConfig.slo``) drives w_tpot from
  the observed windowed TPOT P99 against ``tpot_p99_ms``.

The table's cell is found at ``target_qps`` (default: the ramp's peak), as a gateway configured for its
peak would; the weights are what adapts to the load. Figures: per window of ``window_s`` seconds (by
arrival), each arm's Turn 2+ TPOT P99 and mean TTFT; per arm, the windows above the target and the mean
Turn 2+ TTFT. The TPOT P99 is over every finished turn, Turn 1 included: the population the
controller observes and holds (as the gateway's does); the TTFT is Turn 2+, where the routing acts.
Goals: the SLO arm holds the target in every window where some fixed arm does, and keeps a lower TTFT
than the lowest fixed w_tpot that holds it everywhere.

The controller's tuning for the experiment (``controller_step``, ``controller_interval_s``,
``controller_min_samples``) is not the gateway's default (``ppd.slo.SloSettings``: a 30 s window,
x1.25 steps every 5 s, 50 samples): the ramp here changes level every ``step_s`` seconds, and the
table's cells flip only between w_tpot 2 and 4, so x1.25 steps reach the first flip after ~30 s,
a whole ramp step late. A tick a second is safe: each tick judges only requests routed under the
weight in force (``ppd.slo`` rule 4), so ticking fast reacts sooner without overshooting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from loadgen.arguments import positive, positive_list
from loadgen.report.reproduce import find_table
from loadgen.report.section import (
    add_experiment_parser,
    md_table,
    mean,
    ms,
    p99,
    print_section,
    progress_printer,
    save_png,
)
from loadgen.report.traffic import ramp_conversations
from ppd import slo as controller
from table_builder.records import Record, write_records

__all__ = [
    "ArmSlo",
    "SloFigures",
    "SloSettings",
    "Window",
    "add_parser",
    "run_arm",
    "run_slo",
    "slo_config",
    "windows",
]

logger = logging.getLogger(__name__)

SECTION_NAME: Final = "slo.md"
PNG_NAME: Final = "slo.png"


@dataclass(frozen=True, slots=True, kw_only=True)
class SloSettings:
    shape: str = "3P1D"
    model: str = "llama-3.1-8b"
    profile: str = "llama-3.1-8b-h100"
    workloads: tuple[str, ...] = ("large_huge_paste", "large_big_paste", "large_mid_paste", "large_short_gen")
    #: QPS of each ramp step, in order.
    levels: tuple[float, ...] = (2.0, 4.0, 6.0, 7.0, 6.0, 4.0, 2.0)
    step_s: float = 30.0
    #: QPS the table's cell is looked up at (None: the ramp's peak).
    target_qps: float | None = None
    tpot_p99_ms: float = 25.0
    #: Window of the figures' P99 (and of the controller's).
    window_s: float = 10.0
    fixed_w_tpot: tuple[float, ...] = (1.0, 16.0)
    #: The controller's relative step (1.0: w_tpot doubles or halves), seconds between its moves, and
    #: the fewest samples in its window it acts on.
    controller_step: float = 1.0
    controller_interval_s: float = 1.0
    controller_min_samples: int = 10
    run_slo_arm: bool = True
    seed: int = 0
    tables: Path = Path("tables")
    table: Path | None = None
    timeout_s: float = 30.0

    @property
    def duration_s(self) -> float:
        return self.step_s * len(self.levels)


@dataclass(frozen=True, slots=True)
class Window:
    start: float
    qps: float
    tpot_p99_ms: float | None
    ttft_ms: float | None
    local_share: float | None


#: The name of a fixed-weights arm is this and its w_tpot.
_FIXED: Final = "fixed w_tpot="


@dataclass(frozen=True, slots=True)
class ArmSlo:
    name: str
    windows: tuple[Window, ...]
    violations: int  # windows whose TPOT P99 is above the target
    ttft_ms: float | None  # mean Turn 2+ TTFT over the whole ramp
    tpot_p99_ms: float | None  # over the whole ramp
    failed: int


@dataclass(frozen=True, slots=True)
class SloFigures:
    target_ms: float
    arms: tuple[ArmSlo, ...]

    def arm(self, name: str) -> ArmSlo | None:
        return next((a for a in self.arms if a.name == name), None)

    @property
    def holding_fixed(self) -> ArmSlo | None:
        """The fixed arm with the lowest w_tpot that holds the target in every window."""
        holding = [a for a in self.arms if a.name.startswith(_FIXED) and a.violations == 0]
        return min(holding, key=lambda a: float(a.name.removeprefix(_FIXED)), default=None)


def _level_at(settings: SloSettings, t: float) -> float:
    k = min(int(t // settings.step_s), len(settings.levels) - 1)
    return settings.levels[k]


def windows(records: Sequence[Mapping[str, Any]], settings: SloSettings) -> tuple[Window, ...]:
    """Per window of ``window_s`` (by arrival time): the TPOT P99 of every turn (what the controller
    holds), the mean Turn 2+ TTFT and the Turn 2+ local share."""
    out = []
    t = 0.0
    while t < settings.duration_s:
        every = [r for r in records if r["ok"] and t <= r["start_time"] < t + settings.window_s]
        rows = [r for r in records if r["turn"] >= 2 and t <= r["start_time"] < t + settings.window_s]
        ok = [r for r in rows if r["ok"]]
        out.append(
            Window(
                start=t,
                qps=_level_at(settings, t),
                tpot_p99_ms=p99([float(r["tpot_ms"]) for r in every if r["tpot_ms"] is not None]),
                ttft_ms=mean([float(r["ttft_ms"]) for r in ok if r["ttft_ms"] is not None]),
                local_share=sum(1 for r in rows if r["path"] == "local") / len(rows) if rows else None,
            )
        )
        t += settings.window_s
    return tuple(out)


def _arm_figures(name: str, records: Sequence[Mapping[str, Any]], settings: SloSettings) -> ArmSlo:
    wins = windows(records, settings)
    ok = [r for r in records if r["turn"] >= 2 and r["ok"]]
    every = [r for r in records if r["ok"]]
    return ArmSlo(
        name=name,
        windows=wins,
        violations=sum(1 for w in wins if w.tpot_p99_ms is not None and w.tpot_p99_ms > settings.tpot_p99_ms),
        ttft_ms=mean([float(r["ttft_ms"]) for r in ok if r["ttft_ms"] is not None]),
        tpot_p99_ms=p99([float(r["tpot_ms"]) for r in every if r["tpot_ms"] is not None]),
        failed=sum(1 for r in records if not r["ok"]),
    )


def slo_config(settings: SloSettings) -> controller.SloSettings:
    """The controller's settings (``ppd.slo``) for the experiment's target and tuning."""
    return controller.SloSettings(
        tpot_p99_ms=settings.tpot_p99_ms,
        window_s=settings.window_s,
        step=settings.controller_step,
        interval_s=settings.controller_interval_s,
        min_samples=settings.controller_min_samples,
    )


def run_arm(
    name: str, settings: SloSettings, conversations: Sequence[Any], table_path: Path
) -> list[dict[str, Any]]:
    """``fixed w_tpot=W`` or ``slo`` on the virtual-time cluster; its records."""
    from decision_service.table import Table, Weights
    from simulator.core.cluster import ClusterConfig, simulate
    from simulator.core.profile import load_profile
    from simulator.core.routing import TableRouter
    from simulator.core.topology import Topology

    table = Table.open(table_path)
    extra: dict[str, Any] = {}
    if name == "slo":
        extra["slo"] = slo_config(settings)
        router = TableRouter(table)
    elif name.startswith(_FIXED):
        router = TableRouter(table, Weights(1.0, float(name.removeprefix(_FIXED))))
    else:
        raise ValueError(f"unknown arm {name!r}")
    config = ClusterConfig(
        topology=Topology.parse(settings.shape),
        mode="ppd",
        timeout_s=settings.timeout_s,
        target_qps=settings.target_qps or max(settings.levels),
        run_id="slo-" + name.replace(" ", "-").replace("=", ""),
        model=settings.model,
        **extra,
    )
    return simulate(load_profile(settings.profile), config, conversations, router).records


def _goals(fig: SloFigures) -> list[list[str]]:
    slo, hold = fig.arm("slo"), fig.holding_fixed
    possible = {i for a in fig.arms if a.name != "slo" for i, w in enumerate(a.windows) if _holds(w, fig)}
    held = None if slo is None else all(_holds(slo.windows[i], fig) for i in possible)
    kept = None
    if slo is not None and hold is not None and slo.ttft_ms is not None and hold.ttft_ms is not None:
        kept = slo.ttft_ms < hold.ttft_ms
    marks = {True: "PASS", False: "FAIL", None: "n/a"}
    return [
        [
            f"the SLO arm holds TPOT P99 <= {fig.target_ms:g} ms where a fixed weight can",
            marks[held],
            "-" if slo is None else f"{slo.violations} of {len(slo.windows)} windows above",
        ],
        [
            "its Turn 2+ TTFT is below the lowest fixed w_tpot that holds the target",
            marks[kept],
            "-"
            if slo is None or hold is None
            else f"{ms(slo.ttft_ms)} vs {ms(hold.ttft_ms)} ms ({hold.name})",
        ],
    ]


def _holds(window: Window, fig: SloFigures) -> bool:
    return window.tpot_p99_ms is not None and window.tpot_p99_ms <= fig.target_ms


def _drawing(settings: SloSettings, fig: SloFigures) -> Callable[[Any], None]:
    def draw(axes: Any) -> None:
        for ax, attr, label in (
            (axes[0], "tpot_p99_ms", f"TPOT P99 (all turns) per {settings.window_s:g} s (ms)"),
            (axes[1], "ttft_ms", f"mean Turn 2+ TTFT per {settings.window_s:g} s (ms)"),
        ):
            for arm in fig.arms:
                pts = [(w.start + settings.window_s / 2, getattr(w, attr)) for w in arm.windows]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker=".", label=arm.name)
            if attr == "tpot_p99_ms":
                ax.axhline(fig.target_ms, color="black", linestyle=":", label="target")
            ax.set_xlabel("arrival time (s)")
            ax.set_ylabel(label)
            twin = ax.twinx()
            twin.step(
                [k * settings.step_s for k in range(len(settings.levels) + 1)],
                [*settings.levels, settings.levels[-1]],
                where="post",
                color="lightgray",
            )
            twin.set_ylabel("QPS (gray)")
            ax.legend(loc="upper left", fontsize=7)

    return draw


def run_slo(
    settings: SloSettings, out: Path, *, progress: Callable[[str], None] | None = None
) -> tuple[SloFigures, Path]:
    """Run the arms into ``out`` (records per arm) and write ``slo.md``, ``slo.png`` and ``slo.json``."""
    say = progress or (lambda _line: None)
    table = settings.table or find_table(settings.tables, settings.shape, settings.model)
    if table is None:
        raise FileNotFoundError(f"no table {settings.shape}/{settings.model} under {settings.tables}")
    conversations = ramp_conversations(settings.workloads, settings.levels, settings.step_s, settings.seed)
    names = [f"{_FIXED}{w:g}" for w in settings.fixed_w_tpot] + (["slo"] if settings.run_slo_arm else [])
    notes = [f"table: {table}; cells looked up at {settings.target_qps or max(settings.levels):g} QPS"]
    if settings.run_slo_arm:
        c = slo_config(settings)
        notes.append(
            f"controller: TPOT P99 target {c.tpot_p99_ms:g} ms over {c.window_s:g} s, step x{1 + c.step:g} "
            f"every {c.interval_s:g} s, w_tpot {c.w_tpot_min:g}..{c.w_tpot_max:g}, hysteresis "
            f"{c.hysteresis:g}, min samples {c.min_samples}"
        )
    arms = []
    for name in names:
        say(f"arm {name}: {len(conversations)} conversations on {settings.shape} ...")
        records = run_arm(name, settings, conversations, table)
        slug = name.replace(" ", "_").replace("=", "")
        write_records(out / "records" / f"{slug}.jsonl", [Record.from_dict(r) for r in records])
        arms.append(_arm_figures(name, records, settings))
    fig = SloFigures(settings.tpot_p99_ms, tuple(arms))
    caption = (
        f"virtual-time cluster {settings.shape}, {settings.profile}, seed {settings.seed}; mix "
        f"{'+'.join(settings.workloads)}; ramp {','.join(f'{q:g}' for q in settings.levels)} QPS, "
        f"{settings.step_s:g} s each; TPOT P99 target {settings.tpot_p99_ms:g} ms"
    )
    lines = ["## SLO controller: fixed weights vs TPOT P99 target on a load ramp", ""]
    lines += [f"What was run: {caption}.", "", *[f"- {n}" for n in notes], ""]
    lines += md_table(["goal", "result", "measured"], _goals(fig))
    rows = [
        [a.name, ms(a.ttft_ms), ms(a.tpot_p99_ms), f"{a.violations}/{len(a.windows)}", str(a.failed)]
        for a in arms
    ]
    lines += md_table(
        ["arm", "Turn 2+ TTFT (ms)", "TPOT P99, all turns (ms)", "windows above target", "failed"], rows
    )
    out.mkdir(parents=True, exist_ok=True)
    save_png(out / PNG_NAME, "TPOT P99 and TTFT over a load ramp", caption, _drawing(settings, fig), panels=2)
    lines += [f"![slo]({PNG_NAME})", ""]
    path = out / SECTION_NAME
    path.write_text("\n".join(lines), encoding="utf-8")
    (out / "slo.json").write_text(json.dumps(dataclasses.asdict(fig), indent=2) + "\n", encoding="utf-8")
    return fig, path


# ---------------------------------------------------------------------------------------- the command


def _command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    del environ
    d = SloSettings()
    settings = SloSettings(
        shape=args.shape,
        workloads=tuple(x.strip() for x in args.workloads.split(",") if x.strip())
        if args.workloads
        else d.workloads,
        levels=args.levels,
        step_s=args.step,
        target_qps=args.target_qps,
        tpot_p99_ms=args.tpot_p99_ms,
        window_s=args.window,
        fixed_w_tpot=args.fixed_w_tpot,
        controller_step=args.controller_step,
        controller_interval_s=args.controller_interval,
        controller_min_samples=args.controller_min_samples,
        run_slo_arm=not args.no_slo_arm,
        seed=args.seed,
        tables=args.tables,
        table=args.table,
    )

    fig, path = run_slo(settings, args.out, progress=progress_printer(args.no_progress))
    print_section("slo", path, _goals(fig))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``slo`` subcommand of ``ppd-bench``."""
    d = SloSettings()
    parser = add_experiment_parser(
        sub,
        "slo",
        help="fixed weights vs the SLO controller on a load ramp, on the virtual-time simulator",
        description="Runs one seeded mix of synthetic two-turn workloads up and down a load ramp through "
        "the virtual-time cluster in mode ppd: one arm per fixed w_tpot and one with the SLO controller "
        "driving w_tpot from the windowed TPOT P99. Writes slo.md (a report section), slo.png (P99 over "
        "time), slo.json and each arm's records into --out.",
        shape=d.shape,
        seed=d.seed,
    )
    parser.add_argument("--workloads", default=None, help=f"the mix (default {','.join(d.workloads)})")
    parser.add_argument(
        "--levels", type=positive_list, default=d.levels,
        help=f"QPS of each ramp step (default {','.join(f'{q:g}' for q in d.levels)})",
    )  # fmt: skip
    parser.add_argument(
        "--step", type=positive, default=d.step_s, help=f"seconds per step (default {d.step_s:g})"
    )
    parser.add_argument(
        "--target-qps", type=positive, default=None, help="QPS of the table lookup (default peak)"
    )
    parser.add_argument(
        "--tpot-p99-ms", type=positive, default=d.tpot_p99_ms, help=f"the target (default {d.tpot_p99_ms:g})"
    )
    parser.add_argument(
        "--window", type=positive, default=d.window_s, help=f"P99 window, s (default {d.window_s:g})"
    )
    parser.add_argument(
        "--fixed-w-tpot", type=positive_list, default=d.fixed_w_tpot,
        help=f"one fixed-weights arm per w_tpot (default {','.join(f'{w:g}' for w in d.fixed_w_tpot)})",
    )  # fmt: skip
    parser.add_argument(
        "--controller-step", type=positive, default=d.controller_step,
        help=f"the controller's relative step of w_tpot (default {d.controller_step:g}: x2)",
    )  # fmt: skip
    parser.add_argument(
        "--controller-interval", type=positive, default=d.controller_interval_s,
        help=f"seconds between the controller's moves (default {d.controller_interval_s:g})",
    )  # fmt: skip
    parser.add_argument(
        "--controller-min-samples", type=int, default=d.controller_min_samples,
        help=f"fewest samples in its window the controller acts on (default {d.controller_min_samples})",
    )  # fmt: skip
    parser.add_argument("--no-slo-arm", action="store_true", help="run the fixed arms only")
    parser.add_argument(
        "--tables", type=Path, default=d.tables, help="where the table is found (default tables/)"
    )
    parser.add_argument("--table", type=Path, default=None, help="the table file (default: from --tables)")
    parser.set_defaults(handler=_command)
