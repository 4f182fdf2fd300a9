"""Every Envoy scenario under deploy/envoy is complete, passes `envoy --mode validate` and keeps its
admin interface on loopback; the descriptor set for transcoding comes from one command."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import descriptor_pb2

from decision_service.settings import Settings
from gateway.settings import TimeoutSettings
from tests.deploy.envoy_harness import SCENARIOS, render, validate

SCENARIO_NAMES = sorted(p.name for p in SCENARIOS.iterdir() if p.is_dir())
PLACEHOLDER = re.compile(r"\$\{([A-Z_]+)\}")


#: An operator's WORKER_ENDPOINTS for the picker: two decode workers by IP, the prefill workers by a
#: name Envoy resolves (a Kubernetes headless Service).
EXAMPLE_WORKERS = (
    "[{priority: 0, lb_endpoints: ["
    "{endpoint: {address: {socket_address: {address: 10.0.0.2, port_value: 8000}}}}, "
    "{endpoint: {address: {socket_address: {address: 10.0.0.3, port_value: 8000}}}}]}, "
    "{priority: 1, lb_endpoints: ["
    "{endpoint: {address: {socket_address: {address: vllm-prefill, port_value: 8100}}}}]}]"
)


def rendered(scenario: str, folder: Path, descriptor_set: Path) -> str:
    """The scenario's config with its example endpoints (where it reads any), as an operator would
    render it."""
    (folder / "endpoints").mkdir()
    endpoints = folder / "endpoints" / "endpoints.yaml"
    if _uses_endpoints(scenario):
        shutil.copy(SCENARIOS / scenario / "endpoints.yaml", endpoints)
    values = {
        "LISTEN_PORT": "10000",
        "ADMIN_PORT": "9901",
        "ENDPOINTS_PATH": str(endpoints),
        "DESCRIPTOR_PATH": str(descriptor_set),
        "PICKER_PORT": "9002",
        "FAILURE_MODE_ALLOW": "false",
        "WORKER_ENDPOINTS": EXAMPLE_WORKERS,
    }
    return render((SCENARIOS / scenario / "envoy.yaml").read_text(), values)


def _uses_endpoints(scenario: str) -> bool:
    """Whether the scenario reads an endpoint list from a file."""
    return "${ENDPOINTS_PATH}" in (SCENARIOS / scenario / "envoy.yaml").read_text()


def test_every_scenario_exists() -> None:
    assert {"decision", "gateway", "picker"} <= set(SCENARIO_NAMES)


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_scenario_folder_has_config_endpoints_and_verify_script(scenario: str) -> None:
    folder = SCENARIOS / scenario
    wanted = {"envoy.yaml", "verify.sh", "README.md"} if scenario == "picker" else {"envoy.yaml", "verify.sh"}
    if _uses_endpoints(scenario):
        wanted.add("endpoints.yaml")
    assert wanted <= {p.name for p in folder.iterdir()}


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_config_passes_envoy_validate(scenario: str, tmp_path: Path, descriptor_set: Path) -> None:
    result = validate(rendered(scenario, tmp_path, descriptor_set), tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "OK" in output
    # Validation still says OK when it rejects the endpoint file; we want that caught too.
    assert "rejected" not in output, output


def test_validate_rejects_a_broken_config(tmp_path: Path, descriptor_set: Path) -> None:
    """The validator really reads the config: a misspelled field fails it."""
    broken = rendered("decision", tmp_path, descriptor_set).replace("lb_policy:", "lb_polcy:")
    result = validate(broken, tmp_path)
    assert result.returncode != 0


def test_transcoder_rejects_a_missing_descriptor_set(tmp_path: Path, descriptor_set: Path) -> None:
    text = rendered("decision", tmp_path, descriptor_set)
    text = text.replace(str(descriptor_set), str(tmp_path / "no.pb"))
    assert validate(text, tmp_path).returncode != 0


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_admin_binds_loopback_only(scenario: str, tmp_path: Path, descriptor_set: Path) -> None:
    config = yaml.safe_load(rendered(scenario, tmp_path, descriptor_set))
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_every_placeholder_is_documented(scenario: str) -> None:
    text = (SCENARIOS / scenario / "envoy.yaml").read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    used = set(PLACEHOLDER.findall(text)) - set(PLACEHOLDER.findall(header))
    documented = set(re.findall(r"^#\s+([A-Z_]{4,})\s", header, flags=re.MULTILINE))
    assert used <= documented, f"undocumented placeholders: {used - documented}"


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_render_refuses_a_missing_value(scenario: str) -> None:
    with pytest.raises(KeyError):
        render((SCENARIOS / scenario / "envoy.yaml").read_text(), {})


def test_decision_cluster_is_grpc_with_health_checks_outliers_and_retries(
    tmp_path: Path, descriptor_set: Path
) -> None:
    config = yaml.safe_load(rendered("decision", tmp_path, descriptor_set))
    (cluster,) = config["static_resources"]["clusters"]
    protocol = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    options = cluster["typed_extension_protocol_options"][protocol]
    assert "http2_protocol_options" in options["explicit_http_config"]
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"]["service_name"] == "ppd.decision.v1.DecisionService"
    assert cluster["outlier_detection"]["consecutive_gateway_failure"] > 0
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    unary = next(r for r in routes if r["match"].get("prefix") == "/ppd.decision.v1.DecisionService/")
    assert "unavailable" in unary["route"]["retry_policy"]["retry_on"].split(",")
    assert unary["route"]["timeout"] != "0s"


def test_decision_cluster_keepalive_agrees_with_the_servers_ping_policy(
    tmp_path: Path, descriptor_set: Path
) -> None:
    """Envoy pings each replica no more often than the server's policy allows (twice its minimum
    interval, for jitter), or the replica answers GOAWAY too_many_pings and Envoy reconnects."""
    config = yaml.safe_load(rendered("decision", tmp_path, descriptor_set))
    (cluster,) = config["static_resources"]["clusters"]
    protocol = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    http2 = cluster["typed_extension_protocol_options"][protocol]["explicit_http_config"]
    keepalive = http2["http2_protocol_options"]["connection_keepalive"]
    interval_s = float(keepalive["interval"].removesuffix("s"))
    assert interval_s >= 2 * Settings().keepalive_min_ping_interval_s
    assert float(keepalive["timeout"].removesuffix("s")) > 0


def test_gateway_cluster_hashes_on_the_session_header(tmp_path: Path, descriptor_set: Path) -> None:
    config = yaml.safe_load(rendered("gateway", tmp_path, descriptor_set))
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["lb_policy"] in {"RING_HASH", "MAGLEV"}
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["hash_policy"][0]["header"]["header_name"].lower() == "x-session-id"


def test_descriptor_set_from_one_command_holds_the_service(descriptor_set: Path) -> None:
    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes())
    services = {f"{f.package}.{s.name}" for f in files.file for s in f.service}
    assert "ppd.decision.v1.DecisionService" in services


@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_verify_script_is_valid_bash(scenario: str) -> None:
    subprocess.run(["bash", "-n", str(SCENARIOS / scenario / "verify.sh")], check=True)


def _picker_config(tmp_path: Path, descriptor_set: Path) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(rendered("picker", tmp_path, descriptor_set))
    return config


def _picker_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters: list[dict[str, Any]] = hcm["http_filters"]
    return filters


def test_picker_strips_the_clients_routing_headers_before_ext_proc(
    tmp_path: Path, descriptor_set: Path
) -> None:
    filters = _picker_filters(_picker_config(tmp_path, descriptor_set))
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    strip = filters[0]["typed_config"]
    removed = {m["remove"] for m in strip["mutations"]["request_mutations"]}
    assert removed == {"x-gateway-destination-endpoint", "x-prefiller-host-port"}


def test_picker_ext_proc_mode_fails_closed_by_default_and_waits_for_a_p_leg(
    tmp_path: Path, descriptor_set: Path
) -> None:
    ext = _picker_filters(_picker_config(tmp_path, descriptor_set))[1]["typed_config"]
    assert ext["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "response_header_mode": "SEND",
        "response_body_mode": "NONE",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }
    assert ext["failure_mode_allow"] is False
    # Two P attempts of the gateway's default prefill timeout fit in one message's wait.
    assert float(ext["message_timeout"].removesuffix("s")) > 2 * TimeoutSettings().prefill_s
    assert ext["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    # The endpoint that answered reaches the picker with the response headers (picker_failover.py).
    assert ext["metadata_options"]["forwarding_namespaces"]["untyped"] == ["envoy.lb"]


def test_picker_routes_on_the_destination_metadata_retrying_before_the_first_byte_only(
    tmp_path: Path, descriptor_set: Path
) -> None:
    config = _picker_config(tmp_path, descriptor_set)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    workers = clusters["workers"]
    assert workers["type"] == "STRICT_DNS"
    assert [locality["priority"] for locality in workers["load_assignment"]["endpoints"]] == [0, 1]
    (policy,) = workers["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]
    assert override["name"] == "envoy.load_balancing_policies.override_host"
    # Only the picker can write envoy.lb metadata: a client's header never routes.
    assert override["typed_config"]["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    ]
    assert override["typed_config"]["selected_host_key"] == {
        "key": "envoy.lb",
        "path": [{"key": "x-gateway-destination-endpoint-served"}],
    }
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["timeout"] == "0s"
    retry = route["route"]["retry_policy"]
    # Never a retry once the worker may have started: no 5xx, reset or timeout conditions.
    assert set(retry["retry_on"].split(",")) == {"connect-failure", "reset"}
    assert retry["num_retries"] == 1
    (check,) = clusters["picker"]["health_checks"]
    assert check["grpc_health_check"]["service_name"] == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert check["no_traffic_interval"] == "2s"


def _picker_gie_config(tmp_path: Path) -> dict[str, Any]:
    values = {
        "LISTEN_PORT": "10000",
        "ADMIN_PORT": "9901",
        "PICKER_PORT": "9002",
        "WORKER_ENDPOINTS": EXAMPLE_WORKERS,
    }
    text = render((SCENARIOS / "picker" / "envoy-gie.yaml").read_text(), values)
    result = validate(text, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def test_picker_gie_variant_passes_validate_with_full_duplex_bodies(tmp_path: Path) -> None:
    """The GIE-style config (what GIE's gateways send their picker): both bodies FULL_DUPLEX_STREAMED,
    trailers SEND (Envoy requires them with that body mode), the rest as our own config."""
    config = _picker_gie_config(tmp_path)
    ext = _picker_filters(config)[1]["typed_config"]
    assert ext["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_header_mode": "SEND",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SEND",
    }
    assert ext["failure_mode_allow"] is False
    assert ext["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    (tmp_path / "ours").mkdir()
    ours = _picker_config(tmp_path / "ours", tmp_path / "unused.pb")
    assert [f["name"] for f in _picker_filters(config)] == [f["name"] for f in _picker_filters(ours)]
    assert _picker_filters(config)[0] == _picker_filters(ours)[0]  # the client's headers stripped too
    assert config["static_resources"]["clusters"] == ours["static_resources"]["clusters"]


def test_validate_rejects_full_duplex_without_trailers(tmp_path: Path) -> None:
    """Envoy itself refuses a FULL_DUPLEX_STREAMED body with its trailers skipped: why the variant
    sends them."""
    values = {
        "LISTEN_PORT": "10000",
        "ADMIN_PORT": "9901",
        "PICKER_PORT": "9002",
        "WORKER_ENDPOINTS": EXAMPLE_WORKERS,
    }
    text = render((SCENARIOS / "picker" / "envoy-gie.yaml").read_text(), values)
    broken = text.replace("request_trailer_mode: SEND", "request_trailer_mode: SKIP")
    assert broken != text
    assert validate(broken, tmp_path).returncode != 0
    # The response body off (NONE): its trailers may be skipped (docs/envoy-extproc.md).
    request_only = text.replace("response_body_mode: FULL_DUPLEX_STREAMED", "response_body_mode: NONE")
    request_only = request_only.replace("response_trailer_mode: SEND", "response_trailer_mode: SKIP")
    result = validate(request_only, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
