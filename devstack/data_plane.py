"""``ppd-up --data-plane envoy``: Envoy carries the traffic and streams every answer, and
``ppd-gateway picker`` (our service, on the same generated config the gateway would read) is its ext_proc
endpoint picker: the scenario of ``deploy/envoy/picker``, its ``envoy.yaml`` rendered here (or, for
the router benchmark, its GIE-style ``envoy-gie.yaml``: the same placeholders).

Rule 1: Envoy's ORIGINAL_DST cluster connects to the ``ip:port`` the picker names and resolves no
        names, so every worker of the cluster's ready line must be addressed by an IP address; one that
        is not is refused before the picker starts (``ValueError`` naming it).
Rule 2: the picker is ready when it announces ``{"grpc", "metrics"}`` and its ``/health`` answers 200
        (it sees a live decode worker); Envoy when its admin interface reports the picker healthy
        (gRPC health checks). Only then is the stack announced, with Envoy's listener as its URL.
"""

from __future__ import annotations

import ipaddress
import string
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from devstack.replicas import http_get, on_loopback, poll, run_envoy
from devstack.supervisor import ChildError, ChildSpec, Supervisor

__all__ = [
    "PICKER_ENVOY_TEMPLATE",
    "PICKER_GIE_ENVOY_TEMPLATE",
    "check_addressed_by_ip",
    "picker_envoy_config",
    "start_picker_and_envoy",
]

#: Envoy in front of the workers, the picker its ext_proc service (its ${...} placeholders filled here).
PICKER_ENVOY_TEMPLATE = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / "picker" / "envoy.yaml"
#: The same with GIE's processing mode (bodies FULL_DUPLEX_STREAMED both ways: every answer chunk
#: crosses the picker); the same placeholders.
PICKER_GIE_ENVOY_TEMPLATE = PICKER_ENVOY_TEMPLATE.with_name("envoy-gie.yaml")


def check_addressed_by_ip(workers: Sequence[Mapping[str, Any]]) -> None:
    """Rule 1: a ``ValueError`` naming the first worker whose URL's host is not an IP address."""
    for worker in workers:
        url = str(worker.get("url", ""))
        try:
            ipaddress.ip_address(urlsplit(url).hostname or "")
        except ValueError:
            raise ValueError(
                f"worker {worker.get('id')} is addressed by name ({url}); Envoy's ORIGINAL_DST cluster "
                "connects to the ip:port the picker names and resolves no names"
            ) from None


def picker_envoy_config(*, port: int, picker_grpc: int, template: Path = PICKER_ENVOY_TEMPLATE) -> str:
    """deploy/envoy/picker/envoy.yaml (or `template`) with its listener on 127.0.0.1:`port` (0: any),
    its admin on a free port and the picker's gRPC port."""
    values = {"LISTEN_PORT": str(port), "ADMIN_PORT": "0", "PICKER_PORT": str(picker_grpc)}
    return on_loopback(string.Template(template.read_text(encoding="utf-8")).substitute(values))


async def start_picker_and_envoy(
    picker_argv: tuple[str, ...],
    envoy_argv: Callable[[Path, Path], tuple[str, ...]],
    supervisor: Supervisor,
    folder: Path,
    *,
    port: int,
    timeout_s: float,
    template: Path = PICKER_ENVOY_TEMPLATE,
) -> tuple[str, dict[str, Any]]:
    """Rule 2: the picker, then Envoy on `port` in front of it (its config rendered from `template`);
    Envoy's URL and the picker's ready line (raises ChildError)."""
    picker = await supervisor.start(ChildSpec("picker", picker_argv, timeout_s))
    grpc_port, metrics_port = picker.ready.get("grpc"), picker.ready.get("metrics")
    if type(grpc_port) is not int or type(metrics_port) is not int:
        raise ChildError("picker", f"ready line has no integer 'grpc' and 'metrics' ports: {picker.ready}")
    health = f"http://127.0.0.1:{metrics_port}/health"
    await poll(lambda: bool(http_get(health)), picker, timeout_s, "see a live decode worker", thread=True)
    url = await run_envoy(
        envoy_argv,
        supervisor,
        folder,
        config=picker_envoy_config(port=port, picker_grpc=grpc_port, template=template),
        listener="picker",
        cluster="picker",
        hosts=1,
        timeout_s=timeout_s,
    )
    return url, picker.ready
