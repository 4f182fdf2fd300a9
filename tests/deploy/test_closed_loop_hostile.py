"""The closed loop as deployed, under hostile clients (issue 24's acceptance test).

Real processes: the simulated 1P3D cluster, the DecisionService serving a base table, and the gateway
with the configuration deploy/k8s ships (only addresses, the log path and the decision deadline
changed for this machine). Honest clients hold multi-turn conversations; hostile ones, on the same
gateway at the same time, close their streamed Turn 2 after the first event, send `X-PPD-Mode` and
`X-PPD-Workload`, send outlier-sized prompts, and the log is found twice on the records volume (a
copy). Then `ppd-table refresh` runs as the CronJob runs it (deploy/k8s/base/refresh.yaml),
once on everything and once on the honest clients' lines alone: no answer may flip that the honest
lines alone would not flip.

The base table measures every cell with LOCAL far ahead of PD, so honest traffic, which the table
sends LOCAL, flips nothing; what could flip a cell is evidence the hostile clients make up (on the
code before issue 24: 25 disconnects counted as LOCAL failures took the cell below the success SLO).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from table_builder.build import BuildOptions, build_from_records, default_header
from table_builder.records import Record
from tests.deploy.kustomize import load_documents
from tests.deploy.processes import REPO
from tests.gateway.processes import Process, start
from tests.support.gateway_config import worker_tables
from tests.support.polling import wait_until
from tests.support.records import make_record

pytestmark = pytest.mark.integration

SHAPE, MODEL_LABEL = "1P3D", "llama-3.1-8b"
SERVED = "meta-llama/Llama-3.1-8B-Instruct"
KEY_FILE = f"{SHAPE}__{MODEL_LABEL}.ppdt"
CONFIG_MAP = REPO / "deploy" / "k8s" / "overlays" / "1p3d" / "gateway-config.yaml"
HONEST = 24
DISCONNECTERS = 25  # above the refresh's sample minimum (20): enough to flip a cell if counted
HEADER_SENDERS = 8
OUTLIERS = 3


def _base_records() -> list[Record]:
    """Every cell of the default axes measured by static pd and local runs: LOCAL ten times faster in
    TTFT and as fast in TPOT, both fully successful, 10 requests each."""
    axes = default_header(SHAPE, MODEL_LABEL).axes
    edges = axes.context_edges
    contexts = [max(1, e) for e in edges] + [edges[-1] + 4096]
    records = []
    for c, n_ctx in enumerate(contexts):
        for wl in axes.workloads:
            for qps in axes.qps_levels:
                for i in range(10):
                    for mode, ttft in (("pd", 5000.0), ("local", 500.0)):
                        records.append(
                            make_record(
                                run_id=f"base-{mode}",
                                mode=mode,
                                path=mode,
                                target_qps=qps,
                                workload=f"small_{wl.name}",
                                conversation_id=f"{mode}-{c}-{wl.name}-{qps:g}-{i}",
                                n_in=wl.n_in,
                                n_out=wl.n_out,
                                n_ctx=n_ctx,
                                ttft_ms=ttft + (i % 3),
                                tpot_ms=20.0 + (i % 2),
                            )
                        )
    return records


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("closed-loop-hostile")


@pytest.fixture(scope="module")
def base(tmp: Path) -> Path:
    built = build_from_records(
        _base_records(), BuildOptions(header=default_header(SHAPE, MODEL_LABEL), min_samples=2)
    )
    folder = tmp / "tables" / "base"
    folder.mkdir(parents=True)
    path = folder / KEY_FILE
    path.write_bytes(built.encode())
    (tmp / "tables" / KEY_FILE).write_bytes(built.encode())
    return path


@pytest.fixture(scope="module")
def cluster(tmp: Path) -> Iterator[Process]:
    proc = start(["simulator", "cluster", "--topology", SHAPE, "--base-port", "0"], tmp, "cluster")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def decision(tmp: Path, base: Path) -> Iterator[Process]:
    args = [
        "decision_service",
        "serve",
        "--tables",
        str(tmp / "tables"),
        "--port",
        "0",
        "--metrics-port",
        "0",
    ]
    proc = start(args, tmp, "decision")
    yield proc
    proc.stop()


def _deployed_config(workers: list[dict[str, str]], decision: str, request_log: Path) -> str:
    """deploy/k8s's 1P3D gateway.toml for this machine: the worker list, the decision address, the log
    path, the bind address and the decision deadline (5 ms in a cluster; a loaded 2-core CI machine
    would fall back to pd on most requests) are replaced; every other setting is as deployed. The
    Redis session store is left out (sessions in memory: one replica)."""
    (doc,) = load_documents(CONFIG_MAP)
    text = str(doc["data"]["gateway.toml"])
    text = text[: text.index("[[workers]]")]
    text = re.sub(r'(?m)^host = ".*"$', 'host = "127.0.0.1"', text)
    text = re.sub(r'(?m)^address = ".*"$', f'address = "{decision}"', text)
    text = re.sub(r"(?m)^deadline_ms = .*$", "deadline_ms = 2000.0", text)
    text = re.sub(r'(?m)^redis_url = ".*"$', "", text)
    text = re.sub(r'(?m)^request_log = ".*"$', f'request_log = "{request_log}"', text)
    assert f'request_log = "{request_log}"' in text
    assert f'address = "{decision}"' in text
    return text + "\n".join(worker_tables(workers)) + "\n"


@pytest.fixture(scope="module")
def records_volume(tmp: Path) -> Path:
    return tmp / "records" / "gateways"


@pytest.fixture(scope="module")
def gateway(cluster: Process, decision: Process, records_volume: Path, tmp: Path) -> Iterator[Process]:
    pod = records_volume / "ppd-gateway-0"
    pod.mkdir(parents=True)
    config = tmp / "gateway.toml"
    config.write_text(
        _deployed_config(
            cluster.ready["workers"], f"127.0.0.1:{decision.ready['grpc']}", pod / "requests.jsonl"
        )
    )
    proc = start(["gateway", "serve", "--config", str(config), "--port", "0"], tmp, "gateway")
    yield proc
    proc.stop()


def _prompt(i: int, words: int) -> str:
    return f"[{i}] " + " ".join(f"word{(i * 7 + k) % 997}" for k in range(words))


def _turn_one(client: openai.OpenAI, sid: str, i: int, turn_two_words: int, **headers: str) -> list[Any]:
    """Turn 1 of conversation `sid` in full; returns the messages of its Turn 2."""
    extra = {"X-Session-ID": sid, **headers}
    messages: list[Any] = [{"role": "user", "content": _prompt(i, 60)}]
    first = client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=16, extra_headers=extra
    )
    return [
        *messages,
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": _prompt(i + 1000, turn_two_words)},
    ]


def _honest(client: openai.OpenAI, i: int) -> None:
    sid = f"honest-{i}"
    messages = _turn_one(client, sid, i, 200)
    stream = client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=16, stream=True, extra_headers={"X-Session-ID": sid}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _disconnecter(client: openai.OpenAI, port: int, i: int) -> None:
    """Turn 1 in full, then a streamed Turn 2 closed after its first event."""
    sid = f"hostile-gone-{i}"
    body = {"model": SERVED, "messages": _turn_one(client, sid, i, 200), "max_tokens": 200, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        headers = {"Content-Type": "application/json", "X-Session-ID": sid}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data:")
    finally:
        conn.close()  # the gateway sees the client go mid-answer


def _header_sender(client: openai.OpenAI, i: int) -> None:
    """A conversation whose every turn asks for a static mode and names its own workload."""
    sid = f"hostile-mode-{i}"
    headers = {"X-PPD-Mode": "pd", "X-PPD-Workload": "small_tiny"}
    messages = _turn_one(client, sid, i, 200, **headers)
    client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=16, extra_headers={"X-Session-ID": sid, **headers}
    )


def _outlier(client: openai.OpenAI, i: int) -> None:
    """A Turn 2 whose new prompt is far larger than anyone else's."""
    sid = f"hostile-big-{i}"
    messages = _turn_one(client, sid, i, 6000)
    client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=16, extra_headers={"X-Session-ID": sid}
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _refresh(logs: Path, base: Path, out: Path) -> dict[str, Any]:
    """`ppd-table refresh` with the CronJob's flags (deploy/k8s/base/refresh.yaml)."""
    out.mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, "-m", "table_builder", "refresh", "--logs", str(logs), "--base", str(base),
         "--out", f"{out}/", "--skip-bad-lines", "--json"],
        capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [s for s in result.stdout.splitlines() if s.startswith("{")]
    report: dict[str, Any] = json.loads(line)
    return report


