"""deploy/k8s/sweep without a cluster: the on-demand sweep Job passes the API schemas, finds what it
names in every shape overlay, is in none of them, and its script (run under sh with a stand-in
``ppd-table`` that records its command lines) sweeps the workers each overlay's gateway lists, checks
the table, and publishes it by rename, also as the refresh base."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from pathlib import Path

import kubernetes_validate.utils as kv
import pytest

from table_builder.cli import build_parser
from tests.deploy.kustomize import Manifest, render
from tests.deploy.test_k8s_manifests import (
    K8S,
    KUBERNETES_VERSIONS,
    OVERLAYS,
    container,
    gateway_config,
    one,
    pod_spec,
    rendered,
)

SWEEP = K8S / "sweep"
SCRIPT = "sweep-tables.sh"
#: Records each command line as one JSON array per line; `sweep --publish DIR` writes a table there.
STAND_IN = """#!/bin/sh
python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@" >> "$CALLS"
if [ "$1" = sweep ]; then
  while [ "$#" -gt 0 ]; do
    if [ "$1" = --publish ]; then echo table > "$2/${PPD_SHAPE}__${PPD_MODEL}.ppdt"; fi
    shift
  done
fi
"""


@functools.cache
def sweep_docs() -> tuple[Manifest, ...]:
    return tuple(render(SWEEP))


def _script() -> str:
    return str(one(sweep_docs(), "ConfigMap", "ppd-table-sweep")["data"][SCRIPT])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_sweep_job_passes_the_strict_api_schema(version: str) -> None:
    for doc in sweep_docs():
        kv.validate(doc, version, strict=True)


def test_no_overlay_starts_a_sweep() -> None:
    for overlay in OVERLAYS:
        assert not [d for d in rendered(overlay) if d["metadata"]["name"] == "ppd-table-sweep"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_what_the_sweep_job_names_exists_in_every_overlay(overlay: str) -> None:
    job = one(sweep_docs(), "Job", "ppd-table-sweep")
    mine = {(d["kind"], d["metadata"]["name"]) for d in sweep_docs()}
    theirs = {(d["kind"], d["metadata"]["name"]) for d in rendered(overlay)}
    for source in container(job)["envFrom"]:
        assert ("ConfigMap", source["configMapRef"]["name"]) in mine | theirs
    for volume in pod_spec(job)["volumes"]:
        if "persistentVolumeClaim" in volume:
            assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in theirs
        elif "configMap" in volume:
            assert ("ConfigMap", volume["configMap"]["name"]) in mine
    grid = one(sweep_docs(), "ConfigMap", "ppd-table-sweep-grid")["data"]
    assert grid["PPD_SWEEP_URL"] == "http://ppd-gateway:8000"
    service = one(rendered(overlay), "Service", "ppd-gateway")
    assert [p["port"] for p in service["spec"]["ports"]] == [8000]


def _run(tmp_path: Path, shape: str) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
    root = tmp_path / shape
    (root / "tables").mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin" / "ppd-table").write_text(STAND_IN)
    (root / "bin" / "ppd-table").chmod(0o755)
    script = root / SCRIPT
    script.write_text(_script().replace("/var/lib/ppd", str(root)))
    grid = one(sweep_docs(), "ConfigMap", "ppd-table-sweep-grid")["data"]
    env = {
        **grid,
        "PATH": f"{root / 'bin'}:{os.environ['PATH']}",
        "CALLS": str(root / "calls.jsonl"),
        "PPD_SHAPE": shape,
        "PPD_MODEL": "llama-3.1-8b",
        "TMPDIR": str(tmp_path),
    }
    done = subprocess.run(
        ["sh", str(script)], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    calls_file = root / "calls.jsonl"
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()] if calls_file.exists() else []
    return done, calls


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_script_sweeps_the_gateways_workers_then_checks_and_publishes(
    overlay: str, tmp_path: Path
) -> None:
    shape = one(rendered(overlay), "ConfigMap", "ppd-shape")["data"]["PPD_SHAPE"]
    done, calls = _run(tmp_path, shape)
    assert done.returncode == 0, done.stderr
    dry, run, check = calls
    assert dry[-1] == "--dry-run"  # the plan first, in the Job's log
    assert run[: len(dry) - 1] == dry[:-1]
    assert check[0] == "check"
    args = build_parser().parse_args(run)  # what the real ppd-table accepts
    assert (args.engine, args.shape, args.url) == ("endpoints", shape, "http://ppd-gateway:8000")
    workers = {(w["role"], w["url"]) for w in gateway_config(rendered(overlay))["workers"]}
    assert {tuple(w.split("=", 1)) for w in args.worker} == workers
    name = f"{shape}__llama-3.1-8b.ppdt"
    root = tmp_path / shape
    assert (root / "tables" / name).read_text() == "table\n"
    assert (root / "tables" / "base" / name).read_text() == "table\n"
    assert sorted(p.name for p in (root / "tables").iterdir()) == [name, "base"]  # no temp file left
    assert args.out == root / "records" / "sweeps" / name.removesuffix(".ppdt")


def test_the_script_refuses_a_shape_it_cannot_read(tmp_path: Path) -> None:
    done, calls = _run(tmp_path, "big")
    assert done.returncode == 1
    assert "PPD_SHAPE must be <n>P<m>D, got 'big'" in done.stderr
    assert calls == []


def test_the_script_reads_exactly_the_grid_config_maps_keys() -> None:
    grid = one(sweep_docs(), "ConfigMap", "ppd-table-sweep-grid")["data"]
    keys = {
        "PPD_SWEEP_URL",
        "PPD_SWEEP_WORKLOADS",
        "PPD_SWEEP_QPS",
        "PPD_SWEEP_DURATION",
        "PPD_SWEEP_SETTLE_TIMEOUT",
    }
    assert set(grid) == keys
    assert set(re.findall(r"\$\{?(PPD_SWEEP_[A-Z_]+)", _script())) == keys
