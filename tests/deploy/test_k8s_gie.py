"""deploy/k8s/components/gie-inference-pool without a cluster: the InferencePool passes the OpenAPI
schema of GIE v1.6.0's CRD (tests/testdata/gie, offline, unknown fields refused as `kubectl
--validate=strict` would) and the CRD's CEL rules we rely on, it selects the decode pods on their
port and names the picker's Service and gRPC port; the HTTPRoute routes to the pool; the picker
Deployment and Service pass the Kubernetes API schemas and agree with `ppd-gateway picker --help`."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml

from gateway.picker_server import HEALTH_NAMES
from tests.deploy.kustomize import Manifest, load_documents, render, user_kustomization
from tests.deploy.picker_cli import flags, picker_help_flags
from tests.deploy.processes import REPO

K8S = REPO / "deploy" / "k8s"
COMPONENT = K8S / "components" / "gie-inference-pool"
CRD = REPO / "tests" / "testdata" / "gie" / "inference.networking.k8s.io_inferencepools.yaml"
GIE_RELEASE = "v1.6.0"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
OURS = frozenset({"InferencePool", "HTTPRoute"})  # kinds the Kubernetes API schemas do not know


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Manifest, ...]]:
    root = tmp_path_factory.mktemp("with-gie")
    return {
        overlay: tuple(render(user_kustomization(root / overlay, [K8S / "overlays" / overlay], [COMPONENT])))
        for overlay in OVERLAYS
    }


def one(docs: tuple[Manifest, ...], kind: str, name: str) -> Manifest:
    (hit,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return hit


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused wherever it lists the known ones (the API server
    prunes them; `kubectl apply --validate=strict` refuses them)."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        stack += [v for v in node.get("properties", {}).values() if isinstance(v, dict)]
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                stack.append(node[key])
    return out


@functools.cache
def pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["names"]["kind"] == "InferencePool"
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == GIE_RELEASE
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"]
    assert version["storage"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by the API server
    return schema


def pool() -> Manifest:
    (hit,) = [d for d in load_documents(COMPONENT / "inference-pool.yaml") if d["kind"] == "InferencePool"]
    return hit


def route() -> Manifest:
    (hit,) = [d for d in load_documents(COMPONENT / "inference-pool.yaml") if d["kind"] == "HTTPRoute"]
    return hit


def test_the_component_lists_every_file_and_the_comment_names_the_release() -> None:
    spec = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    assert (spec["apiVersion"], spec["kind"]) == ("kustomize.config.k8s.io/v1alpha1", "Component")
    assert set(spec["resources"]) == {p.name for p in COMPONENT.glob("*.yaml")} - {"kustomization.yaml"}
    assert f"GIE release {GIE_RELEASE}" in (COMPONENT / "inference-pool.yaml").read_text()


def test_the_inference_pool_passes_the_crd_schema() -> None:
    doc = pool()
    assert doc["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(doc, pool_schema())
    # The CRD's CEL rules (x-kubernetes-validations), which JSON Schema cannot express:
    ref = doc["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref  # port required for a Service
    numbers = [p["number"] for p in doc["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers))  # port numbers unique


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "endpointPickerRef", "failureMode"), "FailSometimes"),  # not in the enum
        (("spec", "targetPorts"), []),  # at least one port
        (("spec", "endpointPickerRef", "portNumber"), 9002),  # a field of an older draft
        (("spec", "extensionRef"), {"name": "ppd-picker"}),  # the pre-v1 field name
    ],
)
def test_the_schema_check_catches_a_wrong_pool(path: tuple[str, ...], value: Any) -> None:
    doc = copy.deepcopy(pool())
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, pool_schema())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pool_selects_the_decode_pods_and_names_the_pickers_grpc_service(
    stacks: dict[str, tuple[Manifest, ...]], overlay: str
) -> None:
    docs = stacks[overlay]
    spec = one(docs, "InferencePool", "ppd-decode")["spec"]
    selected = [
        d for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and spec["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]  # fmt: skip
    assert [d["metadata"]["name"] for d in selected] == ["vllm-decode"]
    (vllm,) = selected[0]["spec"]["template"]["spec"]["containers"]
    http = {p["name"]: p["containerPort"] for p in vllm["ports"]}["http"]
    assert spec["targetPorts"] == [{"number": http}]
    ref = spec["endpointPickerRef"]
    service = one(docs, ref.get("kind", "Service"), ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    deployment = one(docs, "Deployment", "ppd-picker")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (picker,) = deployment["spec"]["template"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in picker["ports"]}
    assert container_ports[port["targetPort"]] == port["port"]
    assert port["targetPort"] == "grpc"
    assert ref["failureMode"] == "FailClose"


def test_the_route_sends_everything_to_the_pool_without_a_timeout() -> None:
    doc = route()
    assert doc["apiVersion"] == "gateway.networking.k8s.io/v1"
    (rule,) = doc["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": pool()["metadata"]["name"],
    }
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["timeouts"] == {"request": "0s"}  # Gateway API: a zero duration disables the timeout
    (parent,) = doc["spec"]["parentRefs"]
    assert (parent["group"], parent["kind"]) == ("gateway.networking.k8s.io", "Gateway")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_picker_deployment_agrees_with_its_cli_and_reads_the_overlays_config(
    stacks: dict[str, tuple[Manifest, ...]], overlay: str
) -> None:
    docs = stacks[overlay]
    deployment = one(docs, "Deployment", "ppd-picker")
    (picker,) = deployment["spec"]["template"]["spec"]["containers"]
    assert picker["args"][0] == "picker"
    given = flags(picker["args"][1:])
    assert set(given) <= picker_help_flags()
    assert given["--host"] == "0.0.0.0"  # the gateway's Envoy is in another pod
    ports = {p["name"]: p["containerPort"] for p in picker["ports"]}
    assert int(given["--grpc-port"]) == ports["grpc"]
    assert int(given["--metrics-port"]) == ports["metrics"]
    assert picker["readinessProbe"]["grpc"]["service"] in HEALTH_NAMES
    assert picker["livenessProbe"]["grpc"]["service"] in HEALTH_NAMES
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in picker["volumeMounts"] if m["mountPath"] == str(Path(given["--config"]).parent)]
    name = volumes[mount["name"]]["configMap"]["name"]
    assert Path(given["--config"]).name in one(docs, "ConfigMap", name)["data"]


@pytest.fixture(scope="module")
def cached_schemas() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv, "schema_contents", functools.cache(kv.schema_contents))
        yield


@pytest.mark.usefixtures("cached_schemas")
@pytest.mark.parametrize("version", ["1.30", "1.37"])
def test_the_kubernetes_resources_pass_the_strict_api_schema(
    stacks: dict[str, tuple[Manifest, ...]], version: str
) -> None:
    problems = []
    seen: set[str] = set()
    for overlay, docs in stacks.items():
        for doc in docs:
            key = json.dumps(doc, sort_keys=True)
            if doc["kind"] in OURS or key in seen:
                continue
            seen.add(key)
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as err:
                problems.append(f"{overlay} {doc['kind']}/{doc['metadata']['name']}: {err.message}")
    assert problems == []
