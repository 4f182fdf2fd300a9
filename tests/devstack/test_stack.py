from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import sys
from pathlib import Path

import pytest

from devstack.gateway_config import gateway_config
from devstack.settings import StackSettings
from devstack.stack import StackCommands, parse_settings, run_stack
from devstack.supervisor import ChildError, ChildSpec, Supervisor
from tests.support.polling import eventually

pytestmark = pytest.mark.integration

STANDIN = str(Path(__file__).with_name("standin.py"))
CLUSTER = {
    "topology": "1P3D",
    "workers": [
        {"id": "P0", "role": "prefill", "url": "http://127.0.0.1:1001"},
        {"id": "D0", "role": "decode", "url": "http://127.0.0.1:1002"},
    ],
}


def standin(*args: str) -> tuple[str, ...]:
    return (sys.executable, STANDIN, *args)


async def test_a_ready_child_reports_its_json_line_and_stops_on_sigterm() -> None:
    sup = Supervisor()
    child = await sup.start(ChildSpec("svc", standin("--ready", '{"grpc": 5}'), 30))
    assert child.ready == {"grpc": 5}
    assert await sup.stop_all() == {"svc": 0}


async def test_a_child_without_a_ready_line_is_returned_at_once_and_its_stdout_kept() -> None:
    # A third-party server (SGLang's router in ppd-bench-routers) prints logs, not our JSON line.
    sup = Supervisor()
    try:
        child = await sup.start(ChildSpec("peer", standin("--bad-ready"), 30, ready_line=False))
        assert child.ready == {}

        async def printed() -> bool:
            return "not json" in child.tail

        await eventually(printed)
    finally:
        assert await sup.stop_all() == {"peer": 0}


@pytest.mark.parametrize(
    ("args", "deadline", "reason"),
    [
        (("--stderr", "port in use", "--exit-before", "3"), 60.0, "exited with code 3 before it was ready"),
        (("--bad-ready",), 60.0, "ready line is not a JSON object: 'not json'"),
        (("--silent",), 0.5, "no ready line within 0.5 s"),  # never prints: the deadline always wins
    ],
)
async def test_a_child_that_cannot_get_ready_is_named_with_the_reason(
    args: tuple[str, ...], deadline: float, reason: str
) -> None:
    sup = Supervisor()
    try:
        with pytest.raises(ChildError) as exc:
            await sup.start(ChildSpec("decision service", standin(*args), deadline))
    finally:
        await sup.stop_all()
    assert exc.value.name == "decision service"
    assert exc.value.reason == reason
    if "--stderr" in args:
        assert "port in use" in exc.value.tail


async def test_a_missing_program_is_a_child_error() -> None:
    with pytest.raises(ChildError, match="cannot start"):
        await Supervisor().start(ChildSpec("x", ("/nonexistent/ppd-binary",), 1))


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    sup = Supervisor(grace_s=0.3)
    await sup.start(ChildSpec("stubborn", standin("--ignore-term"), 30))
    assert await sup.stop_all() == {"stubborn": -9}


async def test_a_child_dying_later_is_reported_with_its_last_words() -> None:
    relayed: list[str] = []
    sup = Supervisor(relay=relayed.append)
    await sup.start(ChildSpec("gateway", standin("--exit-after", "4"), 30))
    failure = await sup.wait_any_exit()
    await sup.stop_all()
    assert failure.name == "gateway"
    assert failure.reason == "exited with code 4 while the stack was running"
    assert "bye" in failure.tail
    assert "[gateway] bye" in relayed


def test_gateway_config_comes_from_the_ready_lines() -> None:
    import tomllib

    text = gateway_config(StackSettings(mode="fraction:0.5"), CLUSTER, {"grpc": 7001, "metrics": 7002})
    config = tomllib.loads(text)
    assert config["mode"] == "fraction:0.5"
    assert config["allow_mode_header"] is True  # benchmarks ask for their mode (ppd-bench --send-mode)
    assert config["decision"] == {"address": "127.0.0.1:7001", "table_key": "1P3D/llama-3.1-8b"}
    assert config["workers"] == CLUSTER["workers"]
    with pytest.raises(ValueError, match="no workers"):
        gateway_config(StackSettings(), {"workers": []}, {"grpc": 1})
    with pytest.raises(ValueError, match="grpc"):
        gateway_config(StackSettings(), CLUSTER, {})


class _Out(io.StringIO):
    """Captures what the stack prints and signals once its ready line is out."""

    def __init__(self) -> None:
        super().__init__()
        self.ready = asyncio.Event()

    def write(self, s: str) -> int:
        if s.endswith("\n"):
            self.ready.set()
        return super().write(s)