def test_hostile_clients_flip_no_cell_the_honest_ones_would_not(
    gateway: Process, base: Path, records_volume: Path, tmp: Path
) -> None:
    port = int(gateway.ready["http"])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    jobs: list[tuple[Any, ...]] = [(_honest, client, i) for i in range(HONEST)]
    jobs += [(_disconnecter, client, port, 100 + i) for i in range(DISCONNECTERS)]
    jobs += [(_header_sender, client, 200 + i) for i in range(HEADER_SENDERS)]
    jobs += [(_outlier, client, 300 + i) for i in range(OUTLIERS)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        for future in [pool.submit(*job) for job in jobs]:
            future.result()

    log = records_volume / "ppd-gateway-0" / "requests.jsonl"
    expected = 2 * (HONEST + DISCONNECTERS + HEADER_SENDERS + OUTLIERS)
    wait_until(lambda: len(_lines(log)) >= expected, deadline_s=120, what=f"{expected} request-log lines")
    gateway.stop()
    lines = _lines(log)
    gone = [x for x in lines if str(x["conversation_id"]).startswith("hostile-gone-") and x["turn"] == 2]
    assert len(gone) == DISCONNECTERS, "the disconnects were not logged"
    assert not any(x["ok"] for x in gone)
    # A copy of the same lines left on the volume (a backup, a rotation done by copying).
    log.with_name("requests-copy.jsonl").write_bytes(log.read_bytes())

    honest_logs = tmp / "honest" / "gateways" / "ppd-gateway-0"
    honest_logs.mkdir(parents=True)
    (honest_logs / "requests.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines if str(x["conversation_id"]).startswith("honest-"))
    )
    everything = _refresh(records_volume, base, tmp / "out-all")
    honest = _refresh(honest_logs.parent, base, tmp / "out-honest")
    assert honest["used"] > 0
    assert everything["used"] >= honest["used"]

    left_out = everything["left_out"]
    assert left_out["client disconnected (no failure of the path)"] == DISCONNECTERS
    assert left_out["duplicate line (the same request again)"] == len(lines)
    # The clients' X-PPD-Mode was not honoured: their turns are the gateway's own routing (evidence).
    assert everything["used"] == honest["used"] + HEADER_SENDERS + OUTLIERS
    flipped = {f["cell"] for f in everything["flips"]}
    flipped_honestly = {f["cell"] for f in honest["flips"]}
    assert flipped <= flipped_honestly, (
        f"cells flipped by hostile clients: {sorted(flipped - flipped_honestly)}; report {everything}"
    )
