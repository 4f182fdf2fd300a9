"""``ppd-sim`` / ``python -m simulator``: one argparse sub-command per entry of ``COMMANDS``.

To add a sub-command, write ``def add_<name>(subparsers) -> None`` that creates its parser and sets
``func`` (a callable taking the parsed ``argparse.Namespace`` and returning an exit code), and list
it in ``_registry()``. Only this module reads ``argv``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

__all__ = ["build_parser", "main"]

Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _add_calibrate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "calibrate",
        help="print the interference micro-benchmark and KV transfer figures, target vs model",
        description="Reproduce emulator-model.md 3.1/3.4 in virtual time and print target vs model. "
        "Exit status 1 when a figure is outside its tolerance.",
    )
    p.add_argument("--profile", default="llama-3.1-8b-h100", help="profile name or JSON path")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--raw",
        action="store_true",
        help="also check the model against the raw calibration data by batch size",
    )

    def run(args: argparse.Namespace) -> int:
        from simulator.calibrate import run_calibration

        return run_calibration(args.profile, as_json=args.json, raw=args.raw, out=sys.stdout)

    p.set_defaults(func=run)


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench-virtual",
        help="measure simulated requests per CPU-second of the virtual-time cluster simulation",
        description="Run two-turn conversations through the virtual-time cluster sim and print throughput.",
    )
    from simulator.bench_virtual import add_arguments, run_from_args

    add_arguments(p)
    p.set_defaults(func=run_from_args)


def _add_build_native(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "build-native",
        help="compile the virtual-time core with mypyc into a folder to put on PYTHONPATH (about 2x faster)",
        description="Copy the simulator package to OUT/simulator and compile its hot modules there with "
        "mypyc; run with PYTHONPATH=OUT to use them. Prints one JSON line.",
    )
    from simulator.native_build import add_arguments, run_from_args

    add_arguments(p)
    p.set_defaults(func=run_from_args)


def _registry() -> list[Registrar]:
    from simulator.serve_cli import add_bench_realtime, add_cluster, add_worker

    return [_add_calibrate, _add_bench, _add_build_native, add_worker, add_cluster, add_bench_realtime]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppd-sim", description="GPU-free stand-in for vLLM prefill/decode workers (simulator/)."
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in _registry():
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)
