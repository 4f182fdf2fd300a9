"""Running one of our benchmark scripts at a CI size, as a user would (`python -m benchmarks.X`)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["run_benchmark"]

REPO = Path(__file__).resolve().parents[2]


def run_benchmark(module: str, args: Sequence[str], *, timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """The JSON figures (one per stdout line) of ``python -m module args``; a failed run fails the test.
    The figures are echoed, so ``pytest -s`` shows them."""
    out = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    )
    sys.stdout.write(out.stdout)
    return [json.loads(line) for line in out.stdout.splitlines()]
