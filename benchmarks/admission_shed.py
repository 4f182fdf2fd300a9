"""The live gateway under overload and with a bad worker: prints figures, asserts nothing.

    python -m benchmarks.admission_shed [--shed N] [--requests N]

A simulated 1P3D cluster (`simulator cluster`) behind the standalone gateway (`gateway serve`),
each a process of its own on 127.0.0.1.

1. `shed`: admission control with one request in flight at most and no queue; one long streaming
   answer holds the slot while N requests are sent one after another: each is shed (429). Figures:
   the client's time to the 429 (p50, p99, max, in ms), how many were shed, and the Retry-After told.
2. `ejection`, once with `[outliers] enabled = false` and once with the defaults: D1 fails half its
   requests (the simulator's `/admin/faults` `error_rate` 0.5 with `error_seed`, the same failing draws
   in both runs) while N new conversations are sent one after another. Figures: client-visible
   errors, the requests D1 got before it was ejected (none: not ejected), ejections, retries and
   retries the budget refused.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.gateway import MODEL, _emit, _pct, _Proc, _start

__all__ = ["main"]

SEED = 3  # D1's error draws


def _http(url: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection (as a client that is turned away would make): status,
    headers, body."""
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels`, from the gateway's /metrics."""
    total = 0.0
    for line in _http(url, "/metrics")[2].decode().splitlines():
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


def _ask(url: str, i: int) -> tuple[int, dict[str, str]]:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"question {i}"}]}
    status, headers, _ = _http(url, "/v1/chat/completions", body)
    return status, headers


@contextmanager
def _gateway(cluster: _Proc, extra: str) -> Iterator[str]:
    lines = ['mode = "pd"\n']
    for w in cluster.ready["workers"]:
        lines.append(f'[[workers]]\nid = "{w["id"]}"\nrole = "{w["role"]}"\nurl = "{w["url"]}"\n')
    lines.append("[pool]\nhealth_interval_s = 0.5\nscrape_metrics = false\n" + extra)
    with tempfile.TemporaryDirectory(prefix="ppd-bench-admission-") as folder:
        config = Path(folder) / "gateway.toml"
        config.write_text("\n".join(lines))
        gw = _start(["gateway", "serve", "--config", str(config), "--port", "0"])
        try:
            yield f"http://127.0.0.1:{gw.ready['http']}"
        finally:
            gw.stop()


def _faults(cluster: _Proc, worker: str, faults: dict[str, Any]) -> None:
    url = next(w["url"] for w in cluster.ready["workers"] if w["id"] == worker)
    _http(url, "/admin/faults", faults)


def _shed(cluster: _Proc, n: int) -> None:
    extra = "[admission]\nenabled = true\nmax_inflight = 1\nmax_queue = 0\n"
    with _gateway(cluster, extra) as url:
        host, port = url.removeprefix("http://").split(":")
        holder = http.client.HTTPConnection(host, int(port), timeout=600)
        body = {
            "model": MODEL,
            "max_tokens": 100_000,
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        }
        holder.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        answer = holder.getresponse()
        answer.readline()
        times, shed, retry_after = [], 0, set()
        for i in range(n):
            start = time.perf_counter()
            status, headers = _ask(url, i)
            times.append((time.perf_counter() - start) * 1e3)
            if status == 429:
                shed += 1
                retry_after.add(headers.get("Retry-After", ""))
        holder.close()
        _emit(
            {
                "figure": "shed",
                "requests": n,
                "shed": shed,
                "p50_ms": round(_pct(times, 0.5), 2),
                "p99_ms": round(_pct(times, 0.99), 2),
                "max_ms": round(max(times), 2),
                "retry_after_s": sorted(retry_after),
            }
        )


def _ejection(cluster: _Proc, n: int, *, enabled: bool) -> None:
    _faults(cluster, "D1", {"error_rate": 0.5, "error_seed": SEED})
    extra = f"[outliers]\nenabled = {str(enabled).lower()}\n"
    with _gateway(cluster, extra) as url:
        errors, to_d1, until = 0, 0, None
        for i in range(n):
            status, headers = _ask(url, i)
            errors += status >= 500
            to_d1 += status < 500 and headers.get("X-PPD-Decode-Worker") == "D1"
            if until is None and _metric(url, "ppd_gateway_worker_ejections_total", worker="D1"):
                failed = _metric(url, "ppd_gateway_upstream_errors_total", worker="D1", kind="status")
                until = to_d1 + int(failed)
        _emit(
            {
                "figure": "ejection",
                "outliers": "default" if enabled else "disabled",
                "requests": n,
                "client_errors": errors,
                "d1_requests_until_ejected": until,
                "ejections": _metric(url, "ppd_gateway_worker_ejections_total"),
                "retries": _metric(url, "ppd_gateway_retries_total"),
                "retries_refused_by_budget": _metric(url, "ppd_gateway_retry_budget_exhausted_total"),
            }
        )
    _faults(cluster, "D1", {"error_rate": 0.0})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.admission_shed",
        description="The live gateway's time to answer a shed request, and a worker failing half its "
        "requests with and without ejection, on a simulated 1P3D cluster. Prints JSON lines.",
    )
    parser.add_argument("--shed", type=int, default=200, help="requests shed one after another (default 200)")
    parser.add_argument(
        "--requests", type=int, default=300, help="new conversations per ejection run (default 300)"
    )
    args = parser.parse_args(argv)
    cluster = _start(["simulator", "cluster", "--topology", "1P3D", "--base-port", "0"])
    try:
        _shed(cluster, args.shed)
        for enabled in (False, True):
            _ejection(cluster, args.requests, enabled=enabled)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
