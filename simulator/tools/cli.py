"""``ppd-sim`` / ``python -m simulator``: one argparse sub-command per entry of ``COMMANDS``.

To add a sub-command, write ``def add_<name>(subparsers) -> None`` that creates its parser and sets
``func`` (a callable taking the parsed ``argparse.Namespace`` and returning an exit code), or a
``_ModuleCommand`` for a module with ``add_arguments``/``run_from_args``, and list it in
``_registry()``. Only this module reads ``argv``.

The benchmarks of the simulator (``bench-virtual``, ``bench-realtime``) live in the dev-tooling package
``benchmarks/``, which imports the simulator; this module never imports it (that would be a cycle).
They are found by name in the entry-point group ``ppd_sim.commands`` (pyproject.toml), so the command
lines stay ``ppd-sim bench-virtual ...`` while the dependency points one way only.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["build_parser", "main"]

Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _add_calibrate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "calibrate",
        help="print the interference micro-benchmark and KV transfer figures, target vs model",
        description="Reproduce docs/emulator-model.md 3.1/3.4 in virtual time and print target vs model. "
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
        from simulator.tools.calibrate import run_calibration

        return run_calibration(args.profile, as_json=args.json, raw=args.raw, out=sys.stdout)

    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class _ModuleCommand:
    """A sub-command whose module brings its own ``add_arguments(parser)`` and ``run_from_args(args)``."""

    name: str
    help: str
    description: str
    module: str
    # True: ``module`` names an entry point of the group ``ppd_sim.commands``, not a module path.
    plugin: bool = False

    def __call__(self, sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        p = sub.add_parser(self.name, help=self.help, description=self.description)
        module = _plugin(self.module) if self.plugin else importlib.import_module(self.module)
        module.add_arguments(p)
        p.set_defaults(func=module.run_from_args)


_PLUGIN_GROUP = "ppd_sim.commands"


def _plugin(name: str) -> Any:
    """The module registered as ``name`` in the entry-point group ``ppd_sim.commands``."""
    found = importlib.metadata.entry_points(group=_PLUGIN_GROUP, name=name)
    if not found:
        raise SystemExit(f"ppd-sim: no {name!r} in entry points {_PLUGIN_GROUP!r}; run pip install -e .")
    return next(iter(found)).load()


_BENCH_VIRTUAL = _ModuleCommand(
    "bench-virtual",
    "measure simulated requests per CPU-second of the virtual-time cluster simulation",
    "Run two-turn conversations through the virtual-time cluster sim and print throughput.",
    "bench-virtual",
    plugin=True,
)
_BUILD_NATIVE = _ModuleCommand(
    "build-native",
    "compile the virtual-time core with mypyc into a folder to put on PYTHONPATH (about 2x faster)",
    "Copy the simulator package to OUT/simulator and compile its hot modules there with "
    "mypyc; run with PYTHONPATH=OUT to use them. Prints one JSON line.",
    "simulator.tools.native_build",
)
_BENCH_REALTIME = _ModuleCommand(
    "bench-realtime",
    "measure step timing error and CPU of a 1P3D cluster process under streaming load",
    "Host a 1P3D cluster in this process, stream from a client process, print step lateness "
    "percentiles and the cluster's CPU share.",
    "bench-realtime",
    plugin=True,
)


def _registry() -> list[Registrar]:
    from simulator.server.serve_cli import add_cluster, add_worker

    return [_add_calibrate, _BENCH_VIRTUAL, _BUILD_NATIVE, add_worker, add_cluster, _BENCH_REALTIME]


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
