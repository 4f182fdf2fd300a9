"""deploy/k8s without a cluster: every rendered overlay passes the Kubernetes API schemas
(kubernetes-validate, offline, strict), and ports, probes, labels, selectors, volumes and
command-line flags agree with each other, with the shape each overlay names, with the
services' own CLIs and with the vLLM NixlConnector launch contract."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate.utils as kv
import pytest

from ppd.decision.v1 import decision_pb2
from tests.deploy.kustomize import Manifest, UnsupportedKustomizationError, load_documents, render
from tests.deploy.processes import REPO

K8S = REPO / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSIONS = ("1.30", "1.37")
WORKLOADS = ("Deployment", "StatefulSet", "Job")
DECISION_SERVICE = decision_pb2.DESCRIPTOR.services_by_name["DecisionService"].full_name
# KVTransferConfig's fields in vLLM 0.33 (docs/vllm-protocol.md 1.1); extra keys are rejected there.
KV_TRANSFER_FIELDS = {
    "kv_connector", "engine_id", "kv_buffer_device", "kv_role", "kv_port", "kv_connector_extra_config",
    "kv_connector_module_path", "enable_permute_local_kv", "kv_load_failure_policy",
}  # fmt: skip
ROLE_OF = {"prefill": "kv_producer", "decode": "kv_consumer"}


@functools.cache
def rendered(overlay: str) -> tuple[Manifest, ...]:
    return tuple(render(K8S / "overlays" / overlay))


def one(docs: tuple[Manifest, ...], kind: str, name: str) -> Manifest:
    (hit,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return hit


def pod_spec(doc: Manifest) -> dict[str, Any]:
    spec = doc["spec"]["jobTemplate"]["spec"] if doc["kind"] == "CronJob" else doc["spec"]
    return dict(spec["template"]["spec"])


def container(doc: Manifest) -> dict[str, Any]:
    (only,) = pod_spec(doc)["containers"]
    return dict(only)


def ports_of(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in c.get("ports", [])}


def flags(args: list[str]) -> dict[str, str]:
    """`--name=value` and `--name value` pairs of a container's args."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" in arg:
            name, value = arg.split("=", 1)
            out[name] = value
        elif arg.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[arg] = args[i + 1]
            i += 1
        elif arg.startswith("--"):
            out[arg] = ""
        i += 1
    return out


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def shape_counts(shape: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)P(\d+)D", shape)
    assert match, shape
    return int(match[1]), int(match[2])


# --- layout --------------------------------------------------------------------------------------


def test_three_shapes_have_overlays() -> None:
    assert set(OVERLAYS) == {"1p3d", "2p2d", "3p1d"}


