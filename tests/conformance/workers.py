"""A running cluster of workers (simulated or real vLLM) as the conformance tests see it.

``Cluster`` wraps the JSON ready line both ``ppd-sim cluster`` and ``ppd-vllm cluster`` print, plus
plain-HTTP helpers. Metrics are read with prometheus_client's own text parser, never by slicing lines.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tests.gateway.processes import Process
from tests.support.metrics import samples

__all__ = ["Cluster", "Response", "http"]


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(url: str, body: Any = None, *, raw: bytes | None = None, timeout_s: float = 120.0) -> Response:
    """POST ``body`` as JSON (or ``raw`` bytes), GET without either; any status is returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return Response(resp.status, resp.read())
    except urllib.error.HTTPError as exc:
        return Response(exc.code, exc.read())


@dataclass
class Cluster:
    """Workers from a ready line; ``process`` is None for an external cluster (PPD_TEST_CLUSTER)."""

    engine: str
    ready: Mapping[str, Any]
    process: Process | None
    #: The served model, read once at the start (later a crashed worker could not say).
    model: str = ""
    #: The workers crashed so far (``crash``).
    crashed: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.model:
            first = self.url(self.workers[0]["id"])
            self.model = str(http(first + "/v1/models").json()["data"][0]["id"])

    @property
    def workers(self) -> list[dict[str, Any]]:
        workers: list[dict[str, Any]] = list(self.ready["workers"])
        return workers

    def url(self, worker_id: str) -> str:
        return str(next(w["url"] for w in self.workers if w["id"] == worker_id))

    def ids(self, role: str) -> list[str]:
        return [str(w["id"]) for w in self.workers if w["role"] == role]

    def samples(self, worker_id: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Every sample called ``name`` on the worker's /metrics, by its sorted labels."""
        found = samples(http(self.url(worker_id) + "/metrics").body, name)
        return {tuple(sorted(labels)): value for (_, labels), value in found.items()}

    def metric(self, worker_id: str, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        return sum(
            value
            for key, value in self.samples(worker_id, name).items()
            if all((k, v) in key for k, v in labels.items())
        )

    def by_source(self, worker_id: str) -> dict[str, float]:
        """``vllm:prompt_tokens_by_source_total`` by its ``source`` label."""
        name = "vllm:prompt_tokens_by_source_total"
        return {
            source: self.metric(worker_id, name, source=source)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }

    def crash(self, worker_id: str) -> None:
        """The worker's process dies at once: SIGKILL for real vLLM, the simulator's ``down`` fault.
        A worker crashed before stays down (nothing is sent to it again)."""
        worker = next(w for w in self.workers if w["id"] == worker_id)
        if worker_id in self.crashed:
            return
        self.crashed.add(worker_id)
        if self.engine == "sim":
            assert http(worker["url"] + "/admin/faults", {"down": True}).status == 200
            return
        # The API server only: its engine process sees its parent go and exits, and Python's resource
        # tracker then unlinks the shared memory it registered, as after a real crash.
        os.kill(int(worker["pid"]), signal.SIGKILL)
