"""Admission control end to end with real processes: a simulated 1P1D cluster behind the standalone
gateway with one request in flight at most and two waiting. A long streaming request holds the one
slot until its client leaves (no timer decides what is in flight); the test waits on the gateway's own
gauges before each next step. Excess requests get 429 with Retry-After at once, a higher class (by
header, or by its API key's default) goes first and displaces a queued lower one, and every request
is either answered or shed with a clear error. Behind Envoy the picker sheds with an ImmediateResponse
429 (its turns observed, so each stays in flight until its answer ends)."""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.front_doors import FrontDoor, running
from tests.gateway.processes import Process, start
from tests.support.metrics import sample, total
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
GOLD_KEY = "gold-secret-key-123"
GOLD = "key:" + hashlib.sha256(GOLD_KEY.encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("admission")


@pytest.fixture(scope="module")
def cluster(tmp: Path) -> Iterator[Process]:
    proc = start(["simulator", "cluster", "--topology", "1P1D", "--base-port", "0"], tmp, "cluster")
    yield proc
    assert proc.stop() == 0


STANDALONE = (
    "[admission]\nenabled = true\nmax_inflight = 1\nmax_queue = 2\n"
    "max_wait_high_s = 120.0\nmax_wait_normal_s = 120.0\nmax_wait_low_s = 120.0\n"
    f'[admission.tenants."{GOLD}"]\npriority = "high"\n'
)


def _config(cluster: Process, admission: str = STANDALONE) -> list[str]:
    lines = ['mode = "pd"\n']
    for w in cluster.ready["workers"]:
        lines.append(f'[[workers]]\nid = "{w["id"]}"\nrole = "{w["role"]}"\nurl = "{w["url"]}"\n')
    return [*lines, *admission.splitlines()]


def _body(i: int, *, max_tokens: int = 2, stream: bool = False) -> bytes:
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": f"question {i}"}],
    }
    return json.dumps(body).encode()


