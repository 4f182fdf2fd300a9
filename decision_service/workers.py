"""Several server processes on one gRPC port (SO_REUSEPORT): the kernel spreads connections.

The parent starts worker 0 (which resolves port 0), then the others on the port it bound, each a
plain `python -m decision_service serve --workers 1 --reuse-port` with its own metrics port. It
announces `{"grpc": P, "metrics": M0, "workers": [{"pid": ..., "metrics": ...}, ...]}`, forwards
SIGTERM/SIGINT/SIGHUP to every worker, and stops them all when one dies.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from types import FrameType
from typing import IO

from decision_service.settings import Settings

__all__ = ["run_workers", "worker_command"]

logger = logging.getLogger(__name__)


def worker_command(settings: Settings, *, port: int, metrics_port: int) -> list[str]:
    command = [
        sys.executable, "-m", "decision_service", "serve",
        "--tables", str(settings.tables_dir),
        "--host", settings.host,
        "--port", str(port),
        "--metrics-host", settings.metrics_host,
        "--metrics-port", str(metrics_port),
        "--reload-interval", repr(settings.reload_interval_s),
        "--grace", repr(settings.grace_s),
        "--max-batch-items", str(settings.max_batch_items),
        "--max-message-bytes", str(settings.max_message_bytes),
        "--keepalive-min-ping-interval", repr(settings.keepalive_min_ping_interval_s),
        "--workers", "1",
        "--reuse-port",
        "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()),
    ]  # fmt: skip
    if settings.default_key is not None:
        command += ["--default-key", settings.default_key]
    return command


def _ports(stdout: IO[str] | None) -> dict[str, int]:
    line = stdout.readline() if stdout is not None else ""
    if not line:
        raise RuntimeError("a worker exited before it announced its ports (see its log above)")
    ports: dict[str, int] = json.loads(line)
    return ports


def run_workers(settings: Settings, announce: Callable[[Mapping[str, object]], None]) -> int:
    """Run `settings.workers` server processes until a signal stops them; the exit status."""
    workers: list[subprocess.Popen[str]] = []
    stopping = False

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = stopping or signum != signal.SIGHUP
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    try:
        first = subprocess.Popen(
            worker_command(settings, port=settings.port, metrics_port=settings.metrics_port),
            stdout=subprocess.PIPE,
            text=True,
        )
        workers.append(first)
        head = _ports(first.stdout)
        described = [{"pid": first.pid, "metrics": head["metrics"]}]
        for _ in range(settings.workers - 1):
            worker = subprocess.Popen(
                worker_command(settings, port=head["grpc"], metrics_port=0), stdout=subprocess.PIPE, text=True
            )
            workers.append(worker)
            described.append({"pid": worker.pid, "metrics": _ports(worker.stdout)["metrics"]})
    except (RuntimeError, ValueError, KeyError) as exc:
        logger.error("could not start %d workers: %s", settings.workers, exc)
        forward(signal.SIGTERM, None)
        for worker in workers:
            worker.wait()
        return 1
    announce({"grpc": head["grpc"], "metrics": head["metrics"], "workers": described})
    status = 0
    remaining = list(workers)
    while remaining:
        finished = _wait_any(remaining)
        remaining.remove(finished)
        if finished.returncode != 0:
            status = 1
        if not stopping:
            logger.error(
                "worker %d exited unexpectedly (status %d); stopping the others",
                finished.pid,
                finished.returncode,
            )
            status = 1
            forward(signal.SIGTERM, None)
    return status


def _wait_any(workers: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    while True:
        for worker in workers:
            try:
                worker.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            return worker
