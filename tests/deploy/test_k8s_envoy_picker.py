"""deploy/k8s/components/envoy-picker without a cluster: every shape overlay with the component
passes the strict Kubernetes API schemas (and renders as `kubectl kustomize` renders it, where
kubectl is installed); Envoy's ConfigMap is the ONE template rendered (tests/deploy/k8s_envoy_config.py)
and passes the real `envoy --mode validate`; ports, probes, flags and the picker's config agree with
`ppd-gateway picker --help`, the Envoy config and the overlay; Envoy's readiness probe and drain hook
run for real against the real Envoy's admin interface."""

from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kubernetes_validate.utils as kv
import pytest
import yaml

from gateway.picker_server import HEALTH_NAMES
from tests.deploy import k8s_envoy_config as cfg
from tests.deploy.envoy_harness import Envoy, envoy_binary, validate
from tests.deploy.kustomize import (
    Manifest,
    UnsupportedKustomizationError,
    load_documents,
    render,
    user_kustomization,
)
from tests.deploy.picker_cli import flags, picker_help_flags
from tests.deploy.processes import REPO

K8S = REPO / "deploy" / "k8s"
COMPONENT = K8S / "components" / "envoy-picker"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSIONS = ("1.30", "1.37")
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Manifest, ...]]:
    """Each shape overlay with the component, rendered from a kustomization as operators write it."""
    root = tmp_path_factory.mktemp("with-envoy-picker")
    return {
        overlay: tuple(render(user_kustomization(root / overlay, [K8S / "overlays" / overlay], [COMPONENT])))
        for overlay in OVERLAYS
    }


def one(docs: tuple[Manifest, ...], kind: str, name: str) -> Manifest:
    (hit,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return hit


def containers(doc: Manifest) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["spec"]["template"]["spec"]["containers"]}


def ports_of(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in c.get("ports", [])}


def component_docs() -> list[Manifest]:
    return [
        d
        for f in sorted(COMPONENT.glob("*.yaml"))
        if f.name != "kustomization.yaml"
        for d in load_documents(f)
    ]


def envoy_pod(docs: tuple[Manifest, ...]) -> tuple[Manifest, dict[str, Any], dict[str, Any]]:
    deployment = one(docs, "Deployment", "ppd-envoy")
    by_name = containers(deployment)
    return deployment, by_name["envoy"], by_name["picker"]


def envoy_config() -> dict[str, Any]:
    (config_map,) = load_documents(cfg.CONFIG_MAP)
    return dict(yaml.safe_load(config_map["data"]["envoy.yaml"]))


# --- the component and the rendering ---------------------------------------------------------------