def _commands(*, gateway_args: tuple[str, ...] = (), cluster_args: tuple[str, ...] = ()) -> StackCommands:
    return StackCommands(
        cluster=lambda s: standin("--ready", json.dumps(CLUSTER), *cluster_args),
        decision=lambda s: standin("--ready", '{"grpc": 7001, "metrics": 7002}'),
        gateway=lambda s, config: standin(
            "--ready", f'{{"http": {s.port}}}', "--config", str(config), *gateway_args
        ),
    )


async def test_the_stack_starts_in_order_prints_urls_and_stops_cleanly(tmp_path: Path) -> None:
    out, stop = _Out(), asyncio.Event()
    settings = StackSettings(port=18000, config_dir=tmp_path, ready_timeout_s=30)
    task = asyncio.create_task(run_stack(settings, _commands(), out, stop))
    await out.ready.wait()
    first = json.loads(out.getvalue().splitlines()[0])
    assert first["gateway"] == "http://127.0.0.1:18000"
    assert first["decision"] == {"grpc": 7001, "metrics": 7002}
    assert "curl -sN http://127.0.0.1:18000/v1/chat/completions" in out.getvalue()
    assert "openai.OpenAI(base_url=" in out.getvalue()
    assert (tmp_path / "gateway.toml").exists()
    stop.set()
    assert await task == 0


async def test_the_stack_stops_everything_when_a_child_dies(caplog: pytest.LogCaptureFixture) -> None:
    out, stop = _Out(), asyncio.Event()
    code = await run_stack(StackSettings(port=0), _commands(gateway_args=("--exit-after", "2")), out, stop)
    assert code == 1
    assert "gateway: exited with code 2 while the stack was running" in caplog.text


async def test_the_stack_gives_up_when_a_child_cannot_start(caplog: pytest.LogCaptureFixture) -> None:
    out, stop = _Out(), asyncio.Event()
    commands = _commands(cluster_args=("--exit-before", "5", "--stderr", "no such topology"))
    assert await run_stack(StackSettings(), commands, out, stop) == 1
    assert "simulator cluster: exited with code 5 before it was ready" in caplog.text
    assert "no such topology" in caplog.text
    assert out.getvalue() == ""


async def test_a_signal_while_children_start_stops_those_started_so_far(tmp_path: Path) -> None:
    """Ctrl-C/SIGTERM during start-up: the decision service never gets ready (its deadline is an hour
    away); ppd-up must not wait for it, but stop the cluster and it at once and exit 0."""
    out, stop = _Out(), asyncio.Event()
    pids: dict[str, int] = {}

    def relay(line: str) -> None:
        name, _, text = line.partition("] ")
        if text.startswith("pid "):
            pids[name.removeprefix("[")] = int(text.split()[1])
            if len(pids) == 2:
                stop.set()  # what ppd-up's SIGINT/SIGTERM handler does

    commands = StackCommands(
        cluster=lambda s: standin("--say-pid", "--ready", json.dumps(CLUSTER)),
        decision=lambda s: standin("--say-pid", "--silent"),
        gateway=lambda s, config: standin("--ready", f'{{"http": {s.port}}}'),
    )
    settings = StackSettings(config_dir=tmp_path, ready_timeout_s=3600)
    async with asyncio.timeout(120):  # without the fix: an hour, the decision service's deadline
        code = await run_stack(settings, commands, out, stop, relay=relay)
    assert code == 0
    assert set(pids) == {"simulator cluster", "decision service"}
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped and reaped
    assert out.getvalue() == ""  # never announced as up
    assert not (tmp_path / "gateway.toml").exists()


