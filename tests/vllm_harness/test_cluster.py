"""The launcher's pure parts: core plan, connector config, failure policies, worker command."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest

from simulator.core.topology import Topology
from vllm_harness.cluster import (
    ClusterSettings,
    _explicit_ports,
    _free_port,
    core_plan,
    kv_events_config,
    kv_transfer_config,
    rss_of_group,
    shared_memory_of_group,
    worker_command,
)
from vllm_harness.prepare import Prepared

PREPARED = Prepared(
    python=Path("/venv/bin/python"),
    model=Path("/m"),
    served_model="llama-3-tiny-random",
    vllm_version="0.32.0",
)


@pytest.mark.parametrize(
    ("topology", "cores", "want"),
    [
        ("1P1D", [0, 1], {"P0": (0,), "D0": (1,)}),
        ("1P2D", [0, 1], {"P0": (0,), "D0": (1,), "D1": (1,)}),
        ("2P1D", [0, 1], {"P0": (0,), "P1": (0,), "D0": (1,)}),
        ("1P3D", [0, 1, 2, 3], {"P0": (0,), "D0": (1, 2, 3), "D1": (1, 2, 3), "D2": (1, 2, 3)}),
        ("1P1D", [3], {"P0": (3,), "D0": (3,)}),
        ("2R", [0, 1], {"R0": (0, 1), "R1": (0, 1)}),
    ],
)
def test_prefill_and_decode_get_disjoint_cores_when_there_are_two(
    topology: str, cores: list[int], want: dict[str, tuple[int, ...]]
) -> None:
    assert core_plan(Topology.parse(topology).workers, cores) == want


def test_connector_config_per_role() -> None:
    p = json.loads(kv_transfer_config("prefill", failure_policy="fail", cpu_buffer=True) or "")
    d = json.loads(kv_transfer_config("decode", failure_policy="recompute", cpu_buffer=False) or "")
    assert p == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_load_failure_policy": "fail",
        "kv_buffer_device": "cpu",
    }
    assert d == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
    }
    assert kv_transfer_config("replica", failure_policy="fail", cpu_buffer=True) is None


def test_worker_command_pins_sets_the_side_channel_and_asks_for_the_cpu_fixes() -> None:
    topology = Topology.parse("1P2D")
    settings = ClusterSettings(topology=topology, failure_policies={"D1": "recompute"})
    argv, env = worker_command(
        PREPARED, settings, topology.workers[2], http_port=8201, side_channel_port=5602, cores=(1,)
    )
    assert argv[:3] == ("taskset", "-c", "1")
    assert argv[3] == "/venv/bin/python"
    assert argv[4].endswith("remote/serve_worker.py")
    serve = argv[argv.index("--") + 1 :]
    assert serve[0] == "/m"
    assert serve[serve.index("--served-model-name") + 1] == "llama-3-tiny-random"
    config = json.loads(serve[serve.index("--kv-transfer-config") + 1])
    assert (config["kv_role"], config["kv_load_failure_policy"]) == ("kv_consumer", "recompute")
    assert argv[argv.index("--port") + 1] == "8201"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5602"
    assert env["PPD_VLLM_NIXL_NO_PROGRESS_THREAD"] == env["PPD_VLLM_NIXL_NO_KV_PIN"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_each_worker_names_its_trace_service_unless_the_environment_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topology = Topology.parse("1P1D")
    settings = ClusterSettings(topology=topology)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    names = [
        worker_command(PREPARED, settings, worker, http_port=1, side_channel_port=2)[1]["OTEL_SERVICE_NAME"]
        for worker in topology.workers
    ]
    assert names == ["vllm-P0", "vllm-D0"]
    monkeypatch.setenv("OTEL_SERVICE_NAME", "mine")
    _, env = worker_command(PREPARED, settings, topology.workers[1], http_port=1, side_channel_port=2)
    assert env["OTEL_SERVICE_NAME"] == "mine"


def test_the_cpu_fixes_are_off_unless_asked_for() -> None:
    topology = Topology.parse("1P1D")
    settings = ClusterSettings(topology=topology, pin=False, cpu_nixl_fixes=False)
    argv, env = worker_command(PREPARED, settings, topology.workers[0], http_port=1, side_channel_port=2)
    assert argv[0] == "/venv/bin/python"
    assert "PPD_VLLM_NIXL_NO_PROGRESS_THREAD" not in env
    assert "PPD_VLLM_NIXL_NO_KV_PIN" not in env


def test_kv_events_are_off_unless_given_ports_and_bind_every_interface() -> None:
    topology = Topology.parse("1P1D")
    settings = ClusterSettings(topology=topology, kv_events=True)
    plain, _ = worker_command(PREPARED, settings, topology.workers[0], http_port=1, side_channel_port=2)
    assert "--kv-events-config" not in plain
    argv, _ = worker_command(
        PREPARED, settings, topology.workers[1], http_port=1, side_channel_port=2, kv_event_ports=(5557, 5558)
    )
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    # vLLM binds an endpoint with "*" and connects to any other (docs/vllm-protocol.md 10.1).
    assert config == json.loads(kv_events_config(5557, 5558))
    assert (config["endpoint"], config["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5558")
    assert config["enable_kv_cache_events"] is True


def test_the_shared_memory_of_a_process_group_is_found(tmp_path: Path) -> None:
    """A fake /proc: group 40 holds one segment mapped and one open; group 41's is not ours."""

    def process(pid: int, pgid: int, maps: str, fds: dict[str, str]) -> None:
        folder = tmp_path / str(pid)
        (folder / "fd").mkdir(parents=True)
        (folder / "stat").write_text(f"{pid} (python (x)) S 1 {pgid} {pgid} 0 -1\n")
        (folder / "maps").write_text(maps)
        for fd, target in fds.items():
            (folder / "fd" / fd).symlink_to(target)

    process(
        40,
        40,
        "7f00-7f10 rw-s 00000000 00:1a 12 /dev/shm/psm_aa\n7f10-7f20 r-xp 0 08:01 3 /usr/lib/x.so\n",
        {},
    )
    process(43, 40, "7f00-7f10 rw-p 00000000 00:00 0 \n", {"5": "/dev/shm/sem.mp-bb", "6": "/tmp/other"})
    process(41, 41, "7f00-7f10 rw-s 00000000 00:1a 12 /dev/shm/psm_cc\n", {})
    (tmp_path / "self").mkdir()
    assert shared_memory_of_group(40, proc=tmp_path) == {Path("/dev/shm/psm_aa"), Path("/dev/shm/sem.mp-bb")}
    (tmp_path / "40" / "status").write_text("Name:\tpython\nVmRSS:\t  2000 kB\n")
    (tmp_path / "43" / "status").write_text("VmRSS:\t  500 kB\n")
    (tmp_path / "41" / "status").write_text("VmRSS:\t  9999 kB\n")
    assert rss_of_group(40, proc=tmp_path) == 2500 * 1024