def test_every_base_file_is_listed_in_the_base_kustomization() -> None:
    listed = set(load_documents(K8S / "base" / "kustomization.yaml")[0]["resources"])
    on_disk = {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_renderer_refuses_features_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(UnsupportedKustomizationError, match="namePrefix"):
        render(tmp_path)


def test_renderer_refuses_a_patch_without_a_target(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\npatches:\n- path: p.yaml\n")
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: nope}\ndata: {}\n")
    with pytest.raises(UnsupportedKustomizationError, match="nope"):
        render(tmp_path)


# --- schemas -------------------------------------------------------------------------------------


def unique_documents() -> list[tuple[str, Manifest]]:
    seen: dict[str, tuple[str, Manifest]] = {}
    for overlay in OVERLAYS:
        for doc in rendered(overlay):
            seen.setdefault(json.dumps(doc, sort_keys=True), (overlay, doc))
    return list(seen.values())


@pytest.fixture(scope="module")
def cached_schemas() -> Iterator[None]:
    """kubernetes-validate re-reads its (large) definitions file on every call: read each file once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv, "schema_contents", functools.cache(kv.schema_contents))
        yield


@pytest.mark.usefixtures("cached_schemas")
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_passes_the_strict_api_schema(version: str) -> None:
    problems = []
    for overlay, doc in unique_documents():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as err:
            problems.append(f"{overlay} {doc['kind']}/{doc['metadata']['name']}: {err.message}")
    assert problems == []


@pytest.mark.usefixtures("cached_schemas")
def test_schema_validation_catches_a_misspelled_field() -> None:
    doc = json.loads(json.dumps(one(rendered("1p3d"), "Deployment", "ppd-decision")))
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, KUBERNETES_VERSIONS[0], strict=True)


# --- labels, selectors, ports, probes --------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_names_are_unique_per_kind(overlay: str) -> None:
    keys = [(d["kind"], d["metadata"]["name"]) for d in rendered(overlay)]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workload_selectors_match_their_pod_labels(overlay: str) -> None:
    for doc in rendered(overlay):
        if doc["kind"] in ("Deployment", "StatefulSet"):
            selector = doc["spec"]["selector"]["matchLabels"]
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), doc["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_selects_one_workload_and_targets_its_named_ports(overlay: str) -> None:
    docs = rendered(overlay)
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        selected = [
            d for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")
            and selector <= d["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert len(selected) == 1, f"Service {service['metadata']['name']} selects {len(selected)} workloads"
        declared = ports_of(container(selected[0]))
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in declared, (service["metadata"]["name"], port)
            assert port["port"] == declared[port["targetPort"]], (service["metadata"]["name"], port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_declared_ports(overlay: str) -> None:
    for doc in rendered(overlay):
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        c = container(doc)
        declared = ports_of(c)
        for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.get(probe_name)
            if probe is None:
                continue
            (handler,) = (probe[k] for k in ("grpc", "httpGet", "tcpSocket") if k in probe)
            port = handler["port"]
            assert port in declared or port in declared.values(), (doc["metadata"]["name"], probe_name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_disruption_budgets_select_a_workload(overlay: str) -> None:
    docs = rendered(overlay)
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"].items()
        assert any(
            selector <= d["spec"]["template"]["metadata"]["labels"].items()
            for d in docs
            if d["kind"] == "Deployment"
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_claim_and_config_map_referenced_exists(overlay: str) -> None:
    docs = rendered(overlay)
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    for doc in docs:
        if doc["kind"] not in (*WORKLOADS, "CronJob"):
            continue
        spec = pod_spec(doc)
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps
        for c in spec["containers"]:
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])}
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] in maps


# --- the shape each overlay names ------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_replicas_and_default_table_key_match_its_shape(overlay: str) -> None:
    docs = rendered(overlay)
    shape = one(docs, "ConfigMap", "ppd-shape")["data"]
    assert shape["PPD_SHAPE"].lower() == overlay
    prefill, decode = shape_counts(shape["PPD_SHAPE"])
    assert one(docs, "StatefulSet", "vllm-prefill")["spec"]["replicas"] == prefill
    assert one(docs, "StatefulSet", "vllm-decode")["spec"]["replicas"] == decode
    assert shape["PPD_DECISION_DEFAULT_KEY"] == f"{shape['PPD_SHAPE']}/{shape['PPD_MODEL']}"


# --- decision service ------------------------------------------------------------------------------


@functools.cache
def cli_flags(*command: str) -> frozenset[str]:
    """The long options a command's --help lists."""
    result = subprocess.run(
        [sys.executable, "-m", *command, "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    return frozenset(re.findall(r"(--[a-z][a-z-]*)", result.stdout))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_decision_flags_ports_probes_and_tables_agree(overlay: str) -> None:
    docs = rendered(overlay)
    deployment = one(docs, "Deployment", "ppd-decision")
    c = container(deployment)
    assert c["command"] == ["ppd-decision"]
    assert c["args"][0] == "serve"
    given = flags(c["args"])
    assert set(given) <= cli_flags("decision_service", "serve")
    ports = ports_of(c)
    assert int(given["--port"]) == ports["grpc"]
    assert int(given["--metrics-port"]) == ports["metrics"]
    assert given["--host"] == given["--metrics-host"] == "0.0.0.0"
    assert c["readinessProbe"]["grpc"] == {"port": ports["grpc"], "service": DECISION_SERVICE}
    assert c["livenessProbe"]["grpc"]["port"] == ports["grpc"]
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(
        ports["metrics"]
    )
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == given["--tables"]]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"] == {"claimName": "ppd-tables", "readOnly": True}
    grace = float(given["--grace"])
    assert pod_spec(deployment)["terminationGracePeriodSeconds"] > grace


# --- gateway ---------------------------------------------------------------------------------------


def gateway_config_text(docs: tuple[Manifest, ...]) -> str:
    """The TOML file the gateway container reads: --config's path inside its ConfigMap mount."""
    deployment = one(docs, "Deployment", "ppd-gateway")
    c = container(deployment)
    path = Path(flags(c["args"])["--config"])
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent)]
    (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"]]
    return str(one(docs, "ConfigMap", volume["configMap"]["name"])["data"][path.name])


def gateway_config(docs: tuple[Manifest, ...]) -> dict[str, Any]:
    return tomllib.loads(gateway_config_text(docs))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_flags_port_probes_and_config_mount_agree(overlay: str) -> None:
    docs = rendered(overlay)
    c = container(one(docs, "Deployment", "ppd-gateway"))
    assert c["command"] == ["ppd-gateway"]
    assert c["args"][0] == "serve"
    given = flags(c["args"])
    assert set(given) <= cli_flags("gateway", "serve")
    assert int(given["--port"]) == ports_of(c)["http"]
    assert given["--host"] == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway_config(docs)["host"] == "0.0.0.0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_config_passes_the_gateways_own_check(overlay: str, tmp_path: Path) -> None:
    """`ppd-gateway check-config` loads the file with the settings code `serve` uses."""
    text = gateway_config_text(rendered(overlay))
    (tmp_path / "gateway.toml").write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(tmp_path / "gateway.toml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_lets_no_client_choose_its_routing_mode(overlay: str) -> None:
    """A deployed gateway serves clients it does not trust: X-PPD-Mode is a benchmarking aid, off."""
    from gateway.settings import Settings

    assert Settings.from_mapping(gateway_config(rendered(overlay))).allow_mode_header is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_lists_every_worker_pod_with_its_role_and_port(overlay: str) -> None:
    docs = rendered(overlay)
    config = gateway_config(docs)
    expected = set()
    for role, prefix in (("prefill", "P"), ("decode", "D")):
        sts = one(docs, "StatefulSet", f"vllm-{role}")
        port = ports_of(container(sts))["http"]
        service = sts["spec"]["serviceName"]
        one(docs, "Service", service)
        name, replicas = sts["metadata"]["name"], sts["spec"]["replicas"]
        expected |= {(f"{prefix}{i}", role, f"http://{name}-{i}.{service}:{port}") for i in range(replicas)}
    assert {(w["id"], w["role"], w["url"]) for w in config["workers"]} == expected


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_reaches_the_decision_service_through_its_headless_service(overlay: str) -> None:
    docs = rendered(overlay)
    address = gateway_config(docs)["decision"]["address"]
    match = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", address)
    assert match, address
    service = one(docs, "Service", match[1])
    assert service["spec"]["clusterIP"] == "None"
    assert int(match[2]) in {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"}


# --- vLLM workers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_vllm_workers_follow_the_nixl_launch_contract(overlay: str, role: str) -> None:
    docs = rendered(overlay)
    sts = one(docs, "StatefulSet", f"vllm-{role}")
    c = container(sts)
    assert c["command"] == ["vllm", "serve"]
    assert c["args"][0] == "$(MODEL_ID)"
    given = flags(c["args"][1:])
    ports = ports_of(c)
    assert int(given["--port"]) == ports["http"]
    kv_config = json.loads(given["--kv-transfer-config"])
    assert set(kv_config) <= KV_TRANSFER_FIELDS
    assert kv_config["kv_connector"] == "NixlConnector"
    assert kv_config["kv_role"] == ROLE_OF[role]
    env = env_of(c)
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == ports["nixl"]
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["MODEL_ID"]["valueFrom"]["configMapKeyRef"] == {"name": "ppd-shape", "key": "MODEL_ID"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_prefill_and_decode_use_the_documented_ports() -> None:
    """docs/vllm-protocol.md 1.1: P on 8100 with side channel 5600, D on 8200 with 5601."""
    docs = rendered("1p3d")
    assert ports_of(container(one(docs, "StatefulSet", "vllm-prefill"))) == {"http": 8100, "nixl": 5600}
    assert ports_of(container(one(docs, "StatefulSet", "vllm-decode"))) == {"http": 8200, "nixl": 5601}


# --- tables ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "name"), [("Job", "ppd-table-build"), ("CronJob", "ppd-table-publish")])
def test_table_jobs_write_the_volume_the_decision_service_reads(kind: str, name: str) -> None:
    docs = rendered("1p3d")
    job = one(docs, kind, name)
    c = container(job)
    volumes = {v["name"]: v for v in pod_spec(job)["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    tables = mounts["/var/lib/ppd/tables"]
    assert not tables.get("readOnly", False)
    assert volumes[tables["name"]]["persistentVolumeClaim"]["claimName"] == "ppd-tables"
    assert mounts["/var/lib/ppd/records"]["readOnly"] is True
    script_mount = mounts["/opt/ppd"]
    script_map = one(docs, "ConfigMap", volumes[script_mount["name"]]["configMap"]["name"])
    assert c["command"] == ["sh", "/opt/ppd/publish-tables.sh"]
    assert "publish-tables.sh" in script_map["data"]


def test_publish_script_is_valid_sh_and_publishes_by_rename(tmp_path: Path) -> None:
    script = one(rendered("1p3d"), "ConfigMap", "ppd-table-publish")["data"]["publish-tables.sh"]
    (tmp_path / "publish.sh").write_text(script)
    subprocess.run(["sh", "-n", str(tmp_path / "publish.sh")], check=True)
    assert "ppd-table check" in script
    assert re.search(r"^\s*mv .*\.incoming\" \"\$tables/\$name\"$", script, flags=re.MULTILINE)


def test_cron_job_never_overlaps_itself() -> None:
    cron = one(rendered("1p3d"), "CronJob", "ppd-table-publish")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_decision_settings_from_the_shape_config_map_are_read_by_the_service(overlay: str) -> None:
    """Every PPD_DECISION_* variable the pod gets is one the service's Settings.from_env reads."""
    from decision_service.settings import Settings

    data = one(rendered(overlay), "ConfigMap", "ppd-shape")["data"]
    ours = {k: v for k, v in data.items() if k.startswith("PPD_DECISION_")}
    assert ours == {"PPD_DECISION_DEFAULT_KEY": data["PPD_DECISION_DEFAULT_KEY"]}
    assert Settings.from_env(ours).default_key == data["PPD_DECISION_DEFAULT_KEY"]


# --- the image -------------------------------------------------------------------------------------

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"


def test_dockerfile_copies_only_what_exists_and_installs_the_deploy_extra() -> None:
    text = DOCKERFILE.read_text()
    sources = [s for line in re.findall(r"^COPY (.+) \S+$", text, flags=re.MULTILINE) for s in line.split()]
    assert sources
    assert all((REPO / s).exists() for s in sources), sources
    assert "pip install --no-cache-dir '.[deploy]'" in text


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_our_containers_run_the_documented_image_as_its_user(overlay: str) -> None:
    text = DOCKERFILE.read_text()
    (tag,) = re.findall(r"docker build .* -t (\S+) \.", text)
    (uid,) = re.findall(r"^USER (\d+)$", text, flags=re.MULTILINE)
    ours = [
        c
        for d in rendered(overlay)
        if d["kind"] in (*WORKLOADS, "CronJob")
        for c in pod_spec(d)["containers"]
        if not c["image"].startswith(("vllm/", "redis:"))
    ]
    assert ours
    for c in ours:
        assert c["image"] == tag
        assert c["securityContext"]["runAsUser"] == int(uid)
        assert c["securityContext"]["runAsNonRoot"] is True


# --- the closed loop: gateways' request logs -> hourly refresh -------------------------------------

REFRESH_SCRIPT = "refresh-tables.sh"


def refresh_script() -> str:
    return str(one(rendered("1p3d"), "ConfigMap", "ppd-table-refresh")["data"][REFRESH_SCRIPT])


def refresh_call(script: str) -> list[str]:
    """The `ppd-table refresh ...` line of the script, as argv words."""
    (line,) = [ln.strip() for ln in script.splitlines() if ln.strip().startswith("ppd-table refresh")]
    return line.replace('"', "").split()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_gateway_pod_logs_its_requests_onto_the_records_volume(overlay: str) -> None:
    docs = rendered(overlay)
    deployment = one(docs, "Deployment", "ppd-gateway")
    c = container(deployment)
    log = gateway_config(docs)["log"]
    folder = str(Path(log["request_log"]).parent)
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == folder]
    assert not mount.get("readOnly", False)
    # One folder per pod: no two gateways append to one file.
    assert mount["subPathExpr"] == "gateways/$(POD_NAME)"
    assert env_of(c)["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == "ppd-records"
    # The lines name the table they refresh; the reader refuses empty labels.
    shape = one(docs, "ConfigMap", "ppd-shape")["data"]
    assert (log["shape"], log["model"]) == (shape["PPD_SHAPE"], shape["PPD_MODEL"])
    assert log["run_id"]


def test_refresh_cron_job_merges_the_gateways_logs_into_the_served_folder() -> None:
    docs = rendered("1p3d")
    cron = one(docs, "CronJob", "ppd-table-refresh")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    c = container(cron)
    assert c["command"] == ["sh", f"/opt/ppd/{REFRESH_SCRIPT}"]
    volumes = {v["name"]: v for v in pod_spec(cron)["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert volumes[mounts["/opt/ppd"]["name"]]["configMap"]["name"] == "ppd-table-refresh"
    assert mounts["/var/lib/ppd/records"]["readOnly"] is True
    assert (
        volumes[mounts["/var/lib/ppd/records"]["name"]]["persistentVolumeClaim"]["claimName"] == "ppd-records"
    )
    assert (
        volumes[mounts["/var/lib/ppd/tables"]["name"]]["persistentVolumeClaim"]["claimName"] == "ppd-tables"
    )
    script = refresh_script()
    assert re.search(r"^logs=/var/lib/ppd/records/gateways$", script, flags=re.MULTILINE)
    argv = refresh_call(script)
    assert set(flags(argv[2:])) <= cli_flags("table_builder", "refresh")
    # The decision service reads the top of the tables volume; the base lives in a folder below it.
    assert flags(argv[2:])["--out"] == "$tables/"
    assert flags(argv[2:])["--base"] == "$base"
    assert re.search(r'^base="\$tables/base/\$name"$', script, flags=re.MULTILINE)
    assert "--skip-bad-lines" in argv


def test_publish_script_keeps_the_built_table_as_the_refresh_base() -> None:
    script = one(rendered("1p3d"), "ConfigMap", "ppd-table-publish")["data"]["publish-tables.sh"]
    assert re.search(r'^\s*mv .*\.incoming" "\$tables/base/\$name"$', script, flags=re.MULTILINE)


def _run_refresh_script(root: Path) -> subprocess.CompletedProcess[str]:
    script = root / REFRESH_SCRIPT
    script.write_text(refresh_script().replace("/var/lib/ppd", str(root)))
    subprocess.run(["sh", "-n", str(script)], check=True)
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PPD_SHAPE": "1P3D",
        "PPD_MODEL": "llama-3.1-8b",
    }
    return subprocess.run(
        ["sh", str(script)], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def test_refresh_script_publishes_a_table_refreshed_from_logs_laid_out_as_the_gateways_write_them(
    tmp_path: Path,
) -> None:
    from decision_service.table import Table, TableSpec, write_table
    from table_builder.records import write_records
    from tests.support.records import base_table, logged

    name = "1P3D__llama-3.1-8b.ppdt"
    (tmp_path / "tables" / "base").mkdir(parents=True)
    missing = _run_refresh_script(tmp_path)
    assert missing.returncode == 1
    assert "run the ppd-table-build Job first" in missing.stderr
    offline = base_table()
    write_table(tmp_path / "tables" / "base" / name, TableSpec(offline.header, offline.figures))
    no_logs = _run_refresh_script(tmp_path)
    assert (no_logs.returncode, no_logs.stdout.strip()) == (
        0,
        f"no request logs under {tmp_path}/records/gateways yet: nothing to refresh",
    )
    pod = tmp_path / "records" / "gateways" / "ppd-gateway-5d9c-x2"
    pod.mkdir(parents=True)
    write_records(pod / "requests.jsonl", logged("local", 20, ttft=400.0))
    with (pod / "requests.jsonl").open("a") as fh:
        fh.write('{"run_id": "gateway"')  # a line the gateway is still writing
    done = _run_refresh_script(tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["flipped"], report["skipped_lines"]) == (10, 1)
    served = Table.open(tmp_path / "tables" / name)
    assert served.header.provenance["base"]["version"] == offline.version
    assert sorted(p.name for p in (tmp_path / "tables").iterdir()) == [name, "base"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateways_share_sessions_on_the_redis_service(overlay: str) -> None:
    docs = rendered(overlay)
    url = urlsplit(gateway_config(docs)["sessions"]["redis_url"])
    service = one(docs, "Service", url.hostname or "")
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    redis = one(docs, "Deployment", "ppd-redis")
    assert ports_of(container(redis))[port["targetPort"]] == 6379
    assert service["spec"]["selector"] == redis["spec"]["selector"]["matchLabels"]
    args = container(redis)["args"]
    # A cache: no persistence, bounded memory evicting the least recently used.
    assert args[args.index("--save") + 1] == ""
    assert args[args.index("--appendonly") + 1] == "no"
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert one(docs, "Deployment", "ppd-gateway")["spec"]["replicas"] >= 2