def _ask(door: FrontDoor, i: int, headers: dict[str, str]) -> tuple[int, dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(
        door.url + "/v1/chat/completions",
        data=_body(i),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


class _Client(threading.Thread):
    """One request in a thread of its own (it may wait in the gateway's queue)."""

    def __init__(self, door: FrontDoor, i: int, headers: dict[str, str], done: list[int]) -> None:
        super().__init__(daemon=True)
        self.door, self.i, self.headers, self.done = door, i, headers, done
        self.result: tuple[int, dict[str, str], dict[str, Any]] | None = None

    def run(self) -> None:
        self.result = _ask(self.door, self.i, self.headers)
        self.done.append(self.i)


class _Stream(threading.Thread):
    """A long streaming answer in a thread of its own: `first` is set once its first event arrived
    (it was admitted and is being served); it holds its slot until `close`."""

    def __init__(self, door: FrontDoor, i: int, headers: dict[str, str]) -> None:
        super().__init__(daemon=True)
        port = int(door.url.rsplit(":", 1)[1])
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.i, self.headers = i, headers
        self.status = 0

    def run(self) -> None:
        self.conn.request(
            "POST",
            "/v1/chat/completions",
            body=_body(self.i, max_tokens=4000, stream=True),
            headers={"Content-Type": "application/json", **self.headers},
        )
        answer = self.conn.getresponse()
        self.status = answer.status
        answer.readline()

    def close(self) -> None:
        self.conn.close()


def _gauge(door: FrontDoor, name: str, **labels: str) -> float:
    return sample(door.metrics(), name, labels) or 0.0


def _await(door: FrontDoor, what: str, name: str, value: float, **labels: str) -> None:
    wait_until(lambda: _gauge(door, name, **labels) == value, deadline_s=60.0, what=what)


def _shed(door: FrontDoor, reason: str, priority: str) -> float:
    return total(door.metrics(), "ppd_gateway_admission_shed_total", reason=reason, priority=priority) or 0.0


def test_excess_requests_are_shed_at_once_and_the_higher_class_goes_first(
    cluster: Process, tmp: Path
) -> None:
    with running("standalone", _config(cluster), tmp, "gw") as door:
        # A: a long streaming answer holds the one slot until its client leaves.
        a = _Stream(door, 0, {"X-PPD-Priority": "low"})
        a.start()
        a.join(timeout=60)
        assert a.status == 200  # its first event came: it is being served
        _await(door, "A in flight", "ppd_gateway_admission_in_flight", 1)

        done: list[int] = []
        low = {"X-PPD-Priority": "low"}
        b = _Client(door, 1, low, done)
        b.start()
        _await(door, "B queued", "ppd_gateway_admission_queue_depth", 1, priority="low")
        h = _Stream(door, 2, {"Authorization": f"Bearer {GOLD_KEY}"})  # high by its key, long too
        h.start()
        _await(door, "H queued", "ppd_gateway_admission_queue_depth", 1, priority="high")

        # C: the queue is full and nothing below low waits: shed at once, with a time to retry.
        status, headers, body = _ask(door, 3, low)
        assert status == 429
        assert int(headers["Retry-After"]) >= 1
        assert body["error"]["type"] == "RateLimitError"
        assert body["error"]["code"] == 429
        assert "queue_full" in body["error"]["message"]
        assert "retry after" in body["error"]["message"]
        assert _shed(door, "queue_full", "low") == 1

        # N (normal) finds the queue full too, and displaces B, the newest low one.
        n = _Client(door, 4, {"X-PPD-Priority": "normal"}, done)
        n.start()
        b.join(timeout=60)
        assert b.result is not None
        assert b.result[0] == 429
        assert "displaced" in b.result[2]["error"]["message"]
        assert _shed(door, "displaced", "low") == 1
        _await(door, "N queued", "ppd_gateway_admission_queue_depth", 1, priority="normal")

        a.close()  # A's client leaves: its slot goes to H (high) while N (normal) waits on
        h.join(timeout=60)
        assert h.status == 200
        assert _gauge(door, "ppd_gateway_admission_queue_depth", priority="normal") == 1
        assert _gauge(door, "ppd_gateway_admission_in_flight") == 1
        h.close()  # H's client leaves too: N is served
        n.join(timeout=120)
        assert n.result is not None
        assert n.result[0] == 200, n.result
        assert done == [1, 4]  # B shed, N served; A and H left while being served
        _await(door, "every slot free", "ppd_gateway_admission_in_flight", 0)
        assert (
            sum(
                _gauge(door, "ppd_gateway_admission_queue_depth", priority=p)
                for p in ("high", "normal", "low")
            )
            == 0
        )
        wait_until(
            lambda: "admission control shed a request" in door.router.stderr(),
            deadline_s=30.0,
            what="the shed log line",
        )
        assert GOLD_KEY not in door.router.stderr()


def test_a_bad_priority_header_is_the_clients_error(cluster: Process, tmp: Path) -> None:
    with running("standalone", _config(cluster), tmp, "gw-bad") as door:
        status, _, body = _ask(door, 9, {"X-PPD-Priority": "urgent"})
        assert status == 400
        assert body["error"]["param"] == "X-PPD-Priority"
        assert "high, normal, low" in body["error"]["message"]
        assert _ask(door, 10, {"X-PPD-Priority": "High"})[0] == 200


def test_through_envoy_the_picker_sheds_with_an_immediate_429(cluster: Process, tmp: Path) -> None:
    # Every answer observed: a turn stays in flight until its answer ends (picker.py rule 7).
    admission = (
        "[admission]\nenabled = true\nmax_inflight = 1\nmax_queue = 0\n[log]\npicker_observe_share = 1.0"
    )
    lines = _config(cluster, admission)
    with running("envoy", lines, tmp, "picker") as door:
        a = _Stream(door, 0, {})
        a.start()
        a.join(timeout=60)
        assert a.status == 200
        _await(door, "A in flight", "ppd_gateway_admission_in_flight", 1)
        status, headers, body = _ask(door, 1, {})
        assert status == 429
        assert int(headers["retry-after"]) >= 1
        assert (body["error"]["type"], body["error"]["code"]) == ("RateLimitError", 429)
        assert _shed(door, "queue_full", "normal") == 1
        a.close()  # A's client leaves: Envoy ends its stream, the picker its turn
        _await(door, "A's slot free", "ppd_gateway_admission_in_flight", 0)
        assert _ask(door, 2, {})[0] == 200