def test_only_the_named_workers_get_bidirectional_kv_xfer() -> None:
    topology = Topology.parse("1P2D")
    settings = ClusterSettings(topology=topology, bidir_workers=frozenset({"P0", "D1"}))

    def extra(index: int) -> object:
        argv, _ = worker_command(
            PREPARED, settings, topology.workers[index], http_port=1, side_channel_port=2
        )
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        return config.get("kv_connector_extra_config")

    assert [extra(i) for i in range(3)] == [
        {"bidirectional_kv_xfer": True},
        None,
        {"bidirectional_kv_xfer": True},
    ]


def test_worker_ports_come_from_below_the_ephemeral_range_and_are_free() -> None:
    # A KV-event port is bound tens of seconds after it is chosen: one the kernel could hand to any
    # bind(0) or outgoing connection meanwhile was taken by another process (seen: "Address already
    # in use" from a decode worker's KV-event publisher).
    low, high = _explicit_ports()
    ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert high < ephemeral_start
    first = _free_port("127.0.0.1", rng=random.Random(7))
    assert low <= first <= high
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", first))
        taken.listen()
        # The same draw again meets the taken port first and moves on to a free one.
        again = _free_port("127.0.0.1", rng=random.Random(7))
    assert again != first
    assert low <= again <= high
    # A port chosen for another worker of the cluster is not bound yet: the draw skips it too.
    chosen: set[int] = set()
    first = _free_port("127.0.0.1", rng=random.Random(7), taken=chosen)
    again = _free_port("127.0.0.1", rng=random.Random(7), taken=chosen)
    assert again != first
    assert chosen == {first, again}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("32768\t60999\n", (20000, 32767)), ("40000 60999", (20000, 39999)), ("", (20000, 32767))],
)
def test_the_explicit_range_ends_below_the_kernels_ephemeral_one(
    tmp_path: Path, text: str, expected: tuple[int, int]
) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    assert _explicit_ports(path) == expected
    assert _explicit_ports(tmp_path / "missing") == (20000, 32767)
