"""Start our commands as real processes on port 0 and read the JSON line each prints when ready."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devstack.ready import ReadyLineError, start_ready

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 60.0


@dataclass
class Process:
    proc: subprocess.Popen[str]
    ready: dict[str, Any]
    stderr_path: Path

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def start(
    args: list[str],
    tmp: Path,
    name: str,
    *,
    ready_timeout_s: float = READY_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> Process:
    """`python -m <args>`; returns once the process printed its JSON line (or fails with its stderr)."""
    stderr_path = tmp / f"{name}.stderr"
    try:
        with open(stderr_path, "w") as err:
            proc, ready = start_ready(
                [sys.executable, "-m", *args],
                timeout_s=ready_timeout_s,
                stderr=err,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                cwd=REPO,
                name=name,
            )
    except ReadyLineError as exc:
        raise RuntimeError(
            f"{name} did not become ready ({exc}):\n{stderr_path.read_text(errors='replace')[-3000:]}"
        ) from None
    return Process(proc, ready, stderr_path)
