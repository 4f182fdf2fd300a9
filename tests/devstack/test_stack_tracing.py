"""``ppd-up --tracing-endpoint``: what each child is told (devstack/tracing.py), and that without the flag
every config and command line stays as it was. The stack traced end to end with real processes is
test_stack_real.py's."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from devstack.banner import banner
from devstack.gateway_config import gateway_config
from devstack.stack import StackCommands, main, parse_settings
from gateway.settings import Settings

CLUSTER = {
    "workers": [
        {"id": "P0", "role": "prefill", "url": "http://127.0.0.1:1001"},
        {"id": "D0", "role": "decode", "url": "http://127.0.0.1:1002"},
    ]
}
DECISION = {"grpc": 7001, "metrics": 7002}
RECEIVER = "http://127.0.0.1:4317"
SECTION = f'\n[tracing]\nenabled = true\nendpoint = "{RECEIVER}"\nsampling_ratio = 1.0\n'


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--engine", "vllm-cpu"],
        ["--data-plane", "envoy"],
        ["--kv-events", "--bidir", "--slo-ttft-p99-ms", "500"],
    ],
)
def test_the_flag_adds_only_tracing_and_without_it_nothing_changes(args: list[str]) -> None:
    commands = StackCommands.real(python="py")
    plain = parse_settings(args, {})[0]
    traced = parse_settings([*args, "--tracing-endpoint", RECEIVER], {})[0]
    cluster = {
        "workers": [w | {"kv_events": "tcp://a", "kv_events_replay": "tcp://b"} for w in CLUSTER["workers"]]
    }
    plain_text, traced_text = (gateway_config(s, cluster, DECISION) for s in (plain, traced))
    # Without the flag: no [tracing]; with it, the same text byte for byte plus the one section.
    assert "tracing" not in plain_text
    assert SECTION in traced_text
    assert traced_text.replace(SECTION, "", 1) == plain_text
    # The gateway and the picker (the same file) read it as tracing on, to the receiver.
    read = Settings.from_mapping(tomllib.loads(traced_text)).tracing
    assert (read.enabled, read.endpoint, read.sampling_ratio) == (True, RECEIVER, 1.0)
    assert not Settings.from_mapping(tomllib.loads(plain_text)).tracing.enabled
    # The decision service and the workers: their plain command line, then the tracing flags.
    flags = ("--tracing", "--tracing-endpoint", RECEIVER, "--tracing-sampling-ratio", "1.0")
    assert commands.decision(traced) == (*commands.decision(plain), *flags)
    worker_flags: tuple[str, ...] = ("--otlp-traces-endpoint", RECEIVER)
    if plain.engine == "vllm-cpu":
        worker_flags = ("--", *worker_flags)  # vLLM's own flag, after the harness's --
    assert commands.cluster(traced) == (*commands.cluster(plain), *worker_flags)
    assert not any(
        "tracing" in arg or "otlp" in arg for arg in commands.cluster(plain) + commands.decision(plain)
    )
    assert commands.gateway(traced, Path("g.toml")) == commands.gateway(plain, Path("g.toml"))
    assert commands.picker(traced, Path("g.toml")) == commands.picker(plain, Path("g.toml"))


def test_the_sampling_ratio_reaches_the_gateway_and_the_decision_service() -> None:
    settings = parse_settings(
        ["--tracing-endpoint", "https://collector:4317", "--tracing-sampling-ratio", "0.25"]
    )[0]
    tracing = Settings.from_mapping(tomllib.loads(gateway_config(settings, CLUSTER, DECISION))).tracing
    assert (tracing.endpoint, tracing.sampling_ratio) == ("https://collector:4317", 0.25)
    argv = StackCommands.real(python="py").decision(settings)
    assert argv[argv.index("--tracing-sampling-ratio") + 1] == "0.25"
    assert parse_settings(["--tracing-endpoint", RECEIVER])[0].tracing.sampling_ratio == 1.0  # every trace


def test_the_banner_says_where_traces_go_only_when_they_do() -> None:
    traced = parse_settings(["--tracing-endpoint", RECEIVER, "--tracing-sampling-ratio", "0.5"])[0]
    text = banner("http://127.0.0.1:8000", traced, CLUSTER, DECISION)
    assert f"every process exports to {RECEIVER}, sampling ratio 0.5" in text
    assert "traces" not in banner("http://127.0.0.1:8000", parse_settings([])[0], CLUSTER, DECISION)


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (
            ["--tracing-endpoint", "127.0.0.1:4317"],
            "tracing.endpoint must be http://host:port or https://host:port",
        ),
        (
            ["--tracing-endpoint", "grpc://jaeger:4317"],
            "give --tracing-endpoint as an OTLP/gRPC receiver's URL",
        ),
        (
            ["--tracing-endpoint", RECEIVER, "--tracing-sampling-ratio", "1.5"],
            "must be between 0 and 1, got 1.5",
        ),
        (
            ["--tracing-endpoint", RECEIVER, "--tracing-sampling-ratio", "nan"],
            "must be between 0 and 1, got nan",
        ),
        (["--tracing-sampling-ratio", "0.5"], "--tracing-sampling-ratio needs --tracing-endpoint"),
        (["--tracing-endpoint", RECEIVER, "--tracing-sampling-ratio", "all"], "invalid float value: 'all'"),
    ],
)
def test_ppd_up_refuses_tracing_it_cannot_do_before_starting_anything(
    args: list[str], refusal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert refusal in capsys.readouterr().err


def test_ppd_up_help_describes_the_tracing_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--tracing-endpoint URL export OpenTelemetry traces from every process" in text
    assert "--tracing-sampling-ratio R with --tracing-endpoint, the share of requests traced" in text
