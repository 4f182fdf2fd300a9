"""An optional compiled copy of the virtual-time simulation core (mypyc), for benchmarks and long sweeps.

``ppd-sim build-native [--out build/native]`` copies the ``simulator`` package to ``OUT/simulator`` and
compiles the modules of ``NATIVE_MODULES`` (all in ``simulator/core/``) there with mypyc (it ships with
mypy, a dev dependency; it needs a C compiler). The source tree is not touched, and nothing changes
unless a run puts ``OUT`` first on ``PYTHONPATH``::

    ppd-sim build-native && PYTHONPATH=build/native ppd-sim bench-virtual

Rules:
1. The compiled modules are the same typed source, so a run gives the same records, byte for byte
   (``tests/simulator/tools/test_native_build.py``); only the speed changes (about 2x).
2. The copy is a snapshot: rebuild after changing the simulator. ``bench-virtual`` prints which core
   it ran (``core=native``, ``core=interpreted``, or ``core=native-stale`` with a warning when the
   source it was built from has changed since: ``native_state``). A sweep run on a stale copy names
   the copy's fingerprint in its tables, so ``tests/table_builder/test_shipped_tables.py`` catches it.
3. For virtual-time runs only: compiled classes cannot be monkeypatched, which some real-time tests do.

The command prints one JSON line: ``{"out": ..., "modules": [...], "pythonpath": ...}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from simulator.tools.fingerprint import PACKAGE_ROOT, source_fingerprint

__all__ = [
    "NATIVE_MODULES",
    "SOURCE_NOTE",
    "add_arguments",
    "build",
    "is_native",
    "native_state",
    "run_from_args",
]

log = logging.getLogger(__name__)

# The modules simulate() spends its time in (see simulator/README.md, "Virtual time"), all in the
# pure core: ``simulator.core.<name>``.
NATIVE_MODULES = ("kv_cache", "cost", "engine", "link", "cluster")
_CORE = "core"

#: Written into the compiled copy: the source folder it was made from (to detect a stale copy).
SOURCE_NOTE = "native_source.txt"


def is_native() -> bool:
    """Whether the engine module in use is a compiled one."""
    from simulator.core import engine

    return not (engine.__file__ or "").endswith(".py")


def native_state() -> str:
    """``interpreted``, ``native``, or ``native-stale`` (the source it was built from has changed)."""
    if not is_native():
        return "interpreted"
    note = PACKAGE_ROOT / SOURCE_NOTE
    try:
        source = Path(note.read_text(encoding="utf-8").strip())
    except OSError:
        return "native"
    if source.is_dir() and source_fingerprint(source) != source_fingerprint(PACKAGE_ROOT):
        log.warning(
            "the compiled simulator in %s is older than its source %s: rerun `ppd-sim build-native`",
            PACKAGE_ROOT.parent,
            source,
        )
        return "native-stale"
    return "native"


def build(out: Path) -> list[Path]:
    """Copy the package to ``out/simulator`` and compile ``NATIVE_MODULES`` there; returns the built files.

    Raises ``RuntimeError`` (with mypyc's output) when the compilation fails.
    """
    out = out.resolve()
    target = out / "simulator"
    # A rebuild starts clean: the package copy, mypyc's shared runtime module and its build folder.
    for stale in (target, out / "build"):
        if stale.exists():
            shutil.rmtree(stale)
    for runtime in out.glob("*__mypyc*"):
        runtime.unlink()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(
        PACKAGE_ROOT, target, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", SOURCE_NOTE)
    )
    (target / SOURCE_NOTE).write_text(f"{PACKAGE_ROOT}\n", encoding="utf-8")
    env = dict(os.environ)
    # mypyc type-checks the copy; the rest of the project (imports of the simulator) comes from here.
    env["MYPYPATH"] = str(PACKAGE_ROOT.parent)
    sources = [f"simulator/{_CORE}/{name}.py" for name in NATIVE_MODULES]
    log.info("compiling %s into %s", ", ".join(NATIVE_MODULES), target)
    proc = subprocess.run(
        [sys.executable, "-m", "mypyc", *sources],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"mypyc failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    built = sorted(p for name in NATIVE_MODULES for p in (target / _CORE).glob(f"{name}.*.so"))
    if len(built) != len(NATIVE_MODULES):
        raise RuntimeError(f"mypyc built {len(built)} of {len(NATIVE_MODULES)} modules:\n{proc.stdout}")
    return built


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", default="build/native", help="folder to put first on PYTHONPATH (default build/native)"
    )


def run_from_args(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        built = build(out)
    except (RuntimeError, OSError) as exc:
        log.error("native build failed: %s", exc)
        return 1
    line = {"out": str(out), "modules": [p.name for p in built], "pythonpath": str(out.resolve())}
    sys.stdout.write(json.dumps(line) + "\n")
    return 0
