"""The gateway's two front doors on one config, as the conformance tests start them.

- ``standalone``: ``gateway serve`` (aiohttp) relays every request and its answer.
- ``envoy``: ``gateway picker`` behind the real Envoy on deploy/envoy/picker/envoy.yaml: Envoy carries
  D's leg and streams the answer, the picker (the same request core) says where it goes.

Rule 1: both doors read the same TOML lines (the picker's with its observation share pinned to 0 unless
        they set `[log]`: no answer observed by chance); a test sees a ``FrontDoor``: the URL clients use, the
        router's own ``/metrics`` (the gateway's port, or the picker's metrics port) and its stderr.
Rule 2: a door is ready when its process announced itself and, for ``envoy``, the picker's ``/health``
        answers 200 (a live D) and Envoy reports the picker healthy; stopping it must end the router
        with exit status 0 (asserted when the ``running`` context exits).
Rule 3: the picker does not see the answer (docs/envoy-extproc.md): what it cannot do yet is marked
        where a test needs it, with ``PICKER_CANNOT`` naming the missing behaviour, never skipped.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from devstack.data_plane import worker_localities
from tests.conformance.workers import http
from tests.deploy.envoy_harness import Envoy
from tests.gateway.processes import Process, start
from tests.support.gateway_config import unobserved
from tests.support.metrics import sample
from tests.support.polling import wait_until

__all__ = ["FRONT_DOORS", "PICKER_CANNOT", "FrontDoor", "running"]

FRONT_DOORS: Final = ("standalone", "envoy")

#: Rule 3: the behaviours the picker lacks today (issue 25), as xfail reasons.
PICKER_CANNOT: Final[dict[str, str]] = {}  # none left: a crashed D and bidir pass behind both doors


@dataclass(frozen=True)
class FrontDoor:
    """Rule 1: one running front door."""

    kind: str
    url: str
    metrics_url: str
    router: Process

    def metrics(self) -> bytes:
        return http(self.metrics_url).body

    def live(self, role: str) -> float:
        """How many workers of `role` the router's pool counts live (``ppd_gateway_workers``)."""
        return sample(self.metrics(), "ppd_gateway_workers", role=role, state="live") or 0.0

    def await_live(self, role: str, count: int) -> None:
        wait_until(
            lambda: self.live(role) == count,
            deadline_s=60.0,
            what=f"the {self.kind} front door's pool to count {count} live {role} worker(s)",
        )


@contextmanager
def running(kind: str, config_lines: list[str], tmp: Path, name: str) -> Iterator[FrontDoor]:
    """Rules 1-2: `kind` ("standalone" or "envoy") on the config `config_lines`, in folder `tmp`."""
    if kind not in FRONT_DOORS:
        raise ValueError(f"unknown front door {kind!r}; one of {FRONT_DOORS}")
    config = tmp / f"{name}.toml"
    lines = config_lines if kind == "standalone" else unobserved(config_lines)
    config.write_text("\n".join(lines) + "\n")
    with ExitStack() as exits:
        if kind == "standalone":
            router = start(["gateway", "serve", "--config", str(config), "--port", "0"], tmp, name)
            exits.callback(_stop, router)
            url = f"http://127.0.0.1:{router.ready['http']}"
            yield FrontDoor(kind, url, url + "/metrics", router)
            return
        router = start(["gateway", "picker", "--config", str(config), "--grpc-port", "0"], tmp, name)
        exits.callback(_stop, router)
        metrics = f"http://127.0.0.1:{router.ready['metrics']}"
        wait_until(
            lambda: http(metrics + "/health").status == 200,
            deadline_s=60.0,
            what=f"{name} to see a live decode worker",
        )
        envoy = Envoy.start(
            "picker",
            tmp / f"{name}-envoy",
            cluster="unused",
            upstream_ports=[],
            extra={
                "PICKER_PORT": str(router.ready["grpc"]),
                "FAILURE_MODE_ALLOW": "false",
                # Envoy's workers cluster lists the config's workers (devstack/data_plane.py rule 2).
                "WORKER_ENDPOINTS": json.dumps(
                    worker_localities(tomllib.loads(config.read_text())["workers"])
                ),
            },
        )
        exits.callback(envoy.close)  # closed first: the picker outlives its client
        envoy.await_healthy("picker", {int(router.ready["grpc"])}, deadline_s=60.0)
        yield FrontDoor(kind, f"http://127.0.0.1:{envoy.listeners['picker']}", metrics + "/metrics", router)


def _stop(router: Process) -> None:
    code = router.stop()
    assert code == 0, f"{router.stderr_path.name}: exit status {code}\n{router.stderr()[-2000:]}"