def test_the_component_is_a_kustomize_component_listing_every_file() -> None:
    spec = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    assert (spec["apiVersion"], spec["kind"]) == ("kustomize.config.k8s.io/v1alpha1", "Component")
    on_disk = {p.name for p in COMPONENT.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(spec["resources"]) == on_disk


def test_the_renderer_takes_a_component_only_under_components(tmp_path: Path) -> None:
    user_kustomization(tmp_path / "wrong", [COMPONENT], [])
    with pytest.raises(UnsupportedKustomizationError, match="Component"):
        render(tmp_path / "wrong")
    user_kustomization(tmp_path / "also-wrong", [], [K8S / "overlays" / "1p3d"])
    with pytest.raises(UnsupportedKustomizationError, match="Component"):
        render(tmp_path / "also-wrong")


def test_the_component_adds_its_resources_to_each_overlay(stacks: dict[str, tuple[Manifest, ...]]) -> None:
    ours = {(d["kind"], d["metadata"]["name"]) for d in component_docs()}
    assert ours == {
        ("ConfigMap", "ppd-envoy-picker"),
        ("Deployment", "ppd-envoy"),
        ("Service", "ppd-envoy"),
        ("PodDisruptionBudget", "ppd-envoy"),
    }
    for overlay, docs in stacks.items():
        keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
        assert len(keys) == len(set(keys)), overlay
        base = {(d["kind"], d["metadata"]["name"]) for d in render(K8S / "overlays" / overlay)}
        assert set(keys) == base | ours, overlay


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_what_the_tests_check(
    stacks: dict[str, tuple[Manifest, ...]], tmp_path: Path
) -> None:
    """The real kustomize (in kubectl) on the same kustomization: the same documents."""
    folder = user_kustomization(tmp_path / "user", [K8S / "overlays" / "2p2d"], [COMPONENT])
    result = subprocess.run(
        ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    theirs = sorted(json.dumps(d, sort_keys=True) for d in yaml.safe_load_all(result.stdout) if d)
    assert theirs == sorted(json.dumps(d, sort_keys=True) for d in stacks["2p2d"])


@pytest.fixture(scope="module")
def cached_schemas() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv, "schema_contents", functools.cache(kv.schema_contents))
        yield


@pytest.mark.usefixtures("cached_schemas")
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_overlay_with_the_component_passes_the_strict_api_schema(
    stacks: dict[str, tuple[Manifest, ...]], version: str
) -> None:
    problems = []
    seen: set[str] = set()
    for overlay, docs in stacks.items():
        for doc in docs:
            key = json.dumps(doc, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as err:
                problems.append(f"{overlay} {doc['kind']}/{doc['metadata']['name']}: {err.message}")
    assert problems == []


# --- Envoy's config: the one template ---------------------------------------------------------------


def test_the_config_map_is_the_template_rendered_with_the_components_values() -> None:
    config = cfg.rendered_config()
    assert cfg.CONFIG_MAP.read_text() == cfg.config_map_text(config), (
        "deploy/k8s/components/envoy-picker/envoy-config.yaml is not the rendered template: "
        "run `python -m tests.deploy.k8s_envoy_config`"
    )
    (config_map,) = load_documents(cfg.CONFIG_MAP)
    assert config_map["data"]["envoy.yaml"] == config  # the YAML block holds exactly that text
    deployment = one(tuple(component_docs()), "Deployment", "ppd-envoy")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations[cfg.CONFIG_HASH_ANNOTATION] == cfg.config_hash(config), (
        "the Deployment's config hash is stale: run `python -m tests.deploy.k8s_envoy_config`"
    )


def test_every_placeholder_of_the_template_has_a_value_and_a_new_one_is_named() -> None:
    assert cfg.placeholders(cfg.TEMPLATE.read_text()) <= set(cfg.VALUES)
    with pytest.raises(KeyError, match="FAIL_OPEN_CLUSTER"):
        cfg.rendered_config("a: ${LISTEN_PORT}\nb: ${FAIL_OPEN_CLUSTER}\n")


def test_the_generator_writes_what_the_test_expects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m tests.deploy.k8s_envoy_config` on copies: a stale copy and hash are rewritten."""
    config_map, deployment = tmp_path / "envoy-config.yaml", tmp_path / "envoy-picker.yaml"
    config_map.write_text("stale\n")
    deployment.write_text(
        cfg.DEPLOYMENT.read_text().replace(cfg.config_hash(cfg.rendered_config()), "0" * 64)
    )
    monkeypatch.setattr(cfg, "CONFIG_MAP", config_map)
    monkeypatch.setattr(cfg, "DEPLOYMENT", deployment)
    monkeypatch.setattr(cfg, "REPO", tmp_path)
    assert cfg.main() == 0
    assert config_map.read_text() == cfg.config_map_text(cfg.rendered_config())
    assert f'"{cfg.config_hash(cfg.rendered_config())}"' in deployment.read_text()


def test_the_config_passes_envoy_validate(tmp_path: Path) -> None:
    result = validate(cfg.rendered_config(), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_container_arguments_pass_envoy_validate_with_the_config(tmp_path: Path) -> None:
    """The real binary on the container's own arguments (its -c aimed at the rendered ConfigMap)."""
    _, envoy, _ = envoy_pod(tuple(component_docs()))
    assert envoy["command"] == ["envoy"]
    args = list(envoy["args"])
    config = tmp_path / "envoy.yaml"
    config.write_text(cfg.rendered_config())
    args[args.index("-c") + 1] = str(config)
    result = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    broken = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", *args, "--drain-strategy", "sometimes"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert broken.returncode != 0  # the binary does check its arguments


# --- ports, probes and flags agree ------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_envoy_ports_agree_with_its_config_the_service_and_the_probes(
    stacks: dict[str, tuple[Manifest, ...]], overlay: str
) -> None:
    docs = stacks[overlay]
    deployment, envoy, picker = envoy_pod(docs)
    config = envoy_config()
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"]["port_value"] == ports_of(envoy)["http"]
    admin = config["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1"  # never reachable from the network
    assert admin["port_value"] not in ports_of(envoy).values()
    for command in (
        envoy["readinessProbe"]["exec"]["command"],
        envoy["lifecycle"]["preStop"]["exec"]["command"],
    ):
        assert command[:2] == ["bash", "-c"]
        assert f"/dev/tcp/127.0.0.1/{admin['port_value']} " in command[2]
    assert envoy["livenessProbe"]["tcpSocket"]["port"] == "http"
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "picker"]
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    assert address["address"] == "127.0.0.1"  # the sidecar, in the same network namespace
    assert address["port_value"] == ports_of(picker)["grpc"] == int(flags(picker["args"])["--grpc-port"])
    service = one(docs, "Service", "ppd-envoy")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    selected = [
        d for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]  # fmt: skip
    assert selected == [deployment]
    (port,) = service["spec"]["ports"]
    assert (port["targetPort"], port["port"]) == ("http", ports_of(envoy)["http"])
    pdb = one(docs, "PodDisruptionBudget", "ppd-envoy")
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    (mount,) = envoy["volumeMounts"]
    assert volumes[mount["name"]]["configMap"]["name"] == "ppd-envoy-picker"
    assert envoy["args"][envoy["args"].index("-c") + 1] == f"{mount['mountPath']}/envoy.yaml"


def test_envoy_filters_keep_the_order_the_picker_relies_on() -> None:
    """The client's routing headers are stripped before ext_proc; fail closed; BUFFERED bodies."""
    (listener,) = envoy_config()["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in manager["http_filters"]]
    assert names.index("envoy.filters.http.header_mutation") < names.index(EXT_PROC_FILTER)
    (ext_proc,) = [f["typed_config"] for f in manager["http_filters"] if f["name"] == EXT_PROC_FILTER]
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"


def test_the_envoy_image_is_the_version_of_our_envoy_binary() -> None:
    result = subprocess.run(
        [str(envoy_binary()), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    match = re.search(r"/(\d+\.\d+\.\d+)/", result.stdout)
    assert match, result.stdout
    _, envoy, _ = envoy_pod(tuple(component_docs()))
    assert envoy["image"] == f"envoyproxy/envoy:v{match[1]}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_picker_flags_probes_and_config_agree_with_its_cli_and_the_overlay(
    stacks: dict[str, tuple[Manifest, ...]], overlay: str, tmp_path: Path
) -> None:
    docs = stacks[overlay]
    deployment, _, picker = envoy_pod(docs)
    assert picker["command"] == ["ppd-gateway"]
    assert picker["args"][0] == "picker"
    given = flags(picker["args"][1:])
    assert set(given) <= picker_help_flags()
    assert len(given) == len(picker["args"]) - 1  # every argument is a --flag=value the CLI knows
    ports = ports_of(picker)
    assert (int(given["--grpc-port"]), int(given["--metrics-port"])) == (ports["grpc"], ports["metrics"])
    assert given["--host"] == "0.0.0.0"  # the kubelet's gRPC probes and Prometheus use the pod IP
    assert picker["readinessProbe"]["grpc"] == {"port": ports["grpc"], "service": "readiness"}
    assert picker["livenessProbe"]["grpc"] == {"port": ports["grpc"], "service": "liveness"}
    assert {"readiness", "liveness"} <= set(HEALTH_NAMES)
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"])
    # The settings file is the overlay's gateway.toml (its worker list), at the path --config names.
    path = Path(given["--config"])
    (mount,) = [m for m in picker["volumeMounts"] if m["mountPath"] == str(path.parent)]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mount["name"]]["configMap"]["name"] == "ppd-gateway-config"
    text = one(docs, "ConfigMap", "ppd-gateway-config")["data"][path.name]
    (tmp_path / "gateway.toml").write_text(text)
    checked = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(tmp_path / "gateway.toml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The picker's images and user are the gateway's.
    gateway = one(docs, "Deployment", "ppd-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert picker["image"] == gateway["image"]
    assert picker["securityContext"] == gateway["securityContext"]
    # The picker outlives Envoy's drain: requests in flight still send it their response headers.
    drain_s = int(
        re.findall(
            r"sleep (\d+)", containers(deployment)["envoy"]["lifecycle"]["preStop"]["exec"]["command"][2]
        )[0]
    )
    picker_s = int(re.findall(r"sleep (\d+)", picker["lifecycle"]["preStop"]["exec"]["command"][2])[0])
    envoy_args = containers(deployment)["envoy"]["args"]
    assert int(envoy_args[envoy_args.index("--drain-time-s") + 1]) <= drain_s < picker_s
    assert picker_s < deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_named_by_dns_resolve_while_they_load(
    stacks: dict[str, tuple[Manifest, ...]], overlay: str
) -> None:
    """The picker resolves worker names to IPs (gateway/destinations.py), which must be hosts of
    Envoy's workers cluster: every worker is a StatefulSet pod under a headless Service that
    publishes not-ready addresses, and Envoy's WORKER_ENDPOINTS names that Service on the worker's
    port (STRICT_DNS: one host per pod IP), decode workers at priority 0, prefill at priority 1."""
    docs = stacks[overlay]
    config = tomllib.loads(one(docs, "ConfigMap", "ppd-gateway-config")["data"]["gateway.toml"])
    (workers,) = [c for c in envoy_config()["static_resources"]["clusters"] if c["name"] == "workers"]
    assert workers["type"] == "STRICT_DNS"
    listed = {
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        ): locality["priority"]
        for locality in workers["load_assignment"]["endpoints"]
        for e in locality["lb_endpoints"]
    }
    for worker in config["workers"]:
        host = re.fullmatch(r"http://([a-z0-9-]+)-(\d+)\.([a-z0-9-]+):(\d+)", worker["url"])
        assert host, worker["url"]
        sts = one(docs, "StatefulSet", host[1])
        assert sts["spec"]["serviceName"] == host[3]
        assert int(host[2]) < sts["spec"]["replicas"]
        service = one(docs, "Service", host[3])
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True
        assert listed[(host[3], int(host[4]))] == (1 if worker["role"] == "prefill" else 0), worker


# --- the probe and the hook, for real ---------------------------------------------------------------


@pytest.fixture(scope="module")
def running_envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Envoy]:
    """The picker scenario's Envoy (no picker behind it: its admin is what the commands ask)."""
    envoy = Envoy.start(
        "picker", tmp_path_factory.mktemp("envoy"), cluster="unused", upstream_ports=[],
        extra={"PICKER_PORT": "9", "FAILURE_MODE_ALLOW": "false", "WORKER_ENDPOINTS": "[]"},
    )  # fmt: skip
    yield envoy
    envoy.close()


def _on_port(command: str, port: int | str) -> str:
    """A manifest's admin command aimed at another admin port (the test's Envoy picks its own)."""
    return command.replace(f"/dev/tcp/127.0.0.1/{cfg.VALUES['ADMIN_PORT']} ", f"/dev/tcp/127.0.0.1/{port} ")


@pytest.mark.integration
def test_the_readiness_probe_asks_envoys_admin_for_real(running_envoy: Envoy) -> None:
    _, envoy, _ = envoy_pod(tuple(component_docs()))
    command = envoy["readinessProbe"]["exec"]["command"]
    admin_port = running_envoy.admin.rsplit(":", 1)[1]
    ready = subprocess.run(
        [*command[:2], _on_port(command[2], admin_port)], capture_output=True, timeout=30, check=False
    )
    assert ready.returncode == 0, ready.stderr
    # A port held but not listening (so no other process takes it meanwhile): refused, not ready.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        refused = subprocess.run(
            [*command[:2], _on_port(command[2], held.getsockname()[1])],
            capture_output=True, timeout=30, check=False,
        )  # fmt: skip
    assert refused.returncode != 0
    # An admin answering 503 (Envoy starting or draining): not ready either.
    with _answering(503) as port:
        unready = subprocess.run(
            [*command[:2], _on_port(command[2], port)], capture_output=True, timeout=30, check=False
        )
    assert unready.returncode != 0


@contextmanager
def _answering(status: int) -> Iterator[int]:
    """A real HTTP server on 127.0.0.1 answering every GET with `status`; yields its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.integration
def test_the_drain_hook_is_accepted_by_envoys_admin(running_envoy: Envoy) -> None:
    """The hook's POST is answered 200 (the drain starts; /ready stays 200 meanwhile, so the module's
    other tests do not depend on running before this one)."""
    _, envoy, _ = envoy_pod(tuple(component_docs()))
    command = envoy["lifecycle"]["preStop"]["exec"]["command"]
    assert re.search(r"; sleep \d+$", command[2])
    script = re.sub(
        r"sleep \d+$", 'echo "$status"', _on_port(command[2], running_envoy.admin.rsplit(":", 1)[1])
    )
    done = subprocess.run([*command[:2], script], capture_output=True, text=True, timeout=30, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "200"), done.stderr
    assert running_envoy.is_ready()
