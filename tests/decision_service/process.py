"""`python -m decision_service serve` as a real child process, for the process-level tests."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devstack.ready import start_ready


@dataclass
class ServeProcess:
    process: subprocess.Popen[str]
    ports: dict[str, Any]
    stdout_rest: str = ""

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def stop(self, *, timeout_s: float = 30.0) -> tuple[int, str]:
        """SIGTERM, then the exit status and everything it logged."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.stdout_rest, stderr = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, stderr


@contextmanager
def serve_process(tables: Path, *extra: str, timeout_s: float = 60.0) -> Iterator[ServeProcess]:
    command = [
        sys.executable, "-m", "decision_service", "serve",
        "--tables", str(tables), "--port", "0", "--metrics-port", "0", *extra,
    ]  # fmt: skip
    process, ports = start_ready(command, timeout_s=timeout_s, stderr=subprocess.PIPE, name="serve")
    try:
        yield ServeProcess(process, ports)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=timeout_s)
