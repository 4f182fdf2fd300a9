"""Bad workers, end to end with real processes: the simulator's workers with injected faults
(/admin/faults: `error_rate`, and `error_seed` so every run sees the same failing requests) behind the
standalone gateway, and behind Envoy with the picker: passive outlier detection ejects a worker that
fails half its requests, its half-open probe restores it once it recovers, the last worker of a role is
never ejected, and the retry budget caps retries. Counts come from the router's /metrics and the
responses' provenance headers; time is driven by the settings (short backoffs) and waited on as
conditions, never timed."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.front_doors import FrontDoor, running
from tests.conformance.workers import http
from tests.gateway.processes import Process, start
from tests.support.metrics import sample, total
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SEED = 3  # D1's error draws (error_rate 0.5): the same failing requests in every run


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ejection")


@pytest.fixture(scope="module")
def cluster(tmp: Path) -> Iterator[Process]:
    proc = start(["simulator", "cluster", "--topology", "2P2D", "--base-port", "0"], tmp, "cluster")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(autouse=True)
def healthy_workers(cluster: Process) -> Iterator[None]:
    """Every test starts and ends with workers that inject no faults."""
    yield
    for w in cluster.ready["workers"]:
        _faults(cluster, w["id"], error_rate=None)


def _url(cluster: Process, worker_id: str) -> str:
    return str(next(w["url"] for w in cluster.ready["workers"] if w["id"] == worker_id))


def _faults(cluster: Process, worker_id: str, **faults: Any) -> None:
    assert http(_url(cluster, worker_id) + "/admin/faults", faults).status == 200


def _config(cluster: Process, ids: list[str], extra: str) -> list[str]:
    lines = ['mode = "pd"\nadmin_token = "tok"\n']
    for w in cluster.ready["workers"]:
        if w["id"] in ids:
            lines.append(f'[[workers]]\nid = "{w["id"]}"\nrole = "{w["role"]}"\nurl = "{w["url"]}"\n')
    # No load scraped: sequential requests alternate between the workers of a role (pool.py's
    # turn-taking), so the seeded failures land on the same requests in every run.
    lines.append("[pool]\nhealth_interval_s = 0.5\nscrape_metrics = false\n")
    lines.append(extra)
    return lines


def _ask(door: FrontDoor, i: int) -> tuple[int, str]:
    """One new conversation (a fresh first message: never a known session); its status and D."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"question {i}"}]}
    req = urllib.request.Request(
        door.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            return resp.status, resp.headers.get("X-PPD-Decode-Worker", "")
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code, exc.headers.get("X-PPD-Decode-Worker", "")


def _count(door: FrontDoor, name: str, **labels: str) -> float:
    return total(door.metrics(), name, labels) or 0.0


def _state(door: FrontDoor, worker_id: str) -> str:
    req = urllib.request.Request(door.url + "/admin/workers", headers={"Authorization": "Bearer tok"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        rows = json.loads(resp.read())["workers"]
    return str(next(r for r in rows if r["id"] == worker_id)["outlier"]["state"])


def _d1_requests(door: FrontDoor, served: list[tuple[int, str]]) -> int:
    """Requests D1 got: those it answered, and its 5xx (counted by the gateway)."""
    failed = _count(door, "ppd_gateway_upstream_errors_total", worker="D1", role="decode", kind="status")
    return sum(1 for status, d in served if status == 200 and d == "D1") + int(failed)


def _serve(door: FrontDoor, n: int) -> list[tuple[int, str]]:
    return [_ask(door, i) for i in range(n)]


def test_a_worker_failing_half_its_requests_is_ejected_and_clients_see_far_fewer_errors(
    cluster: Process, tmp: Path
) -> None:
    errors: dict[bool, int] = {}
    for on in (False, True):
        _faults(cluster, "D1", error_rate=0.5, error_seed=SEED)
        extra = f"[outliers]\nenabled = {str(on).lower()}\nbase_ejection_s = 600.0\nmax_ejection_s = 600.0\n"
        with running("standalone", _config(cluster, ["P0", "D0", "D1"], extra), tmp, f"gw-{on}") as door:
            served = _serve(door, 100)
            errors[on] = sum(1 for status, _ in served if status >= 500)
            ejections = _count(door, "ppd_gateway_worker_ejections_total", worker="D1", role="decode")
            if on:
                assert ejections == 1
                assert _d1_requests(door, served) <= 20  # ejected within 20 requests to it
                assert sample(door.metrics(), "ppd_gateway_workers_ejected", role="decode") == 1
                assert _state(door, "D1") == "ejected"
                assert "worker D1 (decode) ejected" in door.router.stderr()
            else:
                assert ejections == 0
                assert _d1_requests(door, served) == 50  # D1 kept its turn
    assert errors[False] >= 3 * errors[True], errors


def test_the_half_open_probe_restores_a_recovered_worker(cluster: Process, tmp: Path) -> None:
    _faults(cluster, "D1", error_rate=0.5, error_seed=SEED)
    extra = "[outliers]\nbase_ejection_s = 0.5\nmax_ejection_s = 1.0\n"
    with running("standalone", _config(cluster, ["P0", "D0", "D1"], extra), tmp, "gw-probe") as door:
        for i in range(60):
            _ask(door, i)
            if _count(door, "ppd_gateway_worker_ejections_total", worker="D1"):
                break
        assert _count(door, "ppd_gateway_worker_ejections_total", worker="D1") >= 1
        _faults(cluster, "D1", error_rate=None)  # D1 recovers
        asked = iter(range(100, 10_000))

        def restored() -> bool:
            _ask(door, next(asked))
            return _state(door, "D1") == "in_rotation"

        wait_until(restored, deadline_s=60.0, what="D1's probe request to restore it")
        assert "worker D1 restored" in door.router.stderr()
        assert any(d == "D1" for _, d in _serve(door, 4))  # back in rotation
        assert sample(door.metrics(), "ppd_gateway_workers_ejected", role="decode") == 0


def test_the_last_live_worker_of_a_role_is_never_ejected(cluster: Process, tmp: Path) -> None:
    _faults(cluster, "D0", error_rate=1.0)
    with running("standalone", _config(cluster, ["P0", "D0"], ""), tmp, "gw-last") as door:
        served = _serve(door, 8)
        assert [status for status, _ in served] == [502] * 8  # requests keep going to it
        assert _count(door, "ppd_gateway_worker_ejections_total") == 0
        assert _state(door, "D0") == "in_rotation"
        # Held at requests 5-8, logged once (rate-limited).
        assert door.router.stderr().count("is the last live decode worker") == 1
        _faults(cluster, "D0", error_rate=None)
        assert _ask(door, 99) == (200, "D0")


def test_the_retry_budget_caps_retries_and_answers_the_error_it_had(cluster: Process, tmp: Path) -> None:
    for p in ("P0", "P1"):  # every P leg fails: each request wants a retry on the other P
        _faults(cluster, p, error_rate=1.0)
    extra = (
        '[policy]\nprefill_failure = "error"\n[outliers]\nenabled = false\n'
        "[retry_budget]\nratio = 0.0\nmin_per_s = 0.02\nwindow_s = 50.0\n"  # 1 retry in 50 s
    )
    with running("standalone", _config(cluster, ["P0", "P1", "D0"], extra), tmp, "gw-budget") as door:
        statuses = [status for status, _ in _serve(door, 6)]
        # The first retried (and every P failed: 503); the others got their P's error (500 -> 502).
        assert statuses == [503] + [502] * 5
        assert _count(door, "ppd_gateway_retries_total", reason="prefill_status") == 1
        assert _count(door, "ppd_gateway_retry_budget_exhausted_total", reason="prefill_status") == 5
        assert _count(door, "ppd_gateway_prefill_retries_total") == 1
        lines = door.router.stderr().count("retry budget exhausted")
        assert 1 <= lines < 5  # rate-limited: fewer lines than refusals


def test_through_envoy_the_picker_stops_naming_an_ejected_decode_worker(cluster: Process, tmp: Path) -> None:
    _faults(cluster, "D1", error_rate=1.0)
    extra = "[outliers]\nbase_ejection_s = 600.0\nmax_ejection_s = 600.0\n"
    with running("envoy", _config(cluster, ["P0", "D0", "D1"], extra), tmp, "picker") as door:
        served = _serve(door, 20)
        named = [d for _, d in served]
        assert named.count("D1") == 5  # 5 errors in a row, then never named again
        assert set(named[named.index("D1") + 9 :]) == {"D0"}
        reason = "consecutive_errors"
        assert _count(door, "ppd_gateway_worker_ejections_total", worker="D1", reason=reason) == 1
        assert all(status == 200 for status, d in served if d == "D0")
