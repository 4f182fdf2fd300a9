"""How the suite behaves on the CI machine (`CI=true`): no skipped requirements, reproducible examples."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

import pytest

__all__ = ["CI_PROFILE", "hypothesis_profile", "require_tool", "running_in_ci"]

CI_PROFILE = "ci"
_FALSE = frozenset({"", "0", "false", "no", "off"})


def running_in_ci(environ: Mapping[str, str] | None = None) -> bool:
    """True when the `CI` variable is set to anything but an explicit false (`CI=true` on CI)."""
    env = os.environ if environ is None else environ
    return env.get("CI", "").strip().lower() not in _FALSE


def hypothesis_profile(environ: Mapping[str, str] | None = None) -> str:
    """The Hypothesis profile the suite loads: `ci` under CI, else Hypothesis' own default."""
    return CI_PROFILE if running_in_ci(environ) else "default"


def require_tool(name: str, why: str) -> None:
    """Skip the calling test when the executable `name` is missing; under CI, fail it instead, so that
    a CI machine without the tool cannot pass the suite with the test silently skipped."""
    if shutil.which(name) is not None:
        return
    message = f"`{name}` not found on PATH: {why}"
    if running_in_ci():
        pytest.fail(f"{message} (CI must provide it; skipping is not allowed under CI)", pytrace=False)
    pytest.skip(message)
