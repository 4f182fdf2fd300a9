"""``ppd-up --data-plane envoy``: Envoy carries the traffic and streams every answer, and
``ppd-gateway picker`` (our service, on the same generated config the gateway would read) is its ext_proc
endpoint picker: the scenario of ``deploy/envoy/picker``, its ``envoy.yaml`` rendered here (or, for
the router benchmark, its GIE-style ``envoy-gie.yaml``: the same placeholders).

Rule 1: Envoy's workers cluster lists the workers by ``ip:port``, the picker names them so and
        nothing resolves names, so every worker of the cluster's ready line must be addressed by an IP
        address; one that is not is refused before the picker starts (``ValueError`` naming it).
Rule 2: Envoy's ``workers`` cluster lists the cluster's workers (``WORKER_ENDPOINTS``, filled by
        ``worker_localities``): decode workers and replicas at priority 0, where Envoy's fallback
        round robin (fail-open, or no destination) goes; prefill workers at priority 1, reached only
        when the picker names one (a pass-through request while no decode worker or replica is live).
Rule 3: ``failure_mode`` ``closed`` (the default) renders ``failure_mode_allow: false``: without the
        picker Envoy answers 500; ``open`` renders ``true``: Envoy sends the client's body unchanged to a
        decode worker (round robin), which prefills it locally.
Rule 4: the picker is ready when it announces ``{"grpc", "metrics"}`` and its ``/health`` answers 200
        (it sees a live decode worker); Envoy when its admin interface reports the picker healthy
        (gRPC health checks). Only then is the stack announced, with Envoy's listener as its URL.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import string
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from devstack.replicas import http_get, on_loopback, poll, run_envoy
from devstack.settings import DATA_PLANES
from devstack.supervisor import ChildError, ChildSpec, Supervisor

__all__ = [
    "FAILURE_MODES",
    "PICKER_ENVOY_TEMPLATE",
    "PICKER_GIE_ENVOY_TEMPLATE",
    "add_data_plane_arguments",
    "check_addressed_by_ip",
    "picker_envoy_config",
    "start_picker_and_envoy",
    "worker_localities",
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
                f"worker {worker.get('id')} is addressed by name ({url}); Envoy's workers cluster "
                "lists workers by ip:port, the picker names them so, and nothing resolves names"
            ) from None


#: Rule 3: what ``--picker-failure-mode`` accepts, and the ``failure_mode_allow`` each renders.
FAILURE_MODES: Final[Mapping[str, str]] = {"closed": "false", "open": "true"}
# Rule 2: the roles Envoy may pick by itself (priority 0), and those it reaches only when named.
_SERVING: Final = ("decode", "replica")


def add_data_plane_arguments(parser: argparse.ArgumentParser) -> None:
    """ppd-up's ``--data-plane`` and, for Envoy's, ``--picker-failure-mode`` (rule 3)."""
    parser.add_argument(
        "--data-plane",
        choices=DATA_PLANES,
        default="python",
        help="python (default): the gateway on --port relays every answer; envoy: Envoy on --port carries "
        "the traffic and streams every answer, `ppd-gateway picker` routing each request over ext_proc "
        "(deploy/envoy/picker; one picker, so not with --gateways N > 1; workers addressed by IP)",
    )
    parser.add_argument(
        "--picker-failure-mode",
        choices=tuple(FAILURE_MODES),
        default="closed",
        help="with --data-plane envoy, what Envoy does while the picker is down or its stream breaks: "
        "closed (default): answer 500; open: send the request unchanged to a decode worker (round robin), "
        "which prefills it locally (GIE's failureMode FailOpen)",
    )


def worker_localities(workers: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rule 2: the ``workers`` cluster's localities (``WORKER_ENDPOINTS``, as JSON: YAML flow text)."""

    def endpoint(worker: Mapping[str, Any]) -> dict[str, Any]:
        url = urlsplit(str(worker["url"]))
        address = {"address": url.hostname, "port_value": url.port or 80}
        return {"endpoint": {"address": {"socket_address": address}}}

    serving = [endpoint(w) for w in workers if w.get("role") in _SERVING]
    named_only = [endpoint(w) for w in workers if w.get("role") not in _SERVING]
    localities = [{"priority": 0, "lb_endpoints": serving}]
    if named_only:
        localities.append({"priority": 1, "lb_endpoints": named_only})
    return localities


def picker_envoy_config(
    *,
    port: int,
    picker_grpc: int,
    workers: Sequence[Mapping[str, Any]],
    failure_mode: str = "closed",
    template: Path = PICKER_ENVOY_TEMPLATE,
) -> str:
    """deploy/envoy/picker/envoy.yaml (or `template`) with its listener on 127.0.0.1:`port` (0: any),
    its admin on a free port, the picker's gRPC port, the workers (rule 2) and the failure mode
    (rule 3; envoy-gie.yaml always fails closed)."""
    values = {
        "LISTEN_PORT": str(port),
        "ADMIN_PORT": "0",
        "PICKER_PORT": str(picker_grpc),
        "WORKER_ENDPOINTS": json.dumps(worker_localities(workers)),
        "FAILURE_MODE_ALLOW": FAILURE_MODES[failure_mode],
    }
    return on_loopback(string.Template(template.read_text(encoding="utf-8")).substitute(values))


async def start_picker_and_envoy(
    picker_argv: tuple[str, ...],
    envoy_argv: Callable[[Path, Path], tuple[str, ...]],
    supervisor: Supervisor,
    folder: Path,
    *,
    port: int,
    timeout_s: float,
    workers: Sequence[Mapping[str, Any]],
    failure_mode: str = "closed",
    template: Path = PICKER_ENVOY_TEMPLATE,
) -> tuple[str, dict[str, Any]]:
    """Rule 4: the picker, then Envoy on `port` in front of it (its config rendered from `template`);
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
        config=picker_envoy_config(
            port=port,
            picker_grpc=grpc_port,
            workers=workers,
            failure_mode=failure_mode,
            template=template,
        ),
        listener="picker",
        cluster="picker",
        hosts=1,
        timeout_s=timeout_s,
    )
    return url, picker.ready
