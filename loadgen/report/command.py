"""The ``ppd-bench report`` command line: its flags, the optional ``--run`` on the simulator, then the report.

``reproduce`` makes the records, ``report`` renders them; this module only reads the arguments and
calls the two.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from loadgen.arguments import names, positive_list, positive_list_or_none
from loadgen.report.placement import placement_file
from loadgen.report.report import load_inputs, write_report

__all__ = ["add_parser"]


def _run_simulation(args: argparse.Namespace) -> None:
    from loadgen.report.reproduce import ReproduceSettings, reproduce

    settings = ReproduceSettings(
        seed=args.seed,
        duration_s=args.duration,
        workload=args.workload,
        shapes=args.shapes,
        qps_levels=args.qps,
        tables=args.tables,
        stress_qps=args.stress_qps,
        wtpot_values=args.wtpot,
        paper_wtpot_values=args.paper_wtpot,
        paper_wtpot_qps=args.paper_wtpot_qps,
        link_duration_s=args.link_duration,
    )
    reproduce(settings, args.records, progress=not args.no_progress)
    if args.placement:
        from tqdm import tqdm

        from loadgen.report.placement import placement_runs, run_placement

        total = placement_runs(settings)
        with tqdm(total=total, unit="run", desc="placement", disable=args.no_progress) as bar:
            run_placement(settings, args.records, on_point=bar.update)


def _report(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    del environ
    if args.run:
        _run_simulation(args)
    inputs = load_inputs(args.records)
    path = write_report(
        inputs,
        args.out,
        shape=args.shape,
        real_vllm=args.real_vllm,
        placement=placement_file(args.records),
    )
    print(f"report: {path}")
    for line in path.read_text("utf-8").splitlines():
        if line.startswith("| ") and ("PASS" in line or "FAIL" in line or "n/a" in line):
            print(line)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``report`` subcommand of ``ppd-bench``."""
    parser = sub.add_parser(
        "report",
        help="write the Markdown reproduction report with PNG plots from benchmark records",
        description="Reads *.jsonl records (and manifest.json) under --records; writes report.md and PNGs "
        "to --out: Turn 2+ TTFT by mode across QPS (Table 1), P99 TTFT vs tokens/s (Figure 1), failure "
        "rates (Table 5), per-metric winners (Table 3), the w_tpot sweep (Figure 6, also in the paper's "
        "own setting), the link sweep (Figure 5), prefix against least-loaded placement of P (when --run "
        "made its figures), and the acceptance checks.",
    )
    parser.add_argument("--records", type=Path, required=True, help="folder of *.jsonl records")
    parser.add_argument("--out", type=Path, required=True, help="folder for report.md and the PNGs")
    parser.add_argument("--shape", default="1P3D", help="shape for the acceptance checks (default 1P3D)")
    parser.add_argument(
        "--real-vllm",
        type=Path,
        default=None,
        help="a `ppd-vllm ppd-effect --out` folder: adds the section 'PPD on real vLLM'",
    )
    run = parser.add_argument_group(
        "--run", "first produce the records on the virtual-time cluster simulation (into --records)"
    )
    run.add_argument("--run", action="store_true", help="run the QPS, w_tpot and link sweeps first")
    run.add_argument("--seed", type=int, default=0, help="seed of arrivals and conversations (default 0)")
    run.add_argument(
        "--duration", type=float, default=10.0, help="seconds of arrivals per point (default 10)"
    )
    run.add_argument("--workload", default="sharegpt", help="sharegpt or a synthetic name (default sharegpt)")
    run.add_argument("--shapes", type=names, default=("1P3D", "2P2D", "3P1D"), help="default 1P3D,2P2D,3P1D")
    run.add_argument(
        "--qps", type=positive_list, default=(0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0),
        help="QPS levels (default the paper's ten)",
    )  # fmt: skip
    run.add_argument(
        "--stress-qps",
        type=positive_list,
        default=(),
        help="extra QPS levels on 1P3D beyond the grid, e.g. 144,160,176",
    )
    run.add_argument("--tables", type=Path, default=Path("tables"), help="tables for ppd (default tables/)")
    run.add_argument(
        "--wtpot",
        type=positive_list,
        default=(1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0),
        help="w_tpot values of the sweep (default 1,4,16,...,4096)",
    )
    run.add_argument(
        "--paper-wtpot",
        type=positive_list_or_none,
        default=(1.0, 3.0, 6.0, 12.0, 24.0),
        help="w_tpot values of Figure 6 in the paper's setting: prefill-heavy ShareGPT conversations on "
        "1P3D (default 1,3,6,12,24; '' to skip)",
    )
    run.add_argument(
        "--paper-wtpot-qps", type=positive_list, default=(8.0, 16.0), help="its QPS levels (default 8,16)"
    )
    run.add_argument(
        "--link-duration", type=float, default=60.0, help="seconds per link-sweep point (default 60)"
    )
    run.add_argument(
        "--no-placement",
        dest="placement",
        action="store_false",
        help="skip the placement runs (prefix against least-loaded placement of P, mode pd, at every "
        "shape and QPS level, on ShareGPT and two shared-prefix workloads; the section 'Prefix-aware "
        "placement')",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=_report)
