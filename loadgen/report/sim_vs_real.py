"""``ppd-bench sim-vs-real``: the runs of ``ppd-vllm ppd-effect`` again, on the virtual-time simulator.

Every run of the folder's manifest is simulated with the same conversations (the manifest's ShareGPT
pool, same seed), the same arrivals (``ppd.arrivals`` seeded as the load generator seeds them), the same
mode, timeout and, for ppd, the same table, on a fitted profile (``ppd-vllm fit-profile``, link preset
``measured`` by default). The figures of both sides, and their ratios (simulated / real), go to stdout
and, through ``sim_vs_real_section``, into the report.

Rule 1: the simulated records go to ``<folder>/sim/<run_id>.jsonl`` with ``sim.json`` (profile, link);
        the section reads them back, so rendering never simulates.
Rule 2: goal: every ratio within 1 +- ``GOAL`` (the issue's +-25%); a figure missing on either side is
        "-", never a pass.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from loadgen.report.real_vllm import (
    MANIFEST_NAME,
    ModeFigures,
    RealVllmManifest,
    load_real_vllm,
    mode_figures,
)
from loadgen.report.section import md_table, ms, save_png
from loadgen.sharegpt import SHAREGPT_WORKLOAD, SharegptLimits, sharegpt_pool
from loadgen.tokens import llama3_counter
from ppd.arrivals import poisson_arrivals
from table_builder.records import Record, read_records, write_records

__all__ = [
    "GOAL",
    "METRICS",
    "add_parser",
    "comparison_rows",
    "ratio",
    "sim_vs_real_section",
    "simulate_runs",
]

GOAL: Final = 0.25
SIM_FOLDER: Final = "sim"
SIM_MANIFEST: Final = "sim.json"
#: (label, ModeFigures attribute) compared per run.
METRICS: Final = (
    ("Turn 2+ TTFT mean", "ttft_mean_ms"),
    ("Turn 2+ TTFT P90", "ttft_p90_ms"),
    ("TPOT mean", "tpot_mean_ms"),
    ("success", "success"),
    ("local share", "local_share"),
)


def ratio(sim: float | None, real: float | None) -> float | None:
    """sim / real; None when either is missing or real is 0 (then a ratio says nothing)."""
    if sim is None or real is None or real == 0:
        return None
    return sim / real


def _table(folder: Path, topology: str, model: str) -> Path | None:
    from decision_service.table import Table

    for path in sorted((folder / "tables").glob("*.ppdt")):
        table = Table.open(path)
        try:
            if table.key == f"{topology}/{model}":
                return path
        finally:
            table.close()
    return None


def simulate_runs(folder: Path, profile: str, link: str = "measured") -> dict[str, list[Record]]:
    """Rule 1: every run of the folder on the virtual-time simulator; also written under ``sim/``."""
    from simulator.core.cluster import ClusterConfig, simulate
    from simulator.core.profile import load_profile
    from simulator.core.routing import TableRouter
    from simulator.core.topology import Topology
    from simulator.core.workload import Conversation, Turn

    manifest, real = load_real_vllm(folder)
    limits = SharegptLimits(
        max_output_tokens=manifest.max_output_tokens, max_context_tokens=manifest.max_context_tokens
    )
    pool = sharegpt_pool(
        llama3_counter(),
        seed=manifest.seed,
        count=manifest.conversations,
        limits=limits,
        turns=manifest.turns,
    )
    loaded = load_profile(profile)
    out: dict[str, list[Record]] = {}
    for run in manifest.runs:
        first = real[run.run_id][0] if real[run.run_id] else None
        model = first.model if first is not None else "model"
        rng = random.Random(f"arrivals:{manifest.seed}")  # noqa: S311 - the load generator's seeding
        arrivals = poisson_arrivals(rng, run.qps, manifest.duration_s)
        conversations = [
            Conversation(
                f"{run.run_id}-{i}", SHAREGPT_WORKLOAD, start,
                tuple(Turn(t.n_in, t.n_out) for t in pool.conversation(i).turns),
            )
            for i, start in enumerate(arrivals)
        ]  # fmt: skip
        router = None
        if run.mode == "ppd":
            table = _table(folder, manifest.topology, model)
            if table is None:
                raise FileNotFoundError(f"no {manifest.topology}/{model} table under {folder / 'tables'}")
            router = TableRouter.open(str(table))
        config = ClusterConfig(
            topology=Topology.parse(manifest.topology), mode=run.mode, link=link, target_qps=run.qps,
            run_id=run.run_id, model=model, timeout_s=manifest.timeout_s,
        )  # fmt: skip
        records = [Record.from_dict(r) for r in simulate(loaded, config, conversations, router).records]
        write_records(folder / SIM_FOLDER / f"{run.run_id}.jsonl", records)
        out[run.run_id] = records
    (folder / SIM_FOLDER / SIM_MANIFEST).write_text(
        json.dumps({"profile": profile, "link": link, "profile_name": loaded.name}) + "\n", encoding="utf-8"
    )
    return out


def _value(fig: ModeFigures, attr: str) -> float | None:
    value: float | None = getattr(fig, attr)
    return value


def _fmt(attr: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.0f}%" if attr in ("success", "local_share") else ms(value)


def comparison_rows(
    manifest: RealVllmManifest, real: Mapping[str, Sequence[Record]], sim: Mapping[str, Sequence[Record]]
) -> tuple[list[list[str]], int, int]:
    """One row per run and metric: real, simulated, ratio, within the goal; and (within, compared)."""
    rows: list[list[str]] = []
    within = compared = 0
    for run in sorted(manifest.runs, key=lambda r: (r.qps, ("pd", "local", "ppd").index(r.mode))):
        r_fig, s_fig = mode_figures(real[run.run_id]), mode_figures(sim.get(run.run_id, []))
        for label, attr in METRICS:
            if attr == "local_share" and run.mode != "ppd":
                continue
            r_val, s_val = _value(r_fig, attr), _value(s_fig, attr)
            q = ratio(s_val, r_val)
            ok = q is not None and abs(q - 1) <= GOAL
            compared += q is not None
            within += ok
            mark = "-" if q is None else ("yes" if ok else "no")
            rows.append(
                [run.level, f"{run.qps:g}", run.mode, label, _fmt(attr, r_val), _fmt(attr, s_val),
                 "-" if q is None else f"{q:.2f}", mark]
            )  # fmt: skip
    return rows, within, compared


def _load_sim(folder: Path, manifest: RealVllmManifest) -> tuple[dict[str, list[Record]], dict[str, Any]]:
    sim_dir = folder / SIM_FOLDER
    about: dict[str, Any] = json.loads((sim_dir / SIM_MANIFEST).read_text("utf-8"))
    records = {
        run.run_id: read_records([sim_dir / f"{run.run_id}.jsonl"])
        for run in manifest.runs
        if (sim_dir / f"{run.run_id}.jsonl").exists()
    }
    return records, about


def sim_vs_real_section(folder: Path, out: Path) -> list[str]:
    """The side-by-side table and ``sim_vs_real.png``; nothing when the folder has no simulated runs."""
    if not (folder / SIM_FOLDER / SIM_MANIFEST).exists():
        return []
    manifest, real = load_real_vllm(folder)
    sim, about = _load_sim(folder, manifest)
    rows, within, compared = comparison_rows(manifest, real, sim)
    caption = (
        f"real: {manifest.caption()}; simulated: virtual-time cluster simulation (simulator.core.cluster), "
        f"profile {about.get('profile_name')}, link {about.get('link')}; same seed, arrivals and "
        "conversations"
    )
    _draw(manifest, real, sim, out, caption)
    return [
        "## The simulator against real vLLM",
        "",
        f"What was compared: {caption}. Ratio = simulated / real; goal within +-{100 * GOAL:.0f}%. "
        f"Rerun: `ppd-bench sim-vs-real --real {folder.name} --profile {about.get('profile')}`.",
        "",
        *md_table(["level", "QPS", "mode", "figure", "real", "simulated", "ratio", "within goal"], rows),
        f"Within +-{100 * GOAL:.0f}%: {within} of {compared} figures compared.",
        "",
        "![simulated vs real](sim_vs_real.png)",
        "",
    ]


def _draw(
    manifest: RealVllmManifest,
    real: Mapping[str, Sequence[Record]],
    sim: Mapping[str, Sequence[Record]],
    out: Path,
    caption: str,
) -> None:
    colours = {"pd": "tab:blue", "local": "tab:orange", "ppd": "tab:green"}

    def draw(axes: Any) -> None:
        for ax, (label, attr) in zip(axes, (METRICS[0], METRICS[2]), strict=True):
            top = 0.0
            for run in manifest.runs:
                r_val = _value(mode_figures(real[run.run_id]), attr)
                s_val = _value(mode_figures(sim.get(run.run_id, [])), attr)
                if r_val is None or s_val is None:
                    continue
                top = max(top, r_val, s_val)
                ax.scatter([r_val], [s_val], color=colours.get(run.mode, "tab:gray"), label=run.mode)
            if top > 0:
                ax.plot([0, top], [0, top], color="black", linewidth=0.8)
                ax.fill_between(
                    [0, top], [0, top * (1 - GOAL)], [0, top * (1 + GOAL)], alpha=0.15, color="gray"
                )
            ax.set(xlabel=f"real {label} (ms)", ylabel=f"simulated {label} (ms)")
            handles, labels = ax.get_legend_handles_labels()
            unique = dict(zip(labels, handles, strict=True))
            if unique:
                ax.legend(unique.values(), unique.keys())

    out.mkdir(parents=True, exist_ok=True)
    save_png(out / "sim_vs_real.png", "Simulator vs real vLLM (per run)", caption, draw, panels=2)


def _command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    del environ
    simulate_runs(args.real, args.profile, args.link)
    manifest, real = load_real_vllm(args.real)
    sim, _ = _load_sim(args.real, manifest)
    rows, within, compared = comparison_rows(manifest, real, sim)
    print(f"real: {manifest.caption()}")
    print(f"simulated: profile {args.profile}, link {args.link}; ratio = simulated / real")
    print(
        "\n".join(
            md_table(["level", "QPS", "mode", "figure", "real", "simulated", "ratio", "within goal"], rows)
        )
    )
    print(f"within +-{100 * GOAL:.0f}%: {within} of {compared}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``sim-vs-real`` subcommand of ``ppd-bench``."""
    parser = sub.add_parser(
        "sim-vs-real",
        help="simulate a ppd-vllm ppd-effect folder's runs and print simulated / real ratios",
        description="Runs every run of a `ppd-vllm ppd-effect` folder on the virtual-time simulator with "
        "the same conversations, arrivals, modes and table, on the given profile; prints Turn 2+ TTFT "
        "mean and P90, TPOT mean, success and the ppd local share side by side with their ratios "
        "(goal within +-25%), and writes the simulated records under FOLDER/sim/ for `ppd-bench report "
        "--real-vllm FOLDER`.",
    )
    parser.add_argument(
        "--real", type=Path, required=True, help=f"a ppd-vllm ppd-effect --out folder (with {MANIFEST_NAME})"
    )
    parser.add_argument(
        "--profile", default="tiny-llama-cpu", help="simulator profile, name or path (default tiny-llama-cpu)"
    )
    parser.add_argument("--link", default="measured", help="link preset of the profile (default measured)")
    parser.set_defaults(handler=_command)
