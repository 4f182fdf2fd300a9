"""A real Prometheus server for tests (Debian's `prometheus` package; `make test` installs it): its own
process on 127.0.0.1, its data in a fresh folder, stopped by the test that started it.

Prometheus takes no port 0 (`--web.listen-address` must name one), so `start()` asks the kernel for a
free port, releases it and lets Prometheus bind it; when another process took the port in that window,
Prometheus exits saying "address already in use" and `start()` tries again on a new port, up to
`tries` times. Any other exit fails at once with Prometheus' own log.

`query()` and `targets()` read its HTTP API (`/api/v1/query`, `/api/v1/targets`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_routers.targets import free_port
from tests.support.ci import require_tool
from tests.support.polling import wait_until

__all__ = ["PORT_IN_USE", "PrometheusServer"]

#: What Prometheus logs when its listen address is taken (Go's net error text).
PORT_IN_USE = "address already in use"


class _PortTakenError(Exception):
    pass


@dataclass
class PrometheusServer:
    folder: Path
    port: int
    proc: subprocess.Popen[bytes]
    #: Ports tried before this one, each lost to another process.
    lost_ports: tuple[int, ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls,
        config: Path,
        *,
        ports: Callable[[], int] = free_port,
        tries: int = 5,
        deadline_s: float = 60.0,
    ) -> PrometheusServer:
        """Prometheus on `config`, answering /-/ready; `ports` gives each try's port."""
        require_tool("prometheus", "the dashboard and alert tests run a real Prometheus (make prometheus)")
        folder = Path(tempfile.mkdtemp(prefix="ppd-prometheus-"))
        lost: list[int] = []
        try:
            for _ in range(tries):
                port = ports()
                try:
                    proc = _launch(config, folder, port, deadline_s)
                except _PortTakenError:
                    lost.append(port)
                    continue
                return cls(folder, port, proc, tuple(lost))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        shutil.rmtree(folder, ignore_errors=True)
        raise AssertionError(
            f"prometheus found every port it was given taken ({', '.join(map(str, lost))}); free some "
            "ports on 127.0.0.1 or raise `tries`"
        )

    def get(self, path: str, **params: str) -> Any:
        """The `data` of a Prometheus API answer (raises when its status is not success)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=30) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise AssertionError(f"prometheus answered {path} with {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (a vector's samples; empty: no data)."""
        data = self.get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self.get("/api/v1/targets", state="active")["activeTargets"]
        return active

    def log_tail(self) -> str:
        return _log_tail(self.folder)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)


def _log_tail(folder: Path) -> str:
    log = folder / "prometheus.log"
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def _launch(config: Path, folder: Path, port: int, deadline_s: float) -> subprocess.Popen[bytes]:
    """One try on `port`: the process once it answers /-/ready (_PortTakenError: it lost the port)."""
    data = folder / f"data-{port}"
    with (folder / "prometheus.log").open("ab") as log:
        proc = subprocess.Popen(
            [
                "prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h", "--log.level=info",
            ],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def ready() -> bool:
        # A short timeout, retried: a port another process took may accept and never answer.
        if proc.poll() is not None:
            return True
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    try:
        wait_until(
            ready, deadline_s=deadline_s, what=f"prometheus to answer /-/ready on port {port}", poll_s=0.1
        )
    except AssertionError as exc:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"{exc}; its log: {_log_tail(folder)}") from None
    if proc.poll() is not None:
        tail = _log_tail(folder)
        if _lost_port(tail, port):
            raise _PortTakenError
        raise AssertionError(f"prometheus exited with {proc.returncode} before it was ready: {tail}")
    return proc


def _lost_port(log: str, port: int) -> bool:
    """Whether the log's last lines say this try's listen address was taken."""
    return any(PORT_IN_USE in line and f":{port}" in line for line in log.splitlines()[-20:])
