"""Render our kustomize overlays without the kustomize binary (tests only).

Our overlays and components use exactly four features, and this renderer implements exactly those:
`resources` (files, or folders with their own kustomization.yaml), `components` (folders whose
kustomization is a `kind: Component`; their resources are added after the kustomization's own and
before its replicas and patches, as kustomize orders them), `replicas` (name + count on a
Deployment or StatefulSet) and `patches` given by `path` whose target is a ConfigMap (a merge of
its `data`). Anything else in a kustomization is refused, so an overlay that grows a feature this
renderer does not know fails the tests instead of being rendered wrongly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = frozenset({"apiVersion", "kind", "resources", "components", "replicas", "patches"})
COMPONENT_KIND = "Component"
SCALABLE_KINDS = frozenset({"Deployment", "StatefulSet"})

Manifest = dict[str, Any]


class UnsupportedKustomizationError(ValueError):
    """The kustomization uses something this renderer does not implement."""


def load_documents(path: Path) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def render(folder: Path, *, component: bool = False) -> list[Manifest]:
    """The manifests `kubectl kustomize folder` would print (for the features above)."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED_KEYS
    if unknown:
        raise UnsupportedKustomizationError(f"{folder}: unsupported keys {sorted(unknown)}")
    if (spec.get("kind") == COMPONENT_KIND) != component:
        raise UnsupportedKustomizationError(
            f"{folder}: a kind: {COMPONENT_KIND} is listed under components, and only there"
        )
    docs: list[Manifest] = []
    for entry in spec.get("resources", []):
        target = (folder / entry).resolve()
        docs += render(target) if target.is_dir() else load_documents(target)
    for entry in spec.get("components", []):
        docs += render((folder / entry).resolve(), component=True)
    for item in spec.get("replicas", []):
        _find(docs, SCALABLE_KINDS, item["name"], folder)["spec"]["replicas"] = int(item["count"])
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise UnsupportedKustomizationError(f"{folder}: only patches by path are supported: {patch}")
        for doc in load_documents(folder / patch["path"]):
            if doc.get("kind") != "ConfigMap" or set(doc) - {"apiVersion", "kind", "metadata", "data"}:
                raise UnsupportedKustomizationError(f"{folder}: only ConfigMap data patches are supported")
            target = _find(docs, frozenset({"ConfigMap"}), doc["metadata"]["name"], folder)
            target.setdefault("data", {}).update(doc.get("data", {}))
    return docs


def _find(docs: list[Manifest], kinds: frozenset[str], name: str, folder: Path) -> Manifest:
    hits = [d for d in docs if d["kind"] in kinds and d["metadata"]["name"] == name]
    if len(hits) != 1:
        raise UnsupportedKustomizationError(
            f"{folder}: {len(hits)} resources of {sorted(kinds)} named {name}"
        )
    return hits[0]


def user_kustomization(folder: Path, resources: list[Path], components: list[Path]) -> Path:
    """A kustomization in `folder` as an operator writes one (a shape overlay plus components), with
    relative paths as `kubectl kustomize` requires; `folder` is returned for render()."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(p, folder) for p in resources],
        "components": [os.path.relpath(p, folder) for p in components],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return folder
