"""The picker scenario's running stack for the deploy tests (deploy/envoy/picker): the simulated
cluster, `ppd-gateway picker` on it and the real Envoy in front, each waited on until ready; the
helpers the picker tests share (one turn through the openai client, a worker's metrics, faults)."""

from __future__ import annotations

import json
import shutil
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from devstack.data_plane import FAILURE_MODES, worker_localities
from tests.deploy.envoy_harness import Envoy
from tests.deploy.processes import REPO, Announced
from tests.support.gateway_config import unobserved, worker_tables
from tests.support.metrics import total
from tests.support.polling import wait_until

__all__ = ["MODEL", "PickerStack", "http", "picker_stack", "turn"]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


#: The test table the decision service serves, and the reasons its answers may carry.
TABLE = REPO / "tests" / "testdata" / "tables" / "good.ppdt"
TABLE_REASONS = frozenset(
    {
        "table",
        "weights",
        "nearest_cell",
        "default",
        "live_signal",
        "pd_failed_in_cell",
        "local_failed_in_cell",
    }
)


def decision_service(tmp_path: Path) -> Announced:
    """A real DecisionService on a copy of TABLE, on port 0 (the caller closes it)."""
    tables = tmp_path / "tables"
    tables.mkdir()
    shutil.copy(TABLE, tables / TABLE.name)
    return Announced.start(
        [sys.executable, "-m", "decision_service", "serve", "--tables", str(tables), "--port", "0",
         "--metrics-port", "0"],
        log=tmp_path / "decision.log",
        deadline_s=60,
    )  # fmt: skip


def http(url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as err:
        return int(err.code), bytes(err.read())


@dataclass
class PickerStack:
    envoy: Envoy
    picker: Announced
    workers: dict[str, str]  # id -> url
    # Envoy's WORKER_ENDPOINTS for this cluster (devstack/data_plane.py rule 2), for a second Envoy.
    worker_endpoints: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listeners['picker']}"

    @property
    def picker_metrics(self) -> str:
        return f"http://127.0.0.1:{self.picker.info['metrics']}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def metric(self, worker_id: str, name: str, **labels: str) -> float:
        """One worker's metric (its /metrics), summed over the other labels; 0 when absent."""
        status, body = http(self.workers[worker_id] + "/metrics")
        assert status == 200
        return total(body, name, **labels) or 0.0

    def prompt_tokens(self, worker_id: str, source: str | None = None) -> float:
        """The prompt tokens a worker has computed so far, or those of one source (its /metrics:
        external_kv_transfer counts what D pulled from P with P's kv_transfer_params)."""
        if source is None:
            return self.metric(worker_id, "vllm:prompt_tokens_total")
        return self.metric(worker_id, "vllm:prompt_tokens_by_source_total", source=source)

    def faults(self, worker_id: str, **faults: Any) -> None:
        """The simulated worker's fault settings (simulator/core/faults.py), through POST /admin/faults."""
        data = json.dumps(faults).encode()
        status, body = http(
            self.workers[worker_id] + "/admin/faults", data, {"Content-Type": "application/json"}
        )
        assert status == 200, body


@contextmanager
def picker_stack(
    tmp: Path,
    *,
    mode: str,
    extra: list[str] | None = None,
    topology: str = "1P1D",
    worker_host: str | None = None,
    worker_urls: Callable[[ExitStack, dict[str, str]], dict[str, str]] | None = None,
    envoy_template: str | None = None,
    cluster_args: tuple[str, ...] = (),
    failure_mode: str = "closed",
    health_interval_s: float = 0.5,
) -> Iterator[PickerStack]:
    """The simulated cluster (`topology`), `ppd-gateway picker` on it (in `mode`, plus `extra`
    config lines, its pool checking the workers every `health_interval_s`) and the real Envoy in
    front (`failure_mode` closed or open, its workers rendered as devstack/data_plane.py does, by
    IP), each waited on until ready. With `worker_host` the picker's
    config names the workers by that host name instead of their 127.0.0.1 address; with
    `worker_urls` (given the stack's exits and each worker's URL by id; it may start what it
    returns on them) by the URLs it returns for some ids. `envoy_template`: another config's text
    instead of the scenario's envoy.yaml; `cluster_args` go to `simulator cluster`
    (`--bidir-workers all`, say)."""
    with ExitStack() as exits:
        cluster = Announced.start(
            [
                sys.executable,
                "-m",
                "simulator",
                "cluster",
                "--topology",
                topology,
                "--base-port",
                "0",
                *cluster_args,
            ],
            log=tmp / "cluster.log",
            deadline_s=60,
        )
        exits.callback(cluster.close)
        workers = list(cluster.info["workers"])
        config = tmp / "gateway.toml"
        lines = [f'mode = "{mode}"', f'served_model = "{MODEL}"', "", "[pool]"]
        lines.append(f"health_interval_s = {health_interval_s}")
        configured = [
            {**w, "url": str(w["url"]).replace("//127.0.0.1:", f"//{worker_host}:")} if worker_host else w
            for w in workers
        ]
        listed = workers  # Envoy's workers cluster: by IP, as ppd-up lists them from the ready line
        if worker_urls is not None:
            urls = worker_urls(exits, {w["id"]: w["url"] for w in workers})
            configured = [{**w, "url": urls.get(w["id"], w["url"])} for w in configured]
            listed = [{**w, "url": urls.get(w["id"], w["url"])} for w in workers]
        config.write_text("\n".join(unobserved(lines + worker_tables(configured) + (extra or []))) + "\n")
        picker = Announced.start(
            [sys.executable, "-m", "gateway", "picker", "--config", str(config), "--grpc-port", "0"],
            log=tmp / "picker.log",
            deadline_s=60,
        )
        exits.callback(picker.close)
        metrics = f"http://127.0.0.1:{picker.info['metrics']}"
        wait_until(
            lambda: http(metrics + "/health")[0] == 200, deadline_s=30, what="the picker to see a live D"
        )
        envoy = Envoy.start(
            "picker",
            tmp / "envoy",
            cluster="unused",
            upstream_ports=[],
            extra={
                "PICKER_PORT": str(picker.info["grpc"]),
                "FAILURE_MODE_ALLOW": FAILURE_MODES[failure_mode],
                "WORKER_ENDPOINTS": (endpoints := json.dumps(worker_localities(listed))),
            },
            template=envoy_template,
        )
        exits.callback(envoy.close)
        envoy.await_healthy("picker", {int(picker.info["grpc"])})
        yield PickerStack(envoy, picker, {w["id"]: w["url"] for w in workers}, endpoints)


def turn(
    client: openai.OpenAI,
    messages: list[dict[str, str]],
    *,
    stream: bool,
    headers: dict[str, str] | None = None,
) -> tuple[str, dict[str, str]]:
    """One turn; the answer's text and its response headers (lower-case names)."""
    if stream:
        with client.chat.completions.with_streaming_response.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            stream=True,
            extra_headers=headers,
        ) as response:
            text = ""
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:]).get("choices", []):
                        text += choice.get("delta", {}).get("content") or ""
            return text, {k.lower(): v for k, v in response.headers.items()}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        extra_headers=headers,
    )
    answer = raw.parse().choices[0].message.content or ""
    return answer, {k.lower(): v for k, v in raw.headers.items()}