@pytest.mark.parametrize(
    ("redis", "reason"),
    [
        (("/nonexistent/redis-server",), "redis: cannot start '/nonexistent/redis-server'"),
        (
            standin("--exit-before", "2", "--stderr", "bad config"),
            "redis: exited with code 2 before it was ready",
        ),
    ],
)
async def test_gateways_without_a_working_redis_stop_the_stack_naming_it(
    redis: tuple[str, ...], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    out, stop = _Out(), asyncio.Event()
    commands = dataclasses.replace(_commands(), redis=lambda sock: redis)
    assert await run_stack(StackSettings(gateways=3, ready_timeout_s=30), commands, out, stop) == 1
    assert reason in caplog.text
    assert out.getvalue() == ""


def test_ppd_up_refuses_zero_gateways(capsys: pytest.CaptureFixture[str]) -> None:
    from devstack.stack import main

    with pytest.raises(SystemExit) as exc:
        main(["--gateways", "0"])
    assert exc.value.code == 2
    assert "--gateways: must be at least 1" in capsys.readouterr().err


def test_the_engine_picks_the_cluster_command() -> None:
    real = StackCommands.real(python="py")
    sim = real.cluster(StackSettings(topology="2P2D"))
    assert sim[:4] == ("py", "-m", "simulator", "cluster")
    assert sim[sim.index("--topology") + 1] == "2P2D"
    vllm = real.cluster(StackSettings(topology="1P1D", engine="vllm-cpu"))
    assert vllm == ("py", "-m", "vllm_harness", "cluster", "--topology", "1P1D")
    # A longer start-up limit than the real cluster's own per-worker one (240 s) is passed on.
    slow = real.cluster(StackSettings(topology="1P1D", engine="vllm-cpu", ready_timeout_s=600.0))
    assert slow == ("py", "-m", "vllm_harness", "cluster", "--topology", "1P1D", "--ready-timeout", "600")


async def test_the_banner_names_the_clusters_own_model(tmp_path: Path) -> None:
    out, stop = _Out(), asyncio.Event()
    cluster = {**CLUSTER, "model": "llama-3-tiny-random"}
    commands = StackCommands(
        cluster=lambda s: standin("--ready", json.dumps(cluster)),
        decision=lambda s: standin("--ready", '{"grpc": 7001, "metrics": 7002}'),
        gateway=lambda s, config: standin("--ready", f'{{"http": {s.port}}}'),
    )
    settings = StackSettings(port=18001, config_dir=tmp_path, ready_timeout_s=30, engine="vllm-cpu")
    task = asyncio.create_task(run_stack(settings, commands, out, stop))
    await out.ready.wait()
    stop.set()
    assert await task == 0
    assert '"model": "llama-3-tiny-random"' in out.getvalue()
    assert "meta-llama" not in out.getvalue()
    assert "real vLLM workers (CPU)" in out.getvalue()


def test_ppd_up_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    from devstack.stack import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--topology" in text
    assert "--data-plane {python,envoy}" in text


def test_real_vllm_defaults_to_its_own_table_and_the_simulator_to_the_h100_ones() -> None:
    # The real-vLLM table lives in its own folder: in tables/ its key (1P1D/...) would sort first and
    # become the decision service's default for callers naming no table.
    sim = parse_settings([])[0]
    assert (sim.topology, sim.tables, sim.model_label) == ("1P3D", Path("tables"), "llama-3.1-8b")
    real = parse_settings(["--engine", "vllm-cpu"])[0]
    assert (real.topology, real.tables, real.model_label) == (
        "1P1D",
        Path("tables/vllm-cpu"),
        "tiny-llama-cpu",
    )
    given = parse_settings(
        ["--engine", "vllm-cpu", "--tables", "t", "--model-label", "m", "--topology", "1P2D"]
    )[0]
    assert (given.topology, given.tables, given.model_label) == ("1P2D", Path("t"), "m")


KV_CLUSTER = {
    "workers": [
        {"id": "P0", "role": "prefill", "url": "http://127.0.0.1:1001"}
        | {"kv_events": "tcp://127.0.0.1:5550", "kv_events_replay": "tcp://127.0.0.1:5560"},
        {"id": "D0", "role": "decode", "url": "http://127.0.0.1:1002"}
        | {"kv_events": "tcp://127.0.0.1:5551", "kv_events_replay": "tcp://127.0.0.1:5561"},
    ]
}


@pytest.mark.parametrize(("engine", "block"), [("sim", 16), ("vllm-cpu", 32)])
def test_kv_events_wire_every_workers_publisher_into_the_gateway(engine: str, block: int) -> None:
    import tomllib

    settings = parse_settings(["--kv-events", "--engine", engine], {"PYTHONHASHSEED": "42"})[0]
    config = tomllib.loads(gateway_config(settings, KV_CLUSTER, {"grpc": 7001}))
    assert config["kv_events"] == {
        "hash_seed": "42",
        "block_size": block,
        "endpoints": {"P0": "tcp://127.0.0.1:5550", "D0": "tcp://127.0.0.1:5551"},
        "replay_endpoints": {"P0": "tcp://127.0.0.1:5560", "D0": "tcp://127.0.0.1:5561"},
    }
    assert "routing" not in config
    # The cluster is told the same block size, and to publish.
    argv = StackCommands.real(python="py").cluster(settings)
    assert argv[argv.index("--block-size") + 1] == str(block)
    assert ("--kv-events" in argv) if engine == "vllm-cpu" else ("--kv-events-config" in argv)
    # Unset, vLLM's fixed seed on both sides; off, no section and no flags.
    assert parse_settings(["--kv-events"], {})[0].kv_hash_seed == ""
    plain = parse_settings(["--engine", engine], {"PYTHONHASHSEED": "42"})[0]
    assert "kv_events" not in tomllib.loads(gateway_config(plain, KV_CLUSTER, {"grpc": 7001}))
    assert not {"--block-size", "--kv-events", "--kv-events-config"} & set(
        StackCommands.real().cluster(plain)
    )


def test_kv_events_from_a_cluster_that_publishes_none_is_a_clear_error() -> None:
    settings = parse_settings(["--kv-events"], {})[0]
    with pytest.raises(ValueError, match="worker P0 publishes no KV events"):
        gateway_config(settings, CLUSTER, {"grpc": 7001})


@pytest.mark.parametrize("engine", ["sim", "vllm-cpu"])
def test_bidir_makes_every_worker_bidirectional_and_lets_the_gateway_serve_it(engine: str) -> None:
    import tomllib

    settings = parse_settings(["--bidir", "--engine", engine], {})[0]
    argv = StackCommands.real(python="py").cluster(settings)
    assert argv[argv.index("--bidir-workers") + 1] == "all"
    assert tomllib.loads(gateway_config(settings, CLUSTER, {"grpc": 7001}))["routing"] == {"bidir": True}
    plain = parse_settings(["--engine", engine], {})[0]
    assert "--bidir-workers" not in StackCommands.real().cluster(plain)


def test_slo_ttft_p99_ms_turns_the_gateways_slo_controller_on() -> None:
    import tomllib

    from gateway.settings import Settings

    settings = parse_settings(["--slo-ttft-p99-ms", "750"], {})[0]
    config = tomllib.loads(gateway_config(settings, CLUSTER, {"grpc": 7001}))
    assert config["slo"] == {"ttft_p99_ms": 750.0}
    assert Settings.from_mapping(config).slo.controller.enabled  # the gateway accepts what ppd-up writes
    off = tomllib.loads(gateway_config(parse_settings([], {})[0], CLUSTER, {"grpc": 7001}))
    assert "slo" not in off


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        ("0", "must be a positive number of milliseconds, not 0"),
        ("-5", "must be a positive number of milliseconds, not -5"),
        ("inf", "must be a positive number of milliseconds, not inf"),
        ("fast", "not a number of milliseconds: 'fast'"),
    ],
)
def test_ppd_up_refuses_an_slo_target_that_is_not_a_positive_time(
    value: str, refusal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_settings(["--slo-ttft-p99-ms", value], {})
    assert exc.value.code == 2
    assert refusal in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (["--data-plane", "envoy", "--gateways", "2"], "--data-plane envoy runs one picker"),
        (["--data-plane", "quic"], "invalid choice: 'quic'"),
    ],
)
def test_ppd_up_refuses_a_data_plane_it_cannot_run(
    args: list[str], refusal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from devstack.stack import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert refusal in capsys.readouterr().err


def test_the_data_plane_is_python_unless_asked_and_envoy_starts_the_picker() -> None:
    assert parse_settings([])[0].data_plane == "python"
    settings = parse_settings(["--data-plane", "envoy", "--engine", "vllm-cpu"])[0]
    assert (settings.data_plane, settings.gateways) == ("envoy", 1)
    argv = StackCommands.real(python="py").picker(settings, Path("g.toml"))
    assert argv == (
        "py", "-m", "gateway", "picker", "--config", "g.toml", "--grpc-port", "0", "--metrics-port", "0",
    )  # fmt: skip


def test_the_picker_scenarios_envoy_is_rendered_on_loopback_with_the_pickers_port() -> None:
    import yaml

    from devstack.data_plane import picker_envoy_config

    workers = [{"id": "D0", "role": "decode", "url": "http://127.0.0.1:8200"}]
    config = yaml.safe_load(picker_envoy_config(port=18002, picker_grpc=9002, workers=workers))
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 18002}
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 0}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    (host,) = clusters["picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert host["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9002}
    (locality,) = clusters["workers"]["load_assignment"]["endpoints"]
    (worker,) = locality["lb_endpoints"]
    assert worker["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8200}


async def test_an_envoy_data_plane_refuses_workers_addressed_by_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Envoy's workers cluster lists workers by ip:port, the picker names them so: nothing resolves names."""
    out, stop = _Out(), asyncio.Event()
    p0 = {"id": "P0", "role": "prefill", "url": "http://127.0.0.1:1001"}
    named = {"workers": [p0, {"id": "D0", "role": "decode", "url": "http://localhost:1002"}]}
    commands = dataclasses.replace(
        _commands(),
        cluster=lambda s: standin("--ready", json.dumps(named)),
        picker=lambda s, config: ("/nonexistent/picker",),  # never reached
    )
    settings = StackSettings(data_plane="envoy", config_dir=tmp_path, ready_timeout_s=30)
    assert await run_stack(settings, commands, out, stop) == 1
    assert "worker D0 is addressed by name (http://localhost:1002)" in caplog.text
    assert "cannot start '/nonexistent/picker'" not in caplog.text
    assert out.getvalue() == ""
