"""`python -m decision_service serve` as a real child process, for the process-level tests."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


def read_line(process: subprocess.Popen[str], *, timeout_s: float) -> str:
    """One stdout line, or fail after `timeout_s` (the process may be stuck or dead)."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no line on stdout within {timeout_s} s")
            if selector.select(remaining):
                return process.stdout.readline()


@contextmanager
def serve_process(tables: Path, *extra: str, timeout_s: float = 60.0) -> Iterator[ServeProcess]:
    command = [
        sys.executable, "-m", "decision_service", "serve",
        "--tables", str(tables), "--port", "0", "--metrics-port", "0", *extra,
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = read_line(process, timeout_s=timeout_s)
        if not line:
            _, stderr = process.communicate(timeout=timeout_s)
            raise AssertionError(f"serve exited with {process.returncode} before announcing ports:\n{stderr}")
        served = ServeProcess(process, json.loads(line))
        yield served
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=timeout_s)
