"""What the Kubernetes tests compare a picker container's arguments with: `ppd-gateway picker --help`."""

from __future__ import annotations

import functools
import re
import subprocess
import sys

__all__ = ["flags", "picker_help_flags"]


def flags(args: list[str]) -> dict[str, str]:
    """The `--name=value` arguments (the form our manifests use) as a mapping."""
    return dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)


@functools.cache
def picker_help_flags() -> frozenset[str]:
    """The long options `ppd-gateway picker --help` lists."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "picker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return frozenset(re.findall(r"(--[a-z][a-z-]*)", result.stdout))
