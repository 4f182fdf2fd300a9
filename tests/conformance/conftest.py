"""One cluster per engine for the whole session, parametrized: every test here runs on both engines.

- ``sim``: ``python -m simulator cluster --topology 1P2D``, seconds to start.
- ``vllm-cpu``: ``python -m vllm_harness cluster --topology 1P2D``: real vLLM on this CPU (a tiny
  random-weight Llama-3, NixlConnector over CPU memory). ``make test`` prepares its venv and model
  first (``ppd-vllm prepare``); a failed preparation or start fails these tests, never skips them.
- ``PPD_TEST_CLUSTER=<ready line JSON>``: run the suite against workers already running elsewhere
  (GPU vLLM, say) instead; its ``engine`` is ``external``, and tests that crash a worker skip.

D1 uses ``kv_load_failure_policy: recompute``, the others vLLM's default ``fail``. P0 and D1 run vLLM's
``bidirectional_kv_xfer`` (test_bidirectional.py), D0 does not (it answers ``kv_transfer_params: null``).
Tests that crash a worker carry the ``crashes_workers`` mark and run after every other test of their engine,
in the order they are written (a later one may rely on what an earlier one crashed); tests that need the
cluster as it started (no blocks held by an earlier test's requests) carry ``first_on_cluster`` and run
before every other test of their engine.

Every worker serves vLLM's development routes (``VLLM_SERVER_DEV_MODE=1``, which the simulator honours
too; vLLM then also logs the stack of each error it answers), of which the endpoints sweep
(test_endpoints_sweep.py) uses ``POST /reset_prefix_cache``: it empties only the cached blocks no request
holds (and publishes ``AllBlocksCleared``), so the tests after it see a colder cache, nothing else.

``otlp``: one OTLP/gRPC receiver for the session (tests/support/otlp_receiver.py), started before the
clusters: every worker exports its ``llm_request`` span per request to it (vLLM's and the simulator's
``--otlp-traces-endpoint``), which test_tracing.py reads; it costs no cluster start.

``front_door`` (front_doors.py): the gateway's two front doors, ``standalone`` (``gateway serve``) and
``envoy`` (``gateway picker`` behind the real Envoy); the tests that start a gateway start it behind each.
Tests are grouped by engine, then by front door, so each starts once per engine where it can.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conformance.front_doors import FRONT_DOORS
from tests.conformance.workers import Cluster
from tests.gateway.processes import start
from tests.support.otlp_receiver import OtlpReceiver, otlp_receiver
from vllm_harness.cluster import held_shared_memory

ENGINES = ("sim", "vllm-cpu")
_COMMANDS = {
    "sim": ["simulator", "cluster", "--topology", "1P2D", "--base-port", "0"],
    # Each worker may take minutes to load on a busy 2-core machine; the session-wide limit is below.
    "vllm-cpu": ["vllm_harness", "cluster", "--topology", "1P2D", "--ready-timeout", "850"],
}
_COMMON = ["--kv-load-failure-policy", "D1=recompute", "--bidir-workers", "P0,D1"]
#: KV cache events on every worker (test_kv_events.py), with one PYTHONHASHSEED for both engines; the
#: simulator takes real vLLM's CPU block size (32) so their events compare block for block. Both keep
#: a small KV cache (32k tokens of the tiny model on vLLM, 32k in the simulator), so that
#: test_kv_eviction.py can make D evict a conversation with a few long prompts.
KV_EVENTS_SEED = "20261201"
_KV_EVENTS = {
    "sim": [
        "--block-size",
        "32",
        "--kv-capacity-tokens",
        "32768",
        "--kv-events-config",
        '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}',
    ],
    "vllm-cpu": ["--kv-events", "--kv-cache-mib", "32"],
}
#: Each worker's spans (test_tracing.py): the simulator's flag, or real vLLM's, after the harness's `--`.
_TRACING = {"sim": ["--otlp-traces-endpoint"], "vllm-cpu": ["--", "--otlp-traces-endpoint"]}
#: OpenTelemetry's batch delay in the workers (5 s by default): their spans arrive within 0.2 s.
_SPAN_DELAY_MS = "200"
#: Real vLLM: preparing (if the cache is cold) plus three workers loading on two cores.
_READY_TIMEOUT_S = {"sim": 60.0, "vllm-cpu": 900.0}


def _order(item: pytest.Item) -> tuple[str, bool, bool, int, str]:
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    engine, door = str(params.get("cluster", "")), str(params.get("front_door", params.get("door", "")))
    first = item.get_closest_marker("first_on_cluster") is not None
    crashes = item.get_closest_marker("crashes_workers") is not None
    line = (item.reportinfo()[1] or 0) if crashes else 0
    return engine, not first, crashes, line, door


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Here, group by engine (one cluster start each), then by front door; in each engine's group the
    ``first_on_cluster`` tests come first and the worker-crashing tests last (in the order they are
    written); the slots of the rest of the session are left as they are."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in item.path.parents]
    mine = sorted((items[i] for i in slots), key=_order)
    for slot, item in zip(slots, mine, strict=True):
        items[slot] = item


def _engines() -> list[str]:
    return ["external"] if os.environ.get("PPD_TEST_CLUSTER") else list(ENGINES)


@pytest.fixture(scope="session", params=FRONT_DOORS)
def front_door(request: pytest.FixtureRequest) -> str:
    """The front door a gateway test starts its gateway behind (front_doors.py)."""
    door: str = request.param
    return door


@pytest.fixture(scope="session")
def otlp() -> Iterator[OtlpReceiver]:
    """The session's OTLP receiver, up before any cluster starts."""
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="session", params=_engines())
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, otlp: OtlpReceiver
) -> Iterator[Cluster]:
    engine: str = request.param
    if engine == "external":
        yield Cluster(engine, json.loads(os.environ["PPD_TEST_CLUSTER"]), None)
        return
    tmp: Path = tmp_path_factory.mktemp(f"cluster-{engine}")
    shm_before = _multiprocessing_shm()
    proc = start(
        [*_COMMANDS[engine], *_COMMON, *_KV_EVENTS[engine], *_TRACING[engine], otlp.endpoint],
        tmp,
        f"cluster-{engine}",
        ready_timeout_s=_READY_TIMEOUT_S[engine],
        # The dev routes (POST /reset_prefix_cache) for the endpoints sweep (test_endpoints_sweep.py).
        env={
            "PYTHONHASHSEED": KV_EVENTS_SEED,
            "VLLM_SERVER_DEV_MODE": "1",
            "OTEL_BSP_SCHEDULE_DELAY": _SPAN_DELAY_MS,
        },
    )
    yield Cluster(engine, proc.ready, proc)
    code = proc.stop(timeout_s=120.0)
    assert code == 0, f"the {engine} cluster did not stop cleanly:\n{proc.stderr()[-3000:]}"
    if engine == "vllm-cpu":  # nothing of it may outlive the cluster
        for worker in proc.ready["workers"]:
            assert not _alive(int(worker["pid"])), f"{worker['id']} still runs after the cluster stopped"
            assert not _accepts(worker["url"]), f"{worker['id']}'s port is still open"
        # New segments nobody holds: another program's (a second test run, say) are still held.
        held = {path.name for path in held_shared_memory()}
        leaked = _multiprocessing_shm() - shm_before - held
        assert not leaked, f"shared memory left behind: {sorted(leaked)}"


def _multiprocessing_shm() -> set[str]:
    """Python multiprocessing's shared-memory segments and semaphores (vLLM's engine uses them)."""
    shm = Path("/dev/shm")
    return (
        {p.name for p in shm.iterdir() if p.name.startswith(("psm_", "sem.mp-"))} if shm.is_dir() else set()
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _accepts(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) == 0
